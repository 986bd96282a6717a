"""Selection: exact top-k (whole and per segment), DGC's sampled threshold and its sample
positions, threshold selection and counting (``csrc/cpu/select.cpp``, ``csrc/cuda/select.cu``, ``segmented.cu``)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .dispatch import _check_values, _native, index_dtype, magnitude_key
from .hash import _I64_MAX, _M64, _fmix64, _signed64, hash_seed


def topk(x: torch.Tensor, k: int, *, backend: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact magnitude top-k of ``x.flatten()``: ``(values, indices)`` in index order.

    Values keep their sign. Ties at the k-th magnitude go to the lower indices.
    """
    _check_values(x, "topk")
    n = x.numel()
    k = int(k)
    if not 0 <= k <= n:
        raise ValueError(f"topk: k={k} out of range [0, {n}]")
    fn = _native(x, "topk", backend)
    if fn is not None:  # the kernel flattens
        return fn(x if x.is_contiguous() else x.contiguous(), k)
    flat = x.reshape(-1)
    idt = index_dtype(n)
    if k == 0:
        return flat[:0].clone(), torch.empty(0, dtype=idt, device=x.device)
    key = magnitude_key(flat)
    kth = torch.topk(key, k, sorted=True).values[-1]  # the exact k-th key, whatever the ties
    above = key > kth
    ties = (key == kth).nonzero().flatten()[: k - int(above.sum())]
    idx = torch.cat([above.nonzero().flatten(), ties]).sort().values
    return flat[idx], idx.to(idt)


def _segments(offsets, ks, op: str):
    """Segment bounds and counts as CPU int64 tensors (the kernels plan on the host), with
    one more offset than counts."""
    offsets = torch.as_tensor(offsets, dtype=torch.int64, device="cpu")
    ks = torch.as_tensor(ks, dtype=torch.int64, device="cpu")
    if offsets.numel() != ks.numel() + 1:
        raise ValueError(f"{op}: {offsets.numel()} offsets for {ks.numel()} segments "
                         "(need len(ks) + 1)")
    return offsets, ks


def _check_segments(offsets: torch.Tensor, ks: torch.Tensor, n: int, op: str) -> None:
    """csrc/checks.h's check_segments for the torch fallbacks that change state (the fused
    error-feedback ops): checked before the residual is touched."""
    size = offsets[1:] - offsets[:-1]
    if ks.numel() and (int(offsets[0]) < 0 or int(offsets[-1]) > n or bool((size < 0).any())):
        raise ValueError(f"{op}: offsets {offsets.tolist()} outside [0, {n}] or decreasing")
    bad = ((ks < 0) | (ks > size)).nonzero().flatten()
    if bad.numel():
        s = int(bad[0])
        raise ValueError(f"{op}: k={int(ks[s])} out of range for segment {s} of {int(size[s])} "
                         "elements")


def segmented_topk(flat: torch.Tensor, offsets, ks, *, backend: Optional[str] = None):
    """Per-segment magnitude top-k in ONE call: segment ``s`` is ``flat[offsets[s]:offsets[s+1]]``
    and gives ``ks[s]`` elements. Results are concatenated in segment order (each segment in
    index order); indices are positions in ``flat``. This is what makes per-tensor
    sparsification of a fusion buffer as cheap as one selection over the whole buffer."""
    _check_values(flat, "segmented_topk")
    flat = flat.reshape(-1)
    offsets, ks = _segments(offsets, ks, "segmented_topk")
    fn = _native(flat, "segmented_topk", backend)
    if fn is not None:
        return fn(flat.contiguous(), offsets, ks)
    vals, idxs = [flat[:0]], [torch.empty(0, dtype=index_dtype(flat.numel()), device=flat.device)]
    for s in range(ks.numel()):  # reference only; the native kernel does this in one call
        lo, hi = int(offsets[s]), int(offsets[s + 1])
        if hi < lo or lo < 0 or hi > flat.numel():
            raise ValueError(f"segmented_topk: bad segment [{lo}, {hi}) of {flat.numel()}")
        v, i = topk(flat[lo:hi], int(ks[s]), backend="torch")
        vals.append(v)
        idxs.append(i.to(idxs[0].dtype) + lo)
    return torch.cat(vals), torch.cat(idxs)


