"""Live profiling for the planner: fills a :class:`~ssfusion_hvd.plan.CostModel` with numbers
measured on the running job (docs/design.md "How a plan is made").

* :func:`probe_collectives`: ``g(x) = α_g + β_g·x`` for allreduce and allgather on the real
  Horovod communicator (Cupcake §4.1: "latency per tensor" and "transfer time per byte").
* :func:`time_sparsifier`: ``h(x) = α_h + β_h·x`` of one sparsifier on one device (Cupcake
  §4.1 compression time; SSFusion §IV-A "sparsification time", timed over several sizes
  and repeats).
* :func:`time_decode`: ``d(x) = α_d + β_d·x`` of one group's decode (zero the gradient,
  scatter-add every rank's record, write the touched positions), ``x`` the bytes it touches.
* :class:`BackwardTimer`: per-tensor backward time ``T_b`` and the backward order, from the
  gradient-ready hooks of the warm-up iterations (SSFusion §IV-A "computation time",
  §IV-B "online profiling" during the first iterations).
* :func:`measure_cost_model`: all of it, broadcast from rank 0 so every rank plans on
  identical numbers; or read from a JSON profile without any collective.

Horovod is imported inside the functions that talk to it, so importing this module (and
using :func:`fit_affine`, :func:`time_sparsifier`, :class:`BackwardTimer` or a JSON profile)
works without Horovod.
"""
from __future__ import annotations

import json
import statistics
import time
import warnings
from typing import Hashable, Iterable, Sequence

import numpy as np
import torch

from .plan.cost import CostModel, nominal_k

__all__ = [
    "BackwardTimer",
    "broadcast_from_root",
    "fit_affine",
    "measure_cost_model",
    "probe_collectives",
    "slowest_rank_times",
    "ready_note",
    "ready_from_note",
    "time_decode",
    "time_sparsifier",
]

#: Probe sizes of :func:`probe_collectives` (bytes one worker contributes).
COLLECTIVE_SIZES = (4096, 65536, 1 << 20, 4 << 20)
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


def _process_set(process_set):
    if process_set is None:
        from .core.transport import global_process_set
        return global_process_set
    return process_set


# -- collectives --------------------------------------------------------------------------
def probe_collectives(process_set=None, device="cpu", dtype=torch.float32,
                      sizes_bytes=COLLECTIVE_SIZES, repeats=5, name="ssf.probe") -> dict:
    """``g(x)`` of allreduce and allgather, measured on this rank (Cupcake §4.1).

    Collective: every rank of ``process_set`` must call it with the same arguments. For
    each size: one untimed warm-up, then ``repeats`` timed synchronous calls, each after a
    barrier so that rank skew is not counted; the median per size goes to
    :func:`fit_affine`. The calls are those the optimizer makes (op=Sum allreduce, allgather
    of one worker's ``x`` bytes) under the job's Horovod settings (cycle time, fusion
    threshold), so Horovod's own per-call latency is part of ``α``. One name per size and
    collective is reused across repeats, as a training loop reuses its names (so Horovod's
    response cache is warm, as in steady state).

    Returns ``{"allreduce": (α, β), "allgather": (α, β)}`` in seconds and seconds per byte.
    """
    from .core import transport

    ps = _process_set(process_set)
    dev = _torch_device(device)
    repeats = max(1, int(repeats))
    sizes = [int(s) for s in sizes_bytes]
    elem = torch.empty((), dtype=dtype).element_size()
    calls = {
        "allreduce": lambda t, n: transport.allreduce(t, n, op=transport.Sum, process_set=ps),
        "allgather": lambda t, n: transport.allgather(t, n, process_set=ps),
    }
    tags = {"allreduce": "ar", "allgather": "ag"}
    fits = {}
    for coll, call in calls.items():
        xs, ts = [], []
        for i, nbytes in enumerate(sizes):
            n = _numel(nbytes, dtype)
            tensor = torch.ones(n, dtype=dtype, device=dev)
            tname = f"{name}.{tags[coll]}.{i}"
            call(tensor, tname)  # warm-up: connections, buffers, response cache
            _sync(dev)
            samples = []
            for _ in range(repeats):
                transport.barrier(process_set=ps)
                start = time.perf_counter()
                call(tensor, tname)
                _sync(dev)
                samples.append(time.perf_counter() - start)
            xs.append(n * elem)
            ts.append(statistics.median(samples))
        fits[coll] = fit_affine(xs, ts, relative=True)
    return fits


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
    from .core.buffers import SparsePart
    from .plan.cost import SEGMENTED_SPARSIFIERS
    from .sparsify import make_sparsifier
    from .sparsify.memory import ResidualMemory

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
        memory.rule.density = float(density)
        grad = torch.randn(n, generator=gen).to(dtype=dtype, device=dev)

        def run(part=part, send=send, memory=memory, grad=grad):
            if part.stage.device != grad.device:  # the offload path's host staging copy
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
    from . import ops
    from .core.buffers import SparsePart, unpack
    from .plan.cost import index_size
    from .sparsify import make_sparsifier

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


