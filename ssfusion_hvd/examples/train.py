"""Data-parallel training on real data that ships with a package, under horovodrun.

    horovodrun -np 2 --gloo python -m ssfusion_hvd.examples.train --scheme ssfusion_oi --epochs 10
    horovodrun -np 2 --gloo python -m ssfusion_hvd.examples.train --task lm --epochs 4

Tasks: ``digits`` (the default: a small CNN on scikit-learn's handwritten digits, momentum
SGD, test accuracy; ``bash scripts/demo.sh`` runs it), ``lm`` (a small GPT-2 on the
standard library's docstrings, byte level, Adam, validation perplexity) and ``code`` (the
harder one: a deeper GPT-2 on the standard library's source; see ``examples/text.py``);
for the accuracy suite (``scripts/accuracy_suite.py``) the same digits with other models:
``mlp`` (64-256-256-10), ``mlp_wide`` (64-1024-10), ``mlp_deep`` (four hidden layers of
128) and ``gru`` (the rows read by a GRU of 128), with ``--optimizer sgd`` (momentum, the
default) or ``adam``. ``--scheme`` also takes the peers a user would pick instead
(``examples/peers.py``: ``ddp``, ``ddp_fp16``, ``ddp_powersgd1``, ``ddp_powersgd4``,
``hvd_fp16``), run on the same data, seeds and launcher. Rank 0 prints one line per epoch: mean training loss over all
ranks, the task's metric, and samples/s (all ranks' samples over the epoch's wall time),
then what the scheme sent in its last iteration (``opt.stats()``). With ``--json`` every
step's ``opt.stats()`` is read (which resolves device counters: a measuring run) so that
each epoch also reports the tensor missing rate (tensors that sent nothing / tensors).
``--device cuda`` trains on the GPU (each rank on GPU ``local_rank`` modulo those visible;
Horovod must be built with CUDA: ``scripts/gpu_setup.sh``), ``--amp`` autocasts there.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import dataclass
from typing import Callable

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import ssfusion_hvd
from ssfusion_hvd.registry import options_for
from ssfusion_hvd.examples.data import DIGITS_MODELS, Split, load_digits_split, shard
from ssfusion_hvd.examples.models import rank_device
from ssfusion_hvd.examples.peers import PEERS, make_peer, peer_bytes

TASKS = (*DIGITS_MODELS, "lm", "code")
#: per task: (batch size per worker, learning rate, steps per epoch or 0 for one pass); the
#: image tasks' SGD rate is per worker (scaled by the workers), Adam's is ADAM_LR
DEFAULTS = {**{t: (32, 0.05, 0) for t in DIGITS_MODELS}, "lm": (16, 2e-3, 100),
            "code": (16, 1e-3, 100)}
#: the image tasks' learning rate with --optimizer adam (not scaled by the workers)
ADAM_LR = 1e-3


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="digits", choices=TASKS)
    p.add_argument("--scheme", default="ssfusion_oi",
                   help=f"one of {sorted(ssfusion_hvd.SCHEMES)}, or a peer: {', '.join(PEERS)}")
    p.add_argument("--sparsifier", default="topk", help=f"one of {sorted(ssfusion_hvd.SPARSIFIERS)}")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=0, help="per worker (0: the task's default)")
    p.add_argument("--lr", type=float, default=0.0,
                   help="0: the task's default (digits: 0.05 per worker, scaled by the number of "
                        "workers; lm: Adam 2e-3)")
    p.add_argument("--steps", type=int, default=0,
                   help="steps per epoch (0: digits one pass over the shard, lm 100)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"),
                   help="image tasks: momentum SGD (lr 0.05 per worker) or Adam (lr 1e-3); the "
                        "text tasks always use Adam")
    p.add_argument("--momentum-correction", default="auto", choices=("auto", "on", "off"),
                   help="the recipe's local rule: DGC momentum correction (SGD) / local Adam "
                        "moments (Adam); off: plain error feedback (see docs/recipe.md)")
    p.add_argument("--moments", default=None, choices=("shared", "local"),
                   help="where the corrected optimizer state lives (default: the package's; "
                        "docs/recipe.md)")
    p.add_argument("--density-warmup-steps", type=int, default=None,
                   help="the recipe's density warm-up in steps (default: the optimizer's, 'auto'; 0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-k", type=int, default=None,
                   help="SSFusion schemes and auto: scheme_options['min_k'], tensors whose top-k "
                        "would keep fewer elements go dense (default: the scheme's, 0: off)")
    p.add_argument("--floor", default=None,
                   help="SSFusion schemes and auto: scheme_options['floor'], the group budget's "
                        "floor share ('none': every tensor its own k; default: the scheme's)")
    p.add_argument("--slack", type=float, default=None,
                   help="SSFusion schemes and auto: scheme_options['slack'], how much slower "
                        "(predicted) a plan with larger shared budgets may be (default: the "
                        "scheme's)")
    p.add_argument("--waits", choices=("on", "off", "auto"), default=None,
                   help="planned schemes: scheme_options['waits'], each sparse entry carries its "
                        "sender's wait for the shared moments (default: the scheme's, 'auto': "
                        "from 3 ranks)")
    p.add_argument("--spread", choices=("on", "off", "auto"), default=None,
                   help="planned schemes: scheme_options['spread'], each sparse entry carries its "
                        "sender's spread for the shared Adam rule (default: the scheme's, "
                        "'auto': with an Adam)")
    p.add_argument("--select-by", choices=("auto", "magnitude", "step", "gain"), default=None,
                   help="planned schemes, zen, spardl, exdyna: scheme_options['select_by'], what the "
                        "top-k (exdyna: its threshold) ranks: the accumulated gradient, the "
                        "optimizer's step with it or their product (Adam; default: the "
                        "scheme's)")
    p.add_argument("--plan", default=None,
                   help="a Plan JSON (opt.plan.save) the sparse scheme runs from the first step "
                        "instead of profiling and planning")
    p.add_argument("--profile", default=None,
                   help="a CostModel JSON for the sparse schemes' planner (and "
                        "ddp_ssfusion_plan's) instead of start-up probes (e.g. one measured "
                        "on the slow network you deploy on)")
    p.add_argument("--amp", default="none", choices=("none", "float16", "bfloat16"),
                   help="autocast the forward pass to this dtype (the model stays float32); "
                        "float16 with torch.amp.GradScaler in Horovod's pattern (synchronize, "
                        "unscale_, step under skip_synchronize, update)")
    p.add_argument("--init-scale", type=float, default=2.0 ** 16,
                   help="--amp float16: GradScaler's initial scale (a large one overflows the "
                        "first steps, which the optimizer then skips)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: each rank on GPU local_rank %% the GPUs visible (ranks may share "
                        "one); the data set is moved there whole")
    p.add_argument("--json", default=None, help="write per-epoch metrics here (rank 0)")
    p.add_argument("--step-losses", action="store_true",
                   help="also write each step's training loss (rank 0's batch) into --json")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return p.parse_args(argv)


@dataclass
class Task:
    """What the training loop needs from a task."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    steps: int  # per epoch
    loss: Callable[[int, int], torch.Tensor]  # (epoch, step) -> this rank's batch loss
    evaluate: Callable[[], float]  # the metric on held-out data
    metric: str  # its name in the history rows
    describe: str
    held_out: int = 0  # the samples `evaluate` scores (0: not a count of samples)
    #: the module `loss` runs forward through, in a one-element list: the model, or the
    #: DDP wrapper a peer puts around it
    forward: list = None