def sampled_threshold(x: torch.Tensor, k: int, samples: int, seed: int = 0, *,
                      backend: Optional[str] = None) -> float:
    """DGC's threshold estimate (Lin et al. 2018, §3): the magnitude keeping about k of the n
    elements, read off a sample of ``samples`` elements (clamped to [1, n]) as its
    ``ceil(k * samples / n)``-th largest magnitude; NaN counts as +Inf.

    The sample is stratified and jittered: sample ``j`` is drawn uniformly from the j-th of
    ``samples`` equal strata of ``x.flatten()`` by a hash of ``(seed, j)``
    (:func:`sample_positions`, ``csrc/sampling.h``). The positions depend on ``n``,
    ``samples`` and ``seed`` only, so every rank (and backend) passing the same seed samples
    the same positions, and a new seed per step samples new ones. A random sample is used
    rather than a fixed stride because a stride aliases with weight layouts: a stride equal
    to a row length reads a single column, and large gradients in the other columns are then
    never seen. ``seed`` is taken mod 2^64."""
    _check_values(x, "sampled_threshold")
    flat = x.reshape(-1)
    n = flat.numel()
    k = int(k)
    if not 1 <= k <= n:
        raise ValueError(f"sampled_threshold: k={k} out of range [1, {n}]")
    seed = int(seed) & _M64
    fn = _native(flat, "sampled_threshold", backend)
    if fn is not None:
        return float(fn(flat.contiguous(), k, int(samples), _signed64(seed)))
    samples = max(1, min(int(samples), n))
    kk = max(1, -(-(k * samples) // n))
    mag = flat[sample_positions(n, samples, seed, device=flat.device)]
    mag = mag.float().abs().nan_to_num(nan=float("inf"), posinf=float("inf"))
    return float(torch.topk(mag, kk).values[-1])


def sample_positions(n: int, samples: int, seed: int, *, device=None) -> torch.Tensor:
    """The positions (int64, ascending, one per stratum) that :func:`sampled_threshold` reads
    from ``n`` elements: ``csrc/sampling.h``'s ``sample_position`` for ``j < samples``
    (``samples`` clamped to [1, n]) on int64 tensors, bit for bit::

        lo_j  = floor(j * n / samples)                 (as j*q + (j*r) // samples)
        h_j   = fmix64(j ^ fmix64(seed + 0x9E3779B97F4A7C15))
        pos_j = lo_j + (h_j >> 1) % (lo_{j+1} - lo_j)
    """
    n = int(n)
    if n < 1:
        raise ValueError(f"sample_positions: n={n} must be positive")
    samples = max(1, min(int(samples), n))
    q, r = divmod(n, samples)
    j = torch.arange(samples + 1, dtype=torch.int64, device=device)
    bounds = j * q + (j * r) // samples  # stratum j is [bounds[j], bounds[j + 1])
    j = j[:-1]
    h = _fmix64(j ^ _signed64(hash_seed(int(seed) & _M64, 0)))
    return bounds[:-1] + ((h >> 1) & _I64_MAX) % (bounds[1:] - bounds[:-1])


def _threshold_input(x: torch.Tensor, thr: float, op: str):
    """``(flat x, threshold as float)``, checked (the threshold ops' shared preamble)."""
    _check_values(x, op)
    thr = float(thr)
    if thr != thr:
        raise ValueError(f"{op}: threshold is NaN")
    return x.reshape(-1), thr


def threshold_select(x: torch.Tensor, thr: float, *, backend: Optional[str] = None):
    """All elements with ``|x| >= thr`` (compared in float64) and every NaN, in index order."""
    flat, thr = _threshold_input(x, thr, "threshold_select")
    fn = _native(x, "threshold_select", backend)
    if fn is not None:
        return fn(flat.contiguous(), thr)
    mask = (flat.abs().double() >= thr) | flat.isnan()
    idx = mask.nonzero().flatten()
    return flat[idx], idx.to(index_dtype(flat.numel()))


def threshold_count(x: torch.Tensor, thr: float, *, backend: Optional[str] = None) -> int:
    """Number of elements :func:`threshold_select` would return."""
    flat, thr = _threshold_input(x, thr, "threshold_count")
    fn = _native(x, "threshold_count", backend)
    if fn is not None:
        return int(fn(flat.contiguous(), thr))
    return int(((flat.abs().double() >= thr) | flat.isnan()).sum())
