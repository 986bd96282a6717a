"""The one wire format of sparse data: records of (value, index) entries.

A *record* of k entries, in a flat buffer of the values' dtype, is the k values, zero
padding up to the index alignment, then the k indices stored bit for bit (the layout of
:func:`ssfusion_hvd.ops.pack`, :func:`~ssfusion_hvd.ops.record_spans`). A message is
records back to back (:func:`encode`, :func:`decode`): SparDL's point-to-point and
all-gather payloads, ZEN's push (one record per owner), the planned schemes' fusion
buffers (fixed-capacity records after the dense part).

A record's length gives back its k (:func:`count_of`): the padding is smaller than one
entry (at most ``index size - value size`` bytes), so ``k = nbytes // (value size + index
size)`` for every pair of dtypes; a length that is no record's raises. So a receiver that
knows its sources' byte splits (an alltoall's received splits) needs no counts.

Horovod's collectives move bytes here: a message travels as ``buf.view(torch.uint8)``
(Horovod 0.28.1 has no bfloat16 collectives; its splits are then in bytes) and is read
back with ``raw.view(dtype)``. Nothing here calls Horovod.
"""
from __future__ import annotations

import functools
import math
from typing import List, Sequence, Tuple

import torch

from .. import ops

__all__ = ["Sparse", "SPARSE_GRAD_DTYPES", "encode", "decode", "count_of", "record_bytes",
           "wait_codes", "code_waits", "WAIT_EXACT", "WAIT_MAX", "spread_codes", "code_spreads",
           "SPREAD_MIN", "SPREAD_MAX", "noise_shares", "noise_ratio", "share_max"]

Sparse = Tuple[torch.Tensor, torch.Tensor]  # (values, indices)

#: what a sparse scheme's gradients may be: its kernels, residuals and wire formats
SPARSE_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def record_bytes(k: int, dtype: torch.dtype, idx_dtype: torch.dtype) -> int:
    """Bytes of a record of ``k`` entries (values of ``dtype``, indices of ``idx_dtype``)."""
    return ops.record_numel(k, dtype, idx_dtype) * _size(dtype)


def count_of(nbytes: int, dtype: torch.dtype, idx_dtype: torch.dtype) -> int:
    """The k of a record of ``nbytes`` bytes; ``ValueError`` if no record is that long."""
    nbytes = int(nbytes)
    k = nbytes // (_size(dtype) + _size(idx_dtype))
    if nbytes < 0 or record_bytes(k, dtype, idx_dtype) != nbytes:
        raise ValueError(f"{nbytes} bytes is not the length of a ({dtype}, {idx_dtype}) "
                         f"record (a record of {k} entries has "
                         f"{record_bytes(max(k, 0), dtype, idx_dtype)})")
    return k


def encode(items: Sequence[Sparse], dtype: torch.dtype, idx_dtype: torch.dtype,
           device=None) -> torch.Tensor:
    """The records of ``items`` back to back, in a 1-D buffer of ``dtype`` (on ``device``,
    default the first item's). Values must be ``dtype`` and indices ``idx_dtype``, 1-D."""
    for v, i in items:
        if v.dtype != dtype or i.dtype != idx_dtype:
            raise TypeError(f"wire.encode: a ({v.dtype}, {i.dtype}) item in a ({dtype}, "
                            f"{idx_dtype}) message")
    if device is None:
        device = items[0][0].device if items else "cpu"
    total = sum(ops.record_numel(v.numel(), dtype, idx_dtype) for v, _ in items)
    out = torch.empty(total, dtype=dtype, device=device)
    at = 0
    for v, i in items:
        at = ops.pack(v, i, out, at)
    return out


def decode(buf: torch.Tensor, counts: Sequence[int], idx_dtype: torch.dtype) -> List[Sparse]:
    """The records of ``counts[j]`` entries each, in order, from the 1-D buffer ``buf`` (of
    the values' dtype) holding exactly them: ``(values, indices)`` copies."""
    dtype = buf.dtype
    spans = [ops.record_numel(int(c), dtype, idx_dtype) for c in counts]
    if buf.numel() != sum(spans):
        raise RuntimeError(f"wire.decode: {buf.numel() * buf.element_size()} bytes received, "
                           f"expected {sum(spans) * _size(dtype)} (records of "
                           f"{[int(c) for c in counts]} entries)")
    out, at = [], 0
    for c, span in zip(counts, spans):
        out.append(ops.unpack(buf, at, int(c), idx_dtype))
        at += span
    return out


# ---------------------------------------------------------------------- waits
#: A sender's wait (steps of gradient an entry carries, ``ResidualMemory.sent_waits``)
#: travels as one byte beside its entry: exact up to WAIT_EXACT, then geometric up to
#: WAIT_MAX (1e5 steps), a ratio of 1.037 between codes, so a decoded wait is within
#: 1.9 % of the true one and the shared moments' share 1/a of it alike.
WAIT_EXACT = 16
WAIT_MAX = 100_000
_WAIT_RATIO = math.log(WAIT_MAX / WAIT_EXACT) / (255 - WAIT_EXACT)


def wait_codes(waits: torch.Tensor) -> torch.Tensor:
    """The one-byte codes (uint8) of ``waits`` (integers >= 1; larger than WAIT_MAX
    saturates)."""
    w = waits.float().clamp_(1, WAIT_MAX)
    far = torch.log(w / WAIT_EXACT).div_(_WAIT_RATIO).round_().add_(WAIT_EXACT)
    return torch.where(w <= WAIT_EXACT, w, far).clamp_(max=255).to(torch.uint8)


