"""Random-k (Stich et al., "Sparsified SGD with Memory", NeurIPS'18): k indices drawn
uniformly without replacement from a generator seeded by (seed, call count), identical on
every rank, so the indices need not travel: only the values do (``shared_indices``).

Density tolerance: exact — k elements every call.
"""
from __future__ import annotations

import torch

from .. import ops
from .base import Sparsifier, check_request


class RandomK(Sparsifier):
    name = "randomk"
    shared_indices = True

    def __init__(self, seed: int = 0):
        self.seed = int(seed)
        self.calls = 0

    def select(self, x, k):
        k = check_request(x, k)
        flat = x.reshape(-1)
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.calls) % 2**63)
        self.calls += 1
        idx = torch.randperm(flat.numel(), generator=g)[:k].sort().values.to(flat.device)
        return flat[idx], idx.to(ops.index_dtype(flat.numel()))

    def state_dict(self):
        return {"seed": self.seed, "calls": self.calls}

    def load_state_dict(self, state):
        self.seed, self.calls = int(state["seed"]), int(state["calls"])