def digits_task(args, rank: int, size: int, device=torch.device("cpu")) -> Task:
    train, test = load_digits_split(seed=args.seed)
    mine = shard(train, rank, size)
    steps = args.steps or len(mine.y) // args.batch_size
    if steps == 0:
        raise SystemExit(f"batch size {args.batch_size} exceeds the shard of {len(mine.y)} samples")
    mine, test = (Split(d.x.to(device), d.y.to(device)) for d in (mine, test))
    model = DIGITS_MODELS[args.task]().to(device)
    if args.optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=args.lr or ADAM_LR)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=(args.lr or DEFAULTS[args.task][1]) * size,
                              momentum=args.momentum)
    orders = {}
    forward = [model]

    def loss(epoch: int, s: int) -> torch.Tensor:
        if epoch not in orders:
            orders.clear()
            g = torch.Generator().manual_seed(args.seed * 1000 + epoch * 10 + rank)
            orders[epoch] = torch.randperm(len(mine.y), generator=g)
        idx = orders[epoch][(s * args.batch_size) % len(mine.y):][:args.batch_size].to(device)
        return F.cross_entropy(forward[0](mine.x[idx]), mine.y[idx])

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            correct = (model(test.x).argmax(1) == test.y).sum().item()
        model.train()
        return correct / len(test.y)
    return Task(model, opt, steps, loss, evaluate, "test_acc",
                f"{args.task}: digits train={len(train.y)} test={len(test.y)}, "
                f"{type(opt).__name__}", held_out=len(test.y), forward=forward)


