"""Throughput of one (model, scheme) under horovodrun: the worker of ``scripts/bench_e2e.py``.

    horovodrun -np 4 --gloo python -m ssfusion_hvd.examples.bench --model gpt2 --scheme ssfusion_oi

Runs ``--warmup`` iterations (they include a sparse scheme's dense warm-up, profiling and
planning: keep ``--warmup`` above ``--warmup-steps``), then times ``--iters`` iterations of
forward, backward, ``opt.synchronize()`` and ``opt.step()`` (in
``opt.skip_synchronize()``) on synthetic data (``examples/models.py``). An
iteration's time is the slowest rank's; samples/s is ``workers * batch / median``. After
every timed iteration it reads ``opt.stats()`` (which resolves device counters, so this is
a measuring run, not a production loop). Rank 0 also reads the byte counter of the
loopback device (``/proc/self/net/dev``) around the timed window: in the benchmark's
network namespace that is every byte the workers put on the shaped link.

``--scheme`` also takes the peers a user would pick instead (``examples/peers.py``: torch
DDP over gloo with the PowerSGD or fp16 hook, Horovod with ``Compression.fp16``), timed
by the same loop; their bytes per step are counted by ``peers.bytes_per_step`` (what
their collectives carry), as ``opt.stats()`` counts ours.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import horovod.torch as hvd
import torch

import ssfusion_hvd
from ssfusion_hvd.registry import options_for
from ssfusion_hvd.examples.models import MODELS, build, rank_device
from ssfusion_hvd.examples.peers import POWERSGD_START, PEERS, make_peer, peer_bytes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo", choices=sorted(MODELS))
    p.add_argument("--scheme", default="ssfusion_oi",
                   help=f"one of {sorted(ssfusion_hvd.SCHEMES)}, or a peer: {', '.join(PEERS)}")
    p.add_argument("--sparsifier", default="topk")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--batch-size", type=int, default=0, help="per worker; 0: the model's default")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (gpt2)")
    p.add_argument("--warmup", type=int, default=7, help="untimed iterations")
    p.add_argument("--density-warmup-steps", type=int, default=0,
                   help="the recipe's density warm-up (default 0 here: the timed window is the "
                        "steady state at --density; docs/recipe.md prices the warm-up)")
    p.add_argument("--momentum-correction", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--warmup-steps", type=int, default=5,
                   help="the sparse schemes' dense profiling iterations (part of --warmup)")
    p.add_argument("--iters", type=int, default=10, help="timed iterations")
    p.add_argument("--min-k", type=int, default=None,
                   help="SSFusion schemes and auto: scheme_options['min_k'] (docs/schemes.md, "
                        "'Small tensors'); other schemes ignore it")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: each rank on GPU local_rank %% the GPUs visible (ranks may share "
                        "one); every iteration ends with torch.cuda.synchronize()")
    p.add_argument("--amp", default="none", choices=("none", "float16", "bfloat16"),
                   help="autocast the forward pass to this dtype (the model and its gradients "
                        "stay float32); float16 adds no GradScaler here (a throughput run)")
    p.add_argument("--powersgd-start", type=int, default=POWERSGD_START,
                   help="the PowerSGD peers' plain-allreduce steps (keep --warmup above it)")
    p.add_argument("--agreement", default="on", choices=("on", "off"),
                   help="off: a measuring switch for the cost of the per-step agreement check; "
                        "a job without it can hang where a rank goes astray")
    p.add_argument("--json", default=None, help="write the result here (rank 0)")
    p.add_argument("--interfaces", default="lo",
                   help="network interfaces whose sent bytes count as wire bytes (every host's "
                        "first rank counts its own; e.g. lo,eth0 on a multi-host job)")
    return p.parse_args(argv)


def host_tx_bytes(interfaces=("lo",)) -> int:
    """Bytes sent by ``interfaces`` of this process's network namespace (its host): the
    loopback, and on a multi-host job its link too (0 if unreadable)."""
    total = 0
    try:
        with open("/proc/self/net/dev") as f:
            for line in f:
                name, sep, rest = line.partition(":")
                if sep and name.strip() in interfaces:
                    total += int(rest.split()[8])
    except (OSError, ValueError, IndexError):
        return 0
    return total


def _peer_stats(peer: str, module, params, step: int, start: int) -> dict:
    """A peer's step in ``opt.stats()``'s terms: its payload bytes (an allreduce's, or our
    DDP hook's allgather), the elements they stand for (a float32 element per 4 bytes),
    nothing waited on apart."""
    sent = peer_bytes(peer, module, params, step, start)
    n = sum(p.numel() for p in params)
    kind = "allgather_bytes" if peer.startswith("ddp_ssfusion") else "allreduce_bytes"
    hook = getattr(module, "ssfusion_hook", None)  # our hook: the density of the step it synchronized
    target = hook.recipe.density_at(max(hook.step - 1, 0)) if hook is not None else 1.0
    return {"phase": "peer", kind: sent, "elements_sent": sent / 4, "elements": n,
            "tensors_missing": 0, "nonfinite": 0, "density_target": target}


def _backward(loss_fn, model, amp: str, device) -> None:
    """One forward and backward of ``model`` as the loop runs them (``ddp_ssfusion_plan``
    times it for its plan)."""
    autocast = (torch.autocast(device.type, dtype=getattr(torch, amp)) if amp != "none"
                else contextlib.nullcontext())
    with autocast:
        loss = loss_fn(0, model)
    loss.backward()


def _barrier() -> None:
    hvd.allreduce(torch.zeros(1), name="bench.barrier")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.warmup <= args.warmup_steps:
        raise SystemExit(f"--warmup ({args.warmup}) must exceed --warmup-steps ({args.warmup_steps}): "
                         "the timed window must start after planning")
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    device = rank_device(args.device, hvd.local_rank())
    model, loss_fn = build(args.model, args.batch_size, args.seq_len, args.seed, rank, device)
    batch = args.batch_size or MODELS[args.model][1]
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    peer = args.scheme in PEERS
    forward = None  # the module the loss runs through: the model, or a peer's DDP wrapper
    if peer:
        forward, opt, _ = make_peer(args.scheme, model, opt, list(model.named_parameters()),
                                    powersgd_start=args.powersgd_start, density=args.density,
                                    density_warmup_steps=args.density_warmup_steps,
                                    backward=lambda: _backward(loss_fn, model, args.amp, device))
    else:
        opt = ssfusion_hvd.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), scheme=args.scheme,
            sparsifier=args.sparsifier, density=args.density, warmup_steps=args.warmup_steps,
            log_plan=False, density_warmup_steps=args.density_warmup_steps,
            momentum_correction={"auto": "auto", "on": True, "off": False}[args.momentum_correction],
            scheme_options=options_for(args.scheme, min_k=args.min_k))
        if args.agreement == "off":
            opt._agreement.enabled = False
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    synchronizes = hasattr(opt, "synchronize")  # Horovod's split step (not DDP's optimizer)
    params = [p for p in model.parameters() if p.requires_grad]
    n_tensors = len(params)

    times, per_iter = [], []
    compute = []  # every step's (forward, backward) on this rank, warm-up steps included
    stamps = []   # every timed step's clock readings on this rank (see "stamps_s" below)
    ifaces = tuple(args.interfaces.split(","))
    autocast = (torch.autocast(device.type, dtype=getattr(torch, args.amp)) if args.amp != "none"
                else contextlib.nullcontext())
    # a GPU iteration ends when its kernels have: the optimizer's update is queued, not run,
    # when step() returns
    settle = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tx0 = 0
    for step in range(args.warmup + args.iters):
        if step == args.warmup:
            _barrier()
            tx0 = host_tx_bytes(ifaces)
        t0 = time.perf_counter()
        opt.zero_grad()
        with autocast:
            loss = loss_fn(step, forward)
        t1 = time.perf_counter()
        loss.backward()  # a DDP peer's allreduces run here, inside its hooks
        t2 = time.perf_counter()
        if synchronizes:
            opt.synchronize()  # Horovod's split step: synchronize, then the update alone
            t_sync = time.perf_counter()
            with opt.skip_synchronize():
                opt.step()
        else:
            t_sync = t2
            opt.step()
        settle()
        t3 = time.perf_counter()
        compute.append((t1 - t0, t2 - t1))
        if step >= args.warmup:
            times.append(t3 - t0)
            s = opt.stats() if not peer else _peer_stats(args.scheme, forward, params, step,
                                                              args.powersgd_start)
            per_iter.append({"forward_s": t1 - t0, "backward_s": t2 - t1, "step_s": t3 - t2,
                             "sync_s": t_sync - t2, "update_s": t3 - t_sync})
            per_iter[-1].update({k: s.get(k, 0) for k in (
                "phase", "wait_s", "communicate_s", "sparsify_s", "offload_s", "agreement_s",
                "allreduce_bytes",
                "allgather_bytes", "alltoall_bytes", "tensors_missing", "elements_sent",
                "elements", "nonfinite", "density_target")})
            stamps.append((t0, t1, t2, t_sync, t3, time.perf_counter()))
    _barrier()
    t_end = time.perf_counter()
    # every host counts once (its first local rank): all workers' bytes, over all links
    tx = float(host_tx_bytes(ifaces) - tx0) if hvd.local_rank() == 0 else 0.0
    tx = float(hvd.allreduce(torch.tensor([tx], dtype=torch.float64), op=hvd.Sum,
                             name="bench.tx")[0])
    everyone = hvd.allgather(torch.tensor([times], dtype=torch.float64), name="bench.times")
    # every rank's forward and backward of every step: what the warm-up profile timed can
    # be set against the steps timed here (scripts/validate_planner.py)
    steps_s = hvd.allgather(torch.tensor([compute], dtype=torch.float64), name="bench.compute")
    # each timed step's (start, backward, synchronize, update, end, after stats()) on every
    # rank, in seconds from the barrier that ends the timed window on this rank
    # (perf_counter is one clock across the processes of one host: the ranks of a host
    # can be lined up; across hosts the barrier is the common reference)
    clock = torch.tensor([[[t - t_end for t in st] for st in stamps]], dtype=torch.float64)
    stamps_s = hvd.allgather(clock, name="bench.stamps")
    slowest = everyone.max(dim=0).values.tolist()
    it = statistics.median(slowest)
    med = lambda key: statistics.median(float(r[key]) for r in per_iter)  # noqa: E731
    # ours, or the DDP hook's under its planner (ddp_ssfusion_plan)
    hook = getattr(forward, "ssfusion_hook", None) if peer else None
    cost_model = getattr(opt, "cost_model", None) or getattr(forward, "ssfusion_cost", None)
    plan = getattr(opt, "plan", None) or getattr(hook, "plan", None)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "amp": args.amp, "agreement": args.agreement,
        "model": args.model, "scheme": args.scheme, "sparsifier": args.sparsifier,
        "density": args.density, "workers": size, "batch": batch, "tensors": n_tensors,
        "parameters": sum(p.numel() for p in model.parameters()),
        "iteration_s": it, "samples_per_s": size * batch / it, "iteration_s_all": slowest,
        # [rank][step] = (forward_s, backward_s) of every step, the untimed ones first
        "steps_s": [[[round(v, 6) for v in st] for st in r] for r in steps_s.tolist()],
        "stamps_s": [[[round(v, 6) for v in st] for st in r] for r in stamps_s.tolist()],
        # the timed window's wall time per iteration on rank 0: what the job's throughput
        # is, stats() and the loop's own code included
        "period_s": (t_end - stamps[0][0]) / max(args.iters, 1) if stamps else 0.0,
        "phase": per_iter[-1]["phase"], "density_target": per_iter[-1]["density_target"],
        "recipe": opt.recipe.describe() if hasattr(opt, "recipe") else "",
        "peer": peer,
        # rank 0's medians: time step() blocked on communication, time from the first
        # collective to the last result, time selecting
        "wait_s": med("wait_s"), "communicate_s": med("communicate_s"),
        "sparsify_s": med("sparsify_s"), "offload_s": med("offload_s"),
        "wait_share": med("wait_s") / it,
        # blocked reading the step's agreement (the check's whole cost for SparDL, ZEN,
        # ExDyna; for the planned schemes shared with the non-finite flags it carries)
        "agreement_s": med("agreement_s"),
        # rank 0's breakdown of an iteration: forward (with zero_grad and the synthetic
        # batch), backward (with the hooks' inline selection and submissions), step
        # (waiting, decoding, copying into .grad, the wrapped optimizer's update)
        "forward_s": med("forward_s"), "backward_s": med("backward_s"), "step_s": med("step_s"),
        # step() split as Horovod allows: synchronize() (waiting, decoding, copying into
        # .grad) and the wrapped optimizer's update
        "sync_s": med("sync_s"), "update_s": med("update_s"),
        "payload_bytes": med("allreduce_bytes") + med("allgather_bytes") + med("alltoall_bytes"),
        "wire_bytes": tx / max(args.iters, 1),  # all workers, per iteration, every host
        "achieved_density": med("elements_sent") / max(med("elements"), 1),
        "missing_rate": statistics.mean(float(r["tensors_missing"]) for r in per_iter) / n_tensors,
        "nonfinite": max(int(r["nonfinite"] or 0) for r in per_iter),
        "final_loss": float(loss.detach()),
        "args": vars(args),
        # what a planned scheme measured at start-up (input of scripts/whatif.py)
        "cost_model": None if cost_model is None else json.loads(cost_model.to_json()),
        # the plan that ran (scripts/validate_planner.py simulates it on that cost model)
        "plan": None if plan is None else json.loads(plan.to_json()),
    }
    if rank == 0:
        print(f"[bench] {args.model} {args.scheme} x{size}: {result['samples_per_s']:.2f} samples/s "
              f"(median iteration {1e3 * it:.1f} ms, blocked on communication "
              f"{100 * result['wait_share']:.0f}%, {result['wire_bytes'] / 1e6:.2f} MB on the wire "
              f"per iteration, missing rate {result['missing_rate']:.3f})", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
