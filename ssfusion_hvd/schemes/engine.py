"""Phase 2 of a planned scheme: one plan's buffers and the step that runs on them.

:class:`PlannedPhase` holds what a plan allocates (fusion buffers per density stage, the
residual memory, the offload worker) and runs a step in the data-flow order of
``docs/design.md``: gradients arrive from the hooks (``submit``); when the last tensor of
a group is ready its buffers are encoded (dense part packed; sparse parts
error-compensated, selected and packed: ``core/buffers.py``) and its allgather
submitted; its allreduce part (SSFusion-I) leaves earlier, as soon as the last of *its*
tensors is ready. Group after group, communication overlaps the rest of backward. Offloaded
tensors (SSFusion-O) go to the :class:`~ssfusion_hvd.core.offload.OffloadWorker` as soon
as *they* are ready; it submits the group's allgather once its selections are packed.
``finish`` waits in plan order and decodes into ``p.grad`` (``core/buffers.unpack``: sum of
dense chunks, scaled by ``op`` and copied; sparse records scatter-added and the positions
they touch written, scaled, into the zeroed gradients).

Scaling follows Horovod: the sender multiplies by ``1 / gradient_predivide_factor`` and
the receiver by ``factor / P`` for Average (1 for Sum); the allreduce part leaves both to
Horovod's own pre/postscale.
"""
from __future__ import annotations

import functools
import json
import time
import zlib
from concurrent.futures import Future
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..core.buffers import (DensePart, GroupBuffers, SparsePart, build_group, fresh_table,
                            nonfinite_count, unpack)
from ..core.layout import views
from ..core.offload import OffloadWorker
from ..core.stats import StepStats
from ..core import wire
from ..core.transport import Transport
from ..plan import Plan

__all__ = ["PlannedPhase", "SPARSE_DTYPES"]

#: gradient dtypes a plan can carry (bfloat16 through Transport: raw words, float32 sums)
SPARSE_DTYPES = wire.SPARSE_GRAD_DTYPES


