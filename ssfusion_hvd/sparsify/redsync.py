"""RedSync's trimmed top-k (Fang et al., "RedSync: Reducing Synchronization Traffic for
Distributed Deep Learning", JPDC 2019): search a threshold between mean(|x|) and max(|x|),
thr = mean + r (max - mean), by bisection on r until the selection holds between k and
``window`` x k elements, then take the exact top-k among those. Bounded: after
``max_iters`` counting passes it falls back to exact top-k over the whole tensor.

Density tolerance: exact — k elements every call.
"""
from __future__ import annotations

from .. import ops
from .base import Sparsifier, check_request, select_above


class RedSync(Sparsifier):
    name = "redsync"

    def __init__(self, window: float = 2.0, max_iters: int = 10):
        self.window = window
        self.max_iters = max_iters

    def select(self, x, k):
        k = check_request(x, k)
        mag = x.reshape(-1).float().abs().nan_to_num(nan=float("inf"), posinf=float("inf"))
        mean, top = float(mag.mean()), float(mag.max())
        lo, hi = 0.0, 1.0
        if top != float("inf") and top > mean:
            for _ in range(self.max_iters):
                r = (lo + hi) / 2
                thr = mean + r * (top - mean)
                count = ops.threshold_count(x, thr)
                if count < k:
                    hi = r
                elif count > self.window * k:
                    lo = r
                else:
                    return select_above(x, thr, k)
        return ops.topk(x, k)