# -- backward -----------------------------------------------------------------------------
class BackwardTimer:
    """Per-tensor backward time ``T_b`` and backward order from gradient-ready marks
    (SSFusion §IV-A "computation time"; §IV-B online profiling in the warm-up iterations).

    ``start_iteration()`` before a backward pass (optional), ``mark(key)`` from the
    gradient-ready hook of each tensor, ``end_iteration()`` once all are ready. On CUDA a
    mark records a timing event on the current stream (resolved at ``end_iteration``, one
    synchronize per iteration); on CPU it reads ``time.perf_counter()``. A key marked twice
    in one iteration keeps its last mark. Iterations without marks are ignored.
    """

    def __init__(self, device="cpu"):
        dev = device if isinstance(device, torch.device) else torch.device(
            "cuda" if device == "gpu" else device)
        self._cuda = dev.type == "cuda"
        self._device = dev
        self._start = None  # this iteration's start stamp (float or event)
        self._marks: dict = {}  # key -> stamp, this iteration
        self._runs: list[tuple[float | None, list[tuple[Hashable, float]]]] = []

    def _stamp(self):
        if self._cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self._device))
            return ev
        return time.perf_counter()

    def start_iteration(self) -> None:
        self._marks = {}
        self._start = self._stamp()

    def mark(self, key) -> None:
        self._marks.pop(key, None)
        self._marks[key] = self._stamp()

    def end_iteration(self) -> None:
        marks, start = self._marks, self._start
        self._marks, self._start = {}, None
        if not marks:
            return
        if self._cuda:
            for ev in marks.values():  # marks may sit on several streams
                ev.synchronize()
            if start is not None:
                start.synchronize()
            ref = start if start is not None else next(iter(marks.values()))
            times = [(k, ref.elapsed_time(ev) * 1e-3) for k, ev in marks.items()]
            t0 = 0.0 if start is not None else None
        else:
            times = list(marks.items())
            t0 = start
        times.sort(key=lambda kt: kt[1])  # stable: ties keep mark order
        self._runs.append((t0, times))

    @property
    def iterations(self) -> int:
        return len(self._runs)

    def reset(self) -> None:
        self._runs.clear()
        self._marks, self._start = {}, None

    def order(self) -> list:
        """Keys in ready order of the last recorded iteration."""
        return [k for k, _ in self._runs[-1][1]] if self._runs else []

    def ready_times(self, keys: Sequence, rows: int) -> np.ndarray:
        """``(rows, len(keys))`` float64: for each of the last ``rows`` iterations that had a
        ``start_iteration()``, every key's ready time since that start (NaN where a key was
        not marked); rows without such an iteration are NaN. Same shape on every rank, so
        the ranks' arrays can be gathered."""
        rows = max(int(rows), 0)
        out = np.full((rows, len(keys)), np.nan)
        started = [(t0, times) for t0, times in self._runs if t0 is not None]
        started = started[max(len(started) - rows, 0):] if rows else []
        col = {k: j for j, k in enumerate(keys)}
        for r, (t0, times) in enumerate(started, start=rows - len(started)):
            for k, t in times:
                if k in col:
                    out[r, col[k]] = max(t - t0, 0.0)
        return out

    def backward_times(self, keys: Iterable) -> list[float]:
        """Median over iterations of each key's ready time minus its predecessor's.

        The first key of an iteration is timed from ``start_iteration()`` when it was
        called, else it gets the median of the other keys' times of that iteration.
        Keys never marked get 0.0.
        """
        samples: dict = {}
        for t0, times in self._runs:
            deltas = [None if i == 0 else t - times[i - 1][1] for i, (_, t) in enumerate(times)]
            if t0 is not None:
                deltas[0] = max(times[0][1] - t0, 0.0)
            elif len(deltas) > 1:
                deltas[0] = statistics.median(deltas[1:])
            for (k, _), d in zip(times, deltas):
                if d is not None:
                    samples.setdefault(k, []).append(d)
        return [float(statistics.median(samples[k])) if k in samples else 0.0 for k in keys]


