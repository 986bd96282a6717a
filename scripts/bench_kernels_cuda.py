"""CUDA kernel benchmark: our selection kernels vs torch.topk vs a memcpy of the same bytes.

Usage: .venv/bin/python scripts/bench_kernels_cuda.py [--reps 50] [--dtype float32]

Times are medians over --reps runs (after --warmup runs) measured with CUDA events around
each call on the current stream, in microseconds. Rows:
  * topk:      ops.topk (ours) | torch.topk(|x|, k, sorted=False) | x -> y copy of n elements
               for n = 1e3 .. 2.5e7 at density 0.01 and 0.001 (k = ceil(density * n));
  * segmented: ResNet-50's 161 parameter tensors (25.6M elements) as one fusion buffer:
               ops.segmented_topk with per-tensor k vs ops.topk over the concatenation with
               k = sum of the per-tensor ks (the cost to beat), and a python loop of per-tensor
               ops.topk calls (what one call replaces);
  * sampled:   ops.sampled_threshold (DGC, 0.1% / 1% samples) for the largest n.
Prints one table at the end.
"""
import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ssfusion_hvd import ops  # noqa: E402
from ssfusion_hvd.plan.models import model_tensors  # noqa: E402


def timeit(fn, warmup, reps):
    """Median milliseconds of fn() on the current stream (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def resnet50_sizes():
    """ResNet-50's 161 gradient sizes, backward order."""
    return [n for _, n in model_tensors("resnet50")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    args = ap.parse_args()
    if args.reps < 20:
        ap.error("--reps must be at least 20")
    if not torch.cuda.is_available() or not ops.build_info().get("cuda_kernels"):
        sys.exit(f"needs a CUDA device and CUDA kernels (build_info: {ops.build_info()})")
    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda")
    t = lambda fn: timeit(fn, args.warmup, args.reps) * 1e3  # noqa: E731  (microseconds)
    rows = []  # (case, n, k, ours_us, torch_us, memcpy_us, note)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  dtype {args.dtype}  "
          f"median of {args.reps} reps", flush=True)

    for n in (1_000, 10_000, 100_000, 1_000_000, 10_000_000, 25_000_000):
        x = torch.randn(n, device=dev, dtype=dtype)
        y = torch.empty_like(x)
        mem = t(lambda: y.copy_(x))
        for density in (0.01, 0.001):
            k = max(1, math.ceil(density * n))
            ours = t(lambda: ops.topk(x, k, backend="native"))
            ref = t(lambda: torch.topk(x.abs(), k, sorted=False))
            rows.append((f"topk d={density}", n, k, ours, ref, mem, ""))
            print("progress:", rows[-1][:4], file=sys.stderr, flush=True)

    sizes = resnet50_sizes()
    n = sum(sizes)
    flat = torch.randn(n, device=dev, dtype=dtype)
    y = torch.empty_like(flat)
    mem = t(lambda: y.copy_(flat))
    offsets = torch.tensor([0] + sizes, dtype=torch.int64).cumsum(0)
    for density in (0.01, 0.001):
        ks = torch.tensor([max(1, math.ceil(density * m)) for m in sizes], dtype=torch.int64)
        ktot = int(ks.sum())
        seg = t(lambda: ops.segmented_topk(flat, offsets, ks, backend="native"))
        one = t(lambda: ops.topk(flat, ktot, backend="native"))
        views = [(flat[int(offsets[s]):int(offsets[s + 1])], int(ks[s])) for s in range(len(sizes))]
        loop = t(lambda: [ops.topk(v, k, backend="native") for v, k in views])
        rows.append((f"segmented d={density} ({len(sizes)} tensors)", n, ktot, seg, one, mem,
                     f"torch col = ops.topk over concat; per-tensor loop {loop:.1f} us"))
        print("progress:", rows[-1][:4], file=sys.stderr, flush=True)

    x = torch.randn(25_000_000, device=dev, dtype=dtype)
    y = torch.empty_like(x)
    mem = t(lambda: y.copy_(x))
    for density in (0.01, 0.001):
        k = math.ceil(density * x.numel())
        samples = max(1, x.numel() // 1000)
        ours = t(lambda: ops.sampled_threshold(x, k, samples, backend="native"))
        rows.append((f"sampled_threshold d={density}", x.numel(), k, ours, float("nan"), mem,
                     f"{samples} samples; includes the host sync"))
        print("progress:", rows[-1][:4], file=sys.stderr, flush=True)

    print()
    head = f"{'case':<40} {'n':>10} {'k':>9} {'ours us':>10} {'torch us':>10} {'memcpy us':>10} {'ours/memcpy':>11}  note"
    print(head)
    print("-" * len(head))
    for case, n, k, ours, ref, mem, note in rows:
        ref_s = f"{ref:10.1f}" if ref == ref else f"{'-':>10}"
        print(f"{case:<40} {n:>10} {k:>9} {ours:10.1f} {ref_s} {mem:10.1f} {ours / mem:11.2f}  {note}")


if __name__ == "__main__":
    main()
