"""Error feedback fused with selection: the residual added, the top-k taken and the sent
values (as the wire rounds them) removed in one pass, whole, per segment or under a
group budget; DGC's velocity step inside (``csrc/cpu/feedback.cpp``, ``csrc/cuda/segmented.cu``)."""
from __future__ import annotations

from typing import Optional

import torch

from .dispatch import VALUE_DTYPES, _check_values, _native, magnitude_key
from .select import _check_segments, _segments, segmented_topk, topk


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
    (``csrc/cpu/feedback.cpp``, ``csrc/cuda/segmented.cu``); the result equals the torch composition bit for bit.

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
    are only excluded). The CPU kernel (``csrc/cpu/feedback.cpp``, ``csrc/cuda/segmented.cu``) does the exclusion and
    the merge natively in O(k log floors); elsewhere they are a few device ops on the
    ``k`` candidates, without a host sync. ``grad`` may be one tensor per segment, as for
    :func:`segmented_ef_topk`."""
    op = "group_ef_topk"
    offsets, floors, k, lo, hi, base = _group_budget(offsets, floors, k, op)
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
    if k == base:
        return fv, fi
    mv, mi = _rest_of_budget(residual.view(-1), lo, hi, k, fi, k - base, backend)
    _wire_error(residual.view(-1), mv, mi, wire)
    if velocity is not None and mask_velocity:
        velocity.view(-1).index_fill_(0, mi.long(), 0)
    return _merge_disjoint(fv, fi, mv, mi)


def keyed_topk(key: torch.Tensor, k: Optional[int] = None, offsets=None, ks=None, *,
               backend: Optional[str] = None) -> torch.Tensor:
    """Indices, in ascending order, of the largest entries of a selection key (flat,
    non-negative): the top ``k`` of the whole key (no ``offsets``); ``ks[s]`` per segment
    (``k`` None), as :func:`segmented_topk`; or ``k`` over the segments with ``ks`` as
    floors, the group budget of :func:`group_ef_topk`. Ties to the lower index.

    The fused ops select by the accumulated magnitude; this selects the same shapes of
    budget by any key a caller computes beside them (``SparsePart``: the size of the step
    the shared Adam rule would take with each pending element). Native top-k kernels
    inside; the group's merge is the device ops of :func:`group_ef_topk`, no host sync."""
    op = "keyed_topk"
    if offsets is None:
        return topk(key, int(k), backend=backend)[1]
    if k is None:
        return segmented_topk(key, offsets, ks, backend=backend)[1]
    offsets, floors, k, lo, hi, base = _group_budget(offsets, ks, k, op)
    fv, fi = segmented_topk(key, offsets, floors, backend=backend)
    if k == base:
        return fi
    mv, mi = _rest_of_budget(key.reshape(-1), lo, hi, k, fi, k - base, backend)
    return _merge_disjoint(fv, fi, mv, mi)[1]


def _group_budget(offsets, floors, k, op: str):
    """A group budget's arguments checked: ``(offsets, floors, k, lo, hi, base)``, the
    segments' span ``[lo, hi)`` and the floors' sum ``base``; ``ValueError`` where ``k``
    is below the floors or above the segments' elements."""
    offsets, floors = _segments(offsets, floors, op)
    k = int(k)
    lo, hi = (int(offsets[0]), int(offsets[-1])) if floors.numel() else (0, 0)
    base = int(floors.sum())
    if not base <= k <= hi - lo:
        raise ValueError(f"{op}: k={k} outside [{base}, {hi - lo}] (the floors' sum, the "
                         "segments' elements)")
    return offsets, floors, k, lo, hi, base


def _rest_of_budget(x: torch.Tensor, lo: int, hi: int, k: int, taken: torch.Tensor, rest: int,
                    backend):
    """The group budget's second pass: the ``rest`` largest of ``x[lo:hi]`` (flat) not
    among ``taken`` (the floors' positions, ascending), from its top ``k``, which holds at
    least that many others. ``(values, indices)`` in index order."""
    cv, ci = topk(x[lo:hi], k, backend=backend)
    ci = ci.to(taken.dtype).add_(lo)
    return _largest_not_in(cv, ci, taken, rest, wide=hi > 2**32)


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


