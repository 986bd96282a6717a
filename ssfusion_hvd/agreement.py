"""The step's agreement and the ranks' non-finite flags: one owner for the one small
allreduce a synchronized step makes of its own.

*Why an agreement.* A checkpoint loaded on some ranks only, a rank a step ahead, or a rank
that called ``hvd.join()`` would make the schemes' collectives differ between ranks, and
Horovod would wait for ever. Every sparse step therefore compares the scheme's
``signature()`` (iteration, plan checksum) across the ranks, under a name that is the same
whatever state a rank is in, and every rank raises the same :class:`RanksDisagree`
instead of hanging.

*Why the flags ride in it.* A stateful step is a transaction (the optimizer undoes it on
every rank when any rank's gradients are not finite), so it allreduces each rank's
non-finite flag anyway; the signature travels beside it: no collective for the check alone.

*When.* Once the step's last gradient is in, after the scheme's first collectives (the
planned schemes' left during backward, the whole-gradient schemes' with the last gradient). Every
wait of a scheme goes through :meth:`StepAgreement.gate`, so nothing that may never
complete (a collective beside a rank that disagrees or has joined) is waited on before
the agreement is read: the check adds no collective of its own. The collectives a scheme
launches before it may meet a rank that called ``hvd.join()``: an allreduce runs there
(the joined rank adds zeros), an allgather or alltoall gets Horovod's error, provided its
name is one step's only (``Transport``'s ``step``; a cached one crashes the joined rank).
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from .core import transport
from .core.transport import Max, Transport

__all__ = ["RanksDisagree", "StepAgreement", "nonfinite_flag"]


class RanksDisagree(RuntimeError):
    """Raised on every rank of the process set, before any of the step's collectives, when
    the step's agreement finds its ranks at different points (iteration, plan) or one of
    them joined (``hvd.join()``) where the scheme cannot run beside it."""


def nonfinite_flag(tensors) -> torch.Tensor:
    """A one-element int32 tensor on the tensors' device: 1 when any element of
    ``tensors`` is NaN or infinite. One pass: their float32 L2 norms (``_foreach_norm``, a
    fused kernel on the GPU, the fastest reduction here on the CPU: 0.1 s for 124M
    elements where a max-abs or ``isfinite`` pass took 1-3 s), no host read. A NaN or Inf
    makes its tensor's norm non-finite; so does a finite tensor whose norm exceeds
    float32's range (about 1.8e19), a gradient no run survives anyway."""
    dense = [t._values() if t.is_sparse else t for t in tensors]
    norms = torch._foreach_norm(dense, 2, dtype=torch.float32)
    return torch.stack(norms).isfinite().all().logical_not().to(torch.int32).reshape(1)


