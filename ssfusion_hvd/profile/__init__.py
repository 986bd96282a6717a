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

import statistics
import time

import torch

from ..plan.cost import CostModel
from .backward import BackwardTimer, ready_from_note, ready_note, slowest_rank_times
from .timing import (ALLGATHER_CURVE_SIZES, COLLECTIVE_SIZES, DECODE_SIZES, SPARSIFY_SIZES,
                     _numel, _sync,
                     _torch_device, fit_affine, time_decode, time_sparsifier)

__all__ = [
    "BackwardTimer",
    "broadcast_from_root",
    "fit_affine",
    "measure_cost_model",
    "probe_collectives",
    "slowest_rank_times",
    "time_collectives",
    "ready_note",
    "ready_from_note",
    "time_decode",
    "time_sparsifier",
]


def _process_set(process_set):
    if process_set is None:
        from ..core.transport import global_process_set
        return global_process_set
    return process_set


# -- collectives --------------------------------------------------------------------------
def probe_collectives(process_set=None, device="cpu", dtype=torch.float32,
                      sizes_bytes=COLLECTIVE_SIZES, repeats=5, name="ssf.probe",
                      curve_sizes=()) -> dict:
    """``g(x)`` of allreduce and allgather, measured on this rank (Cupcake §4.1).

    Collective: every rank of ``process_set`` must call it with the same arguments. For
    each size: one untimed warm-up, then ``repeats`` timed synchronous calls, each after a
    barrier so that rank skew is not counted; the median per size goes to
    :func:`fit_affine`. The calls are those the optimizer makes (op=Sum allreduce, allgather
    of one worker's ``x`` bytes) under the job's Horovod settings (cycle time, fusion
    threshold), so Horovod's own per-call latency is part of ``α``. One name per size and
    collective is reused across repeats, as a training loop reuses its names (so Horovod's
    response cache is warm, as in steady state).

    Returns ``{"allreduce": (α, β), "allgather": (α, β)}`` in seconds and seconds per byte,
    and ``"allgather_curve"``: the allgather's ``(x, median)`` at every size, those of
    ``curve_sizes`` included (they are timed for the curve, not fitted).
    """
    from ..core import transport

    ps = _process_set(process_set)
    calls = {
        "allreduce": lambda t, n: transport.allreduce(t, n, op=transport.Sum, process_set=ps),
        "allgather": lambda t, n: transport.allgather(t, n, process_set=ps),
    }
    return time_collectives(calls, lambda: transport.barrier(process_set=ps), device, dtype,
                            sizes_bytes, repeats, name, curve_sizes)


def time_collectives(calls, barrier, device="cpu", dtype=torch.float32,
                     sizes_bytes=COLLECTIVE_SIZES, repeats=5, name="ssf.probe",
                     curve_sizes=()) -> dict:
    """:func:`probe_collectives`'s measurement on any communicator: ``calls`` maps
    ``"allreduce"`` and ``"allgather"`` to ``call(tensor, name)``, which makes that
    collective of ``tensor`` (one worker's share for the allgather) and returns once it is
    done on this rank; ``barrier()`` lines the ranks up before each timed call. Collective:
    every rank calls it with the same arguments. Same result as :func:`probe_collectives`."""
    dev = _torch_device(device)
    repeats = max(1, int(repeats))
    sizes = [int(s) for s in sizes_bytes]
    elem = torch.empty((), dtype=dtype).element_size()
    tags = {"allreduce": "ar", "allgather": "ag"}
    fits = {}
    curve = []
    for coll in ("allreduce", "allgather"):
        call = calls[coll]
        xs, ts = [], []
        extra = [int(c) for c in curve_sizes] if coll == "allgather" else []
        for i, nbytes in enumerate(sizes + extra):
            n = _numel(nbytes, dtype)
            tensor = torch.ones(n, dtype=dtype, device=dev)
            tname = f"{name}.{tags[coll]}.{i}"
            call(tensor, tname)  # warm-up: connections, buffers, response cache
            _sync(dev)
            samples = []
            for _ in range(repeats):
                barrier()
                start = time.perf_counter()
                call(tensor, tname)
                _sync(dev)
                samples.append(time.perf_counter() - start)
            xs.append(n * elem)
            ts.append(statistics.median(samples))
        fits[coll] = fit_affine(xs[:len(sizes)], ts[:len(sizes)], relative=True)
        if coll == "allgather":
            curve = list(zip(xs, ts))
    fits["allgather_curve"] = tuple(curve)
    return fits


# -- putting it together ------------------------------------------------------------------
def broadcast_from_root(obj, process_set=None, name="ssf.profile"):
    """The first rank's ``obj`` (global rank 0 for the global set) on every rank of
    ``process_set``, so every rank plans identically. Collective."""
    from ..core import transport

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

    from ..core import transport

    ps = _process_set(process_set)
    dev = _torch_device(device)
    comm = probe_collectives(process_set=ps, device=dev, sizes_bytes=COLLECTIVE_SIZES,
                             curve_sizes=ALLGATHER_CURVE_SIZES)
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
        allgather_curve=comm["allgather_curve"],
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
