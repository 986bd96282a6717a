"""DGC's sampled threshold (Lin et al., "Deep Gradient Compression", ICLR'18, §3 and its
"hierarchical" top-k): estimate the k-th magnitude from a strided sample of ~1 % of the
elements (more when k is small, so that the sample holds enough selected elements),
select everything above it, and when that over-selects, refine by an exact top-k
among the selected only (cheap: about k elements, not n).

The estimate aims at ``overshoot`` x k so that the refinement, which can only trim, usually
lands on exactly k. Density tolerance: [0.75, 1.0] x k (exactly k when the sample
over-estimates, which ``overshoot`` makes the common case; below k when the sample misses).
"""
from __future__ import annotations

import math

from .. import ops
from .base import Sparsifier, check_request, select_above


class DGC(Sparsifier):
    name = "dgc"
    tolerance = (0.75, 1.0)

    def __init__(self, sample_fraction: float = 0.01, min_samples: int = 2048,
                 min_hits: int = 64, overshoot: float = 1.25):
        self.sample_fraction = sample_fraction
        self.min_samples = min_samples
        self.min_hits = min_hits  # expected selected elements inside the sample
        self.overshoot = overshoot

    def select(self, x, k):
        k = check_request(x, k)
        n = x.numel()
        # enough samples that about min_hits of them lie above the threshold: at density
        # 0.001 a 1 % sample would hold only ~10, too few for a stable estimate
        samples = min(n, max(self.min_samples, int(n * self.sample_fraction),
                             -(-self.min_hits * n // k)))
        thr = ops.sampled_threshold(x, min(n, math.ceil(k * self.overshoot)), samples)
        return select_above(x, thr, k)
