#!/usr/bin/env python
"""Regenerate docs/observations.md: SSFusion's Table II and Table I on our layer lists.

(a) Table II (SSFusion §III-B): share, in number and in size, of small gradient tensors
    in ResNet-152, ViT-large, BERT-large and GPT2-large, from the real layer lists of
    ``ssfusion_hvd.plan.models``.
(b) Table I (SSFusion §III-A): tensor missing rate of multi-tensor sparsification (one
    top-k over each fusion buffer, density 0.01) against the fusion degree, on synthetic
    gradients (generator in the generated document); per-tensor sparsification is 0 by
    construction (every tensor sends k >= 1).

    python scripts/observations.py [--out docs/observations.md] [--seed 0]
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np

from ssfusion_hvd.plan import model_tensors, nominal_k

DENSITY = 0.01
DEGREES = (0.2, 0.4, 0.6, 0.8, 1.0)
SCALE_SIGMAS = (0.5, 1.0, 2.0)
TABLE_II_PAPER = {"resnet152": (72.38, 2.37), "vit-large": (62.76, 0.11),
                  "bert-large": (62.66, 0.10), "gpt2-large": (66.51, 0.08)}
TABLE_I_PAPER = {"resnet152": (9.8, 22.8, 47.0, 68.2, 75.6), "bert-large": (8.6, 24.0, 42.5, 66.5, 81.2)}


def small_share(sizes: list[int], max_elements: int) -> tuple[float, float]:
    """(% of tensors, % of elements) in tensors of at most ``max_elements`` elements."""
    small = [n for n in sizes if n <= max_elements]
    return 100.0 * len(small) / len(sizes), 100.0 * sum(small) / sum(sizes)


class SyntheticGradients:
    """Per-tensor gradient magnitudes ``s_t · |z|`` with ``z ~ Laplace(0, 1)`` (so ``|z|``
    is Exp(1)) and per-tensor scales ``s_t = exp(σ · ξ_t)``, ``ξ_t ~ N(0, 1)`` i.i.d.

    Only what top-k needs is kept: each tensor's largest magnitude and its magnitudes
    down to a floor (first its top 5 %). A buffer's k-th largest magnitude computed from
    the kept values is exact once no member's floor lies above it; a member whose floor
    does is regenerated from its own seed with everything above the threshold kept.
    """

    def __init__(self, sizes: list[int], sigma: float, seed: int, keep: float = 0.05):
        self.sizes, self.seed = sizes, seed
        self.scales = np.exp(sigma * np.random.default_rng(seed).standard_normal(len(sizes)))
        self.max = np.empty(len(sizes))
        self.floor = np.empty(len(sizes))          # every magnitude >= floor is kept
        self.kept: list[np.ndarray] = [np.empty(0, np.float32)] * len(sizes)
        for t, n in enumerate(sizes):
            mags = self._magnitudes(t)
            self.max[t] = float(mags.max())
            m = min(n, max(1, math.ceil(keep * n)))
            self._keep(t, mags, float(np.partition(mags, n - m)[n - m]) if m < n else 0.0)

    def _magnitudes(self, t: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, t])
        return rng.standard_exponential(self.sizes[t], dtype=np.float32) * np.float32(self.scales[t])

    def _keep(self, t: int, mags: np.ndarray, floor: float) -> None:
        """Keep every magnitude >= ``floor`` of tensor ``t``."""
        self.kept[t] = mags[mags >= floor]
        self.floor[t] = floor

    def missing(self, start: int, end: int, k: int) -> int:
        """Tensors of buffer ``[start, end)`` with no element in the buffer's top-k."""
        while True:
            pool = np.concatenate(self.kept[start:end])
            threshold = float(np.partition(pool, len(pool) - k)[len(pool) - k])
            short = [t for t in range(start, end) if self.floor[t] > threshold]
            if not short:
                return int(np.sum(self.max[start:end] < threshold))
            for t in short:  # the threshold only rises as values are added: this ends
                self._keep(t, self._magnitudes(t), threshold)


