"""DGC's sampled threshold (Lin et al., "Deep Gradient Compression", ICLR'18, §3 and its
"hierarchical" top-k): estimate the k-th magnitude from a random sample of ~1 % of the
elements (more when k is small, so that the sample holds enough selected elements),
select everything above it, and when that over-selects, refine by an exact top-k
among the selected only (cheap: about k elements, not n).

The sample (:func:`ssfusion_hvd.ops.sampled_threshold`) is stratified and jittered: one
position drawn per stratum by a hash of the call's seed. A fixed stride would alias with a
weight layout (a stride equal to a row length reads one column only, and misses large
gradients everywhere else). The seed of a call is derived from the instance's base ``seed``
and its call counter, so it is the same on every rank (ranks call ``select`` alike) and
changes every step, so that no position is systematically left out; the counter is part of
``state_dict()``, so a resumed run continues the same sequence of samples.

The estimate aims at ``overshoot`` x k so that the refinement, which can only trim, usually
lands on exactly k. Density tolerance: [0.75, 1.0] x k (exactly k when the sample
over-estimates, which ``overshoot`` makes the common case; below k when the sample misses).
"""
from __future__ import annotations

import math

from .. import ops
from .base import Sparsifier, check_request, select_above

#: the base seed when none is given ("DGC" in ASCII): every rank must use the same
DEFAULT_SEED = 0x444743


class DGC(Sparsifier):
    name = "dgc"
    tolerance = (0.75, 1.0)

    def __init__(self, sample_fraction: float = 0.01, min_samples: int = 2048,
                 min_hits: int = 64, overshoot: float = 1.25, seed: int = DEFAULT_SEED):
        self.sample_fraction = sample_fraction
        self.min_samples = min_samples
        self.min_hits = min_hits  # expected selected elements inside the sample
        self.overshoot = overshoot
        self.seed = int(seed)
        self.calls = 0  # select() calls so far: the sample's seed advances with it

    def sample_seed(self) -> int:
        """The seed the next ``select`` samples with: a hash of (base seed, call count), the
        same on every rank at the same step, different from step to step."""
        return ops.hash_seed(self.seed, self.calls)

    def select(self, x, k):
        k = check_request(x, k)
        n = x.numel()
        # enough samples that about min_hits of them lie above the threshold: at density
        # 0.001 a 1 % sample would hold only ~10, too few for a stable estimate
        samples = min(n, max(self.min_samples, int(n * self.sample_fraction),
                             -(-self.min_hits * n // k)))
        thr = ops.sampled_threshold(x, min(n, math.ceil(k * self.overshoot)), samples,
                                    self.sample_seed())
        self.calls += 1
        return select_above(x, thr, k)

    def state_dict(self):
        return {"seed": self.seed, "calls": self.calls}

    def load_state_dict(self, state):
        if not state:  # written before DGC had state (a fixed-stride sample): start afresh
            self.calls = 0
            return
        self.seed, self.calls = int(state["seed"]), int(state["calls"])
