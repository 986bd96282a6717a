"""The sparsifier interface.

A sparsifier selects about k elements of a gradient: ``select(x, k) -> (values, indices)``
over ``x.flatten()``, indices ascending (int32, int64 past 2^31 elements), values with
their sign. One instance serves one tensor (or one fusion buffer) for the whole run, so
stateful methods (online threshold scaling, random-k's shared seed) keep their state in
the instance; ``state_dict()`` makes that state part of the optimizer's checkpoint.

Selections never exceed ``capacity(k)`` elements, so a fixed-size wire record of
``capacity(k)`` entries always holds them (docs/design.md "Wire format": pad to capacity). ``tolerance``
documents the achieved count as a fraction of k that the tests hold each method to.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .. import ops


class Sparsifier:
    name = "base"
    #: (low, high) bounds of achieved count / k on the test inputs (Gaussian, Laplace,
    #: per-layer-scaled): documented per method and checked by tests/test_sparsify.py
    tolerance: Tuple[float, float] = (1.0, 1.0)
    #: True when every rank selects the same indices from its own data (random-k), so only
    #: values need to travel
    shared_indices = False
    #: True when ``select`` is the exact magnitude top-k of ``ops.topk``: error feedback and
    #: selection then run as one fused kernel (``ResidualMemory.select_topk``)
    exact_topk = False

    def select(self, x: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def capacity(self, k: int) -> int:
        """Upper bound of the number of selected elements for a request of k."""
        return k

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"sparsifier {self.name!r} has no state, got {sorted(state)}")


def check_request(x: torch.Tensor, k: int) -> int:
    k = int(k)
    if not 1 <= k <= x.numel():
        raise ValueError(f"cannot select k={k} of {x.numel()} elements")
    return k


def trim(values: torch.Tensor, indices: torch.Tensor, k: int):
    """The exact top-k (by magnitude, lower index on ties) of a selection larger than k."""
    if values.numel() <= k:
        return values, indices
    v, pos = ops.topk(values, k)
    return v, indices[pos.long()]


def select_above(x: torch.Tensor, thr: float, k: int):
    """Elements with |x| >= thr (and NaNs), trimmed to the k largest."""
    v, i = ops.threshold_select(x, thr)
    return trim(v, i, k)
