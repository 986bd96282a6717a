"""Data-parallel training of the default model on the default data, under horovodrun.

    horovodrun -np 2 --gloo python -m ssfusion_hvd.examples.train --scheme ssfusion_oi --epochs 10

(or ``bash scripts/demo.sh``). Rank 0 prints one line per epoch: mean training loss over
all ranks, test accuracy, and samples/s (all ranks' samples over the epoch's wall time),
then what the scheme sent in its last iteration (``opt.stats()``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import ssfusion_hvd
from ssfusion_hvd.examples.data import DigitsNet, load_digits_split, shard


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scheme", default="ssfusion_oi", help=f"one of {sorted(ssfusion_hvd.SCHEMES)}")
    p.add_argument("--sparsifier", default="topk", help=f"one of {sorted(ssfusion_hvd.SPARSIFIERS)}")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.05, help="per worker; scaled by the number of workers")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write per-epoch metrics here (rank 0)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return p.parse_args(argv)


def evaluate(model, split) -> float:
    model.eval()
    with torch.no_grad():
        correct = (model(split.x).argmax(1) == split.y).sum().item()
    model.train()
    return correct / len(split.y)


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(args.seed)
    train, test = load_digits_split(seed=args.seed)
    mine = shard(train, rank, size)
    steps = len(mine.y) // args.batch_size
    if steps == 0:
        raise SystemExit(f"batch size {args.batch_size} exceeds the shard of {len(mine.y)} samples")

    model = DigitsNet()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=args.momentum)
    opt = ssfusion_hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                            scheme=args.scheme, sparsifier=args.sparsifier,
                                            density=args.density)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    if rank == 0:
        print(f"ssfusion_hvd {ssfusion_hvd.__version__}: scheme={args.scheme} "
              f"sparsifier={args.sparsifier} density={args.density} workers={size} "
              f"train={len(train.y)} test={len(test.y)} steps/epoch={steps}", flush=True)
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.epochs * steps, unit="step", file=sys.stderr, mininterval=1.0, leave=False)
    history = []
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(mine.y), generator=torch.Generator().manual_seed(args.seed * 1000 + epoch * 10 + rank))
        loss_sum = torch.zeros(1)
        start = time.perf_counter()
        for s in range(steps):
            idx = order[s * args.batch_size:(s + 1) * args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(mine.x[idx]), mine.y[idx])
            loss.backward()
            opt.step()
            loss_sum += loss.detach()
            if bar is not None:
                bar.update(1)
        elapsed = time.perf_counter() - start
        mean_loss = hvd.allreduce(loss_sum / steps, name="train.loss", op=hvd.Average).item()
        elapsed = hvd.allreduce(torch.tensor([elapsed]), name="train.time", op=hvd.Max).item()
        acc = evaluate(model, test)
        row = {"epoch": epoch, "loss": mean_loss, "test_acc": acc,
               "samples_per_s": size * steps * args.batch_size / elapsed}
        history.append(row)
        if rank == 0:
            line = (f"epoch {epoch:3d}/{args.epochs}  loss {mean_loss:.4f}  test_acc {100 * acc:6.2f}%"
                    f"  samples/s {row['samples_per_s']:9.1f}")
            print(line, flush=True)
    if bar is not None:
        bar.close()
    stats = opt.stats()
    if rank == 0:
        print(f"last iteration: {stats.get('phase')}, sent {stats.get('elements_sent')} of "
              f"{stats.get('elements')} elements (density {stats.get('density', 1.0):.4g}), "
              f"{stats.get('tensors_sparse', 0)} tensors sparse, {stats.get('tensors_dense', 0)} "
              f"dense, {stats.get('tensors_missing', 0)} missing; bytes allreduce "
              f"{stats.get('allreduce_bytes', 0)}, allgather {stats.get('allgather_bytes', 0)}",
              flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "workers": size, "history": history,
                       "stats": stats}, f, indent=1)
    return history


if __name__ == "__main__":
    main()