def code_waits(device=None) -> torch.Tensor:
    """The wait each of the 256 codes stands for (float64; code 0 is not a wait and
    reads as 1)."""
    c = torch.arange(256, dtype=torch.float64, device=device)
    far = WAIT_EXACT * torch.exp((c - WAIT_EXACT) * _WAIT_RATIO)
    return torch.where(c <= WAIT_EXACT, c.clamp(min=1), far)


# ---------------------------------------------------------------------- spreads
#: A sender's spread (``ResidualMemory.sent_spreads``: the variance of its gradient over
#: the steps an entry waited, as a ratio to the entry's value squared, dimensionless)
#: travels as one byte beside its entry: code 0 is 0 (an entry that waited one step has
#: no spread), codes 1-255 geometric from SPREAD_MIN to SPREAD_MAX, a ratio of 1.15
#: between codes, so a decoded spread is within 7 % of the true one (3.5 % in the square
#: root Adam divides by). Below about SPREAD_MIN it reads as 0 (a variance a billionth of
#: the value's square); above SPREAD_MAX it saturates (a value that is almost all
#: cancellation, which a top-k rarely sends).
SPREAD_MIN = 2.0 ** -30
SPREAD_MAX = 2.0 ** 20
_SPREAD_RATIO = math.log(SPREAD_MAX / SPREAD_MIN) / 254


def spread_codes(spreads: torch.Tensor) -> torch.Tensor:
    """The one-byte codes (uint8) of ``spreads`` (>= 0; NaN reads as 0)."""
    s = torch.nan_to_num(spreads.float(), nan=0.0, posinf=SPREAD_MAX).clamp_(min=0.0)
    c = torch.log(s / SPREAD_MIN).div_(_SPREAD_RATIO).round_().add_(1).clamp_(0, 255)
    return torch.where(s > 0, c, torch.zeros_like(c)).to(torch.uint8)


def code_spreads(device=None) -> torch.Tensor:
    """The spread each of the 256 codes stands for (float64; code 0 is 0)."""
    c = torch.arange(256, dtype=torch.float64, device=device)
    return torch.where(c > 0, SPREAD_MIN * torch.exp((c - 1) * _SPREAD_RATIO),
                       torch.zeros_like(c))


def noise_shares(variances: torch.Tensor, against: torch.Tensor, scale: float,
                 nranks: int) -> torch.Tensor:
    """This rank's share of a summed variance, as float16 for a Sum allreduce:
    ``scale² · variances / against``, ``scale`` the average's (1/P), ``against`` a per
    element quantity every rank holds alike in the units of a synchronized gradient
    squared (:func:`noise_ratio` turns the sum back). Where a scheme sums every rank's
    variance at elements whose synchronized value every rank already holds (SparDL after
    its gathers, ExDyna after its values' allreduce), the shares travel in 16 bits where
    a variance (a gradient squared) would underflow.

    ``against`` is the value's rate per step squared, ``(value / a)²`` for an element that
    waited ``a`` steps: what Adam's second moment takes at the arrival. Where the mean
    gradient μ per step dominates the rate, a share is about ``σ_r² / (P² μ²)``, about
    1/P where the noise is as large as the mean, whatever the wait, and in the wire's own
    units (a loss scale on the wire scales both; docs/design.md has the two measures that
    failed: the value squared, Adam's ``v-hat``). Where noise dominates, a share grows
    with the wait; the sum saturates once the noise is about 4e4 times the rate squared
    (a top-k rarely sends such an element). Shares below 6e-8 read as 0; each is clamped
    to :func:`share_max` (``nranks``), so the float16 sum cannot overflow. A zero
    ``against`` or a non-finite share reads as no noise."""
    share = variances.float().mul(scale * scale).div_(against)
    ok = (against > 0) & torch.isfinite(share)
    return torch.where(ok, share, torch.zeros_like(share)).clamp_(
        0.0, share_max(nranks)).to(torch.float16)


def noise_ratio(summed: torch.Tensor, against: torch.Tensor,
                values: torch.Tensor) -> torch.Tensor:
    """The noise ratio ``R = scale² Σ_r σ_r² / value²`` (float32) from the allreduced
    :func:`noise_shares` ``summed``: ``summed · against / values²``, 0 where a value is 0
    or the ratio not finite (Adam adds ``R · value²``: the summed variance)."""
    ratio = summed.float().mul(against).div_(values.float().square())
    return torch.where((values != 0) & torch.isfinite(ratio), ratio, torch.zeros_like(ratio))


@functools.lru_cache(maxsize=None)
def share_max(nranks: int) -> float:
    """A float16 of which ``nranks`` summed in float16, in any order, stay finite: each
    addition rounds up by at most half a unit (a factor 1 + 2^-11), so the bound divides
    float16's largest by ``nranks·(1 + 2^-11)^nranks`` and rounds down (65504 / 3 rounds
    up to 21840, three of which overflow; ten 6548s, summed one by one, reach inf)."""
    n = max(1, nranks)
    top = torch.finfo(torch.float16).max / (n * (1 + 2 ** -11) ** n)
    half = torch.tensor([top], dtype=torch.float64).to(torch.float16)
    if float(half) > top:  # the float16 below it: its bit pattern less one (positive)
        half = (half.view(torch.int16) - 1).view(torch.float16)
    return float(half)