class PlannedPhase:
    """Synchronization by ``plan`` (see the module docstring). ``params`` are the
    parameters in plan order; ``sparsifier_for(key)`` gives the sparsifier of a tensor
    (key: its name) or of a fusion buffer (key: its part's)."""

    def __init__(self, plan: Plan, params: Sequence[torch.Tensor], config, transport: Transport,
                 sparsifier_for: Callable, iteration: int, name: str, waits: int = 0,
                 key: Optional[bool] = None, spread: bool = False):
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ValueError(f"scheme {name!r} needs every gradient in one dtype on one "
                             f"device, got {sorted(map(str, kinds))}; use scheme='dense'")
        self.dtype, self.device = next(iter(kinds))
        if self.dtype not in SPARSE_DTYPES:
            raise ValueError(f"scheme {name!r} supports float32, float16 and bfloat16 "
                             f"gradients, got {self.dtype}; use scheme='dense'")
        self.plan = plan
        #: the checksum of the plan and of its stage in force (:meth:`enter_stage`), which
        #: the step's agreement compares across ranks (``PlannedScheme.signature``)
        self.crc = 0
        self.config, self.transport = config, transport
        self.params = list(params)
        self._pos = {p: i for i, p in enumerate(self.params)}
        self._group_of = plan.group_of()
        self.sparse_set = frozenset(p for p, sp in zip(self.params, plan.sparse) if sp)
        self._elements = sum(plan.sizes)
        self._dense_elements = sum(n for n, sp in zip(plan.sizes, plan.sparse) if not sp)
        # build_group asks for (part key, plan index or None for a whole buffer)
        self._sparsifier_for = lambda key, i: sparsifier_for(key if i is None else plan.names[i])
        self._prescale, self._postscale = transport.scales()
        self.memory = config.recipe.make_memory(self.dtype)
        # each sender's wait on the wire, for the shared moments (docs/design.md, "Each
        # sender's wait"): the decode computes `waits` shares, its tables follow the rule
        # and hyper-parameters in force (_set_fresh)
        self._waits = waits
        # each sender's spread on the wire, for the shared Adam rule's second moment
        # (docs/recipe.md, "The senders' variance")
        self._spread = spread
        # select each exact top-k part by its pending steps in the optimizer's geometry
        # (Recipe.step_scales; docs/recipe.md, "Selecting by the step"): None (by
        # magnitude), or the key's root (True: by the gain, False: by the step)
        self._key = key
        self._fresh: Optional[tuple] = None  # (rule, hyper-parameters, their tables)
        #: per sparsified parameter whose wire carried the senders' waits, the shares of
        #: what arrived in the last decode, (rows, *shape) (the shared moments' step reads them)
        self.shares: Dict[torch.Tensor, torch.Tensor] = {}
        #: per sparsified parameter whose wire carried the senders' spreads, the noise
        #: ratio of what arrived in the last decode, shaped like it
        self.noise: Dict[torch.Tensor, torch.Tensor] = {}
        self.primed = False
        self._worker: Optional[OffloadWorker] = None
        self._stage: Optional[int] = None
        self.groups: List[GroupBuffers] = []
        self.enter_stage(iteration)
        # scheme="auto": which scheme's plan this is and why (plan.choose_plan)
        self.auto = ({"scheme_chosen": plan.scheme,
                      "predicted_s": json.loads(plan.notes["predicted_s"])}
                     if plan.notes.get("chosen_by") == "auto" and "predicted_s" in plan.notes
                     else {})

    # ------------------------------------------------------------------ buffers
    def enter_stage(self, iteration: int) -> None:
        """Buffers for the density in force at step ``iteration`` (density warm-up,
        ``ssfusion_hvd/recipe.py``): allocated once per stage, same parts and keys in
        every stage, so residuals and the local rule's state carry over."""
        recipe = self.config.recipe
        stage = recipe.stage(iteration)
        if stage == self._stage:
            return
        self._stage = stage
        self.active = active = self.plan.at_density(recipe.stage_density(stage))
        # The stage's k shape every record: ranks that agree on the plan but scale it
        # differently (another release of Plan.at_density) must fail the agreement, not
        # decode each other's records at the wrong offsets; and two plans may scale to one
        # stage, so the plan's own checksum stays in.
        self.crc = zlib.crc32(active.to_json().encode(), zlib.crc32(self.plan.to_json().encode()))
        self.memory.set_density(active.density)
        offload = any(active.offload)
        shapes = [p.shape for p in self.params]
        self.groups = [build_group(gi, active, shapes, self.dtype, self.device,
                                   self._sparsifier_for,
                                   offload_device=torch.device("cpu") if offload else None,
                                   acc_dtype=self.memory.acc_dtype(self.dtype),
                                   waits=self._waits, spread=self._spread)
                       for gi in range(len(active.groups))]
        self._sparse = [part for gb in self.groups for part in gb.parts
                        if isinstance(part, SparsePart)]
        # this stage's share views; :attr:`shares` moves to them at the stage's first decode
        # (the scheme enters the next stage before step() has read the last one's)
        self._stage_shares = {self.params[i]: view for part in self._sparse if part.waits
                              for i, view in zip(part.tensors, part.share_views)}
        self._stage_noise = {self.params[i]: view for part in self._sparse if part.spread
                             for i, view in zip(part.tensors, part.noise_views)}
        for part in self._sparse:
            self.memory.register(part.key, [active.names[i] for i in part.tensors],
                                 [shapes[i] for i in part.tensors], part.stage_device)
            if self._key is not None and recipe.selects_by_step:
                part.step_scales = functools.partial(
                    self._step_scales, [self.params[i] for i in part.tensors])
        self._offload_part = {part.tensors[0]: part for gb in self.groups for part in gb.offloaded}
        if offload and self._worker is None:
            self._worker = OffloadWorker(self.device)
        self.reset()

    def _step_scales(self, params):
        # the recipe in force: a broadcast that replaces the hyper-parameters re-resolves it
        return self.config.recipe.step_scales(params, root=self._key)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def settle(self) -> None:
        """Returns once the offload worker has run everything queued (nothing to wait for
        without one, or after ``finish()``)."""
        if self._worker is not None:
            self._worker.settle()

    # ------------------------------------------------------------------ submit
    def _grad(self, i: int) -> torch.Tensor:
        p = self.params[i]
        if p.grad.is_sparse:  # sparse schemes send sparse gradients densely
            p.grad = p.grad.to_dense()
        return p.grad

    def submit(self, p: torch.Tensor) -> None:
        if self._t_first is None:
            self._t_first = time.perf_counter()
            if not self.primed:
                # the local rules take over the wrapped optimizer's state here, on this
                # thread, after its last dense step (not on the offload worker)
                for part in self._sparse:  # (the rule reads the device and dtype only)
                    self.memory.prime(part.key, torch.empty(0, dtype=part.acc_dtype,
                                                            device=part.stage_device))
                self.primed = True
        i = self._pos[p]
        if i in self._offload_part:
            self._worker.start(self._offload_part[i], self._grad(i), self.memory)
        gi = self._group_of[i]
        gb = self.groups[gi]
        if i in gb.allreduce_set:
            self._ar_ready[gi] += 1
            if self._ar_ready[gi] == len(gb.allreduce):  # the allreduce part leaves now
                self._launch_allreduce(gb)
        self._ready[gi] += 1
        if self._ready[gi] == len(gb.tensors):
            self._launch(gb)

    def _launch_allreduce(self, gb: GroupBuffers) -> None:
        cfg, tr = self.config, self.transport
        torch.cat([self._grad(i).reshape(-1) for i in gb.allreduce], out=gb.ar_buf)
        compressed, ctx = cfg.compression.compress(gb.ar_buf)
        pre, post = tr.horovod_scales()
        self._ar_pending[gb.index] = (
            tr.allreduce(compressed, f"{gb.index}.ar", prescale=pre, postscale=post), ctx)

    def _launch(self, gb: GroupBuffers) -> None:
        """The group is complete: encode and select what rides its allgather, submit it."""
        t0 = time.perf_counter()
        for part in gb.parts:
            if isinstance(part, DensePart):
                part.encode([self._grad(i) for i in part.tensors], gb.send, self._prescale)
            elif part not in gb.offloaded:
                result = part.select_grads(self.memory, [self._grad(i) for i in part.tensors])
                part.pack(result, gb.send, self._prescale)
                self._results[part.key] = result
        self._sparsify_s += time.perf_counter() - t0
        if gb.offloaded:  # the worker packs its selections, then submits (FIFO: plan order)
            ag = self._worker.then(self._submit_offloaded_group, gb)
        else:
            ag = self._allgather(gb)
        self._pending[gb.index] = (self._ar_pending.pop(gb.index, None), ag)

    def _allgather(self, gb: GroupBuffers):
        return None if gb.send is None else self.transport.allgather(gb.send, f"{gb.index}.ag")

    def _submit_offloaded_group(self, gb: GroupBuffers):  # on the worker thread
        for part in gb.offloaded:
            result = self._worker.result(part.key)
            part.pack(result, gb.send, self._prescale)
            self._results[part.key] = result
        if gb.send.is_cuda:
            torch.cuda.current_stream(gb.send.device).synchronize()
        return self._allgather(gb)

    # ------------------------------------------------------------------ finish
    def finish(self, iteration: int) -> StepStats:
        """Waits, decodes into ``p.grad``; returns the step's stats (``iteration``: the
        number of steps done, this one included)."""
        t_wait = time.perf_counter()
        cfg, tr = self.config, self.transport
        outputs = []
        if self._waits:
            self._set_fresh()
        for gb in self.groups:
            ar, ag = self._pending[gb.index]
            if isinstance(ag, Future):
                ag = ag.result()
            if ar is not None:
                out = cfg.compression.decompress(tr.wait(ar[0]), ar[1])
                outs = gb.ar_views if out is gb.ar_buf else views(
                    out, [self.params[i].shape for i in gb.allreduce])
                torch._foreach_copy_([self.params[i].grad for i in gb.allreduce], outs)
                outputs.append(out)
            if ag is not None:
                gathered = tr.wait(ag)
                nranks = gathered.numel() // gb.record_len
                for part in gb.parts:
                    outputs.append(unpack(part, gathered, nranks, gb.record_len,
                                          [self.params[i].grad for i in part.tensors],
                                          self._postscale))
        self.shares = self._stage_shares
        self.noise = self._stage_noise
        stats = self._stats(iteration, outputs).timed(self._t_first, t_wait, time.perf_counter())
        self.reset()
        return stats

    def _set_fresh(self) -> None:
        """The decode's share tables for the rule and hyper-parameters the shared moments
        step with now (a broadcast may have replaced them since the parts were built)."""
        recipe = self.config.recipe
        key = (recipe.kind, sorted(recipe.hparams.items()))
        if self._fresh is None or self._fresh[:2] != key:
            self._fresh = (*key, fresh_table(recipe.kind, recipe.hparams, self.device))
        for part in self._sparse:
            part.fresh = self._fresh[2]

    def _stats(self, iteration: int, outputs) -> StepStats:
        results = [self._results[part.key] for part in self._sparse]
        sent = self._dense_elements + sum(r.values.numel() for r in results)
        missing = [part.missing(r) for part, r in zip(self._sparse, results)]

        def nonfinite():  # passes over the dense outputs: taken when stats() is read
            return sum(nonfinite_count(o) for o in outputs)

        return StepStats(
            phase="planned", iteration=iteration,
            allreduce_bytes=self.transport.sent["allreduce"],
            allgather_bytes=self.transport.sent["allgather"],
            tensors_dense=len(self.params) - len(self.sparse_set),
            tensors_sparse=len(self.sparse_set),
            elements=self._elements, elements_sent=sent, density_target=self.active.density,
            tensors_missing=missing, nonfinite=nonfinite, sparsify_s=self._sparsify_s,
            offload_s=self._worker.seconds if self._worker is not None else 0.0,
            extra=dict(self.auto))

    def pending(self) -> bool:
        return any(self._ready) or any(self._ar_ready) or bool(self._pending or self._ar_pending)

    def reset(self) -> None:
        self._ready = [0] * len(self.groups)
        self._ar_ready = [0] * len(self.groups)
        self._ar_pending: Dict[int, tuple] = {}
        self._pending: Dict[int, tuple] = {}
        self._results: Dict[str, object] = {}
        if self._worker is not None:
            self._worker.reset()
        self._t_first = None
        self._sparsify_s = 0.0
        self.transport.reset_counters()
