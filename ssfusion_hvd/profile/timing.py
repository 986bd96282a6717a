"""Timings on this rank alone, no collective: the affine fits of the cost model
(:func:`fit_affine`), a sparse part's encode (:func:`time_sparsifier`) and a group's
decode (:func:`time_decode`)."""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from ..plan.cost import nominal_k

#: Probe sizes of :func:`probe_collectives` (bytes one worker contributes).
COLLECTIVE_SIZES = (4096, 65536, 1 << 20, 4 << 20)
#: Further allgather sizes, for the measured curve only (``CostModel.allgather_curve``): a
#: large record's allgather, which over Gloo leaves the affine fit (twice a slow link's time
#: from about 4 MiB per rank; docs/results/collectives_probe.md)
ALLGATHER_CURVE_SIZES = (16 << 20,)
#: Dense input sizes (bytes) of :func:`time_sparsifier`: from a small tensor to one far
#: larger than a CPU's caches, where every pass over it runs at memory speed.
SPARSIFY_SIZES = (40_000, 400_000, 4_000_000, 40_000_000)
#: Output sizes (bytes) of :func:`time_decode`.
DECODE_SIZES = (40_000, 400_000, 4_000_000, 40_000_000)


# -- fitting ------------------------------------------------------------------------------
def fit_affine(sizes_bytes, seconds, relative: bool = False) -> tuple[float, float]:
    """Least-squares ``(α, β)`` of ``t = α + β·x`` with ``α, β >= 0`` (Cupcake §4.1).

    ``relative``: minimize the squared *relative* residuals ``((t - α - β·x) / t)²``
    instead of the absolute ones, so that sizes spanning orders of magnitude each count
    alike: the small sizes pin ``α`` (a fixed cost paid once per call, per tensor or per
    collective), the large ones ``β``. The live profile fits this way; with absolute
    residuals the largest size's noise alone decides ``α``.

    A negative fitted slope (noise on a flat curve) becomes 0 with ``α`` = mean time; a
    negative intercept becomes 0 with ``β`` refitted through the origin. With a single
    distinct size the two cannot be told apart: the time is taken as all per-byte
    (``α = 0, β = t/x``), or as all latency when that size is 0.
    """
    x = np.asarray(sizes_bytes, dtype=np.float64).reshape(-1)
    t = np.asarray(seconds, dtype=np.float64).reshape(-1)
    if x.size == 0 or x.size != t.size:
        raise ValueError(f"need matching non-empty sizes and times, got {x.size} and {t.size}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(t))):
        raise ValueError("sizes and times must be finite")
    w = np.ones_like(t)
    if relative:
        floor = max(float(np.abs(t).max()) * 1e-9, 1e-15)  # a zero time must not divide
        w = 1.0 / np.maximum(np.abs(t), floor) ** 2
    w = w / w.sum()
    t_mean = float(np.dot(w, t))
    if np.ptp(x) == 0.0:  # one distinct size
        if x[0] > 0:
            return 0.0, max(t_mean, 0.0) / float(x[0])
        return max(t_mean, 0.0), 0.0
    x_mean = float(np.dot(w, x))
    dx = x - x_mean
    beta = float(np.dot(w * dx, t - t_mean) / np.dot(w * dx, dx))
    alpha = t_mean - beta * x_mean
    if beta < 0.0:
        return max(t_mean, 0.0), 0.0
    if alpha < 0.0:
        sxx = float(np.dot(w * x, x))
        return 0.0, max(float(np.dot(w * x, t)) / sxx, 0.0) if sxx > 0 else 0.0
    return float(alpha), float(beta)


def _numel(nbytes: int, dtype: torch.dtype) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    return max(1, int(nbytes) // size)


def _torch_device(device) -> torch.device:
    """``"gpu"`` means the current CUDA device; anything else goes to ``torch.device``."""
    if isinstance(device, str) and device == "gpu":
        return torch.device("cuda", torch.cuda.current_device())
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# -- sparsification -----------------------------------------------------------------------
def time_sparsifier(sparsifier: str, device="cpu", density=0.01, sizes_bytes=SPARSIFY_SIZES,
                    repeats=3, dtype=torch.float32, rule=None, stage_device=None,
                    grouped: bool = False) -> tuple[float, float]:
    """``h(x)`` of ``sparsifier`` on ``device`` as the engine runs it (Cupcake §4.1,
    SSFusion §IV-A), ``x`` the dense bytes.

    One timed call is one sparse part's encode (``core/buffers.SparsePart``): stage the
    gradient, error feedback with the recipe's local rule (``rule()``: a new
    :class:`~ssfusion_hvd.rules.LocalRule`, e.g. momentum correction; None:
    plain error feedback), select ``k = ceil(density·n)``, update the residual, pack the
    record into a send buffer. A selection kernel timed alone misses most of that: the
    encode makes several passes over the gradient, and on a large tensor each pass
    runs at memory speed, not cache speed. ``stage_device``: where the part is staged
    and selected (the SSFusion-O offload path: ``"cpu"`` for a GPU job, so each call
    includes the device-to-host copy); default ``device``. ``grouped``: the part holds
    two tensors of half the size each under the group budget (``SparsePart`` mode
    ``"group"``, floors of one element; an exact top-k sparsifier only), the selection
    the SSFusion schemes run by default: its second pass is in the fit. One untimed call first (the
    residual and rule state exist from then on, as in steady state), then the median of
    ``repeats``; CUDA is synchronized around every timed call. Fitted with relative
    residuals (:func:`fit_affine`). Local: no collective.
    """
    from ..core.buffers import SparsePart
    from ..plan.cost import SEGMENTED_SPARSIFIERS
    from ..sparsify import make_sparsifier
    from ..sparsify.memory import ResidualMemory

    if not 0.0 < float(density) <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    make_sparsifier(sparsifier)  # an unknown name fails here, before any timing
    dev = _torch_device(device)
    stage = dev if stage_device is None else _torch_device(stage_device)
    mode = "segmented" if sparsifier in SEGMENTED_SPARSIFIERS else "per_tensor"
    grouped = grouped and mode == "segmented"
    gen = torch.Generator().manual_seed(0)
    xs, ts = [], []
    for nbytes in sizes_bytes:
        n = _numel(nbytes, dtype)
        halves = [n // 2, n - n // 2] if grouped and n >= 2 else [n]
        ks = [int(nominal_k(h, float(density))) for h in halves]
        part = SparsePart("profile", list(range(len(halves))), [torch.Size([h]) for h in halves],
                          ks, "group" if len(halves) > 1 else mode,
                          [make_sparsifier(sparsifier) for _ in halves], 0, dtype, dev,
                          stage_device=stage, floors=[1] * len(halves) if len(halves) > 1 else None)
        send = torch.empty(part.length, dtype=dtype, device=dev)
        memory = ResidualMemory(rule() if rule is not None else None)
        memory.set_density(density)
        grad = torch.randn(n, generator=gen).to(dtype=dtype, device=dev)

        def run(part=part, send=send, memory=memory, grad=grad):
            if part.stage_device != grad.device:  # the offload path's host staging copy
                part.stage.copy_(grad)
                result = part.select(memory)
            else:
                result = part.select_grads(memory, list(grad.split(halves)))
            part.pack(result, send, 1.0)

        ts.append(_median_seconds(run, dev, max(1, int(repeats))))
        xs.append(n * grad.element_size())
    return fit_affine(xs, ts, relative=True)


def _median_seconds(run, dev, repeats: int) -> float:
    run()  # warm-up
    samples = []
    for _ in range(repeats):
        _sync(dev)
        start = time.perf_counter()
        run()
        _sync(dev)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def time_decode(device="cpu", world_size=2, density=0.01, sizes_bytes=DECODE_SIZES,
                repeats=3, dtype=torch.float32) -> tuple[float, float]:
    """``d(x)`` of one group's decode on ``device``, as ``step()`` runs it for a sparse part
    of one tensor of each size (``core/buffers.unpack``: zero the gradient, scatter-add
    ``world_size`` records of ``k = ceil(density·n)`` elements into the part's output, write
    the touched positions scaled by ``1/world_size`` (Average) into the gradient and clear
    them), ``x`` the bytes it touches as the simulator counts them
    (:func:`~ssfusion_hvd.plan.timeline.decode_bytes`). Fitted with relative residuals.
    Local: no collective."""
    from .. import ops
    from ..core.buffers import SparsePart, unpack
    from ..plan.cost import index_size
    from ..sparsify import make_sparsifier

    dev = _torch_device(device)
    gen = torch.Generator().manual_seed(0)
    xs, ts = [], []
    for nbytes in sizes_bytes:
        n = _numel(nbytes, dtype)
        k = int(nominal_k(n, density))
        part = SparsePart("profile", [0], [torch.Size([n])], [k], "segmented",
                          [make_sparsifier("topk")], 0, dtype, dev)
        rec = part.length
        gathered = torch.zeros(world_size * rec, dtype=dtype)  # packed on the host, then moved
        for r in range(world_size):
            idx = torch.randint(0, n, (k,), generator=gen, dtype=part.idx_dtype)  # random access
            ops.pack(torch.randn(k, generator=gen).to(dtype), idx, gathered, r * rec)
        gathered = gathered.to(dev)
        grad = torch.empty(n, dtype=dtype, device=dev)

        def run(part=part, gathered=gathered, rec=rec, grad=grad):
            unpack(part, gathered, world_size, rec, [grad], 1.0 / world_size)

        ts.append(_median_seconds(run, dev, max(1, int(repeats))))
        es = grad.element_size()
        xs.append(n * es + world_size * k * (es + index_size(n)))
    return fit_affine(xs, ts, relative=True)
