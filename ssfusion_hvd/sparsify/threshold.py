"""Threshold selection with ExDyna's online threshold scaling (paper 004, §IV-D,
Algorithm 5): select every |x| >= delta_t; then compare the achieved count k' with the
requested k and rescale the threshold for the next call:

    exam = k' / k
    exam > beta       -> delta *= 1 + gamma        (far too many: raise quickly)
    exam < 1 / beta   -> delta *= 1 - gamma        (far too few: lower quickly)
    otherwise         -> delta *= 1 +/- gamma / 4  (fine-tune toward k)

The paper's line 5 reads "1 + gamma/4" in both fine-tuning directions as converted; we
fine-tune in the direction of the error (up when exam > 1, down when exam < 1), which is
what the text describes ("the threshold should decrease ... if a sparsifier selected a
smaller number of gradients than the user required").

The paper gives no values for beta and gamma; gamma = 0.05 keeps the swing bounded in far
tails (at density 0.001 of a Gaussian, +5 % on the threshold removes ~40 % of the count).
The first call has no threshold yet and takes the exact k-th magnitude. Selections beyond
``capacity(k) = ceil(cap * k)`` are trimmed to the largest (the count used for scaling is
the untrimmed one). Density tolerance: [0.5, cap] x k per call on a stationary stream once
the threshold has settled (a few calls); the long-run average tracks k.
"""
from __future__ import annotations

import math

from .. import ops
from .base import Sparsifier, check_request, trim


class Threshold(Sparsifier):
    name = "threshold"
    tolerance = (0.5, 1.5)

    def __init__(self, beta: float = 1.2, gamma: float = 0.05, cap: float = 1.5):
        self.beta, self.gamma, self.cap = beta, gamma, cap
        self.threshold = None

    def capacity(self, k):
        return math.ceil(self.cap * k)

    def select(self, x, k):
        k = check_request(x, k)
        if self.threshold is None:
            v, i = ops.topk(x, k)
            self.threshold = float(v.float().abs().min()) if k else 0.0
            return v, i
        v, i = ops.threshold_select(x, self.threshold)
        self.threshold *= self.scale_factor(v.numel() / k)
        return trim(v, i, min(self.capacity(k), x.numel()))

    def scale_factor(self, exam: float) -> float:
        """Algorithm 5's multiplier for an achieved/requested ratio ``exam``."""
        if exam > self.beta:
            return 1 + self.gamma
        if exam < 1 / self.beta:
            return 1 - self.gamma
        if exam > 1:
            return 1 + self.gamma / 4
        if exam < 1:
            return 1 - self.gamma / 4
        return 1.0

    def state_dict(self):
        return {"threshold": self.threshold}

    def load_state_dict(self, state):
        self.threshold = state["threshold"]
