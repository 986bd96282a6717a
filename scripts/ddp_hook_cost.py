"""What a DDP communication hook adds to a training step, on one rank (issue 36): DDP
without a hook, with torch's PowerSGD hook (rank 4, error feedback, warm start) and with
``ssfusion_hvd.ddp`` (each of its sparse schemes), the same model, batches and optimizer.
With one rank every collective is trivial, so the difference to plain DDP is the hook's
own work: PowerSGD's projections and orthogonalization against our error feedback,
selection, record packing and decode.

    python scripts/ddp_hook_cost.py --device cuda --model gpt2 --batch-size 8 \\
        --seq-len 1024 --amp bfloat16 --json build/hook_cost.json

On a GPU the process group is NCCL (world size 1), on the CPU gloo. Each configuration
is run ``--rounds`` times, interleaved (A B C A B C), each round on a fresh model: steps
``--warmup`` untimed (PowerSGD compresses from its 3rd step, our hook sparsifies from its
1st: no density warm-up), then ``--iters`` timed, each ended by
``torch.cuda.synchronize()``. It prints the median step, its spread (min-max over every
timed step of every round), the median added to DDP's, peak GPU memory and bytes a
step would send (``peers.peer_bytes``)."""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ssfusion_hvd.examples.models import MODELS, build
from ssfusion_hvd.examples.peers import make_peer, peer_bytes

CONFIGS = ("ddp", "ddp_powersgd4", "ssfusion", "per_tensor", "multi_tensor")
POWERSGD_FROM = 2  # PowerSGD's plain-allreduce steps (untimed: --warmup is more)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2", choices=sorted(MODELS))
    p.add_argument("--batch-size", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--amp", default="none", choices=("none", "float16", "bfloat16"))
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="DDP peers (ddp, ddp_powersgd4, ...) and hook schemes, a scheme as "
                        "SCHEME:MB for DDP buckets of MB (default DDP's 25)")
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def one_round(args, config: str, device: torch.device) -> dict:
    model, loss_fn = build(args.model, args.batch_size, args.seq_len, 0, 0, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    params = list(model.parameters())
    if config.startswith("ddp"):
        module, opt, _ = make_peer(config, model, opt, list(model.named_parameters()),
                                   powersgd_start=POWERSGD_FROM)
    else:
        import ssfusion_hvd.ddp

        from torch.nn.parallel import DistributedDataParallel as DDP

        scheme, _, cap = config.partition(":")  # "ssfusion:4096": DDP's buckets of 4096 MB
        module = DDP(model, bucket_cap_mb=float(cap)) if cap else DDP(model)
        module.ssfusion_hook = ssfusion_hvd.ddp.register(
            module, scheme=scheme, density=args.density, density_warmup_steps=0, optimizer=opt)
    autocast = (torch.autocast(device.type, dtype=getattr(torch, args.amp)) if args.amp != "none"
                else contextlib.nullcontext())
    settle = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        settle()
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for step in range(args.warmup + args.iters):
        t0 = time.perf_counter()
        opt.zero_grad()
        with autocast:
            loss = loss_fn(step, module)
        loss.backward()
        opt.step()
        settle()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    peer = config if config.startswith("ddp") else "ddp_ssfusion"
    out = {"times_s": times,
           "bytes": peer_bytes(peer, module, params, args.warmup + args.iters, POWERSGD_FROM)}
    if device.type == "cuda":
        out["peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    del module, model, opt
    # the hook, the optimizer's wrapped step and the DDP module refer to each other: free
    # the cycle now, so the next configuration's peak is its own
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = tempfile.mkdtemp(prefix="ssf-hookcost-")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"file://{os.path.join(store, 'store')}", rank=0, world_size=1)
    configs = args.configs.split(",")
    runs = {c: [] for c in configs}
    for _ in range(args.rounds):
        for c in configs:
            runs[c].append(one_round(args, c, device))
    dist.destroy_process_group()
    rows = {}
    for c, rs in runs.items():
        ts = [t for r in rs for t in r["times_s"]]
        rows[c] = {"median_ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts),
                   "max_ms": 1e3 * max(ts), "round_medians_ms": [1e3 * statistics.median(r["times_s"]) for r in rs],
                   "bytes": rs[-1]["bytes"], "peak_gb": max(r.get("peak_gb", 0.0) for r in rs)}
    base = rows.get("ddp", {}).get("median_ms")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"[hook_cost] {args.model}, batch {args.batch_size or MODELS[args.model][1]}, {name}, "
          f"amp {args.amp}, density {args.density}, one rank ({'nccl' if device.type == 'cuda' else 'gloo'})")
    print(f"[hook_cost] {'config':<14} {'median ms':>10} {'(min-max)':>16} {'+ over DDP':>11} "
          f"{'MB a step':>10} {'peak GB':>8}")
    for c, r in rows.items():
        added = f"{r['median_ms'] - base:+.1f}" if base is not None else "-"
        print(f"[hook_cost] {c:<14} {r['median_ms']:>10.1f} {r['min_ms']:>7.1f}-{r['max_ms']:<8.1f} "
              f"{added:>11} {r['bytes'] / 1e6:>10.2f} {r['peak_gb']:>8.2f}")
    result = {"args": vars(args), "device": name, "torch": torch.__version__, "rows": rows}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