class StepAgreement:
    """One step's agreement and flags, from the first gradient to the keep decision.

    ``params``: the parameters whose gradients the flags cover (read when sent);
    ``scheme_name``: for the errors. ``enabled`` is False only in a measuring run
    (``examples/bench.py --agreement off``): without it a rank gone astray hangs the job."""

    def __init__(self, transport_: Optional[Transport], params: Sequence[torch.Tensor],
                 scheme_name: str):
        self.transport = transport_
        self.params = params
        self.scheme_name = scheme_name
        self.enabled = True
        self.blocked_s = 0.0  # seconds the last step blocked reading it (stats())
        self.reset()

    def reset(self) -> None:
        """Forgets the step in flight (a checkpoint load, a rebuilt scheme)."""
        self._due = None  # True: this step's agreement is due; False: none; None: undecided
        self._handle = None  # the agreement, sent and not yet read
        self._flags = None  # the flags' own allreduce, where the agreement does not carry them
        self._flags_read = None  # the ranks' flags, read from the agreement

    def _grads(self) -> list:
        return [p.grad for p in self.params if p.grad is not None]

    # ------------------------------------------------------------------ a step
    def start(self, scheme) -> None:
        """With the step's first gradient: whether the step has an agreement to make
        (the scheme has a ``signature()``)."""
        if self._due is not None:
            return
        self._due = self.enabled and scheme.signature() is not None
        self.blocked_s = 0.0

    def send(self, scheme) -> None:
        """The agreement (unless sent or not due): the signature's values and their
        negatives, with ``Max``, so every rank learns their minimum and maximum; a last
        entry of 1 tells a rank that called ``hvd.join()`` apart (Horovod runs the
        allreduce on the ranks still stepping with zeros for the joined ones, so its
        minimum comes back 0); then this rank's non-finite flag. On the gradients'
        device, so the flag is not read back before the collective."""
        if self._due is not True or self._handle is not None:
            return
        vals = [int(v) for v in scheme.signature()] + [1]
        t = torch.tensor(vals + [-v for v in vals], dtype=torch.int64)
        grads = self._grads()
        flag = (nonfinite_flag(grads) if grads and scheme.stateful
                else torch.zeros(1, dtype=torch.int32))
        t = torch.cat([t.to(flag.device), flag.to(torch.int64)])
        self._handle = self.transport.allreduce(t, "step", op=Max)

    def send_flags(self, scheme) -> None:
        """After the step's last submission: the ranks' non-finite flags, in the
        agreement where one is due, else by their own allreduce. A rank's NaN can
        hide from the synchronized gradients (a threshold never selects it, a partition
        not its own never sends it); it would then stay in its residual for ever."""
        self.send(scheme)
        if self._handle is not None or self._flags_read is not None:
            return  # the agreement carries them (or carried them)
        grads = self._grads()
        if scheme.stateful and grads:
            self._flags = self.transport.allreduce(nonfinite_flag(grads), "finite", op=Max)

    def gate(self, handle) -> None:
        """Before a scheme waits on one of the step's collectives (``transport.gated``):
        returns once that collective has completed, or once the agreement is read
        (raising where the ranks disagree). A collective that completed may be waited on
        and decoded whatever the agreement says (an error it causes gives way to the
        agreement's); one that has not may never complete on ranks that disagree, and is
        waited on only after the agreement says they do not. So decoding overlaps the
        later groups' collectives, as without an agreement."""
        if self._handle is None:
            return
        pause = transport.POLL_FIRST_S
        while not transport.done(handle):
            if transport.done(self._handle):
                self.read()
                return
            pause = transport.pause_between_polls(pause)

    def read(self, scheme=None) -> None:
        """Reads the agreement (sending it first where ``scheme`` is given and it is due
        and not yet sent); raises the same :class:`RanksDisagree` on every rank where the
        ranks disagree. Nothing where it was read."""
        if scheme is not None:
            self.send(scheme)
        handle, self._handle = self._handle, None
        self._due = None  # read (or none): the next step's first gradient decides anew
        if handle is None:
            return
        t0 = time.perf_counter()
        out = self.transport.wait(handle).tolist()
        self.blocked_s = time.perf_counter() - t0
        self._flags_read = out.pop()
        n = len(out) // 2
        hi, lo = out[:n], [-v for v in out[n:]]
        if lo[-1] == 0:
            raise RanksDisagree(
                f"ssfusion_hvd: a rank of the process set called hvd.join() while this rank "
                f"still steps (ranks with different numbers of batches). Scheme "
                f"{self.scheme_name!r} sends its sparse records by allgather or alltoall, "
                f"which Horovod does not run with joined ranks. Give every rank the same "
                f"number of steps (e.g. shards of equal length: "
                f"DistributedSampler(drop_last=True), or stop every rank at the smallest "
                f"count, agreed by hvd.allreduce(op=hvd.Min)), or "
                f"use scheme='dense', which runs with hvd.join() as Horovod's optimizer does. "
                f"This rank's step did not update the parameters; call hvd.join() to end it.")
        if hi != lo:
            raise RanksDisagree(
                f"ssfusion_hvd: the ranks of the process set are at different points of "
                f"scheme {self.scheme_name!r} (iteration from {lo[0]} to {hi[0]}"
                f"{', different plans or optimizer states' if lo[1] != hi[1] else ''}): their collectives cannot "
                f"match. A checkpoint loaded on some ranks only must be followed by "
                f"hvd.broadcast_optimizer_state(optimizer, root_rank) on every rank "
                f"(docs/horovod.md, \"Checkpoint and resume\"), and every rank must call "
                f"step() equally often.")

    def any_nonfinite(self, scheme) -> bool:
        """Once the synchronized gradients are in ``p.grad``: whether any rank's own
        gradients or the synchronized ones hold NaN or Inf. The same answer on every rank
        (the flags are summed by an allreduce, the synchronized gradients are the same
        everywhere). Reads the agreement first; one host read."""
        self.read(scheme)
        handle, self._flags = self._flags, None
        known, self._flags_read = self._flags_read, None
        if handle is None and known is None:
            return False
        out = nonfinite_flag(self._grads())
        ranks = (torch.tensor([known], dtype=out.dtype) if known is not None
                 else self.transport.wait(handle))
        return any(torch.cat([ranks.to(out.device), out]).tolist())
