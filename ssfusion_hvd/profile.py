"""Live profiling for the planner: fills a :class:`~ssfusion_hvd.plan.CostModel` with numbers
measured on the running job (docs/design.md "How a plan is made").

* :func:`probe_collectives`: ``g(x) = α_g + β_g·x`` for allreduce and allgather on the real
  Horovod communicator (Cupcake §4.1: "latency per tensor" and "transfer time per byte").
* :func:`time_sparsifier`: ``h(x) = α_h + β_h·x`` of one sparsifier on one device (Cupcake
  §4.1 compression time; SSFusion §IV-A "sparsification time", timed over several sizes
  and repeats).
* :func:`time_decode`: ``d(x) = α_d + β_d·x`` of one group's decode (zero the output,
  scatter-add every rank's record), ``x`` the bytes it touches.
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

import statistics
import time
from typing import Hashable, Iterable

import numpy as np
import torch

from .plan.cost import CostModel, nominal_k

__all__ = [
    "BackwardTimer",
    "broadcast_from_root",
    "fit_affine",
    "measure_cost_model",
    "probe_collectives",
    "time_decode",
    "time_sparsifier",
]

#: Probe sizes of :func:`probe_collectives` (bytes one worker contributes).
COLLECTIVE_SIZES = (4096, 65536, 1 << 20, 4 << 20)
#: Dense input sizes (bytes) of :func:`time_sparsifier`.
SPARSIFY_SIZES = (40_000, 400_000, 4_000_000)
#: Output sizes (bytes) of :func:`time_decode`.
DECODE_SIZES = (40_000, 400_000, 4_000_000)


# -- fitting ------------------------------------------------------------------------------
def fit_affine(sizes_bytes, seconds) -> tuple[float, float]:
    """Least-squares ``(α, β)`` of ``t = α + β·x`` with ``α, β >= 0`` (Cupcake §4.1).

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
    t_mean = float(t.mean())
    if np.ptp(x) == 0.0:  # one distinct size
        if x[0] > 0:
            return 0.0, max(t_mean, 0.0) / float(x[0])
        return max(t_mean, 0.0), 0.0
    x_mean = float(x.mean())
    dx = x - x_mean
    beta = float(np.dot(dx, t - t_mean) / np.dot(dx, dx))
    alpha = t_mean - beta * x_mean
    if beta < 0.0:
        return max(t_mean, 0.0), 0.0
    if alpha < 0.0:
        sxx = float(np.dot(x, x))
        return 0.0, max(float(np.dot(x, t)) / sxx, 0.0) if sxx > 0 else 0.0
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
        fits[coll] = fit_affine(xs, ts)
    return fits


# -- sparsification -----------------------------------------------------------------------
def time_sparsifier(sparsifier: str, device="cpu", density=0.01,
                    sizes_bytes=SPARSIFY_SIZES, repeats=3, dtype=torch.float32) -> tuple[float, float]:
    """``h(x)`` of ``sparsifier`` on ``device`` (Cupcake §4.1, SSFusion §IV-A).

    Times ``select(x, k)``, ``k = ceil(density·n)``, on random normal tensors of each size
    (``x`` = dense bytes): one untimed warm-up (stateful methods reach their steady state),
    then the median of ``repeats``; CUDA is synchronized around every timed call. Local:
    no collective.
    """
    from .sparsify import make_sparsifier

    if not 0.0 < float(density) <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    return _time_select(make_sparsifier, sparsifier, _torch_device(device), float(density),
                        sizes_bytes, max(1, int(repeats)), dtype)


