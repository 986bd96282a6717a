"""The collective step of the data flow: the one module, besides ``optimizer.py``, that
calls Horovod (``docs/design.md``, "Transport").

Two levels:

* free functions for the few blocking collectives of set-up and profiling
  (:func:`allgather_bytes`, :func:`broadcast_object`, :func:`root_rank`,
  :func:`allreduce`, :func:`allgather`, :func:`barrier`), on a process set;
* :class:`Transport`: one scheme instance's asynchronous collectives. It owns the name
  tag (``"<prefix><n>"``, ``n`` counted per prefix: schemes are created in the same order
  on every rank, so the names match), counts the bytes this rank sends per collective,
  and knows the ``op`` scaling of a sum over the ranks (:meth:`Transport.scales`).

Handles are Horovod's; :meth:`Transport.wait` returns the output (``hvd.synchronize``,
after sleeping rather than spinning until the handle is done: see :data:`POLL_MAX_S`).

bfloat16: Horovod 0.28.1 reduces and gathers no bfloat16 tensor. :class:`Transport`
allgathers one as its raw 16-bit words (``int16``: the same bytes), and allreduces one
through a float32 copy whose sum is rounded back into it once, at the end (twice the
bytes of a bfloat16 allreduce, and a sum that does not round at every hop; an allgather
of the words and a local sum would cost P/2 times the bytes).
Horovod is imported when this module is (``import ssfusion_hvd`` alone does not).
"""
from __future__ import annotations

import collections
import itertools
import os
import re
import sys
import threading
import time
from contextlib import contextmanager
from typing import Optional, Sequence

import torch
from horovod.common.util import split_list
import horovod.torch.functions as _hvd_functions
from horovod.torch import mpi_ops as _mpi
from horovod.torch.mpi_ops import Average, Max, Min, Sum, global_process_set

__all__ = ["Transport", "allgather_bytes", "broadcast_object", "root_rank", "allreduce",
           "allgather", "barrier", "split_list", "Average", "Sum", "Max", "Min",
           "global_process_set", "op_scales", "gated", "done",
           "in_broadcast_optimizer_state"]

#: Horovod's ``synchronize`` waits by spinning on ``sched_yield``. Where ranks share cores
#: (several ranks per host on a CPU job, or the offload worker beside backward) the ranks
#: that wait take the cores from the rank still computing, the one they all wait for
#: (``docs/design.md``, "Transport", has the measurement). :meth:`Transport.wait` polls
#: instead, sleeping from ``POLL_FIRST_S`` doubling up to ``POLL_MAX_S``, the most it adds
#: to a wait.
POLL_FIRST_S, POLL_MAX_S = 20e-6, 5e-4

#: cores a rank needs to itself before its waits spin: its own thread, Horovod's
#: background thread (and an offload worker's, which mostly waits on copies)
CORES_PER_SPINNING_RANK = 2


def _spin() -> bool:
    """Whether this rank's waits may spin (Horovod's ``synchronize``) rather than sleep
    between polls: when the host has the cores for every local rank, nobody's core is
    taken by a waiting rank, and sleeping only adds up to :data:`POLL_MAX_S` to each wait,
    latency a GPU step should not pay (the lent GPU machines: 16 cores, 2-4 ranks). Decided
    once, from what the job shares: the local ranks and this process's usable cores."""
    global _SPIN
    if _SPIN is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cores = os.cpu_count() or 1
        _SPIN = _mpi.local_size() * CORES_PER_SPINNING_RANK <= cores
    return _SPIN


_SPIN = None

#: per thread, what every :meth:`Transport.wait` asks first (:func:`gated`)
_GATE = threading.local()


@contextmanager
def _thread_setting(key: str, value):
    before = getattr(_GATE, key, None)
    setattr(_GATE, key, value)
    try:
        yield
    finally:
        setattr(_GATE, key, before)


def gated(gate):
    """Within: every :meth:`Transport.wait` of this thread first calls ``gate(handle)``,
    which returns once that collective may be waited on (the optimizer's step agreement:
    ``agreement.StepAgreement.gate``)."""
    return _thread_setting("fn", gate)


