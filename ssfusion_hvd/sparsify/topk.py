"""Exact magnitude top-k (Aji & Heafield 2017; the selection SSFusion and Cupcake use).

Density tolerance: exact, k elements every call (ties at the k-th magnitude go to the
lower index, see ``ssfusion_hvd.ops.topk``).
"""
from __future__ import annotations

import torch

from .. import ops


class TopK:
    name = "topk"

    def select(self, x: torch.Tensor, k: int):
        return ops.topk(x, k)
