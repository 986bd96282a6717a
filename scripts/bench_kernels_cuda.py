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
  * feedback:  ops.ef_topk (error feedback fused with the selection, float32 residual) vs
               top-k alone on such a sum (the ref column), with the unfused composition
               (residual.add_, ops.topk, index_fill_) and the accumulation alone in the note;
               and ops.segmented_ef_topk over ResNet-50's buffer vs ops.segmented_topk;
  * decode:    a sparse part of GPT-2's 148 tensors at a fifth of their size, P = 2 and 4
               ranks' records (scripts/bench_kernels.py's decode_cases): the direct decode
               (records delivered straight into the gradients) vs the full decode (zero,
               scatter-add, scale, copy; what a GPU decode runs unless
               sparse_part.DIRECT_ON_CUDA) in the ref column;
  * sampled:   ops.sampled_threshold (DGC, 0.1% / 1% samples) for the largest n.
Prints one table at the end.
"""
import argparse
import math
import statistics
import sys

import torch

from ssfusion_hvd import ops  # noqa: E402
from ssfusion_hvd.plan.models import model_tensors  # noqa: E402

from bench_kernels import decode_cases  # noqa: E402


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
    mem_flat = mem = t(lambda: y.copy_(flat))
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

    for n in (100_000, 1_000_000, 10_000_000, 25_000_000):
        grad = torch.randn(n, device=dev, dtype=dtype)
        res = torch.zeros(n, device=dev)  # float32 residual whatever the gradient's dtype
        k = math.ceil(0.01 * n)
        fused = t(lambda: ops.ef_topk(grad, res, k, backend="native"))
        total = res + grad  # top-k's input in error feedback: a gradient plus a residual
        alone = t(lambda: ops.topk(total, k, backend="native"))

        def unfused():
            res.add_(grad)
            _, i = ops.topk(res, k, backend="native")
            res.index_fill_(0, i.long(), 0)

        unf = t(unfused)
        acc = t(lambda: res.add_(grad))
        y = torch.empty_like(grad)
        mem = t(lambda: y.copy_(grad))
        rows.append(("ef_topk d=0.01 (ref: topk alone)", n, k, fused, alone, mem,
                     f"fused/topk {fused / alone:.2f}x; unfused {unf:.1f} us; add_ {acc:.1f} us"))
        print("progress:", rows[-1][:4], file=sys.stderr, flush=True)
        del grad, res, total, y

    res = torch.zeros(flat.numel(), device=dev)
    for density in (0.01, 0.001):
        ks = torch.tensor([max(1, math.ceil(density * m)) for m in sizes], dtype=torch.int64)
        fused = t(lambda: ops.segmented_ef_topk(flat, res, offsets, ks, backend="native"))
        seg = t(lambda: ops.segmented_topk(flat, offsets, ks, backend="native"))
        rows.append((f"segmented_ef_topk d={density} (ref: segmented_topk)", sum(sizes),
                     int(ks.sum()), fused, seg, mem_flat, f"fused/segmented {fused / seg:.2f}x"))
        print("progress:", rows[-1][:4], file=sys.stderr, flush=True)
    del res

    if dtype == torch.float32:  # the decode sums in the gradient's dtype; float32 here
        from ssfusion_hvd.core import sparse_part
        for nranks in (2, 4):
            n, ntensors, k, full, new, copy, direct = decode_cases("gpt2", 5, 0.01, nranks, dev)
            full_us, mem = t(full), t(copy)
            on_cuda = sparse_part.DIRECT_ON_CUDA
            sparse_part.DIRECT_ON_CUDA = True  # the direct path, which a GPU decode skips by default
            try:
                if not direct():  # e.g. the records touch more than DIRECT_MAX_SHARE
                    sys.exit(f"decode P={nranks}: the direct path does not apply")
                direct_us = t(new)
            finally:
                sparse_part.DIRECT_ON_CUDA = on_cuda
            rows.append((f"direct decode P={nranks} gpt2/5 (ref: full)", n, k, direct_us,
                         full_us, mem, f"{ntensors} tensors; full/direct "
                         f"{full_us / direct_us:.2f}x; sparse_part.DIRECT_ON_CUDA={on_cuda}"))
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
    head = f"{'case':<50} {'n':>10} {'k':>9} {'ours us':>10} {'ref us':>10} {'memcpy us':>10} {'ours/memcpy':>11}  note"
    print(head)
    print("-" * len(head))
    for case, n, k, ours, ref, mem, note in rows:
        ref_s = f"{ref:10.1f}" if ref == ref else f"{'-':>10}"
        print(f"{case:<50} {n:>10} {k:>9} {ours:10.1f} {ref_s} {mem:10.1f} {ours / mem:11.2f}  {note}")


if __name__ == "__main__":
    main()
