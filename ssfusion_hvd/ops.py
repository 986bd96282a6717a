"""The only door to the compiled extension ``ssfusion_hvd._C``.

Every op here has two implementations with identical results: the native kernel (C++ on
CPU, CUDA on GPU; ``csrc/``) and a pure-torch fallback. ``backend=None`` picks the native
kernel when it is built for the tensor's device, else the fallback; ``"native"`` or
``"torch"`` force one (tests compare them).

Shared semantics (also documented in ``csrc/ops.h``):

* Values are float32, float16 or bfloat16; inputs are read as ``x.flatten()``.
* Magnitude order is a total order: IEEE order of ``|x|`` for numbers, NaN above +Inf, so a
  NaN gradient is always selected and never dropped silently. Ties go to the lower index.
* Selections are returned in ascending index order, indices int32 (int64 from 2^31 elements).
* A *sparse record* of k elements in a flat buffer of the values' dtype is k values, zero
  padding up to the index size, then the k indices stored bit for bit (:func:`record_spans`).
* Hash ops (ZEN's hierarchical hashing, :func:`hash_partition`, :func:`hash_owner`) use the
  hash functions of ``csrc/hash.h``; collisions go to the lowest position, so the partition
  order is deterministic and the same on every backend.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

try:  # the extension links against libtorch: torch must be imported first (it is, above)
    from . import _C  # type: ignore[attr-defined]

    _IMPORT_ERROR: Optional[BaseException] = None
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    _C = None
    _IMPORT_ERROR = exc

VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT32_MAX = 2**31 - 1
_SIGN_CLEAR = {4: (torch.int32, 0x7FFFFFFF), 2: (torch.int16, 0x7FFF)}


def have_extension() -> bool:
    """True when ``ssfusion_hvd._C`` imported."""
    return _C is not None


def build_info() -> dict:
    """What the extension was built with (``cuda_kernels``, ``cuda_sources_compiled``,
    ``openmp``: whether its CPU kernels fork onto torch's intra-op threads)."""
    if _C is None:
        return {"extension": False, "error": repr(_IMPORT_ERROR)}
    return {"extension": True, **dict(_C.build_info)}


def index_dtype(numel: int) -> torch.dtype:
    """Index dtype of selections from a tensor of ``numel`` elements."""
    return torch.int32 if numel <= _INT32_MAX else torch.int64


def _check_values(x: torch.Tensor, op: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in VALUE_DTYPES:
        raise TypeError(f"{op}: unsupported dtype {x.dtype}; supported: float32, float16, bfloat16")


_NATIVE: dict = {}  # (op, device type) -> the extension's function, or None


def _native(x: torch.Tensor, op: str, backend: Optional[str]):
    """The native function for x's device, or None for the torch fallback. Looked up once per
    op and device type: this runs on every kernel call, where microseconds count."""
    if backend == "torch":
        return None
    if backend not in (None, "native"):
        raise ValueError(f"backend must be None, 'native' or 'torch', got {backend!r}")
    dev = "cpu" if x.is_cpu else x.device.type
    try:
        fn = _NATIVE[op, dev]
    except KeyError:
        fn = _NATIVE[op, dev] = getattr(_C, f"{op}_{dev}", None) if _C is not None else None
    if fn is None and backend == "native":
        raise RuntimeError(f"no native {op} kernel for device {x.device} ({build_info()})")
    return fn


def has_native(op: str, x: torch.Tensor) -> bool:
    """Whether the extension has a native ``op`` for ``x``'s device."""
    return _native(x, op, None) is not None


def magnitude_key(x: torch.Tensor) -> torch.Tensor:
    """Integer key whose order is the magnitude order (NaN above Inf), same shape as x."""
    idt, mask = _SIGN_CLEAR[x.element_size()]
    return x.contiguous().view(idt).bitwise_and(mask)


# --------------------------------------------------------------------------- selection


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


# --------------------------------------------------------------------------- error feedback


def _feedback_input(grad: torch.Tensor, residual: torch.Tensor, wire_dtype, op: str):
    """The wire dtype, with the inputs checked: the fused error-feedback ops' shared preamble
    (``csrc/checks.h: check_feedback`` holds the native ops to the same rules; the native
    kernels flatten the gradient themselves, a Python reshape costs ~0.8 us a call)."""
    _check_values(grad, op)
    _check_values(residual, op)
    wire = residual.dtype if wire_dtype is None else wire_dtype
    if wire not in VALUE_DTYPES:
        raise TypeError(f"{op}: unsupported wire dtype {wire}")
    if not residual.is_contiguous():
        raise ValueError(f"{op}: the residual must be contiguous (it is updated in place)")
    if residual.device != grad.device or residual.numel() != grad.numel():
        raise ValueError(f"{op}: residual ({residual.numel()} on {residual.device}) and gradient "
                         f"({grad.numel()} on {grad.device}) must match")
    if residual.dtype != torch.float32 and (grad.dtype != residual.dtype or wire != residual.dtype):
        raise TypeError(f"{op}: a {residual.dtype} residual needs a gradient and a wire of the same "
                        f"dtype (got {grad.dtype}, {wire}); accumulate 16-bit gradients in float32")
    return wire


def _wire_error(acc: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, wire) -> None:
    """The residual's selected entries become what the wire loses of them (memory.py)."""
    idx = indices.long()
    if wire == acc.dtype:
        acc.index_fill_(0, idx, 0)
    else:
        acc.index_copy_(0, idx, values - values.to(wire).to(acc.dtype))


def _velocity_input(velocity, grad: torch.Tensor, residual: torch.Tensor, op: str) -> None:
    """Checks an error-feedback op's optional DGC velocity (csrc/checks.h: check_velocity)."""
    if velocity is None:
        return
    _check_values(velocity, op)
    if velocity.dtype != residual.dtype or grad.dtype != residual.dtype:
        raise TypeError(f"{op}: velocity, gradient and residual need one dtype (got "
                        f"{velocity.dtype}, {grad.dtype}, {residual.dtype})")
    if velocity.device != residual.device or velocity.numel() != residual.numel():
        raise ValueError(f"{op}: velocity ({velocity.numel()} on {velocity.device}) and residual "
                         f"({residual.numel()} on {residual.device}) must match")
    if not velocity.is_contiguous():
        raise ValueError(f"{op}: the velocity must be contiguous (it is updated in place)")
    def overlaps(a, b):  # contiguous (checked or required): byte ranges
        return (a.numel() and b.numel() and a.data_ptr() < b.data_ptr() + b.nbytes
                and b.data_ptr() < a.data_ptr() + a.nbytes)
    if overlaps(velocity, residual) or (grad.is_contiguous() and overlaps(velocity, grad)):
        raise ValueError(f"{op}: the velocity must not share memory with the residual or the "
                         "gradient")


def _velocity_step(grad: torch.Tensor, velocity, momentum: float) -> torch.Tensor:
    """The torch composition's first step: velocity = momentum * velocity + grad (flat)."""
    if velocity is None:
        return grad.reshape(-1)
    v = velocity.view(-1)
    v.mul_(momentum).add_(grad.reshape(-1))
    return v


def ef_topk(grad: torch.Tensor, residual: torch.Tensor, k: int, wire_dtype=None,
            *, velocity: Optional[torch.Tensor] = None, momentum: float = 0.0,
            mask_velocity: bool = False, backend: Optional[str] = None):
    """Error feedback fused with the exact top-k, in place: ``residual += grad`` (in the
    residual's dtype), then the top-k of the sum exactly as :func:`topk` returns it
    (values in the residual's dtype), and the selected entries of ``residual`` replaced by
    what ``wire_dtype`` (default: the residual's) loses of them: zero, or
    ``v - v.to(wire_dtype)`` for a float32 residual sent as float16/bfloat16. So
    ``residual`` is afterwards the next step's residual.

    The residual is float32 (any gradient and wire dtype) or the 16-bit dtype of both. The
    native CPU kernel reads gradient and residual once and writes the residual once
    (``csrc/cpu/feedback.cpp``); the result equals the torch composition bit for bit.

    ``velocity`` (DGC's momentum correction; the residual's dtype, as the gradient): first
    ``velocity.mul_(momentum).add_(grad)``, then the above with the velocity for the
    gradient, and with ``mask_velocity`` its selected entries set to 0 (momentum factor
    masking). The CPU kernel does it in the same pass.

    ``grad`` may also be a list of tensors laid back to back that tile the residual (a
    fusion buffer's gradients, of one dtype): one k over their concatenation, the same
    result. The CPU kernel reads each where it lies, so nothing stages them into one buffer
    first; elsewhere they are concatenated."""
    if isinstance(grad, (list, tuple)):
        grads = list(grad)
        fn = _native(residual, "ef_topk_tensors", None if backend == "native" else backend)
        if fn is not None:  # checks in csrc/checks.h: check_feedback_segments
            return fn([g.contiguous() if isinstance(g, torch.Tensor) else g for g in grads],
                      residual, int(k), residual.dtype if wire_dtype is None else wire_dtype,
                      velocity, float(momentum), bool(mask_velocity))
        return ef_topk(_concat_tiles(grads, None, residual, "ef_topk"), residual, k, wire_dtype,
                       velocity=velocity, momentum=momentum, mask_velocity=mask_velocity,
                       backend=backend)
    wire = _feedback_input(grad, residual, wire_dtype, "ef_topk")
    _velocity_input(velocity, grad, residual, "ef_topk")
    k = int(k)
    if not 0 <= k <= grad.numel():
        raise ValueError(f"ef_topk: k={k} out of range [0, {grad.numel()}]")
    fn = _native(residual, "ef_topk", backend)
    if fn is not None:
        return fn(grad if grad.is_contiguous() else grad.contiguous(), residual, k, wire,
                  velocity, float(momentum), bool(mask_velocity))
    acc = residual.view(-1)
    acc.add_(_velocity_step(grad, velocity, momentum).to(acc.dtype))
    values, indices = topk(acc, k, backend="torch")
    _wire_error(acc, values, indices, wire)
    if velocity is not None and mask_velocity:
        velocity.view(-1).index_fill_(0, indices.long(), 0)
    return values, indices


def segmented_ef_topk(grad: torch.Tensor, residual: torch.Tensor, offsets, ks, wire_dtype=None,
                      *, velocity: Optional[torch.Tensor] = None, momentum: float = 0.0,
                      mask_velocity: bool = False, backend: Optional[str] = None):
    """:func:`ef_topk` per segment of :func:`segmented_topk`, in one call: ``residual +=
    grad`` everywhere, segment ``s`` gives its top ``ks[s]``, the selected entries of the
    residual become their wire error. Elements outside every segment are only
    accumulated (and, with a velocity, its momentum step taken).

    ``grad`` may also be a list of tensors, one per segment (a fusion group's gradients,
    of one dtype), whose segments tile the residual: the same result as on their
    concatenation. The CPU kernel reads each where it lies, so nothing stages them into
    one buffer first; elsewhere they are concatenated."""
    if isinstance(grad, (list, tuple)):
        return _segmented_ef_topk_tensors(list(grad), residual, offsets, ks, wire_dtype,
                                          velocity, momentum, mask_velocity, backend)
    wire = _feedback_input(grad, residual, wire_dtype, "segmented_ef_topk")
    _velocity_input(velocity, grad, residual, "segmented_ef_topk")
    offsets, ks = _segments(offsets, ks, "segmented_ef_topk")
    fn = _native(residual, "segmented_ef_topk", backend)
    if fn is not None:
        return fn(grad if grad.is_contiguous() else grad.contiguous(), residual, offsets, ks, wire,
                  velocity, float(momentum), bool(mask_velocity))
    _check_segments(offsets, ks, residual.numel(), "segmented_ef_topk")
    acc = residual.view(-1)
    acc.add_(_velocity_step(grad, velocity, momentum).to(acc.dtype))
    values, indices = segmented_topk(acc, offsets, ks, backend="torch")
    _wire_error(acc, values, indices, wire)
    if velocity is not None and mask_velocity:
        velocity.view(-1).index_fill_(0, indices.long(), 0)
    return values, indices


def group_ef_topk(grad, residual: torch.Tensor, offsets, floors, k: int, wire_dtype=None,
                  *, velocity: Optional[torch.Tensor] = None, momentum: float = 0.0,
                  mask_velocity: bool = False, backend: Optional[str] = None):
    """One budget of ``k`` elements over a group of segments, shared by magnitude, with a
    floor per segment: error feedback as :func:`segmented_ef_topk` (``residual += grad``,
    DGC's velocity step and masking), then segment ``s`` gives its top ``floors[s]`` and
    the ``k - sum(floors)`` largest magnitudes among all the segments' other elements
    complete the selection (ties to the lower index, as everywhere). The selected entries
    of the residual become their wire error. Returns ``(values, indices)`` in index order.

    Floors of zero and ``k`` at the segments' total give one top-k over the group
    (:func:`ef_topk`); floors equal to per-segment counts summing to ``k`` give
    :func:`segmented_ef_topk`. In between, a fusion buffer's budget goes where the
    accumulated magnitudes are (as one top-k over the buffer does) while no segment with
    a floor of at least one can go missing.

    Two passes over the group, whatever the backend: the segmented op takes the floors
    (and does the accumulation), then one top-``k`` over the segments' residual, which
    now holds every unselected element unchanged, yields the rest: its ``k`` largest
    contain at least ``k - sum(floors)`` that the floors did not take, and the largest of
    those are the rest's top (the floors' entries may hold wire errors of any size; they
    are only excluded). The CPU kernel (``csrc/cpu/feedback.cpp``) does the exclusion and
    the merge natively in O(k log floors); elsewhere they are a few device ops on the
    ``k`` candidates, without a host sync. ``grad`` may be one tensor per segment, as for
    :func:`segmented_ef_topk`."""
    op = "group_ef_topk"
    offsets, floors = _segments(offsets, floors, op)
    k = int(k)
    lo, hi = (int(offsets[0]), int(offsets[-1])) if floors.numel() else (0, 0)
    base = int(floors.sum())
    if not base <= k <= hi - lo:
        raise ValueError(f"{op}: k={k} outside [{base}, {hi - lo}] (the floors' sum, the "
                         "segments' elements)")
    wire = residual.dtype if wire_dtype is None else wire_dtype
    # the CPU kernel does all of it; elsewhere the segmented op and the top-k below run
    # natively (backend="native" requires those) and the merge is a few device ops
    listed = isinstance(grad, (list, tuple))
    fn = _native(residual, "group_ef_topk_tensors" if listed else "group_ef_topk",
                 "torch" if backend == "torch" else None)
    if fn is not None:
        if listed:  # checked natively (csrc/checks.h: check_feedback_segments)
            grad = [g.contiguous() for g in grad]
        else:
            _feedback_input(grad, residual, wire, op)
            _velocity_input(velocity, grad, residual, op)
            grad = grad if grad.is_contiguous() else grad.contiguous()
        return fn(grad, residual, offsets, floors, k, wire, velocity, float(momentum),
                  bool(mask_velocity))
    fv, fi = segmented_ef_topk(grad, residual, offsets, floors, wire, velocity=velocity,
                               momentum=momentum, mask_velocity=mask_velocity, backend=backend)
    rest = k - base
    if rest == 0:
        return fv, fi
    cv, ci = topk(residual.view(-1)[lo:hi], k, backend=backend)
    ci = ci.to(fi.dtype).add_(lo)
    mv, mi = _largest_not_in(cv, ci, fi, rest, wide=hi > 2**32)
    _wire_error(residual.view(-1), mv, mi, wire)
    if velocity is not None and mask_velocity:
        velocity.view(-1).index_fill_(0, mi.long(), 0)
    return _merge_disjoint(fv, fi, mv, mi)


def _largest_not_in(values: torch.Tensor, indices: torch.Tensor, taken: torch.Tensor, count: int,
                    wide: bool = False):
    """The ``count`` largest magnitudes of candidates ``(values, indices)`` (index order)
    whose index is not in ``taken`` (ascending, at most ``len(values) - count`` of them
    among the candidates), ties to the lower index; index order. No host sync. ``wide``:
    indices may reach 2^32."""
    idx = indices.long()
    order = magnitude_key(values).long()
    if not wide:  # one int64 order key: magnitude, then the lower index
        order = (order << 32) | (2**32 - 1 - idx)
    else:  # (a part of 2^32 elements or more) the rank instead: best first, ties in index order
        best = torch.sort(order, descending=True, stable=True).indices
        order = torch.empty_like(order).index_copy_(
            0, best, torch.arange(order.numel() - 1, -1, -1, device=order.device))
    if taken.numel():
        t = taken.long()
        at = torch.searchsorted(t, idx).clamp_(max=t.numel() - 1)
        order.masked_fill_(t[at] == idx, -1)
    if values.is_cuda:  # on the device, without a host sync: a top-count, back to index order
        keep = torch.topk(order, count, sorted=False).indices.sort().values
    else:  # the few left out (at most len(taken)) found by a small top-k, the rest kept
        keep = torch.ones(order.numel(), dtype=torch.bool)
        keep[torch.topk(order, order.numel() - count, largest=False, sorted=False).indices] = False
        keep = keep.nonzero().flatten()
    return values[keep], indices[keep]


def _merge_disjoint(av: torch.Tensor, ai: torch.Tensor, bv: torch.Tensor, bi: torch.Tensor):
    """Two selections with disjoint ascending indices merged into one in index order."""
    a, b = ai.long(), bi.long()
    pa = torch.arange(a.numel(), device=a.device) + torch.searchsorted(b, a)
    pb = torch.arange(b.numel(), device=b.device) + torch.searchsorted(a, b)
    values = torch.empty(a.numel() + b.numel(), dtype=av.dtype, device=av.device)
    indices = torch.empty(values.numel(), dtype=ai.dtype, device=ai.device)
    values.index_copy_(0, pa, av).index_copy_(0, pb, bv)
    indices.index_copy_(0, pa, ai).index_copy_(0, pb, bi.to(ai.dtype))
    return values, indices


def _segmented_ef_topk_tensors(grads, residual, offsets, ks, wire_dtype, velocity, momentum,
                               mask_velocity, backend):
    """segmented_ef_topk with the gradient as one tensor per segment (see there)."""
    op = "segmented_ef_topk"
    offsets, ks = _segments(offsets, ks, op)
    # CPU only (its checks in csrc/checks.h: check_feedback_segments, the same rules as
    # below); elsewhere, and with backend="native", the concatenation takes the native
    # segmented op, which raises if there is none
    fn = _native(residual, "segmented_ef_topk_tensors", None if backend == "native" else backend)
    if fn is not None:
        grads = [g.contiguous() if isinstance(g, torch.Tensor) else g for g in grads]
        return fn(grads, residual, offsets, ks, residual.dtype if wire_dtype is None else wire_dtype,
                  velocity, float(momentum), bool(mask_velocity))
    flat = _concat_tiles(grads, offsets.tolist(), residual, op)
    return segmented_ef_topk(flat, residual, offsets, ks, wire_dtype, velocity=velocity,
                             momentum=momentum, mask_velocity=mask_velocity, backend=backend)


def _concat_tiles(grads, bounds, residual: torch.Tensor, op: str) -> torch.Tensor:
    """The torch fallback's concatenation of gradient tensors that tile the residual, tensor
    s at [bounds[s], bounds[s + 1]) (None: back to back), checked by the rules of the
    native list ops (csrc/checks.h: check_feedback_segments); the op checks the rest."""
    if not grads or (bounds is not None and len(grads) != len(bounds) - 1):
        raise ValueError(f"{op}: {len(grads)} gradient tensors for "
                         f"{'no' if bounds is None else len(bounds) - 1} segments")
    for g in grads:
        _check_values(g, op)
    if any(g.dtype != grads[0].dtype for g in grads):
        raise TypeError(f"{op}: the gradient tensors must share one dtype")
    numels = [g.numel() for g in grads]
    if bounds is None:
        bounds = [0]
        for n in numels:
            bounds.append(bounds[-1] + n)
    if bounds[0] != 0 or bounds[-1] != residual.numel() or any(
            n != hi - lo for n, lo, hi in zip(numels, bounds, bounds[1:])):
        raise ValueError(f"{op}: gradient tensors of {numels} elements do not tile a residual "
                         f"of {residual.numel()} by offsets {bounds}")
    return torch.cat([g.reshape(-1) for g in grads])


# --------------------------------------------------------------------------- codec


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


# --------------------------------------------------------------------------- hash (ZEN)
#
# The hash functions of csrc/hash.h, on int64 tensors: arithmetic wraps mod 2^64 like the
# C++ uint64_t, ">>" is made logical by masking, constants are their signed 64-bit images.

_M64 = (1 << 64) - 1
_I64_MAX = (1 << 63) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53
_MAX_RANGE = 2**31 - 1
_MAX_ROUNDS = 64


def _signed64(u: int) -> int:
    u &= _M64
    return u - (1 << 64) if u >> 63 else u


def _fmix64_int(h: int) -> int:
    h &= _M64
    h ^= h >> 33
    h = (h * _MIX1) & _M64
    h ^= h >> 33
    h = (h * _MIX2) & _M64
    return h ^ (h >> 33)


def hash_seed(seed: int, i: int) -> int:
    """Seed of hash function ``i`` (0: the partition hash h_0), as an unsigned 64-bit int."""
    return _fmix64_int((int(seed) + (i + 1) * _GOLDEN) & _M64)


def _fmix64(h: torch.Tensor) -> torch.Tensor:
    h = h ^ ((h >> 33) & 0x7FFFFFFF)
    h = h * _signed64(_MIX1)
    h = h ^ ((h >> 33) & 0x7FFFFFFF)
    h = h * _signed64(_MIX2)
    return h ^ ((h >> 33) & 0x7FFFFFFF)


def _hash_to(keys: torch.Tensor, s: int, m: int) -> torch.Tensor:
    """h(keys) reduced to [0, m) by the high 32 bits (csrc/hash.h)."""
    h = _fmix64(keys ^ _signed64(s))
    return (((h >> 32) & 0xFFFFFFFF) * m) >> 32


def _check_hash(indices: torch.Tensor, nparts: int, table_size: int, rounds: int, op: str) -> None:
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"{op}: expected a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype not in (torch.int32, torch.int64) or indices.dim() != 1:
        raise TypeError(f"{op}: indices must be a 1-D int32 or int64 tensor, got "
                        f"{tuple(indices.shape)} {indices.dtype}")
    for name, v, lo, hi in (("nparts", nparts, 1, _MAX_RANGE),
                            ("table_size", table_size, 1, _MAX_RANGE),
                            ("rounds", rounds, 0, _MAX_ROUNDS)):
        if not lo <= v <= hi:
            raise ValueError(f"{op}: {name}={v} out of range [{lo}, {hi}]")


def default_table_size(m: int, nparts: int) -> int:
    """Slots of each partition's parallel memory when not given: twice the mean load."""
    return min(_MAX_RANGE, max(1, 2 * -(-int(m) // int(nparts))))


def hash_owner(indices: torch.Tensor, nparts: int, seed: int, *,
               backend: Optional[str] = None) -> torch.Tensor:
    """h_0 of every index (int32): the partition :func:`hash_partition` puts it in. The index
    sets ``{i : h_0(i) = p}`` are what ZEN's hash bitmap (§3.3, Algorithm 2) is laid over."""
    nparts = int(nparts)
    _check_hash(indices, nparts, 1, 0, "hash_owner")
    seed = int(seed) & _M64
    fn = _native(indices, "hash_owner", backend)
    if fn is not None:
        return fn(indices.contiguous(), nparts, _signed64(seed))
    return _hash_to(indices.long(), hash_seed(seed, 0), nparts).to(torch.int32)


def hash_partition(indices: torch.Tensor, nparts: int, seed: int, *,
                   table_size: Optional[int] = None, rounds: int = 3,
                   backend: Optional[str] = None):
    """ZEN's hierarchical hashing (OSDI'25 §3.2, Algorithm 1): groups the (non-zero) indices
    of a gradient into ``nparts`` balanced partitions, losing none.

    Index ``j`` goes to partition ``h_0(indices[j])`` (the first level: the same ``seed``
    gives the same partition on every rank, so an index from any rank meets its copies at
    one owner). Each partition has a *parallel memory* of ``table_size`` slots (default
    :func:`default_table_size`: twice the mean load) and a *serial memory* without bound.
    ``rounds`` second-level hash functions ``h_1..h_rounds`` are tried in turn: in round i
    every index not yet placed tries slot ``h_i(indices[j])``; a slot that is empty at the
    start of the round goes to the lowest ``j`` trying it (the paper's read-after-write
    collision check, made deterministic so CPU, CUDA and this fallback agree bit for bit),
    the others stay pending. What is still pending after the last round is appended to its
    partition's serial memory in input order (the paper's atomic counter), so nothing is
    lost however small the table. Hash functions: ``csrc/hash.h`` (MurmurHash3's fmix64 with
    per-function seeds derived from ``seed``).

    Returns ``(order, counts, overflow)``, all int64:

    * ``order[m]``: positions into ``indices`` grouped by partition 0..nparts-1; inside
      partition p the occupied slots of its parallel memory in slot order, then its serial
      memory. ``indices[order]`` / ``values[order]`` is what goes to each owner;
    * ``counts[nparts]``: entries per partition (the alltoall splits);
    * ``overflow[nparts]``: entries that went to each partition's serial memory.

    Duplicate indices are each placed (in the same partition).
    """
    nparts, rounds = int(nparts), int(rounds)
    _check_hash(indices, nparts, 1, rounds, "hash_partition")
    if table_size is None:
        table_size = default_table_size(indices.numel(), nparts)
    table_size = int(table_size)
    _check_hash(indices, nparts, table_size, rounds, "hash_partition")
    seed = int(seed) & _M64
    fn = _native(indices, "hash_partition", backend)
    if fn is not None:
        return fn(indices.contiguous(), nparts, _signed64(seed), table_size, rounds)
    dev, m = indices.device, indices.numel()
    keys = indices.long()
    part = _hash_to(keys, hash_seed(seed, 0), nparts)
    table = torch.full((nparts * table_size,), -1, dtype=torch.int64, device=dev)
    pending = torch.arange(m, dtype=torch.int64, device=dev)
    for r in range(1, rounds + 1):  # a loop over the hash functions, not over indices
        if pending.numel() == 0:
            break
        slot = part[pending] * table_size + _hash_to(keys[pending], hash_seed(seed, r), table_size)
        free = table[slot] < 0
        bids = torch.full_like(table, m).scatter_reduce_(0, slot[free], pending[free], "amin")
        won = free & (bids[slot] == pending)
        table[slot[won]] = pending[won]
        pending = pending[~won]
    occupied = (table >= 0).nonzero().flatten()  # (partition, slot) order
    key = torch.cat([(occupied // table_size) * 2, part[pending] * 2 + 1])
    order = torch.cat([table[occupied], pending])[torch.sort(key, stable=True).indices]
    counts = torch.bincount(part, minlength=nparts)
    overflow = torch.bincount(part[pending], minlength=nparts)
    return order, counts, overflow
