"""Per-tensor backward times and backward order from the gradient-ready hooks
(:class:`BackwardTimer`), and the slowest rank's curve the planner sees
(:func:`slowest_rank_times`), kept in a cost model's notes (:func:`ready_note`)."""
from __future__ import annotations

import json
import statistics
import time
import warnings
from typing import Hashable, Iterable, Sequence

import numpy as np
import torch

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
