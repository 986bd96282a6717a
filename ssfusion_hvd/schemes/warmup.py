"""Phase 1 of a planned scheme: dense steps, measured (SSFusion §IV-B, "online profiling").

The first ``warmup_steps`` iterations synchronize as the ``dense`` scheme does, except
that the gradients are sent once backward is over: a
:class:`~ssfusion_hvd.profile.BackwardTimer` records when each gradient becomes ready,
from the end of the step before, and on a CPU-only job a dense allreduce running beside
backward would take its cores and inflate every time the plan is made from. The ranks'
times are gathered so that the plan sees the slowest rank's
(``profile.slowest_rank_times``). :meth:`WarmupPhase.measure` then fills the cost model
(collective probes and sparsifier timings, or a saved profile) that rank 0 plans with.
"""
from __future__ import annotations

import dataclasses
from typing import List, Sequence, Tuple

import torch

from .. import profile as _profile
from ..core import transport
from ..core.stats import StepStats
from ..plan import CostModel
from .dense import DenseScheme

__all__ = ["WarmupPhase", "READY_NOTE"]

#: the cost model's note holding the warm-up's gathered ready times
#: (``profile.ready_note``), so a saved run can be re-planned or its estimate re-derived
READY_NOTE = "warmup_ready_s"


class WarmupPhase:
    """Dense synchronization of ``trainable`` while the backward pass is timed."""

    def __init__(self, config, trainable: Sequence[torch.Tensor], device: torch.device):
        self.config = config
        self.trainable = list(trainable)
        self.device = device
        # Horovod's allreduce has no options of its own: the planned scheme's are not its
        self.dense = DenseScheme(dataclasses.replace(config, options={}))
        self.timer = _profile.BackwardTimer(device=device)
        self._held: List[torch.Tensor] = []  # this step's ready gradients, in ready order

    def submit(self, p: torch.Tensor) -> None:
        self.timer.mark(p)
        self._held.append(p)

    def finish(self, iteration: int) -> StepStats:
        self.timer.end_iteration()
        for p in self._held:  # sent after backward, so that no collective shares its time
            self.dense.submit(p)
        self._held = []
        self.dense.finish()
        self.timer.start_iteration()  # the next iteration is timed from this step's end
        st = self.dense.last_stats
        st.phase, st.iteration, st.density_target = "warmup", iteration, 1.0
        return st

    def pending(self) -> bool:
        return bool(self._held) or self.dense.pending()

    def reset(self) -> None:
        self._held = []
        self.dense.reset()

    def measure(self) -> Tuple[List[torch.Tensor], CostModel]:
        """The gradients in the order they became ready (never-ready ones last) and the
        measured cost model, identical on every rank. Collective."""
        cfg = self.config
        order = self.timer.order()
        seen = set(order)
        order += [p for p in self.trainable if p not in seen]  # never ready: unused layers
        forward_s, backward_s, ready = self._slowest_rank(order)
        es = order[0].element_size() if order else 4
        cost = _profile.measure_cost_model(
            backward_s, cfg.sparsifier, cfg.process_set, device=self.device.type,
            element_size=es, density=cfg.density, profile=cfg.profile,
            rule=cfg.recipe.make_rule, forward_s=forward_s,
            grouped=cfg.options.get("floor") is not None)
        if ready is not None:  # the same gathered array on every rank
            cost.notes[READY_NOTE] = _profile.ready_note(ready)
        return order, cost

    def _slowest_rank(self, order: List[torch.Tensor]):
        """Forward and per-tensor backward times, in ``order``, of the slowest rank
        (``profile.slowest_rank_times``), and the gathered ready times they came from
        (``(ranks, steps, tensors)`` in ``order``; None when no step was timed). Every
        rank's ready times are gathered in the canonical parameter order (the same on
        every rank), one row per warm-up step. Collective; without a timed iteration, this
        rank's own backward times."""
        ready = self.timer.ready_times(self.trainable, rows=self.config.warmup_steps)
        gathered = transport.allgather(torch.from_numpy(ready)[None], "ssf.profile.ready",
                                       process_set=self.config.process_set).numpy()
        column = {p: j for j, p in enumerate(self.trainable)}
        ordered = gathered[:, :, [column[p] for p in order]]
        found = _profile.slowest_rank_times(ordered)
        if found is None:
            return 0.0, self.timer.backward_times(order), None
        return found[0], found[1], ordered