def _inner(handle):
    return handle.handle if isinstance(handle, (_Widened, _Viewed)) else handle


def done(handle) -> bool:
    """Whether ``handle``'s collective has completed (it may then be waited on without
    blocking). False for a handle Horovod cannot poll (a sparse allreduce's function)."""
    inner = _inner(handle)
    return isinstance(inner, int) and (inner not in _mpi._handle_map or _mpi.poll(inner))


def pause_between_polls(pause: float) -> float:
    """Waits between two polls as :meth:`Transport.wait` does (nothing but a yield where
    waits may spin, :func:`_spin`); returns the next pause."""
    if _spin():
        os.sched_yield()
        return pause
    time.sleep(pause)
    return min(2.0 * pause, POLL_MAX_S)

#: per-prefix instance counters: the n-th scheme of a kind gets tag "<prefix><n>" on every rank
_COUNTERS = collections.defaultdict(itertools.count)


@contextmanager
def numbered_as(tag: Optional[str]):
    """Transports created inside take ``tag``'s number for its prefix (``None``: the next
    number as usual). A scheme rebuilt for a new world (Horovod elastic) keeps the names
    it had: a rank that joined numbered its transports from scratch, in the same order as
    the ranks that rebuild, so their names match."""
    m = re.fullmatch(r"(.*?)(\d+)", tag) if tag else None
    if m is None:
        yield
        return
    prefix, n = m.group(1), int(m.group(2))
    saved = _COUNTERS.get(prefix)
    _COUNTERS[prefix] = itertools.count(n)
    try:
        yield
    finally:
        if saved is None:
            _COUNTERS.pop(prefix, None)
        else:
            _COUNTERS[prefix] = saved


def elastic() -> bool:
    """Whether this is a Horovod elastic worker (``horovodrun`` sets ``HOROVOD_ELASTIC``).
    There a rank that joins builds its optimizer while the others are past theirs, so
    nothing built at construction may run a collective."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def in_broadcast_optimizer_state() -> bool:
    """Whether Horovod's ``broadcast_optimizer_state`` runs in this thread, whatever lies
    between it and the caller (step wrappers, ``torch.compile``, a helper a later Horovod
    moves its ``step()`` call into): the stack is searched for its code object. Asked only
    where a step comes without a gradient and in ``state_dict()``, never per step."""
    code = _hvd_functions.broadcast_optimizer_state.__code__
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is code:
            return True
        f = f.f_back
    return False


def _ps(process_set):
    return global_process_set if process_set is None else process_set


def op_scales(op, predivide: float, size: int) -> tuple:
    """``(sender prescale, receiver postscale)`` of a sum over ``size`` ranks, as Horovod
    scales an allreduce: Average is ``1/f`` before the sum and ``f/P`` after it
    (``f = gradient_predivide_factor``); Sum scales nothing."""
    if op == Average:
        return 1.0 / predivide, predivide / size
    return 1.0, 1.0


# ----------------------------------------------------------------------- blocking helpers
def allreduce(tensor: torch.Tensor, name: str, op=Sum, process_set=None) -> torch.Tensor:
    return _mpi.allreduce(tensor, name=name, op=op, process_set=_ps(process_set))


def allgather(tensor: torch.Tensor, name: str, process_set=None) -> torch.Tensor:
    return _mpi.allgather(tensor, name=name, process_set=_ps(process_set))


def barrier(process_set=None) -> None:
    _mpi.barrier(process_set=_ps(process_set))


def root_rank(process_set=None) -> int:
    """Global rank of the process set's first member (Horovod's broadcast takes global
    ranks). Collective for a set whose ranks are not known locally."""
    ps = _ps(process_set)
    if ps.ranks:
        return int(min(ps.ranks))
    me = torch.tensor([_mpi.rank()], dtype=torch.int64)
    return int(allreduce(me, "ssf.root", op=Min, process_set=ps))


def broadcast_object(obj, name: str, process_set=None):
    """The first rank's ``obj`` on every rank of ``process_set``. Collective."""
    ps = _ps(process_set)
    return _hvd_functions.broadcast_object(obj, root_rank=root_rank(ps), name=name, process_set=ps)


