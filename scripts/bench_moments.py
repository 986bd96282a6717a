"""The shared-moments step (``ssfusion_hvd/moments.py``) on a model's parameters: the native
pass (``csrc/moments.h``) against the foreach path it replaced, SGD with momentum and Adam,
about 2 % of the elements arrived this step (density 0.01 on 2 ranks).

    python scripts/bench_moments.py [--model gpt2] [--device cpu|cuda] [--reps 4]

Prints the milliseconds of each repetition (the first includes creating the state)."""
from __future__ import annotations

import argparse
import time

import torch

import ssfusion_hvd.moments as moments
from ssfusion_hvd.examples.models import MODELS, build
from ssfusion_hvd.ops import native_op


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2", choices=sorted(MODELS))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--reps", type=int, default=4)
    args = p.parse_args()
    model, _ = build(args.model, 1, 64, 0, 0, args.device)
    params = list(model.parameters())
    g = torch.Generator(args.device).manual_seed(0)
    for q in params:
        mask = torch.rand(q.shape, generator=g, device=q.device) < 0.02
        q.grad = torch.randn(q.shape, generator=g, device=q.device) * mask
    settle = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    on_cuda = moments.NATIVE_ON_CUDA
    for kind, hp in (("momentum", {"momentum": 0.9}), ("adam", {"betas": (0.9, 0.999), "eps": 1e-8})):
        for path in ("native", "foreach"):
            moments.native_op = native_op if path == "native" else (lambda op, x: None)
            moments.NATIVE_ON_CUDA = path == "native"
            opt = (torch.optim.SGD(params, lr=0.01, momentum=0.9) if kind == "momentum"
                   else torch.optim.Adam(params, lr=1e-3))
            rule = moments.SharedMoments(kind, hp)
            ms = []
            for _ in range(args.reps):
                settle()
                t0 = time.perf_counter()
                rule.step(opt, opt.param_groups[0], params)
                settle()
                ms.append(1e3 * (time.perf_counter() - t0))
            print(f"[bench_moments] {args.model} {args.device} {kind:8s} {path:7s} "
                  + " ".join(f"{t:.0f}" for t in ms) + " ms")
    moments.native_op = native_op
    moments.NATIVE_ON_CUDA = on_cuda


if __name__ == "__main__":
    main()
