#!/usr/bin/env python3
"""Where a GPU job's sparse collective time goes (docs/gpu.md: GPT-2's 10 MB allgather took
~280 ms on a 1 Gbit/s link that allows 80 ms). Run under horovodrun, paced like a bench:

    horovodrun -np 2 -H localhost:2 --gloo env LD_PRELOAD=build/pace/libssfpace.so \\
        SSF_PACE_BYTES_PER_S=125000000 python scripts/gpu_probe_collectives.py

Times, as the median of ``--reps`` rounds on the slowest rank, one Horovod allgather of
``--mb`` MB per rank (float32) and one allreduce of the same size:

* of a host tensor (gloo alone: what the start-up cost model measures);
* of a CUDA tensor (Horovod built without GPU operations stages it through host memory);
* of a CUDA tensor while every rank keeps the GPU busy with matmuls queued before the
  collective (the backward of a rank sharing the GPU with another), so that the staging
  copy waits for them;

and the device-to-host copy alone; then torch.distributed's gloo allgather and allreduce of
the same tensors (what the DDP hook and PowerSGD use). Prints one line per case;
``--json`` writes them. Runs on a machine without a GPU too (host tensors only).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import horovod.torch as hvd
import torch


def sweep(args) -> None:
    """Median (of ``--reps``, slowest rank) Horovod allgather time of host tensors from 0.25
    to 16 MiB per rank, beside the time a 1 Gbit/s link needs for them."""
    rows = {}
    for mib in (0.25, 1, 2, 4, 8, 16):
        x = torch.ones(int(mib * (1 << 20) / 4))
        times = []
        for i in range(args.reps + 1):
            hvd.allreduce(torch.zeros(1), name="probe.sweep.barrier")
            t0 = time.perf_counter()
            hvd.allgather(x, name=f"probe.sweep.{mib}")
            times.append(time.perf_counter() - t0)
        slowest = hvd.allgather(torch.tensor([times[1:]]), name=f"probe.sweep.t.{mib}").max(dim=0).values
        rows[mib] = statistics.median(slowest.tolist())
    if hvd.rank() == 0:
        for mib, v in rows.items():
            print(f"[probe] allgather {mib} MiB per rank: {1e3 * v:.1f} ms "
                  f"(1 Gbit/s: {mib * (1 << 20) * 8 / 1e6:.1f} ms)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": hvd.size(), "allgather_seconds_by_mib": rows}, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=10.0)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--busy-ms", type=float, default=50.0, help="GPU work queued before the busy case")
    p.add_argument("--pieces", type=int, default=16,
                   help="the allgathers again as this many smaller ones (Horovod fuses them "
                        "back into one unless HOROVOD_FUSION_THRESHOLD is below a piece)")
    p.add_argument("--sweep", action="store_true",
                   help="instead: one Horovod allgather per size from 0.25 to 16 MiB per rank "
                        "(where Gloo's allgather leaves the link's rate)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    hvd.init()
    gpu = torch.cuda.is_available()  # without one (a dry run of the script) every tensor is a host one
    dev = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count()) if gpu else torch.device("cpu")
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    if gpu:
        torch.cuda.set_device(dev)
    if args.sweep:
        sweep(args)
        return
    n = int(args.mb * 1e6 / 4)
    host = torch.randn(n)
    cuda = host.to(dev)
    a = torch.randn(4096 if gpu else 256, 4096 if gpu else 256, device=dev)
    # how many 4096^3 matmuls make --busy-ms on this GPU (alone)
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    sync()
    per = (time.perf_counter() - t0) / 10
    busy = max(1, int(args.busy_ms / 1e3 / per))

    def timed(fn, tag: str) -> float:
        times = []
        for i in range(args.reps + 1):
            hvd.allreduce(torch.zeros(1), name=f"probe.barrier.{tag}.{i}")
            sync()
            t0 = time.perf_counter()
            fn(f"{tag}.{i}")
            sync()
            times.append(time.perf_counter() - t0)
        slowest = hvd.allgather(torch.tensor([times[1:]]), name=f"probe.times.{tag}").max(dim=0).values
        return statistics.median(slowest.tolist())

    def busy_then(op):
        def fn(name):
            for _ in range(busy):
                a @ a
            op(cuda, name=name)
        return fn
    cases = {
        "allgather host": timed(lambda nm: hvd.allgather(host, name=nm), "agh"),
        "allgather cuda": timed(lambda nm: hvd.allgather(cuda, name=nm), "agc"),
        f"allgather cuda after {busy} queued matmuls": timed(busy_then(hvd.allgather), "agb"),
        f"{busy} matmuls alone": timed(lambda nm: [a @ a for _ in range(busy)], "mm"),
        "allreduce host": timed(lambda nm: hvd.allreduce(host, name=nm), "arh"),
        "allreduce cuda": timed(lambda nm: hvd.allreduce(cuda, name=nm), "arc"),
        "device-to-host copy": timed(lambda nm: cuda.cpu(), "d2h"),
    }
    # the same through torch.distributed's gloo (what the DDP hook and PowerSGD use), on
    # the same ranks and links
    import torch.distributed as dist

    from ssfusion_hvd.examples.peers import _init_gloo

    _init_gloo()
    world = dist.get_world_size()
    me = dist.get_rank()

    def exchange(x, out):
        """An allgather as every rank's direct send to every other (isend / irecv)."""
        chunks = out.view(world, -1)
        chunks[me].copy_(x)
        ops = [op for r in range(world) if r != me
               for op in (dist.P2POp(dist.isend, x, r), dist.P2POp(dist.irecv, chunks[r], r))]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    pieces = host.chunk(args.pieces)

    def hvd_pieces(nm):
        for h in [hvd.allgather_async(c, name=f"{nm}.{j}") for j, c in enumerate(pieces)]:
            hvd.synchronize(h)
    cases[f"horovod allgather in {args.pieces} pieces, host"] = timed(hvd_pieces, "agp")
    outs = [torch.empty(world * c.numel()) for c in pieces]

    def torch_pieces(nm):
        for w in [dist.all_gather_into_tensor(o, c, async_op=True) for o, c in zip(outs, pieces)]:
            w.wait()
    cases[f"torch gloo all_gather_into_tensor in {args.pieces} pieces, host"] = timed(torch_pieces, "tagp")
    cases["horovod alltoall as an allgather, host"] = timed(
        lambda nm: hvd.alltoall(host.repeat(world), splits=torch.full((world,), n, dtype=torch.int32),
                                name=nm), "a2a")
    for label, x in (("host", host), ("cuda", cuda)):
        out = torch.empty(world * n, device=x.device)
        if label == "host":
            cases["torch gloo isend/irecv to every rank, host"] = timed(
                lambda nm, x=x, out=out: exchange(x, out), "p2p")
        cases[f"torch gloo all_gather_into_tensor {label}"] = timed(
            lambda nm, x=x, out=out: dist.all_gather_into_tensor(out, x), f"tag{label}")
        cases[f"torch gloo all_reduce {label}"] = timed(lambda nm, x=x: dist.all_reduce(x), f"tar{label}")
    if hvd.rank() == 0:
        link = args.mb * 8 / 1e3  # seconds at 1 Gbit/s for one rank's share
        print(f"[probe] {hvd.size()} ranks on {torch.cuda.get_device_name(dev) if gpu else 'no GPU'}, {args.mb} MB per "
              f"rank ({1e3 * link:.0f} ms at 1 Gbit/s), medians of {args.reps}:")
        for k, v in cases.items():
            print(f"[probe] {k}: {1e3 * v:.1f} ms")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"mb": args.mb, "ranks": hvd.size(), "gpu": torch.cuda.get_device_name(dev) if gpu else None,
                           "seconds": cases}, f, indent=1)


if __name__ == "__main__":
    main()
