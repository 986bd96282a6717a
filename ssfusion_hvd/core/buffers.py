"""Fusion buffers of one plan group and their wire format (``docs/design.md``, "Wire format").

A group of the plan travels as at most two collectives:

* an **allreduce part**: the group's dense tensors bound for allreduce (SSFusion-I's dense
  part, or every tensor of a dense scheme), packed back to back into one flat buffer;
* an **allgather buffer**: one flat buffer of the gradient dtype holding, in this order,
  ``parts``: a :class:`DensePart` (values of the dense tensors that ride the allgather,
  SSFusion §IV-B: small tensors are left dense), then :class:`SparsePart` records
  ``[capacity values | capacity indices]`` (indices aligned to their own size,
  ``ops.record_spans``). Every rank's buffer has the same length, so the allgather needs no
  size exchange; rank r's copy is chunk r of the gathered buffer.

A sparse part's selection modes, its records and its decode: ``core/sparse_part.py``.

Nothing here talks to Horovod: encode/decode are pure functions of tensors, shared by the
live schemes and by the tests' reference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch

from .layout import views
from .sparse_part import SelectionResult, SparsePart, _scaled_copy, fresh_table

__all__ = ["DensePart", "SparsePart", "GroupBuffers", "SelectionResult", "build_group",
           "fresh_table", "nonfinite_count", "unpack"]


def unpack(part, gathered: torch.Tensor, nranks: int, record_len: int,
           grads: Sequence[torch.Tensor], postscale: float) -> torch.Tensor:
    """The whole decode of ``part`` (a :class:`DensePart` or :class:`SparsePart`) from the
    gathered records into ``grads`` (its tensors' ``.grad``, written in place), scaled by
    ``postscale``: as ``step()`` runs it and as ``profile.time_decode`` times it.

    Returns what the step's ``nonfinite`` count is read from: the decoded flat output (to
    be scanned), or, for a sparse part decoded straight into ``grads``, a 0-d int64 tensor
    already holding the count of non-finite values it wrote."""
    return part.decode_into(gathered, nranks, record_len, list(grads), postscale)


def nonfinite_count(decoded: torch.Tensor) -> int:
    """Non-finite elements of what :func:`unpack` returned.

    One read pass decides the usual case: a sum is finite only if every term is (a NaN
    term makes it NaN; an infinite one makes it infinite, or NaN beside the opposite
    infinity), so a finite sum means no non-finite element. Accumulating in at least
    float32 keeps a half-precision sum from overflowing; a sum that overflows all the same
    (or a gradient that does hold NaN/Inf) takes the exact count: one sum's pass costs a
    small part of counting every element (``docs/design.md``, "Invariants")."""
    if not decoded.is_floating_point():
        return int(decoded)
    acc = torch.float64 if decoded.dtype == torch.float64 else torch.float32
    if bool(torch.isfinite(decoded.sum(dtype=acc))):
        return 0
    return int(torch.isfinite(decoded).logical_not_().sum())


class DensePart:
    """Dense tensors carried by the allgather: values only, summed over ranks on decode
    (in ``acc_dtype``, e.g. float32 for float16 gradients)."""

    def __init__(self, tensors: Sequence[int], shapes: Sequence[torch.Size], offset: int,
                 dtype: torch.dtype, device: torch.device, acc_dtype: torch.dtype | None = None):
        self.tensors = list(tensors)
        self.numels = [math.prod(s) for s in shapes]
        self.offset = offset
        self.length = sum(self.numels)
        self.out = torch.empty(self.length, dtype=acc_dtype or dtype, device=device)
        self.out_views = views(self.out, shapes)

    def encode(self, grads: Sequence[torch.Tensor], send: torch.Tensor, prescale: float) -> None:
        region = send[self.offset:self.offset + self.length]
        torch.cat([g.reshape(-1) for g in grads], out=region)
        if prescale != 1.0:
            region.mul_(prescale)

    def decode(self, gathered: torch.Tensor, nranks: int, record_len: int) -> torch.Tensor:
        chunks = gathered.view(nranks, record_len)[:, self.offset:self.offset + self.length]
        torch.sum(chunks, dim=0, dtype=self.out.dtype, out=self.out)
        return self.out

    def decode_into(self, gathered: torch.Tensor, nranks: int, record_len: int,
                    grads: List[torch.Tensor], postscale: float) -> torch.Tensor:
        """Sum of the chunks, scaled, copied into ``grads``; returns the sum."""
        return _scaled_copy(self.decode(gathered, nranks, record_len), self, grads, postscale)


@dataclass
class GroupBuffers:
    """Everything one plan group sends, allocated once per plan."""

    index: int
    tensors: List[int]  # plan indices of the group, in plan order
    allreduce: List[int]  # plan indices sent by allreduce
    ar_buf: Optional[torch.Tensor]
    ar_views: List[torch.Tensor]
    parts: List[object]  # DensePart / SparsePart, in wire order
    send: Optional[torch.Tensor]  # the allgather buffer
    offloaded: List[SparsePart] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.allreduce_set = frozenset(self.allreduce)

    @property
    def record_len(self) -> int:
        return 0 if self.send is None else self.send.numel()


def build_group(index: int, plan, shapes, dtype, device, new_sparsifier, offload_device=None,
                key_prefix: str = "g", acc_dtype: torch.dtype | None = None,
                waits: int = 0, spread: bool = False) -> GroupBuffers:
    """The buffers of ``plan.groups[index]``.

    ``shapes`` are the gradient shapes in plan order; ``new_sparsifier(key, i)`` returns the
    sparsifier instance for tensor ``i`` (or for a fusion buffer, with ``i = None``).
    Offloaded tensors (SSFusion-O) get a sparse part each, staged on ``offload_device``.
    ``waits``: the sparse parts' entries carry their sender's wait, from which their decode
    computes that many shares (:class:`SparsePart`; 0: none); ``spread``: they carry
    their sender's spread, from which the decode computes the noise ratio.
    """
    g = plan.groups[index]
    members = list(g.indices())
    if g.buffer_k is not None:  # multi-tensor: one top-k over the whole fusion buffer
        key = f"{key_prefix}{index}"
        part = SparsePart(key, members, [shapes[i] for i in members], [g.buffer_k], "buffer",
                          [new_sparsifier(key, None)], 0, dtype, device, acc_dtype=acc_dtype,
                          waits=waits, spread=spread)
        send = torch.empty(part.length, dtype=dtype, device=device)
        return GroupBuffers(index, members, [], None, [], [part], send)
    ar = [i for i in members if not plan.sparse[i] and plan.collective[i] == "allreduce"]
    ag_dense = [i for i in members if not plan.sparse[i] and plan.collective[i] == "allgather"]
    inline = [i for i in members if plan.sparse[i] and not plan.offload[i]]
    offl = [i for i in members if plan.sparse[i] and plan.offload[i]]
    ar_buf = None
    ar_views: List[torch.Tensor] = []
    if ar:
        ar_buf = torch.empty(sum(math.prod(shapes[i]) for i in ar), dtype=dtype, device=device)
        ar_views = views(ar_buf, [shapes[i] for i in ar])
    parts: List[object] = []
    offset = 0
    if ag_dense:
        parts.append(DensePart(ag_dense, [shapes[i] for i in ag_dense], offset, dtype, device,
                               acc_dtype))
        offset += parts[-1].length
    offloaded = []
    for tensors, on in ([inline, None], *[([i], offload_device) for i in offl]):
        if not tensors:
            continue
        key = f"{key_prefix}{index}.{'s' if on is None else f'o{tensors[0]}'}"
        sps = [new_sparsifier(key, i) for i in tensors]
        mode = "segmented" if all(s.exact_topk for s in sps) else "per_tensor"
        floors = None
        if mode == "segmented" and plan.group_floor is not None and len(tensors) > 1:
            mode, floors = "group", plan.floors(tensors)  # (one tensor: its own k either way)
        part = SparsePart(key, tensors, [shapes[i] for i in tensors], [plan.k[i] for i in tensors],
                          mode, sps, offset, dtype, device, stage_device=on, acc_dtype=acc_dtype,
                          floors=floors, waits=waits, spread=spread)
        parts.append(part)
        if on is not None:
            offloaded.append(part)
        offset += part.length
    send = torch.empty(offset, dtype=dtype, device=device) if offset else None
    return GroupBuffers(index, members, ar, ar_buf, ar_views, parts, send, offloaded)