def _time_select(make, sparsifier, dev, density, sizes_bytes, repeats, dtype,
                 host_copy=False) -> tuple[float, float]:
    """Fits h(x); with ``host_copy`` the input lies on ``dev`` and each timed call includes
    its copy to host memory before a CPU selection (the SSFusion-O offload path)."""
    gen = torch.Generator().manual_seed(0)
    xs, ts = [], []
    for nbytes in sizes_bytes:
        n = _numel(nbytes, dtype)
        k = int(nominal_k(n, density))
        x = torch.randn(n, generator=gen).to(dtype=dtype, device=dev)
        if host_copy:
            host = torch.empty(n, dtype=dtype, pin_memory=dev.type == "cuda")

            def run(x=x, k=k, host=host, s=make(sparsifier)):
                host.copy_(x)  # device -> host (synchronous on the host side)
                return s.select(host, k)
        else:
            def run(x=x, k=k, s=make(sparsifier)):
                return s.select(x, k)
        ts.append(_median_seconds(run, dev, repeats))
        xs.append(n * x.element_size())
    return fit_affine(xs, ts)


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
    """``d(x)`` of one group's decode on ``device``: what ``SparsePart.decode`` runs for a
    tensor of each size (zero the output, then scatter-add ``world_size`` records of
    ``k = ceil(density·n)`` elements), ``x`` the bytes it touches as the simulator counts
    them (:func:`~ssfusion_hvd.plan.timeline.decode_bytes`). Local: no collective."""
    from . import ops
    from .plan.cost import index_size

    dev = _torch_device(device)
    gen = torch.Generator().manual_seed(0)
    xs, ts = [], []
    for nbytes in sizes_bytes:
        n = _numel(nbytes, dtype)
        k = int(nominal_k(n, density))
        rec = ops.record_numel(k, dtype)
        gathered = torch.zeros(world_size * rec, dtype=dtype)  # packed on the host, then moved
        for r in range(world_size):
            idx = torch.randperm(n, generator=gen)[:k].to(torch.int32)
            ops.pack(torch.randn(k, generator=gen).to(dtype), idx, gathered, r * rec)
        gathered = gathered.to(dev)
        out = torch.empty(n, dtype=dtype, device=dev)

        def run(out=out, gathered=gathered, k=k):
            out.zero_()
            ops.scatter_add_chunks(out, gathered, world_size, 0, k)

        ts.append(_median_seconds(run, dev, max(1, int(repeats))))
        es = out.element_size()
        xs.append(n * es + world_size * k * (es + index_size(n)))
    return fit_affine(xs, ts)


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


# -- putting it together ------------------------------------------------------------------
def broadcast_from_root(obj, process_set=None, name="ssf.profile"):
    """The first rank's ``obj`` (global rank 0 for the global set) on every rank of
    ``process_set``, so every rank plans identically. Collective."""
    from .core import transport

    return transport.broadcast_object(obj, name, _process_set(process_set))


def measure_cost_model(backward_s, sparsifier, process_set=None, device="cpu",
                       element_size=4, density=0.01, profile=None) -> CostModel:
    """The :class:`CostModel` every rank plans with (Cupcake §4.1, SSFusion §IV-A).

    With ``profile`` (a :class:`CostModel` or the path of its JSON) its fits are used
    as they are, without probing and without any collective (Horovod is not touched); its
    ``backward_s`` is kept when it has ``len(backward_s)`` entries, else replaced by
    ``backward_s``. A profile without fits for ``sparsifier`` raises ``ValueError``.

    Otherwise (collective: every rank of ``process_set``): probes the collectives, times
    ``sparsifier`` on ``device`` (key ``"gpu"``: the gradients' device, main thread) and
    on the CPU (key ``"cpu"``, the offload path: for a CUDA job each call includes the
    device-to-host copy; on a CPU-only job it is the same CPU timing, measured once), and
    broadcasts rank 0's model as JSON text so all ranks hold identical numbers.
    ``sparsifier=None`` skips the sparsifier timing (dense schemes). The probe sizes are
    the module's ``COLLECTIVE_SIZES`` and ``SPARSIFY_SIZES``, read at call time.
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
        if sparsifier is not None and sparsifier not in model.sparsify:
            raise ValueError(
                f"profile {model.notes.get('source', '<CostModel>')!r} has no sparsification "
                f"fit for {sparsifier!r}; it has {sorted(model.sparsify)}")
        return model

    from .core import transport
    from .sparsify import make_sparsifier

    ps = _process_set(process_set)
    dev = _torch_device(device)
    comm = probe_collectives(process_set=ps, device=dev, sizes_bytes=COLLECTIVE_SIZES)
    sparsify = {}
    if sparsifier is not None:
        fit = time_sparsifier(sparsifier, device=dev, density=density, sizes_bytes=SPARSIFY_SIZES)
        if dev.type == "cpu":
            cpu_fit = fit
        else:
            cpu_fit = _time_select(make_sparsifier, sparsifier, dev, float(density),
                                   SPARSIFY_SIZES, 3, torch.float32, host_copy=True)
        sparsify[sparsifier] = {"gpu": fit, "cpu": cpu_fit}
    world = ps.size() if ps.size() is not None else transport.world_size()
    decode = time_decode(dev, world_size=int(world), density=density) if sparsifier else (0.0, 0.0)
    model = CostModel(
        world_size=int(world),
        allreduce=comm["allreduce"],
        allgather=comm["allgather"],
        sparsify=sparsify,
        backward_s=backward_s,
        element_size=int(element_size),
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
        },
    )
    text = broadcast_from_root(model.to_json(), process_set=ps, name="ssf.profile")
    return CostModel.from_json(text)