def lm_task(args, rank: int, size: int, device=torch.device("cpu")) -> Task:
    from ssfusion_hvd.examples import text

    if args.task == "code":  # the harder task: stdlib source, a deeper model
        train, valid = text.load_text_split(max_bytes=4_000_000, corpus="source")
        model = text.lm_model(width=192, layers=4, heads=6)
    else:
        train, valid = text.load_text_split()
        model = text.lm_model()
    model.to(device)
    train, valid = (text.TextSplit(d.data.to(device), d.block) for d in (train, valid))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr or DEFAULTS[args.task][1])
    gens = {}
    forward = [model]

    def loss(epoch: int, s: int) -> torch.Tensor:
        if epoch not in gens:
            gens.clear()
            gens[epoch] = torch.Generator().manual_seed((args.seed * 1000 + epoch) * 1000 + rank)
        return text.lm_loss(forward[0], *train.batch(args.batch_size, gens[epoch]))
    corpus = "stdlib source" if args.task == "code" else "stdlib docstrings"
    return Task(model, opt, args.steps or DEFAULTS[args.task][2], loss,
                lambda: text.perplexity(model, valid), "val_ppl",
                f"{args.task}: {corpus}, {len(train.data)} train / {len(valid.data)} valid bytes, "
                f"{sum(p.numel() for p in model.parameters())} parameters", forward=forward)


def metric_text(metric: str, value: float) -> str:
    return f"test_acc {100 * value:6.2f}%" if metric == "test_acc" else f"{metric} {value:8.3f}"