def slowest_rank_times(ready: np.ndarray) -> tuple[float, list[float]] | None:
    """``(forward_s, backward_s)`` as the slowest rank sets them, from every rank's
    :meth:`BackwardTimer.ready_times` gathered into ``(ranks, iterations, tensors)``, the
    tensors in backward order, each iteration timed from the end of the step before.

    A collective can start only once its last rank has submitted it, so what the planner
    must see is, per iteration, the latest rank's ready time of every gradient (on a
    loaded machine the ranks drift apart by far more than a collective's fixed cost);
    their median over iterations is the typical curve. Its first point is the time from
    the end of one step to the first gradient: the wrapped optimizer's update, the
    training loop's own code, forward, and the first gradient's backward, which is
    charged, as :meth:`BackwardTimer.backward_times` does without a start, the median of
    the other tensors' times; the rest is ``forward_s``. Returns None when no iteration
    had a start (a single warm-up step)."""
    ready = np.asarray(ready, dtype=np.float64)
    with warnings.catch_warnings():  # all-NaN slices: iterations or tensors never timed
        warnings.simplefilter("ignore", RuntimeWarning)
        typical = np.nanmedian(np.nanmax(ready, axis=0), axis=0)
    if typical.size == 0 or np.isnan(typical[0]):
        return None
    typical = np.fmax.accumulate(np.nan_to_num(typical, nan=0.0))  # never ready: no time
    backward = np.diff(typical)
    first = float(np.median(backward)) if backward.size else 0.0
    first = min(first, float(typical[0]))
    return float(typical[0]) - first, [first] + [float(b) for b in backward]


def ready_note(ready: np.ndarray) -> str:
    """The gathered ready times ``(ranks, iterations, tensors)`` as a JSON string for a
    cost model's notes (microsecond resolution; never-timed entries as null), so that a
    saved run's forward and backward estimate (:func:`slowest_rank_times`, or another
    one) can be derived again from what was measured, without rerunning it."""
    ready = np.asarray(ready, dtype=np.float64)
    rounded = np.round(ready, 6).astype(object)
    rounded[np.isnan(ready)] = None
    return json.dumps(rounded.tolist(), separators=(",", ":"))


def ready_from_note(text: str) -> np.ndarray:
    """:func:`ready_note`'s array back (null as NaN)."""
    return np.array(json.loads(text), dtype=np.float64)


# -- putting it together ------------------------------------------------------------------
def broadcast_from_root(obj, process_set=None, name="ssf.profile"):
    """The first rank's ``obj`` (global rank 0 for the global set) on every rank of
    ``process_set``, so every rank plans identically. Collective."""
    from .core import transport

    return transport.broadcast_object(obj, name, _process_set(process_set))


