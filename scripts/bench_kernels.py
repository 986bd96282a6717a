#!/usr/bin/env python
"""Selection-kernel benchmark (CPU; see scripts/bench_kernels_cuda.py for the GPU).

Prints medians (and the interquartile range, "lo-hi") of repeated runs, all measured in
this one process:

1. exact magnitude top-k, ours (ssfusion_hvd.ops.topk) vs ``torch.topk(x.abs(), k)`` vs a
   ``torch.kthvalue`` threshold followed by a mask select, and a memcpy of the same bytes
   (``copy_`` into a preallocated tensor: reads n and writes n floats, the memory floor),
   for n from 1e3 to 2.5e7 at density 0.01 and 0.001;
2. error feedback around the selection: the fused op (``ops.ef_topk``: residual += grad,
   top-k of the sum, selected residual entries zeroed) vs the same three steps as
   separate torch calls around our top-k, against top-k alone and a memcpy of the
   gradient;
3. segmented top-k over a real model's gradient list (GPT-2 small and ResNet-50) vs one
   top-k call per tensor vs one call over the concatenation, and the fused segmented op.

    .venv/bin/python scripts/bench_kernels.py [--quick] [--threads N]

Targets (issue 17; reported, not asserted): top-k at density 0.01 within 3x the memcpy
floor for every n >= 1e5 and >= 10x faster than torch.topk; the fused op within 4x one
memcpy of the gradient at 2.5e7 and no slower than top-k alone + 30 %; segmented
selection within 1.2x one selection over the concatenation.
"""
from __future__ import annotations

import argparse
import math
import platform
import statistics
import time

import torch

from ssfusion_hvd import ops
from ssfusion_hvd.plan.models import model_tensors


class Timing(float):
    """A median time in seconds that also carries its interquartile range (lo, hi)."""

    def __new__(cls, times):
        q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
        self = super().__new__(cls, statistics.median(times))
        self.lo, self.hi = q[0], q[2]
        return self

    def ms(self) -> str:
        return f"{self * 1e3:.3f} ({self.lo * 1e3:.3f}-{self.hi * 1e3:.3f})"


def median_time(fn, reps: int, min_time: float = 0.2) -> Timing:
    fn()  # warm-up
    times = []
    start = time.perf_counter()
    while len(times) < reps or (time.perf_counter() - start < min_time and len(times) < 100):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return Timing(times)


def kthvalue_select(x, k):
    a = x.abs()
    thr = torch.kthvalue(a, a.numel() - k + 1).values
    idx = (a >= thr).nonzero().flatten()
    return x[idx], idx