def main(argv=None):
    args = parse_args(argv)
    batch, _, _ = DEFAULTS[args.task]
    args.batch_size = args.batch_size or batch
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    device = rank_device(args.device, hvd.local_rank())
    torch.manual_seed(args.seed)
    task = (digits_task if args.task in DIGITS_MODELS else lm_task)(args, rank, size, device)
    model, steps = task.model, task.steps
    recipe = {"momentum_correction": {"auto": "auto", "on": True, "off": False}[args.momentum_correction]}
    if args.density_warmup_steps is not None:
        recipe["density_warmup_steps"] = args.density_warmup_steps
    if args.moments is not None:
        recipe["moments"] = args.moments
    # --min-k goes to the schemes that take it (the demo's dense comparison run does not)
    options = options_for(args.scheme, min_k=args.min_k, slack=args.slack,
                          waits={None: None, "auto": "auto", "on": True, "off": False}[args.waits],
                          spread={None: None, "auto": "auto", "on": True, "off": False}[args.spread],
                          select_by=args.select_by)
    if args.floor is not None and options_for(args.scheme, floor=0.0):  # a scheme that takes it
        options = dict(options or {}, floor=None if args.floor == "none" else float(args.floor))
    # mixed precision as users train: autocast on the device and, for float16, a
    # GradScaler the optimizer is told about up front (docs/horovod.md, "Mixed precision")
    scaler = (torch.amp.GradScaler(device.type, init_scale=args.init_scale)
              if args.amp == "float16" else None)
    peer = args.scheme in PEERS
    if peer:  # what a user would run instead (DDP broadcasts rank 0's parameters itself)
        task.forward[0], opt, peer_what = make_peer(args.scheme, model, task.optimizer,
                                                    model.named_parameters(),
                                                    density=args.density, profile=args.profile,
                                                    **({} if args.density_warmup_steps is None else
                                                       {"density_warmup_steps":
                                                        args.density_warmup_steps}))
    else:
        opt = ssfusion_hvd.DistributedOptimizer(task.optimizer,
                                                named_parameters=model.named_parameters(),
                                                scheme=args.scheme, sparsifier=args.sparsifier,
                                                density=args.density, profile=args.profile,
                                                plan=args.plan, scheme_options=options,
                                                grad_scaler=scaler, **recipe)
    if not peer or args.scheme == "hvd_fp16":
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    params = [p for p in model.parameters() if p.requires_grad]
    dense_bytes = 4 * sum(p.numel() for p in params)

    peer_steps = [0]

    def stats() -> dict:
        """``opt.stats()``, or for a peer what it sent in the step just taken (called once
        a step): its bytes, PowerSGD's first plain steps counted dense."""
        if not peer:
            return opt.stats()
        sent = peer_bytes(args.scheme, task.forward[0], params, peer_steps[0])
        peer_steps[0] += 1
        return {"phase": args.scheme, "bytes_sent": sent, "elements": dense_bytes // 4}
    n_tensors = sum(1 for p in model.parameters() if p.requires_grad)
    measure = args.json is not None

    if rank == 0:
        print(f"ssfusion_hvd {ssfusion_hvd.__version__}: scheme={args.scheme} "
              f"sparsifier={args.sparsifier} density={args.density} workers={size} "
              f"{task.describe} steps/epoch={steps}", flush=True)
        if peer:
            print(f"peer: {peer_what}", flush=True)
        elif args.scheme != "dense" and hasattr(opt, "recipe"):
            print(opt.recipe.describe(), flush=True)
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.epochs * steps, unit="step", file=sys.stderr, mininterval=1.0, leave=False)
    history = []
    step_log = [] if args.step_losses else None
    for epoch in range(1, args.epochs + 1):
        loss_sum = torch.zeros(1, device=device)
        missing = sent = elements = sent_bytes = 0
        start = time.perf_counter()
        for s in range(steps):
            opt.zero_grad()
            with (torch.autocast(device.type, dtype=getattr(torch, args.amp)) if args.amp != "none"
                  else contextlib.nullcontext()):
                loss = task.loss(epoch, s)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                if peer:
                    scaler.step(opt)
                else:  # Horovod's documented AMP pattern
                    opt.synchronize()
                    scaler.unscale_(opt)
                    with opt.skip_synchronize():
                        scaler.step(opt)
                scaler.update()
            loss_sum += loss.detach().float()
            if step_log is not None:
                step_log.append(loss.item())
            if measure:
                st = stats()
                missing += int(st.get("tensors_missing", 0))
                sent += int(st.get("elements_sent", 0))
                elements += int(st.get("elements", 0))
                sent_bytes += int(st.get("bytes_sent", st.get("allreduce_bytes", 0)
                                         + st.get("allgather_bytes", 0)
                                         + st.get("alltoall_bytes", 0)))  # (ZEN's push)
            if bar is not None:
                bar.update(1)
        elapsed = time.perf_counter() - start
        mean_loss = hvd.allreduce(loss_sum / steps, name="train.loss", op=hvd.Average).item()
        elapsed = hvd.allreduce(torch.tensor([elapsed]), name="train.time", op=hvd.Max).item()
        value = task.evaluate()
        row = {"epoch": epoch, "loss": mean_loss, task.metric: value,
               "samples_per_s": size * steps * args.batch_size / elapsed}
        if measure:
            row["missing_rate"] = missing / (steps * n_tensors)
            # elements sent / elements over every step of the epoch (warm-up included)
            row["density_sent"] = sent / max(elements, 1) if not peer else None
            # bytes one rank sent per step (a dense float32 allreduce: 4 per element)
            row["bytes_per_step"] = sent_bytes / steps
            row["dense_bytes_per_step"] = dense_bytes
        if scaler is not None:
            row["loss_scale"] = scaler.get_scale()
            if not peer:
                row["steps_skipped"] = opt.stats().get("steps_skipped")
        history.append(row)
        if rank == 0:
            line = (f"epoch {epoch:3d}/{args.epochs}  loss {mean_loss:.4f}  {metric_text(task.metric, value)}"
                    f"  samples/s {row['samples_per_s']:9.1f}")
            print(line, flush=True)
    if bar is not None:
        bar.close()
    final = stats()
    if rank == 0 and peer:
        print(f"{args.scheme}: {final['bytes_sent']:,} bytes in the last step "
              f"({final['bytes_sent'] / dense_bytes:.4f} of dense)", flush=True)
    elif rank == 0:
        print(f"last iteration: {final.get('phase')}, sent {final.get('elements_sent')} of "
              f"{final.get('elements')} elements (density {final.get('density', 1.0):.4g}), "
              f"{final.get('tensors_sparse', 0)} tensors sparse, {final.get('tensors_dense', 0)} "
              f"dense, {final.get('tensors_missing', 0)} missing; bytes allreduce "
              f"{final.get('allreduce_bytes', 0)}, allgather {final.get('allgather_bytes', 0)}",
              flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "workers": size, "metric": task.metric,
                       "held_out": task.held_out, "history": history, "stats": final,
                       **({"step_losses": step_log} if step_log is not None else {})}, f,
                      indent=1)
    return history


if __name__ == "__main__":
    main()