def ef_step_key(grads, residual: torch.Tensor, exp_avg_sqs, bias2_sqrt, eps: float,
                key: torch.Tensor, *, root: bool = False,
                backend: Optional[str] = None) -> torch.Tensor:
    """A fusion group's error-feedback sum and the size of the step the shared Adam rule
    would take with it, the key that selects by the pending step (``docs/recipe.md``,
    "Selecting by the step"): ``residual += grads`` (the tensors laid back to back tile
    the residual), then per element ``key = |residual| / (sqrt(v) / bias2_sqrt[s] + eps)``,
    ``v`` the element's ``exp_avg_sqs[s]`` (the same element counts as ``grads[s]``) and
    ``bias2_sqrt[s]`` = ``(1 - beta2^t)^(1/2)`` at tensor ``s``'s step count: the shared
    rule's denominator (``csrc/moments.h``). A float32 ``key``; the sum in the residual's
    dtype, the key's operations in float32, each rounded once in that order, the square
    root correctly rounded. Returns
    ``key``; its magnitude top-k is the top-k by the pending step.

    ``root``: the denominator's square root is taken (once more correctly rounded), ``key =
    |residual| / sqrt(sqrt(v) / bias2_sqrt[s] + eps)``, whose order is that of
    ``residual² / (sqrt(v) / bias2_sqrt[s] + eps)``: the pending sum times the step it
    would take, the first-order decrease of the loss (``docs/recipe.md``, "Selecting by the
    gain").

    The native kernels (``csrc/cpu/step_key.cpp``; on CUDA, ``csrc/cuda/moments.cu``) read
    gradients and ``v`` where they lie, one pass; they take float32 tensors on the
    residual's device and host bias corrections. Elsewhere (16-bit gradients, step counts
    held on the device as 0-d tensors, an offloaded part whose state lies on another
    device) the torch composition computes the same bits."""
    grads, vs = list(grads), list(exp_avg_sqs)
    if not (len(grads) == len(vs) == len(bias2_sqrt)) or not grads:
        raise ValueError(f"ef_step_key: {len(grads)} gradients, {len(vs)} exp_avg_sq tensors and "
                         f"{len(bias2_sqrt)} bias corrections (one of each per tensor, at least one)")
    if any(g.numel() != v.numel() for g, v in zip(grads, vs)):
        raise ValueError("ef_step_key: each gradient and its exp_avg_sq must have one element count")
    n = sum(g.numel() for g in grads)
    for name, t, dtypes in (("residual", residual, VALUE_DTYPES), ("key", key, (torch.float32,))):
        if t.dtype not in dtypes or not t.is_contiguous() or t.numel() != n:
            raise ValueError(f"ef_step_key: the {name} must be contiguous, "
                             f"{' or '.join(map(str, dtypes))}, of the tensors' {n} elements "
                             f"(got {t.dtype}, {t.numel()})")
    host = all(not isinstance(b, torch.Tensor) for b in bias2_sqrt)
    fn = _native(residual, "ef_step_key", backend) if host else None
    if fn is not None and all(t.dtype == torch.float32 and t.device == residual.device
                              for t in [residual, *grads, *vs]):
        fn([g.contiguous() for g in grads], residual, [v.contiguous() for v in vs],
           [float(b) for b in bias2_sqrt], float(eps), key, bool(root))
        return key
    if backend == "native":
        raise RuntimeError("ef_step_key: the native kernel takes float32 tensors on the residual's "
                           "device and host bias corrections")
    flat = grads[0].reshape(-1) if len(grads) == 1 else torch.cat([g.reshape(-1) for g in grads])
    residual.add_(flat.to(residual.device, residual.dtype))
    step_denominator(vs, bias2_sqrt, eps, key, root=root, backend=backend)
    return torch.div(residual.float(), key, out=key).abs_()


def _exact_sqrt_(x: torch.Tensor) -> None:
    """``x``'s float32 square roots in place, correctly rounded as the native kernels'."""
    if x.is_cuda:  # IEEE's square root on the GPU; torch's CPU one is not correctly rounded
        x.sqrt_()
    else:  # (a float32 square root through float64 is, as the native kernel's)
        x.copy_(x.double().sqrt_())


def step_denominator(exp_avg_sqs, bias2_sqrt, eps: float, out: torch.Tensor, *,
                     root: bool = False, backend: Optional[str] = None) -> torch.Tensor:
    """What the shared Adam rule divides each element's step by, ``sqrt(v) / bias2_sqrt[s]
    + eps`` for the tensors of ``exp_avg_sqs`` laid back to back, into ``out`` (float32,
    contiguous), bit for bit as :func:`ef_step_key` divides by it (each operation rounded
    once, the square root correctly rounded); ``bias2_sqrt`` host floats or 0-d tensors.
    ``root``: its square root, as :func:`ef_step_key` with ``root`` divides by.
    For the schemes whose selections run on partial sums (SparDL's merges), which divide
    by it themselves. Returns ``out``. The native kernels (CPU and CUDA, as
    :func:`ef_step_key`'s) read ``v`` where it lies, one pass, for float32 states on
    ``out``'s device and host bias corrections."""
    vs = list(exp_avg_sqs)
    host = all(not isinstance(b, torch.Tensor) for b in bias2_sqrt)
    fn = _native(out, "step_denominator", backend) if host else None
    if fn is not None and out.dtype == torch.float32 and all(
            v.dtype == torch.float32 and v.device == out.device for v in vs):
        fn([v.contiguous() for v in vs], [float(b) for b in bias2_sqrt], float(eps), out,
           bool(root))
        return out
    if backend == "native":
        raise RuntimeError("step_denominator: the native kernel takes float32 tensors on the "
                           "output's device and host bias corrections")
    # computed where v lies: an offloaded part's (staged on the host, v on the GPU) is
    # copied once
    if all(v.device == out.device and v.dtype == out.dtype for v in vs):
        den = torch.cat([v.reshape(-1) for v in vs], out=out)
    else:
        den = torch.cat([v.reshape(-1).float() for v in vs])
    _exact_sqrt_(den)
    if any(isinstance(b, torch.Tensor) for b in bias2_sqrt):  # where capturable Adam keeps steps
        bias2_sqrt = torch.stack([torch.as_tensor(b).reshape(()).float() for b in bias2_sqrt]
                                 ).to(den.device).unbind()
    torch._foreach_div_(list(den.split([v.numel() for v in vs])), list(bias2_sqrt))
    den.add_(float(eps))
    if root:
        _exact_sqrt_(den)
    if den is not out:
        out.copy_(den)
    return out