def bench_topk(sizes, densities, reps):
    rows = []
    for n in sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))
        for d in densities:
            k = max(1, math.ceil(d * n))
            r = reps if n < 5_000_000 else max(3, reps // 3)
            ours = median_time(lambda: ops.topk(x, k), r)
            torch_topk = median_time(lambda: torch.topk(x.abs(), k, sorted=False), r)
            kth = median_time(lambda: kthvalue_select(x, k), r)
            dst = torch.empty_like(x)  # preallocated: the floor is the copy, not page faults
            memcpy = median_time(lambda: dst.copy_(x), r)
            rows.append((n, d, k, ours, torch_topk, kth, memcpy))
    return rows


def unfused_feedback(grad, residual, k):
    """Error feedback as separate calls: accumulate, select, zero what was sent."""
    residual.add_(grad)
    v, i = ops.topk(residual, k)
    residual.index_fill_(0, i.long(), 0)
    return v, i


def bench_feedback(sizes, density, reps):
    rows = []
    for n in sizes:
        g = torch.Generator().manual_seed(n + 1)
        grad = torch.randn(n, generator=g)
        k = max(1, math.ceil(density * n))
        r = reps if n < 5_000_000 else max(3, reps // 3)
        res = torch.randn(n, generator=g) * 0.1
        fused = median_time(lambda: ops.ef_topk(grad, res, k), r)
        res = torch.randn(n, generator=g) * 0.1
        unfused = median_time(lambda: unfused_feedback(grad, res, k), r)
        acc = grad + torch.randn(n, generator=g) * 0.1
        alone = median_time(lambda: ops.topk(acc, k), r)
        dst = torch.empty_like(grad)
        memcpy = median_time(lambda: dst.copy_(grad), r)
        rows.append((n, density, k, fused, unfused, alone, memcpy))
    return rows


def bench_segmented(model, density, reps):
    sizes = [n for _, n in model_tensors(model)]
    offsets = torch.tensor([0] + sizes).cumsum(0)
    flat = torch.randn(int(offsets[-1]), generator=torch.Generator().manual_seed(0))
    # per-layer scale differences, like real gradients
    scales = torch.logspace(-4, 0, len(sizes))[torch.randperm(len(sizes), generator=torch.Generator().manual_seed(1))]
    flat.mul_(torch.repeat_interleave(scales, torch.tensor(sizes)))
    ks = torch.tensor([max(1, math.ceil(density * s)) for s in sizes])
    total_k = int(ks.sum())
    views = [flat[int(offsets[i]):int(offsets[i + 1])] for i in range(len(sizes))]
    seg = median_time(lambda: ops.segmented_topk(flat, offsets, ks), reps)
    loop = median_time(lambda: [ops.topk(v, int(k)) for v, k in zip(views, ks)], reps)
    single = median_time(lambda: ops.topk(flat, total_k), reps)
    torch_loop = median_time(lambda: [torch.topk(v.abs(), int(k), sorted=False) for v, k in zip(views, ks)], reps)
    residual = torch.zeros_like(flat)
    fused = median_time(lambda: ops.segmented_ef_topk(flat, residual, offsets, ks), reps)
    return (model, len(sizes), flat.numel(), total_k, seg, loop, single, torch_loop, fused)


def fmt_ms(s):
    return f"{s * 1e3:9.3f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: all)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [1_000, 100_000, 1_000_000, 25_000_000] if args.quick else \
        [1_000, 10_000, 100_000, 1_000_000, 10_000_000, 25_000_000]
    reps = 5 if args.quick else args.reps
    print(f"# CPU kernel benchmark: {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}; medians in ms")
    print()
    print("| n | density | k | ours (IQR) | torch.topk | kthvalue | memcpy (IQR) | topk/ours "
          "| ours/memcpy |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, d, k, ours, tt, kth, mc in bench_topk(sizes, (0.01, 0.001), reps):
        print(f"| {n:,} | {d} | {k:,} | {ours.ms()} | {fmt_ms(tt)} | {fmt_ms(kth)} | {mc.ms()} "
              f"| {tt / ours:6.1f}x | {ours / mc:5.2f}x |")
    print()
    print("| n | k | fused ef_topk (IQR) | unfused (add, topk, index_fill) | topk alone | memcpy "
          "| fused/memcpy | fused/topk | unfused/fused |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, d, k, fused, unfused, alone, mc in bench_feedback(sizes, 0.01, reps):
        print(f"| {n:,} | {k:,} | {fused.ms()} | {fmt_ms(unfused)} | {fmt_ms(alone)} | {mc.ms()} "
              f"| {fused / mc:5.2f}x | {fused / alone:5.2f}x | {unfused / fused:5.2f}x |")
    print()
    print("| model | tensors | elements | k total | segmented (IQR) | loop (ours) "
          "| one call on concat (IQR) | loop (torch.topk) | segmented/concat | fused segmented ef |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model in ("resnet50", "gpt2"):
        m, t, n, k, seg, loop, single, tl, fused = bench_segmented(model, 0.01, 3 if args.quick else 5)
        print(f"| {m} | {t} | {n:,} | {k:,} | {seg.ms()} | {fmt_ms(loop)} | {single.ms()} "
              f"| {fmt_ms(tl)} | {seg / single:5.2f}x | {fmt_ms(fused)} |")

if __name__ == "__main__":
    main()