def missing_rate(gen: SyntheticGradients, sizes: list[int], degree: float, tile: bool) -> float:
    """% of all tensors that send nothing at fusion degree ``degree``.

    ``tile=False`` (the paper's definition, §III-A: "fusion degree = 20 % means that only
    20 % of the tensors are fused"): the first ``ceil(degree · N)`` tensors in backward
    order form one fusion buffer, the others are sparsified per tensor (never missing).
    ``tile=True``: every tensor is fused, in buffers of ``ceil(degree · N)`` consecutive
    tensors. Each buffer keeps its top-k, ``k = ceil(0.01 · buffer elements)``.
    """
    n = len(sizes)
    per_buffer = math.ceil(degree * n)
    starts = range(0, n, per_buffer) if tile else (0,)
    missing = 0
    for start in starts:
        end = min(n, start + per_buffer)
        missing += gen.missing(start, end, nominal_k(sum(sizes[start:end]), DENSITY))
    return 100.0 * missing / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/observations.md")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    md = [
        "# Observations: SSFusion Tables I and II on our layer lists",
        "",
        "Generated by `python scripts/observations.py` (seed "
        f"{args.seed}); do not edit by hand. Layer lists: `ssfusion_hvd/plan/models.py` "
        "(ResNet-152 written out, ImageNet head; transformer models built from `transformers` "
        "configs on the meta device, QA head for BERT, LM head tied to the embedding for GPT-2, "
        "1000-class head for ViT). Paper: *SSFusion: Tensor Fusion with Selective "
        "Sparsification* (ICDE'26), §III.",
        "",
        "## Table II: small and large tensors",
        "",
        "The paper calls a tensor small when it has fewer than 102,400 elements and says that is "
        "\"approximately 200 KB\"; for fp32 gradients 102,400 elements are 400 KB, and 200 KB are "
        "51,200 elements. Both cutoffs are shown.",
        "",
        "| model | tensors | small ≤ 200 KB fp32: number % | size % | small < 102,400 elements: number % | size % | paper: number % | size % |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for model, (paper_n, paper_s) in TABLE_II_PAPER.items():
        sizes = [n for _, n in model_tensors(model)]
        a_n, a_s = small_share(sizes, 200 * 1024 // 4)
        b_n, b_s = small_share(sizes, 102_400 - 1)
        md.append(f"| {model} | {len(sizes)} | {a_n:.2f} | {a_s:.2f} | {b_n:.2f} | {b_s:.2f} | {paper_n:.2f} | {paper_s:.2f} |")

    md += [
        "",
        "## Table I: tensor missing rate of multi-tensor sparsification",
        "",
        "Fusion degree D, as the paper defines it (§III-A: \"fusion degree = 100 % indicates "
        "that all tensors are fused into a single buffer, fusion degree = 20 % means that only "
        "20 % of the tensors are fused\"): the first ceil(D · N) tensors in backward order form "
        "one fusion buffer and the others are sparsified per tensor. A second reading, where "
        "every tensor is fused in buffers of ceil(D · N) consecutive tensors, is shown as "
        "\"tiled\". A buffer keeps its top-k magnitudes with k = ceil(0.01 · buffer elements); "
        "a tensor is *missing* when none of its elements is kept. Per-tensor sparsification "
        "keeps k = ceil(0.01 · n) ≥ 1 of every tensor, so its missing rate is 0 by construction.",
        "",
        "Synthetic gradients: every element of tensor t has magnitude s_t · |z|, z ~ Laplace(0, 1) "
        "(heavy-tailed, like real gradients), with a per-tensor scale s_t = exp(σ · ξ_t), "
        "ξ_t ~ N(0, 1) i.i.d.: layers differ in gradient scale, which is what makes tensors go "
        "missing (SSFusion Fig. 3). σ sets the spread (σ = 1: the middle 95 % of layers span a "
        "factor of about 50). Thresholds are exact k-th largest magnitudes of the sampled "
        "gradients (only magnitudes that can reach a threshold are kept; the script regenerates a tensor from its seed when more are needed).",
        "",
        "| model | σ | buffers | per-tensor | " + " | ".join(f"{int(d * 100)} %" for d in DEGREES) + " |",
        "| --- | ---: | --- | ---: | " + " | ".join("---:" for _ in DEGREES) + " |",
    ]
    for model, paper in TABLE_I_PAPER.items():
        sizes = [n for _, n in model_tensors(model)]
        for sigma in SCALE_SIGMAS:
            gen = SyntheticGradients(sizes, sigma, args.seed)
            for tile in (False, True):
                rates = [missing_rate(gen, sizes, d, tile) for d in DEGREES]
                md.append(f"| {model} | {sigma:g} | {'tiled' if tile else 'one'} | 0 | "
                          + " | ".join(f"{r:.1f} %" for r in rates) + " |")
        md.append(f"| {model} (paper: DGC, real gradients) | | | 0 | " + " | ".join(f"{r} %" for r in paper) + " |")
    md += [
        "",
        f"Runtime of this script: {time.perf_counter() - t0:.0f} s.",
        "",
    ]
    Path(args.out).write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
