"""What naming an allgather for one step only costs (``Transport``'s ``step``).

Horovod caches a collective's response by name; a name used for one step only is never a
cache hit, so each Horovod cycle that holds such an allgather negotiates it through the
coordinator (a gather of the ranks' requests and a broadcast of the response) where a
cached one exchanges a bit vector. This measures that difference where it would show: a
step of ``--groups`` small allgathers (a planned scheme's sparse groups) beside one
gradient allreduce, the allgathers under the same names every step (A) or under names of
their step (B). A and B alternate in blocks within one run, so both see the same machine;
printed are the medians of per-block step times and B/A per pair of blocks.

    horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python scripts/bench_step_names.py
    python scripts/cluster.py --hosts 2 --slots 1 -- .venv/bin/python scripts/bench_step_names.py
"""
from __future__ import annotations

import argparse
import statistics
import time

import horovod.torch as hvd
import torch


def step(n: int, named_by_step: bool, grad: torch.Tensor, records) -> None:
    handles = [hvd.allreduce_async_(grad, name="grad")]
    for g, rec in enumerate(records):
        name = f"ag{g}@{n}" if named_by_step else f"ag{g}"
        handles.append(hvd.allgather_async(rec, name=name))
    for h in handles:
        hvd.synchronize(h)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=4, help="allgathers per step")
    p.add_argument("--entries", type=int, default=10_000, help="int32 entries per allgather")
    p.add_argument("--grad-mb", type=float, default=4.0, help="the allreduce's size, MB")
    p.add_argument("--block", type=int, default=20, help="steps per block")
    p.add_argument("--pairs", type=int, default=10, help="A/B block pairs")
    args = p.parse_args()
    hvd.init()
    grad = torch.zeros(int(args.grad_mb * 2**20 / 4))
    records = [torch.arange(args.entries, dtype=torch.int32) for _ in range(args.groups)]
    n = 0
    for _ in range(args.block):  # warm-up: connections, buffers, the cache
        step(n, False, grad, records)
        n += 1
    blocks = {False: [], True: []}
    for pair in range(args.pairs):
        for mode in ((False, True) if pair % 2 == 0 else (True, False)):
            hvd.barrier()
            t0 = time.perf_counter()
            for _ in range(args.block):
                step(n, mode, grad, records)
                n += 1
            blocks[mode].append((time.perf_counter() - t0) / args.block * 1e3)
    if hvd.rank() == 0:
        a, b = blocks[False], blocks[True]
        ratios = sorted(y / x for x, y in zip(a, b))
        print(f"size {hvd.size()}, {args.groups} allgathers of {args.entries} int32 + "
              f"{args.grad_mb} MB allreduce, {args.pairs} pairs of {args.block}-step blocks")
        print(f"A (same names)  ms/step median {statistics.median(a):.3f} "
              f"[{min(a):.3f}, {max(a):.3f}]")
        print(f"B (step names)  ms/step median {statistics.median(b):.3f} "
              f"[{min(b):.3f}, {max(b):.3f}]")
        print(f"B/A per pair    median {statistics.median(ratios):.3f} "
              f"[{ratios[0]:.3f}, {ratios[-1]:.3f}]")
    hvd.shutdown()


if __name__ == "__main__":
    main()
