"""The selection of one fusion group under the group budget, by magnitude (the fused
error-feedback kernel) and by the pending step (``scheme_options["select_by"]``: Adam's
``|acc| / (sqrt(v-hat) + eps)``, ``SparsePart._select_steps``), on a model's gradients.

    python scripts/bench_select_key.py [--model gpt2] [--device cpu|cuda] [--reps 7]

The two alternate, repetition by repetition, on the same inputs; prints each one's median
and range over the repetitions after the first two, and the ratio of the medians."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ssfusion_hvd.core.buffers import SparsePart
from ssfusion_hvd.examples.models import MODELS, build
from ssfusion_hvd.plan.cost import nominal_k
from ssfusion_hvd.sparsify import ResidualMemory, make_sparsifier


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2", choices=sorted(MODELS))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    model, _ = build(args.model, 1, 64, 0, 0, args.device)
    params = [q for q in model.parameters() if q.requires_grad]
    g = torch.Generator(args.device).manual_seed(0)
    grads = [torch.randn(q.shape, generator=g, device=q.device) for q in params]
    vs = [torch.rand(q.shape, generator=g, device=q.device) + 0.1 for q in params]
    shapes = [q.shape for q in params]
    ks = [int(nominal_k(q.numel(), args.density)) for q in params]
    settle = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def denominator(out):  # what Recipe.step_denominator computes, at one step count
        torch.cat([v.reshape(-1) for v in vs], out=out)
        return out.div_(0.5).sqrt_().add_(1e-8)

    parts, memories = {}, {}
    for key in ("magnitude", "step"):
        parts[key] = SparsePart("g", list(range(len(shapes))), shapes, ks, "group",
                                [make_sparsifier("topk") for _ in shapes], 0, torch.float32,
                                torch.device(args.device), floors=[min(k, 1) for k in ks])
        if key == "step":
            parts[key].update_denominator = denominator
        memories[key] = ResidualMemory()
    times = {key: [] for key in parts}
    for _ in range(args.reps):
        for key, part in parts.items():
            settle()
            t0 = time.perf_counter()
            part.select_grads(memories[key], grads)
            settle()
            times[key].append(time.perf_counter() - t0)
    n = sum(q.numel() for q in params)
    med = {}
    for key, ts in times.items():
        ts = ts[2:]
        med[key] = statistics.median(ts)
        print(f"{args.model} ({n} elements, {len(params)} tensors, {args.device}) by {key}: "
              f"{1e3 * med[key]:.1f} ms (min {1e3 * min(ts):.1f}, max {1e3 * max(ts):.1f})")
    print(f"by step / by magnitude: {med['step'] / med['magnitude']:.2f}x")


if __name__ == "__main__":
    main()
