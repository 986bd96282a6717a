"""SparDL over Horovod: :class:`SparDLScheme` serves :func:`~.algorithm.run_rank`'s requests
with the scheme's :class:`~ssfusion_hvd.core.transport.Transport` (a :class:`~.algorithm.Send`
is a point-to-point ``send``, a :class:`~.algorithm.Gather` an ``allgather``); messages
travel as bytes. See the package docstring for the algorithm."""
from __future__ import annotations

import copy

import time
import warnings
from typing import Optional

import torch

from ... import ops
from ...core.transport import Sum
from ...core.wire import noise_ratio, noise_shares
from ..base import SELECT_BY, SPREAD, Option, SyncConfig, carries_spread, is_int
from ..whole import WholeGradientScheme
from .algorithm import BSAGState, Gather, Layout, RankResult, output_scale, run_rank

__all__ = ["SparDLScheme"]


class SparDLScheme(WholeGradientScheme):
    """SparDL over Horovod (see the package docstring)."""

    name = "spardl"
    prefix = "spardl"
    options = {"teams": Option(1, is_int(1), "a positive int dividing the number of workers"),
               # every selection (blocks, the own block, the merges' cuts) by the pending
               # step under Adam with shared moments, as the planned schemes' top-k
               "select_by": SELECT_BY,
               # the ranks' gradient variance at the delivered elements, for the shared
               # Adam rule's second moment (docs/recipe.md, "The senders' variance")
               "spread": SPREAD}

    def __init__(self, config: SyncConfig):
        super().__init__(config)
        if config.sparsifier != "topk":
            warnings.warn(f"scheme 'spardl' selects by exact top-k (the paper's operator); "
                          f"sparsifier={config.sparsifier!r} is ignored")
        self._nranks, self._rank = self.transport.size, self.transport.rank
        # the optimizer checks that every rank passes the same options
        self._teams = self.opts["teams"]
        self.layout = None
        self._set_layout()  # raises ValueError (on every rank) when teams do not divide P
        self._scale = output_scale(self.transport.averages, self._nranks)
        # the gradients gathered back to back, read by the error feedback: allocated once
        # (a new tensor each step cost page faults over the whole model every step)
        self._flat = torch.empty(self.flat.numel, dtype=self._dtype, device=self._device)
        self._scratch = None  # run_rank's working copy and output, allocated at the first step
        # An arrival here is a merge of partial sums, some of them dropped on the way and
        # kept by another rank, so no rank's value is its own sum over its own wait: each
        # rank keeps its gradient's sum and sum of squares since an element was last
        # delivered, and at a delivery the ranks' variances over that window are summed by
        # one small allreduce over the delivered elements (the same on every rank)
        self.spread = carries_spread(config, self.opts["spread"])
        self._noise = (torch.zeros(self.flat.numel, dtype=torch.float32, device=self._device)
                       if self.spread else None)
        self._noise_views = (dict(zip(self._trainable, self.flat.views(self._noise)))
                             if self.spread else {})
        self.reset()

    def _set_layout(self) -> None:
        """The layout of the density in force (density warm-up changes it per stage).
        Values travel in the accumulation dtype: relays add partial sums, which float16
        would round at every hop."""
        density = self._density()
        if self.layout is not None and self.layout.density == density:
            return
        self.layout = Layout(self.flat.numel, self._nranks, self._teams, density,
                             self._acc_dtype())
        self._bsag = self._initial_bsag() if self.layout.sag == "bsag" else None

    def _initial_bsag(self) -> BSAGState:
        return BSAGState.initial(self.layout, self.layout.pos_of(self._rank))

    # ------------------------------------------------------------------ submit

    def _launch(self) -> None:
        self._set_layout()
        flat = self._flat_grad(out=self._flat)
        if self.spread:  # this step's gradients into the window's sums
            self._memory.add_squares(self._KEY, [flat], sums=True)
        acc = self._memory.compensate(self._KEY, flat)
        if self._scratch is None or self._scratch[0].dtype != acc.dtype:
            self._scratch = (torch.empty_like(acc), torch.empty_like(acc))
        den, scales = None, self._step_scales()
        if scales is not None:
            if self._den is None:
                self._den = torch.empty(acc.numel(), dtype=torch.float32, device=acc.device)
            den = ops.step_denominator(scales.exp_avg_sqs, scales.bias2_sqrt, scales.eps, self._den,
                                       root=scales.root)
        self._gen = run_rank(self.layout, self._rank, acc, self._bsag, self._scratch, den)
        self._advance(None)

    def _advance(self, reply) -> None:
        """Runs this rank's algorithm up to its next request and submits it (async)."""
        t0 = time.perf_counter()
        try:
            req = self._gen.send(reply)
        except StopIteration as stop:
            self._result, self._gen, self._handle = stop.value, None, None
            self._sparsify_s += time.perf_counter() - t0
            return
        self._sparsify_s += time.perf_counter() - t0
        self._collectives += 1
        payload = req.payload.view(torch.uint8)  # bytes: Horovod has no bfloat16 collectives
        if isinstance(req, Gather):
            self._handle = (self.transport.allgather(payload, req.name), None)
        else:
            self._handle = (self.transport.send(payload, req.target, req.name), req.source)

    def _receive(self) -> torch.Tensor:
        """The reply to the pending request, in the layout's value dtype."""
        handle, source = self._handle
        out = self.transport.wait(handle)
        if source is not None:  # a point-to-point step: data from ``source`` only
            out, received = out
            if int(received.sum()) != int(received[source]):
                raise RuntimeError(f"spardl: data from ranks other than {source}: "
                                   f"{received.tolist()}")
        return out.view(self.layout.dtype)

    def finish(self) -> None:
        if self._submitted == 0 and self._gen is None and self._result is None:
            return  # nothing was submitted (no trainable parameters)
        if self._submitted < len(self._trainable):
            raise RuntimeError(f"spardl: finish() after {self._submitted} of "
                               f"{len(self._trainable)} gradients were submitted")
        t_wait = time.perf_counter()
        while self._gen is not None:
            self._advance(self._receive())
        result = self._result
        flat = result.delivered
        if self._scale != 1.0:
            flat.mul_(self._scale)
        if self.spread:
            self._window_noise(result.final, flat)
        self._deliver(flat)
        self._memory.set_residual(self._KEY, result.residual, result.final)
        t_end = time.perf_counter()
        self._finished()
        self._record_stats(result, flat, t_wait, t_end)
        self.reset()

    def _record_stats(self, result: RankResult, flat: torch.Tensor, t_wait, t_end) -> None:
        lay = self.layout
        self.last_stats = self._step_stats(
            t_wait, t_end, allgather_bytes=sum(result.bytes.values()),
            allreduce_bytes=self.transport.sent["allreduce"],  # (the spread's variances)
            elements_sent=result.elements_sent, density_target=lay.density,
            tensors_missing=self.flat.missing(result.final),
            # only the delivered entries can be non-finite (the rest is 0): count those
            nonfinite=torch.isfinite(flat.index_select(0, result.final.long())).logical_not_().sum(),
            sparsify_s=self._sparsify_s,
            extra={"teams": lay.teams, "sag": lay.sag, "srs_steps": lay.steps,
                   "collectives": self._collectives, "block_k": lay.L, "k": lay.k,
                   "srs_bytes": result.bytes["srs"], "sag_bytes": result.bytes["sag"],
                   "gather_bytes": result.bytes["gather"],
                   "delivered": int(result.final.numel()),
                   "bsag_h": result.h, "bsag_count": result.count})

    def _window_noise(self, final: torch.Tensor, flat: torch.Tensor) -> None:
        """The noise ratio at the delivered elements ``final`` (the same on every rank):
        the synchronized gradient is ``c·Σ_r g_r`` (``c`` its scale), whose variance per
        step is ``c²·Σ_r σ_r²``, over the delivered value ``flat`` squared; ``σ_r²`` each
        rank's gradient variance over the steps since the element was last delivered
        (``ResidualMemory.window_variances``). Every rank holds the delivered values and
        the shared moments' ages, so each sends its variance as a float16 share against
        the value's rate per step squared (``wire.noise_shares``, ``_noise_against``) and
        an allreduce sums them."""
        idx = final.long()
        var = self._memory.window_variances(self._KEY, final,
                                            self._memory.sent_waits(self._KEY, final))
        value = flat.index_select(0, idx)
        against = self._noise_against(idx, value)
        shares = noise_shares(var, against, self._scale, self._nranks)
        self._noise[idx] = noise_ratio(
            self.transport.wait(self.transport.allreduce(shares, "var", op=Sum)), against, value)

    def noise(self) -> dict:
        return self._noise_views if self._last_sparse else {}

    def pending(self) -> bool:
        return self._submitted > 0 or self._gen is not None

    def reset(self) -> None:
        super().reset()
        self._gen = self._handle = None
        self._result: Optional[RankResult] = None
        self._collectives = 0

    # ------------------------------------------------------------------ state
    def _step_state(self) -> dict:
        # a layout is never changed once built (a new density builds a new one)
        return {**super()._step_state(), "layout": self.layout,
                "bsag": copy.deepcopy(self._bsag)}

    def _restore_step_state(self, saved: dict) -> None:
        super()._restore_step_state(saved)
        self.layout, self._bsag = saved["layout"], saved["bsag"]

    def shared_state(self) -> dict:
        return {"iteration": self._iteration, "teams": self.layout.teams}

    def adopt_shared(self, shared: dict, keep_local: bool, all_keep: bool) -> None:
        super().adopt_shared(shared, keep_local, all_keep)
        self._set_layout()
        if not all_keep and self._bsag is not None:
            # Algorithm 2's state is shared by a position group; a rank that starts from
            # zero would leave its group: every rank restarts it
            self._bsag = self._initial_bsag()

    def state_dict(self) -> dict:
        """Residuals and local rule state per parameter name (they differ per rank: every
        rank saves its own), the iteration count, the team count and Algorithm 2's state
        (B-SAG)."""
        return {"iteration": self._iteration, "teams": self.layout.teams,
                **self._memory_state(),
                "bsag": None if self._bsag is None else self._bsag.as_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.reset()
        self._iteration = int(state["iteration"])
        self._load_memory_state(state)
        self._set_layout()
        if self._bsag is not None:
            if state.get("bsag") is not None and int(state.get("teams", 0)) == self.layout.teams:
                self._bsag = BSAGState(**state["bsag"])
            else:
                self._bsag = self._initial_bsag()
