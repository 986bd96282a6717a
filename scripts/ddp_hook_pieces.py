"""The DDP hook's allgather as one message or in pieces (``ssfusion_hvd.ddp.
ALLGATHER_PIECE_BYTES``), on the links of a real multi-host job: one 4096 x 4096 linear
layer in one DDP bucket, so a step's record is one large allgather (6.7 MB per rank at
density 0.05). Run under horovodrun (its ranks start the gloo group), e.g.

    sudo .venv/bin/python scripts/cluster.py --hosts 2 --slots 1 --rate 1gbit --delay 0 -- \\
        .venv/bin/python scripts/ddp_hook_pieces.py

Alternates the two settings, rounds of --steps timed steps each (after 3 untimed), and
prints the median step and its min-max per setting, the slowest rank's."""
from __future__ import annotations

import argparse
import statistics
import time

import horovod.torch as hvd
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ssfusion_hvd.ddp
from ssfusion_hvd.examples.peers import _init_gloo


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--density", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    hvd.init()
    _init_gloo()
    torch.manual_seed(0)
    settings = {"one message": 1 << 62, "pieces of 1 MiB": 1 << 20}
    times = {k: [] for k in settings}
    x = torch.randn(8, 4096)
    for _ in range(args.rounds):
        for label, piece in settings.items():
            ssfusion_hvd.ddp.ALLGATHER_PIECE_BYTES = piece
            model = DDP(torch.nn.Linear(4096, 4096), bucket_cap_mb=4096)
            ssfusion_hvd.ddp.register(model, scheme="ssfusion", density=args.density,
                                      density_warmup_steps=0)
            for step in range(3 + args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                model(x).square().mean().backward()
                model.zero_grad()
                if step >= 3:
                    times[label].append(time.perf_counter() - t0)
    for label, ts in times.items():
        t = torch.tensor(ts, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if dist.get_rank() == 0:
            ms = [1e3 * v for v in t.tolist()]
            print(f"[pieces] {label}: median {statistics.median(ms):.1f} ms "
                  f"({min(ms):.1f}-{max(ms):.1f}), {len(ms)} steps", flush=True)


if __name__ == "__main__":
    main()
