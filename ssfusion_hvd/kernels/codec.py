"""The sparse record codec: record layout, pack, unpack, scatter-add decode and delivery
into the gradients (``csrc/record.h``, ``csrc/cpu/codec.cpp``, ``csrc/cuda/codec.cu``)."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .dispatch import _SIGN_CLEAR, _check_values, _native


def record_spans(k: int, value_dtype: torch.dtype, idx_dtype: torch.dtype = torch.int32) -> Tuple[int, int]:
    """Buffer elements (of ``value_dtype``) taken by a record's padded values and its indices."""
    if idx_dtype not in (torch.int32, torch.int64):
        raise TypeError(f"indices must be int32 or int64, got {idx_dtype}")
    vb = torch.empty(0, dtype=value_dtype).element_size()
    ib = torch.empty(0, dtype=idx_dtype).element_size()
    per = ib // vb if ib > vb else 1
    vspan = -(-k // per) * per
    ispan = -(-(k * ib) // vb)
    return vspan, ispan


def record_numel(k: int, value_dtype: torch.dtype, idx_dtype: torch.dtype = torch.int32) -> int:
    """Total buffer elements of a record of k elements."""
    return sum(record_spans(k, value_dtype, idx_dtype))


def _byte_view(buf: torch.Tensor, start: int, nbytes: int) -> torch.Tensor:
    """Bytes [start, start+nbytes) of a contiguous 1-D buffer, as a uint8 view."""
    return buf.view(torch.uint8)[start : start + nbytes]


def pack(values: torch.Tensor, indices: torch.Tensor, out: torch.Tensor, offset: int,
         *, backend: Optional[str] = None) -> int:
    """Writes the record (values, indices) into ``out`` at ``offset``; returns the next offset."""
    _check_values(values, "pack")
    if out.dtype != values.dtype or out.dim() != 1 or not out.is_contiguous():
        raise ValueError(f"pack: out must be a contiguous 1-D {values.dtype} buffer, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if values.dim() != 1 or indices.dim() != 1 or values.numel() != indices.numel():
        raise ValueError("pack: values and indices must be 1-D of equal length")
    fn = _native(out, "pack", backend)
    if fn is not None:
        return int(fn(values, indices, out, int(offset)))
    k = values.numel()
    vspan, ispan = record_spans(k, values.dtype, indices.dtype)
    if offset < 0 or offset + vspan + ispan > out.numel():
        raise ValueError(f"pack: record of {k} elements at offset {offset} does not fit in "
                         f"a buffer of {out.numel()}")
    out[offset : offset + k].copy_(values)
    out[offset + k : offset + vspan].zero_()
    eb = out.element_size()
    ib = indices.element_size()
    _byte_view(out, (offset + vspan) * eb, k * ib).copy_(indices.contiguous().view(torch.uint8))
    return offset + vspan + ispan


def unpack(buf: torch.Tensor, offset: int, k: int, idx_dtype: torch.dtype = torch.int32):
    """``(values, indices)`` of the record of k elements at ``offset`` of ``buf`` (copies)."""
    vspan, _ = record_spans(k, buf.dtype, idx_dtype)
    values = buf[offset : offset + k].clone()
    ib = torch.empty(0, dtype=idx_dtype).element_size()
    raw = _byte_view(buf, (offset + vspan) * buf.element_size(), k * ib).clone()
    return values, raw.view(idx_dtype)


def scatter_add(dense: torch.Tensor, values: torch.Tensor, indices: torch.Tensor,
                *, backend: Optional[str] = None) -> torch.Tensor:
    """``dense.view(-1)[indices] += values``, duplicates adding in order; returns dense."""
    _check_values(dense, "scatter_add")
    if not dense.is_contiguous():
        raise ValueError("scatter_add: dense must be contiguous")
    fn = _native(dense, "scatter_add", backend)
    if fn is not None:
        fn(dense, values, indices)
        return dense
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= dense.numel()):
        raise IndexError("scatter_add: index out of range")
    dense.view(-1).index_add_(0, indices.long(), values)
    return dense


def _check_sums(sums: torch.Tensor, gathered: torch.Tensor, nchunks: int, op: str) -> None:
    """The decode ops' shared checks: ``sums`` holds sums of the records in ``gathered`` (the
    records' dtype, or float32 for float16/bfloat16 records), a 1-D buffer of ``nchunks``
    equal chunks."""
    _check_values(sums, op)
    _check_values(gathered, op)
    if sums.dtype != gathered.dtype and not (sums.dtype == torch.float32
                                             and gathered.element_size() == 2):
        raise ValueError(f"{op}: {sums.dtype} cannot sum records of {gathered.dtype} (same "
                         "dtype, or float32 for float16/bfloat16)")
    if gathered.dim() != 1 or gathered.numel() % max(nchunks, 1):
        raise ValueError(f"{op}: {gathered.numel()} elements do not split into {nchunks} chunks")


def scatter_add_chunks(dense: torch.Tensor, gathered: torch.Tensor, nchunks: int, offset: int,
                       k: int, idx_dtype: torch.dtype = torch.int32,
                       *, backend: Optional[str] = None) -> torch.Tensor:
    """Decode: adds the record at ``offset`` of each of the ``nchunks`` equal chunks of the
    allgathered buffer ``gathered`` into ``dense``, chunk 0 first (every rank sums in the same
    order). Indices must be distinct within a chunk (true of every selection op). ``dense``
    has the records' dtype, or is float32 for float16/bfloat16 records (each value converted
    exactly, then added in float32)."""
    _check_sums(dense, gathered, nchunks, "scatter_add_chunks")
    chunk_len = gathered.numel() // nchunks if nchunks else 0
    fn = _native(dense, "scatter_add_chunks", backend)
    if fn is not None:
        fn(dense, gathered, int(nchunks), chunk_len, int(offset), int(k), idx_dtype)
        return dense
    for p in range(nchunks):  # loop over ranks, not tensors
        v, i = unpack(gathered, p * chunk_len + offset, k, idx_dtype)
        scatter_add(dense, v.to(dense.dtype), i, backend="torch")
    return dense


def deliver_chunks(out: torch.Tensor, tensors, gathered: torch.Tensor, nchunks: int, offset: int,
                   k: int, idx_dtype: torch.dtype = torch.int32, scale: float = 1.0,
                   *, backend: Optional[str] = None) -> torch.Tensor:
    """The rest of a sparse decode after :func:`scatter_add_chunks` ``(out, gathered, ...)``
    on the same records, into ``tensors`` the caller has zeroed: moves the sums at the
    positions the records name out of ``out`` into the list ``tensors``, scaled, and leaves
    +0 behind, so a decode costs one zeroing pass over the tensors and work in proportion to
    the records, not passes over ``out``.

    ``tensors`` (contiguous, of the records' dtype, on ``out``'s device) lie back to back in
    ``out``'s layout: position ``i`` in ``[b_t, b_t + numel(t))`` (``b_0 = 0``) is element
    ``i - b_t`` of ``tensors[t]``; positions from ``b_T = sum of numels`` to ``out.numel()``
    are the sink of padding entries, cleared and never delivered. For the records of chunk
    0, 1, ... in order, each entry's position ``i`` where ``out`` still holds a value (bits
    not all zero) is cleared and, below ``b_T``, delivered:
    ``tensors[t].view(-1)[i - b_t] = out[i] * scale``, computed as ``out.mul_(scale)``
    computes it (skipped for ``scale == 1``) and cast to the tensors' dtype as a copy casts.
    Later chunks naming ``i`` find +0 and skip it, so each position is delivered once,
    whole. A +0 sum is not written (the zeroed tensors hold +0, and ``scale`` must be finite
    and >= 0), so the tensors end bit for bit as ``out.mul_(scale)`` followed by
    ``torch._foreach_copy_(tensors, views of out)`` leaves them; elements no record names
    are not written. ``out`` has the records' dtype, or float32 for float16/bfloat16
    records. An index outside ``[0, out.numel())`` raises before anything is written (a
    device-side assertion on CUDA). Returns a 0-d int64 tensor on ``out``'s device: the
    delivered values that are NaN or +-Inf (no host sync). NaN payload bits may differ
    between backends (torch's own vectorized casts canonicalize some NaNs)."""
    tensors = list(tensors)
    _check_sums(out, gathered, nchunks, "deliver_chunks")
    if not out.is_contiguous():
        raise ValueError("deliver_chunks: out must be contiguous")
    for t, x in enumerate(tensors):
        if not isinstance(x, torch.Tensor) or x.dtype != gathered.dtype \
                or x.device != out.device or not x.is_contiguous():
            raise ValueError(f"deliver_chunks: tensor {t} must be a contiguous {gathered.dtype} "
                             f"tensor on {out.device} (the records' dtype)")
    bounds = [0]
    for x in tensors:
        bounds.append(bounds[-1] + x.numel())
    if bounds[-1] > out.numel():
        raise ValueError(f"deliver_chunks: the tensors hold {bounds[-1]} elements, out only "
                         f"{out.numel()}")
    scale = float(scale)
    if not (math.isfinite(scale) and scale >= 0.0):
        raise ValueError(f"deliver_chunks: scale {scale} must be finite and >= 0")
    chunk_len = gathered.numel() // nchunks if nchunks else 0
    fn = _native(out, "deliver_chunks", backend)
    if fn is not None:
        return fn(out, tensors, gathered, int(nchunks), chunk_len, int(offset), int(k),
                  idx_dtype, scale)
    if not 0 <= offset <= chunk_len - record_numel(k, gathered.dtype, idx_dtype):
        raise ValueError("deliver_chunks: record outside the chunk")
    if nchunks == 0 or k == 0:
        return torch.zeros((), dtype=torch.int64, device=out.device)
    idx = torch.cat([unpack(gathered, p * chunk_len + offset, k, idx_dtype)[1]
                     for p in range(nchunks)]).long()
    if int(idx.min()) < 0 or int(idx.max()) >= out.numel():
        raise IndexError("deliver_chunks: index out of range")
    flat = out.view(-1)
    named = torch.unique(idx)  # sorted, each position once
    live = named[:int(torch.searchsorted(named, bounds[-1]))]  # without the sink
    sums = flat[live]
    held = sums.view(_SIGN_CLEAR[sums.element_size()][0]) != 0  # not +0
    live, sums = live[held], sums[held]
    vals = (sums * scale if scale != 1.0 else sums).to(gathered.dtype)
    cuts = torch.searchsorted(live, torch.tensor(bounds, device=live.device)).tolist()
    for t, x in enumerate(tensors):  # a loop over tensors, not positions
        if cuts[t] < cuts[t + 1]:
            x.view(-1)[live[cuts[t]:cuts[t + 1]] - bounds[t]] = vals[cuts[t]:cuts[t + 1]]
    flat[named] = 0
    return torch.isfinite(vals).logical_not_().sum()