def measure_cost_model(backward_s, sparsifier, process_set=None, device="cpu",
                       element_size=4, density=0.01, profile=None, rule=None,
                       forward_s=0.0, grouped: bool = False) -> CostModel:
    """The :class:`CostModel` every rank plans with (Cupcake §4.1, SSFusion §IV-A).

    With ``profile`` (a :class:`CostModel` or the path of its JSON) its fits are used
    as they are, without probing and without any collective (Horovod is not touched); its
    ``backward_s`` is kept when it has ``len(backward_s)`` entries, else replaced by
    ``backward_s`` (and its ``forward_s`` by ``forward_s``). A profile without fits for
    ``sparsifier`` raises ``ValueError``.

    Otherwise (collective: every rank of ``process_set``): probes the collectives, times
    a sparse part's encode with ``sparsifier`` and the recipe's local rule (``rule``, see
    :func:`time_sparsifier`) on ``device`` (key ``"gpu"``: the gradients' device, main
    thread) and on the CPU (key ``"cpu"``, the offload path: for a CUDA job each call
    includes the device-to-host copy; on a CPU-only job it is the same CPU timing,
    measured once), times the decode, and broadcasts rank 0's model as JSON text so all
    ranks hold identical numbers.
    ``grouped``: the encode is timed under the group budget (see :func:`time_sparsifier`).
    ``sparsifier=None`` skips the sparsifier timing (dense schemes). The probe sizes are
    the module's ``COLLECTIVE_SIZES``, ``SPARSIFY_SIZES`` and ``DECODE_SIZES``, read at
    call time.
    """
    backward_s = tuple(float(b) for b in backward_s)
    if profile is not None:
        if isinstance(profile, CostModel):
            model = CostModel.from_json(profile.to_json())  # a private copy
        else:
            model = CostModel.load(profile)
            model.notes = dict(model.notes, source=str(profile))
        if len(model.backward_s) != len(backward_s):
            model = model.with_backward(backward_s)
            model.forward_s = float(forward_s)
        if sparsifier is not None and sparsifier not in model.sparsify:
            raise ValueError(
                f"profile {model.notes.get('source', '<CostModel>')!r} has no sparsification "
                f"fit for {sparsifier!r}; it has {sorted(model.sparsify)}")
        return model

    from .core import transport

    ps = _process_set(process_set)
    dev = _torch_device(device)
    comm = probe_collectives(process_set=ps, device=dev, sizes_bytes=COLLECTIVE_SIZES)
    sparsify = {}
    if sparsifier is not None:
        fit = time_sparsifier(sparsifier, device=dev, density=density,
                              sizes_bytes=SPARSIFY_SIZES, rule=rule, grouped=grouped)
        cpu_fit = fit if dev.type == "cpu" else time_sparsifier(  # one tensor per offloaded part
            sparsifier, device=dev, density=density, sizes_bytes=SPARSIFY_SIZES, rule=rule,
            stage_device="cpu")
        sparsify[sparsifier] = {"gpu": fit, "cpu": cpu_fit}
    world = ps.size() if ps.size() is not None else transport.world_size()
    decode = (time_decode(dev, world_size=int(world), density=density, sizes_bytes=DECODE_SIZES)
              if sparsifier else (0.0, 0.0))
    model = CostModel(
        world_size=int(world),
        allreduce=comm["allreduce"],
        allgather=comm["allgather"],
        sparsify=sparsify,
        backward_s=backward_s,
        element_size=int(element_size),
        forward_s=float(forward_s),
        decode=decode,
        # a CPU-only job: the offload worker's thread runs on the cores backward uses
        shared_cores=dev.type == "cpu",
        notes={
            "source": "measured",
            "device": str(dev),
            "probe_sizes": ",".join(str(s) for s in COLLECTIVE_SIZES),
            "sparsify_sizes": ",".join(str(s) for s in SPARSIFY_SIZES),
            "decode_sizes": ",".join(str(s) for s in DECODE_SIZES),
            "density": repr(float(density)),
            "encode": "group" if grouped else "per tensor",
        },
    )
    text = broadcast_from_root(model.to_json(), process_set=ps, name="ssf.profile")
    return CostModel.from_json(text)