def allgather_bytes(payload: bytes, name: str, process_set=None) -> list:
    """One bytes object per rank of ``process_set`` (in its rank order), by one allgather:
    Horovod's allgather takes a different first dimension per rank, so each rank's
    payload travels prefixed by its length and the concatenation is cut apart."""
    header = len(payload).to_bytes(8, "little")
    data = torch.frombuffer(bytearray(header + payload), dtype=torch.uint8)
    gathered = allgather(data, name, process_set).numpy().tobytes()
    out, pos = [], 0
    while pos < len(gathered):
        size = int.from_bytes(gathered[pos:pos + 8], "little")
        out.append(gathered[pos + 8:pos + 8 + size])
        pos += 8 + size
    return out


def world_size() -> int:
    return _mpi.size()


class _Widened:
    """A bfloat16 allreduce in flight: Horovod's handle of the float32 copies, and the
    tensors the sums go back into (one, or a group's list)."""

    __slots__ = ("handle", "targets", "grouped")

    def __init__(self, handle, targets, grouped: bool):
        self.handle, self.targets, self.grouped = handle, targets, grouped

    def output(self, out):
        if not self.grouped:
            return self.targets.copy_(out)
        for t, o in zip(self.targets, out):
            t.copy_(o)
        return list(self.targets)


class _Viewed:
    """A bfloat16 allgather in flight as raw 16-bit words: viewed back when done."""

    __slots__ = ("handle",)

    def __init__(self, handle):
        self.handle = handle

    @staticmethod
    def output(out):
        return out.view(torch.bfloat16)


def _horovod_dtype(t: torch.Tensor) -> bool:
    return t.dtype != torch.bfloat16


