"""Gaussian-k (Shi et al., "Understanding Top-k Sparsification in Distributed Deep Learning",
2019): model the gradient as N(mu, sigma^2) and take the two-sided tail that holds a
fraction d of the mass, thr = sigma * Phi^-1(1 - d/2) around mu; then correct the guess
with at most ``refinements`` counting passes (real gradients are heavier-tailed than a
Gaussian), and trim an over-selection to the exact top-k among the selected.

Density tolerance: [0.5, 1.0] x k.
"""
from __future__ import annotations

import torch

from .. import ops
from .base import Sparsifier, check_request, select_above


class GaussianK(Sparsifier):
    name = "gaussiank"
    tolerance = (0.5, 1.0)

    def __init__(self, refinements: int = 3, step: float = 0.8):
        self.refinements = refinements
        self.step = step  # threshold multiplier per refinement that lowers an under-selection

    def select(self, x, k):
        k = check_request(x, k)
        # statistics of the finite values only: an Inf or NaN would poison mean and std
        # (they are still selected below: threshold_select keeps Inf and NaN)
        flat = x.reshape(-1).float().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        n = flat.numel()
        d = torch.tensor(k / n, dtype=torch.float64)
        z = float(torch.special.ndtri(1 - d / 2))
        mu = float(flat.mean())
        sigma = float(flat.std()) if n > 1 else 0.0
        thr = abs(mu) + sigma * z
        for _ in range(self.refinements):
            count = ops.threshold_count(x, thr)
            if count < k * self.tolerance[0] * 1.2:
                thr *= self.step  # too few: lower the threshold
            elif count > 2 * k:
                thr /= self.step  # far too many: trimming would cost a large top-k
            else:
                break
        return select_above(x, thr, k)
