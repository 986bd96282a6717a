"""Exact magnitude top-k (Aji & Heafield, "Sparse Communication for Distributed Gradient
Descent", EMNLP'17; the selection SSFusion and Cupcake use).

Density tolerance: exact — k elements every call; ties at the k-th magnitude go to the
lower index (``ssfusion_hvd.ops.topk``).
"""
from __future__ import annotations

from .. import ops
from .base import Sparsifier, check_request


class TopK(Sparsifier):
    name = "topk"
    exact_topk = True

    def select(self, x, k):
        return ops.topk(x, check_request(x, k))