# ----------------------------------------------------------------------- per scheme
class Transport:
    """A scheme's asynchronous collectives on ``config.process_set`` (see the module
    docstring). ``sent`` counts the bytes this rank handed to each kind of collective
    since :meth:`reset_counters`.

    ``step``: a scheme's step counter (a callable, read at each launch). Given, the names
    of its allgathers and alltoalls carry the step: ``"<tag>.<suffix>@<step>"``. Horovod
    caches a collective's response by name, and a rank that called ``hvd.join()`` takes
    part in every cached collective the others launch: a cached allreduce it feeds with
    zeros, as designed, but a cached allgather or alltoall crashes it (a segfault, or
    "Trying to overwrite cached response" and a shut-down Horovod; Horovod 0.28.1,
    ``Controller::ComputeResponseList``). An uncached one gets Horovod's error on every
    rank instead. A scheme launches these before its step's agreement is read
    (``agreement.py``), beside a joined rank whenever the data are uneven, so none of
    them may ever be a cache hit: a name is used for one step only. (Every rank names a
    step alike when their steps agree; when they do not, the names differ, nothing
    matches, and the agreement, read before any such wait, raises.)"""

    def __init__(self, config, prefix: str, counted: bool = True, step=None):
        self.config = config
        self.step = step
        self.process_set = config.process_set
        # counted=False: the prefix alone (names then depend on nothing created before)
        self.tag = f"{prefix}{next(_COUNTERS[prefix])}" if counted else prefix
        self.op = config.op
        self.predivide = config.gradient_predivide_factor
        self.rank = self.process_set.rank()
        self.size = self.process_set.size()
        self.sent = {"allreduce": 0, "allgather": 0, "alltoall": 0}

    @property
    def averages(self) -> bool:
        return self.op == Average

    def scales(self) -> tuple:
        """``(prescale, postscale)`` of a sum this scheme computes itself (allgather
        decode, SparDL, ZEN): see :func:`op_scales`."""
        return op_scales(self.op, self.predivide, self.size)

    def horovod_scales(self) -> tuple:
        """``(prescale, postscale)`` handed to Horovod's own Average allreduce (its backend
        divides by the size itself)."""
        if self.op == Average:
            return 1.0 / self.predivide, self.predivide
        return 1.0, 1.0

    def name(self, suffix) -> str:
        return f"{self.tag}.{suffix}"

    def _step_name(self, suffix) -> str:
        """The name of an allgather or alltoall: one step's only (see the class docstring)."""
        return self.name(suffix) if self.step is None else f"{self.name(suffix)}@{self.step()}"

    def reset_counters(self) -> None:
        for k in self.sent:
            self.sent[k] = 0

    @staticmethod
    def _nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- collectives (asynchronous; wait() returns the output) --------------------------
    def allreduce(self, tensor: torch.Tensor, suffix, *, op=None, prescale: float = 1.0,
                  postscale: float = 1.0):
        """In-place allreduce of ``tensor`` (dense; Horovod scales by pre/postscale)."""
        wide = tensor if _horovod_dtype(tensor) else tensor.float()
        self.sent["allreduce"] += self._nbytes([wide])
        handle = _mpi.allreduce_async_(wide, name=self.name(suffix),
                                       op=self.op if op is None else op,
                                       prescale_factor=prescale, postscale_factor=postscale,
                                       process_set=self.process_set)
        return handle if wide is tensor else _Widened(handle, tensor, False)

    def grouped_allreduce(self, tensors: Sequence[torch.Tensor], suffix):
        tensors = list(tensors)
        wide = [t if _horovod_dtype(t) else t.float() for t in tensors]
        self.sent["allreduce"] += self._nbytes(wide)
        handle = _mpi.grouped_allreduce_async_(wide, name=self.name(suffix), op=self.op,
                                               process_set=self.process_set)
        if all(w is t for w, t in zip(wide, tensors)):
            return handle
        return _Widened(handle, tensors, True)

    def sparse_allreduce(self, tensor: torch.Tensor, suffix):
        """A torch sparse gradient (Horovod allgathers its indices and values)."""
        self.sent["allreduce"] += tensor._nnz() * tensor.element_size()
        return _mpi.sparse_allreduce_async(tensor, name=self.name(suffix), op=self.op,
                                           process_set=self.process_set)

    def allgather(self, tensor: torch.Tensor, suffix):
        self.sent["allgather"] += self._nbytes([tensor])
        if _horovod_dtype(tensor):
            return _mpi.allgather_async(tensor, name=self._step_name(suffix),
                                        process_set=self.process_set)
        return _Viewed(_mpi.allgather_async(tensor.view(torch.int16),
                                            name=self._step_name(suffix),
                                            process_set=self.process_set))

    def alltoall(self, tensor: torch.Tensor, splits: torch.Tensor, suffix):
        """Rows ``splits[r]`` of ``tensor`` go to rank ``r``; ``wait`` returns
        ``(received, received_splits)``."""
        self.sent["alltoall"] += self._nbytes([tensor])
        return _mpi.alltoall_async(tensor, splits=splits, name=self._step_name(suffix),
                                   process_set=self.process_set)

    def send(self, payload: torch.Tensor, target: int, suffix):
        """A point-to-point send to ``target`` (and a receive from whoever sends to this
        rank under the same name): an alltoall whose splits name one peer."""
        splits = torch.zeros(self.size, dtype=torch.int32)
        splits[target] = payload.numel()
        return self.alltoall(payload, splits, suffix)

    def broadcast_object(self, obj, suffix):
        """Blocking: the first rank's ``obj`` on every rank."""
        return broadcast_object(obj, self.name(suffix), self.process_set)

    @staticmethod
    def wait(handle):
        """The output of ``handle``'s collective, once done; sleeps between polls
        (:data:`POLL_MAX_S`) where the local ranks share cores, else lets Horovod spin
        (:func:`_spin`). A sparse allreduce's handle (Horovod's function) is waited by
        Horovod. A bfloat16 collective's output is bfloat16 again (see the module docstring).
        A handle waited a second time gives None, as ``hvd.synchronize`` does."""
        gate = getattr(_GATE, "fn", None)
        if gate is not None:
            gate(handle)
        inner = _inner(handle)
        if isinstance(inner, int) and inner not in _mpi._handle_map:
            return None  # waited already: None, as Horovod's synchronize returns
        if isinstance(inner, int) and not _spin():
            pause = POLL_FIRST_S
            while not _mpi.poll(inner):
                pause = pause_between_polls(pause)
        out = _mpi.synchronize(inner)
        return out if inner is handle else handle.output(out)

