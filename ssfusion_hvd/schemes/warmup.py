"""Phase 1 of a planned scheme: dense steps, measured (SSFusion §IV-B, "online profiling").

The first ``warmup_steps`` iterations synchronize exactly as the ``dense`` scheme does
while a :class:`~ssfusion_hvd.profile.BackwardTimer` records when each gradient becomes
ready. :meth:`WarmupPhase.measure` then fills the cost model (collective probes and
sparsifier timings, or a saved profile) that rank 0 plans with.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from .. import profile as _profile
from ..core.stats import StepStats
from ..plan import CostModel
from .dense import DenseScheme

__all__ = ["WarmupPhase"]


class WarmupPhase:
    """Dense synchronization of ``trainable`` while the backward pass is timed."""

    def __init__(self, config, trainable: Sequence[torch.Tensor], device: torch.device):
        self.config = config
        self.trainable = list(trainable)
        self.device = device
        self.dense = DenseScheme(config)
        self.timer = _profile.BackwardTimer(device=device)

    def submit(self, p: torch.Tensor) -> None:
        self.timer.mark(p)
        self.dense.submit(p)

    def finish(self, iteration: int) -> StepStats:
        self.dense.finish()
        self.timer.end_iteration()
        st = self.dense.last_stats
        st.phase, st.iteration, st.density_target = "warmup", iteration, 1.0
        return st

    def pending(self) -> bool:
        return self.dense.pending()

    def reset(self) -> None:
        self.dense.reset()

    def measure(self) -> Tuple[List[torch.Tensor], CostModel]:
        """The gradients in the order they became ready (never-ready ones last) and the
        measured cost model, identical on every rank. Collective."""
        cfg = self.config
        order = self.timer.order()
        seen = set(order)
        order += [p for p in self.trainable if p not in seen]  # never ready: unused layers
        backward_s = self.timer.backward_times(order)
        es = order[0].element_size() if order else 4
        cost = _profile.measure_cost_model(
            backward_s, cfg.sparsifier, cfg.process_set, device=self.device.type,
            element_size=es, density=cfg.density, profile=cfg.profile)
        return order, cost
