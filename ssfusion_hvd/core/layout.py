"""The buffer step of the data flow: tensors laid out back to back in one flat vector.

:class:`FlatLayout` is the one description of "these parameters, in this order, in one
flat buffer" that every scheme uses: the whole model gradient (SparDL, ZEN, ExDyna), a
fusion buffer's parts (``core/buffers.py``) and the residual memory's keys. Offsets are
element offsets; ``bounds[i]:bounds[i + 1]`` is tensor ``i``.
"""
from __future__ import annotations

import bisect
import itertools
import math
from typing import List, Sequence

import torch

__all__ = ["FlatLayout", "views"]


def views(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> List[torch.Tensor]:
    """Views of ``flat`` with ``shapes``, back to back from offset 0."""
    out, lo = [], 0
    for s in shapes:
        n = math.prod(s)
        out.append(flat[lo:lo + n].view(s))
        lo += n
    return out


class FlatLayout:
    """``shapes`` (and optionally ``names``) back to back in one flat vector."""

    def __init__(self, shapes: Sequence[torch.Size], names: Sequence[str] = ()):
        self.shapes = [torch.Size(s) for s in shapes]
        self.names = list(names)
        if self.names and len(self.names) != len(self.shapes):
            raise ValueError(f"{len(self.names)} names for {len(self.shapes)} shapes")
        self.sizes = [math.prod(s) for s in self.shapes]
        self.bounds = [0] + list(itertools.accumulate(self.sizes))
        self.numel = self.bounds[-1]
        self._inner = {}  # device -> inner bounds as a tensor (made once per device)

    def __len__(self) -> int:
        return len(self.shapes)

    def views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """Per-tensor views of ``flat`` (``numel`` elements or more: a tail is ignored)."""
        return views(flat, self.shapes)

    def gather(self, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """``tensors`` flattened back to back (into ``out`` when given)."""
        flat = [t.reshape(-1) for t in tensors]
        if out is None:
            return torch.cat(flat) if flat else torch.empty(0)
        if flat:
            torch.cat(flat, out=out[:self.numel])
        return out

    def scatter(self, flat: torch.Tensor, targets: Sequence[torch.Tensor]) -> None:
        """Copies the per-tensor views of ``flat`` into ``targets`` (one fused op)."""
        if targets:
            torch._foreach_copy_(list(targets), self.views(flat))

    def owner(self, indices: torch.Tensor) -> torch.Tensor:
        """The tensor each flat index belongs to."""
        inner = self._inner.get(indices.device)
        if inner is None:
            inner = self._inner[indices.device] = torch.tensor(
                self.bounds[1:-1], dtype=torch.int64, device=indices.device)
        return torch.bucketize(indices.long(), inner, right=True)

    def missing(self, indices: torch.Tensor) -> torch.Tensor:
        """0-d count of the tensors none of ``indices`` falls into (no host sync)."""
        if not self.shapes:
            return torch.zeros((), dtype=torch.int64)
        hits = torch.bincount(self.owner(indices), minlength=len(self.shapes))
        return (hits[:len(self.shapes)] == 0).sum()

    def window(self, tensors: Sequence[torch.Tensor], lo: int, hi: int):
        """The flat elements ``lo:hi`` of ``tensors`` laid out as this layout, without
        laying them out: ``(pieces, which)``, the 1-D views (a contiguous tensor's are
        views, else copies) that tile the window in order, and the index of the tensor
        each comes from. For a scheme that needs a per-element quantity of its own
        partition only (ExDyna's Adam denominators)."""
        if not 0 <= lo <= hi <= self.numel:
            raise ValueError(f"window {lo}:{hi} outside a layout of {self.numel} elements")
        pieces, which = [], []
        first = max(0, bisect.bisect_right(self.bounds, lo) - 1)
        for i in range(first, len(self.shapes)):
            start, stop = self.bounds[i], self.bounds[i + 1]
            if start >= hi:
                break
            a, b = max(lo, start), min(hi, stop)
            if a < b:
                pieces.append(tensors[i].reshape(-1)[a - start:b - start])
                which.append(i)
        return pieces, which
