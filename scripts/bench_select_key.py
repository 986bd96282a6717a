"""The selection of one fusion group under the group budget, by magnitude (the fused
error-feedback kernel), by the gain (``scheme_options["select_by"]``'s default under Adam:
``|acc| / sqrt(sqrt(v-hat) + eps)``, which orders as ``acc² / (sqrt(v-hat) + eps)``) and
by the pending step (``|acc| / (sqrt(v-hat) + eps)``), each key with the native kernel
where the device has one and, as ``*-torch``, with the torch composition
(``SparsePart._select_steps``), on a model's gradients.

    python scripts/bench_select_key.py [--model gpt2] [--device cpu|cuda] [--reps 7]

The five alternate, repetition by repetition, on the same inputs; prints each one's median
and range over the repetitions after the first two, and the ratios of the medians."""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from ssfusion_hvd.core.buffers import SparsePart
from ssfusion_hvd.examples.models import MODELS, build
from ssfusion_hvd.kernels import dispatch
from ssfusion_hvd.recipe import StepScales
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

    # Recipe.step_scales' shape, by the gain (root) and by the step
    scales = {root: StepScales(vs, [0.5 ** 0.5] * len(vs), 1e-8, root) for root in (True, False)}

    parts, memories = {}, {}
    for key in ("magnitude", "gain", "gain-torch", "step", "step-torch"):
        parts[key] = SparsePart("g", list(range(len(shapes))), shapes, ks, "group",
                                [make_sparsifier("topk") for _ in shapes], 0, torch.float32,
                                torch.device(args.device), floors=[min(k, 1) for k in ks])
        if key != "magnitude":
            parts[key].step_scales = (lambda s=scales[key.startswith("gain")]: s)
        memories[key] = ResidualMemory()
    times = {key: [] for key in parts}
    for _ in range(args.reps):
        for key, part in parts.items():
            settle()
            t0 = time.perf_counter()
            with torch_key(key.endswith("-torch")):
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
    for key in ("gain", "step"):
        print(f"by {key} / by magnitude: {med[key] / med['magnitude']:.2f}x; "
              f"its torch composition / its native key: {med[key + '-torch'] / med[key]:.2f}x")


@contextlib.contextmanager
def torch_key(on: bool):
    """The key's torch composition instead of its native kernel, while ``on``."""
    if not on:
        yield
        return
    saved = dict(dispatch._NATIVE)
    for dev in ("cpu", "cuda"):
        dispatch._NATIVE["ef_step_key", dev] = None
    try:
        yield
    finally:
        dispatch._NATIVE.clear()
        dispatch._NATIVE.update(saved)


if __name__ == "__main__":
    main()
