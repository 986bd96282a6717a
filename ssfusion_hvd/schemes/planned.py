"""Every planned sparse scheme (per-tensor, multi-tensor, the SSFusion family): a state
object that runs one of two phases.

1. :class:`~ssfusion_hvd.schemes.warmup.WarmupPhase`: the first ``warmup_steps``
   iterations synchronize densely and are measured; then rank 0 builds the plan of this
   scheme (``ssfusion_hvd.plan.build_plan``) from the measured cost model and broadcasts
   it, so every rank submits the same collectives in the same order. A plan given as
   ``plan=`` skips this phase.
2. :class:`~ssfusion_hvd.schemes.engine.PlannedPhase`: the plan's buffers and the step.

What outlives a phase lives here: the iteration count, the plan's sparsifier instances
(one per tensor or fusion buffer for the whole run: their state is part of checkpoints),
the cost model, the transport. A subclass only gives its name, which is its planner's.
"""
from __future__ import annotations

import copy
import dataclasses
import sys
import zlib
from typing import Dict, Optional

import torch

from ..core.transport import Transport, elastic
from ..moments import SHARE_ROWS
from ..plan import CostModel, Plan, build_plan
from ..sparsify import make_sparsifier
from .base import SELECT_BY, SPREAD, Option, Scheme, SyncConfig, carries_spread, selection_key
from .engine import PlannedPhase
from .warmup import WarmupPhase

__all__ = ["PlannedScheme", "WAITS_MIN_RANKS"]

#: ``waits="auto"`` carries the senders' waits from this many ranks on, per optimizer
#: family. SGD: with 2 ranks the union's age and each sender's differ little (neutral on
#: six 2-worker cells, at 8 % more bytes); with 4 the union's age is about a quarter of
#: each value's wait (GRU +4.2 points, MLP +1.2; docs/recipe.md "Whose wait"); the replica
#: gained at 3 and 8 too. Adam, from 3 ranks too: on 2 workers the GRU gained 4.0 points
#: over 5 seeds and the MLP lost 0.3, but the LM's perplexity rose on 2 seeds of 3 (17.3
#: and 16.7 against 13.9 and 14.2); on 4 workers, with the selection by the pending step,
#: the GRU gained 19.4 points, the MLP 2.4 and the LM's perplexity fell from 19.15 to
#: 16.00 (2 seeds; docs/results/accuracy_bystep_adam.md).
WAITS_MIN_RANKS = {"sgd": 3, "adam": 3}


def _print_plan(plan: Plan, auto: dict) -> None:
    """The plan's table on rank 0's stderr (``log_plan``), and for ``auto`` which scheme's
    plan it runs and the simulated alternatives."""
    print(plan.table(), file=sys.stderr, flush=True)
    if auto:
        ranked = sorted(auto["predicted_s"].items(), key=lambda kv: kv[1])
        print(f"[ssfusion_hvd] scheme='auto' runs {plan.scheme}; simulated ms per iteration "
              "on the measured cost model: "
              + ", ".join(f"{s} {1e3 * t:.2f}" for s, t in ranked), file=sys.stderr, flush=True)


def _load(obj, cls):
    return cls.load(obj) if isinstance(obj, (str, bytes)) or hasattr(obj, "__fspath__") else obj


class PlannedScheme(Scheme):
    """Base of the planned schemes: ``name`` is also the planner's
    (``ssfusion_hvd.plan.PLANNERS``)."""

    name = "planned"
    options = {
        # each sparse entry carries its sender's wait (1 byte), for the shared moments;
        # "auto": from WAITS_MIN_RANKS ranks on (docs/results.md §2b: with 4 workers better
        # for SGD and Adam; with 2 neutral for SGD at 8 % more bytes, worse on Adam's LM)
        "waits": Option("auto", lambda v: isinstance(v, bool) or v == "auto",
                        "'auto', True or False"),
        # each sparse entry carries its sender's spread (1 byte), for the shared Adam
        # rule's second moment
        "spread": SPREAD,
        "select_by": SELECT_BY,
    }

    def __init__(self, config: SyncConfig):
        super().__init__(config)
        # (allgather and alltoall names per step: Transport, on hvd.join())
        self.transport = Transport(config, "ssf", step=lambda: self._iteration)
        self._trainable = [p for p in config.order if p.requires_grad]
        self._by_name = {config.names[p]: p for p in self._trainable}
        dev = {p.device for p in self._trainable}
        self._device = next(iter(dev)) if len(dev) == 1 else torch.device("cpu")
        self._iteration = 0
        self.cost: Optional[CostModel] = None
        self._sparsifiers: Dict[str, object] = {}
        self._last_sparse = frozenset()
        self._warmup = WarmupPhase(config, self._trainable, self._device)
        self._engine: Optional[PlannedPhase] = None
        if config.plan is not None:
            text = _load(config.plan, Plan).to_json()
            if not elastic():
                # rank 0's plan everywhere; under elastic no collective here (a joining
                # rank builds this while the others train): every rank hands its own,
                # and the per-step agreement (the checksum of the plan and its stage)
                # raises on every rank if they differ
                text = self.transport.broadcast_object(text, "plan")
            self._adopt(Plan.from_json(text))

    @property
    def plan(self) -> Optional[Plan]:
        """The plan at the target density (None during the warm-up)."""
        return None if self._engine is None else self._engine.plan

    @property
    def _phase(self):
        return self._warmup if self._engine is None else self._engine

    # ------------------------------------------------------------------ plan
    def _adopt(self, plan: Plan) -> None:
        """Checks ``plan`` against the model and starts its phase (buffers once per plan)."""
        missing = sorted(set(self._by_name) - set(plan.names))
        unknown = sorted(set(plan.names) - set(self._by_name))
        if missing or unknown:
            raise ValueError(f"plan does not match the model: parameters not in the plan "
                             f"{missing[:5]}, plan tensors not in the model {unknown[:5]}")
        params = [self._by_name[n] for n in plan.names]
        for p, n in zip(params, plan.sizes):
            if p.numel() != n:
                raise ValueError(f"plan says {self.config.names[p]!r} has {n} elements, "
                                 f"the model has {p.numel()}")
        self.close()
        self._sparsifiers = {}
        self._engine = PlannedPhase(plan, params, self.config, self.transport,
                                    self._sparsifier_for, self._iteration, self.name,
                                    waits=self._carries_waits(),
                                    key=selection_key(self.opts["select_by"]),
                                    spread=self._carries_spread())
        if self.config.log_plan and self.transport.rank == 0:
            _print_plan(plan, self._engine.auto)

    def _carries_waits(self) -> int:
        """How many shares the decode computes from the senders' waits on the wire
        (``moments.SHARE_ROWS`` of the optimizer's family), 0 if the entries carry none:
        ``scheme_options["waits"]`` (True, or "auto": ``WAITS_MIN_RANKS``) under
        ``moments="shared"`` (the only rule that reads them). It shapes the allgather, so
        it is decided from what every rank agrees on (the options, the optimizer's class
        and the ``moments`` argument: ``check_same_model``'s setup; the process set's size),
        not from hyper-parameters a broadcast may still replace (an SGD without momentum
        carries them unread)."""
        recipe = self.config.recipe
        rows = SHARE_ROWS.get(recipe.family, 0)
        wanted = self.opts["waits"]
        if wanted == "auto":
            # the process set's size: the same on every rank, and remade with the plan
            # when an elastic reset changes it
            least = WAITS_MIN_RANKS.get(recipe.family)
            wanted = least is not None and self.transport.size >= least
        return rows if wanted and (recipe.options or {}).get("moments") == "shared" else 0

    def _carries_spread(self) -> bool:
        return carries_spread(self.config, self.opts["spread"])

    def _sparsifier_for(self, key: str):
        """The sparsifier of a tensor (its name) or a fusion buffer (its part key): one
        instance for the whole run of a plan. Random-k's and DGC's seeds come from the key:
        the same on every rank, different between tensors."""
        if key not in self._sparsifiers:
            seeded = self.config.sparsifier in ("randomk", "dgc")
            kwargs = {"seed": zlib.crc32(key.encode())} if seeded else {}
            self._sparsifiers[key] = make_sparsifier(self.config.sparsifier, **kwargs)
        return self._sparsifiers[key]

    def _make_plan(self) -> None:
        """End of warm-up: measure, plan on rank 0, broadcast (all ranks call this together)."""
        cfg = self.config
        order, self.cost = self._warmup.measure()
        extra = bool(self._carries_waits()) + self._carries_spread()
        if extra:
            # the plan prices the wire it will run on: a byte more per sparse entry for
            # each of the wait and the spread
            self.cost = dataclasses.replace(self.cost, entry_extra=extra)
        text = None
        if self.transport.rank == 0:
            text = build_plan(self.name, [p.numel() for p in order], self.cost, cfg.density,
                              names=[cfg.names[p] for p in order], sparsifier=cfg.sparsifier,
                              min_k=self.opts.get("min_k", 0),
                              group_floor=self.opts.get("floor"),
                              accuracy_slack=self.opts.get("slack", 0.0)).to_json()
        self._adopt(Plan.from_json(self.transport.broadcast_object(text, "plan")))

    # ------------------------------------------------------------------ step
    def sparsifies(self, p: torch.Tensor) -> bool:
        return self._engine is not None and p in self._engine.sparse_set

    def sparse_params(self) -> frozenset:
        return self._last_sparse

    def shares(self) -> dict:
        return {} if self._engine is None or not self._last_sparse else self._engine.shares

    def noise(self) -> dict:
        return {} if self._engine is None or not self._last_sparse else self._engine.noise

    def submit(self, p: torch.Tensor) -> None:
        self._phase.submit(p)

    def finish(self) -> None:
        phase = self._phase
        self.last_stats = phase.finish(self._iteration + 1)
        if not self.keep_step():
            return  # undone (the optimizer rolls it back): it counts nowhere
        self._iteration += 1
        if phase is self._warmup:
            self._last_sparse = frozenset()
            if self._iteration >= self.config.warmup_steps:
                self._make_plan()
        else:
            self._last_sparse = phase.sparse_set
            phase.enter_stage(self._iteration)

    def pending(self) -> bool:
        return self._warmup.pending() or (self._engine is not None and self._engine.pending())

    def reset(self) -> None:
        self._warmup.reset()
        if self._engine is not None:
            self._engine.reset()

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()

    def rollback(self) -> None:
        if self._engine is not None:  # a step abandoned mid-way: its selections end first
            self._engine.settle()
        super().rollback()

    def memories(self) -> list:
        return [] if self._engine is None else [self._engine.memory]

    # ------------------------------------------------------------------ state
    def _step_state(self) -> dict:
        return {"iteration": self._iteration, "last_sparse": self._last_sparse,
                "primed": self._engine is not None and self._engine.primed,
                "sparsifiers": {k: copy.deepcopy(s.state_dict())
                                for k, s in self._sparsifiers.items()}}

    def _restore_step_state(self, saved: dict) -> None:
        self._iteration, self._last_sparse = saved["iteration"], saved["last_sparse"]
        if self._engine is not None:
            self._engine.primed = saved["primed"]
            self._engine.enter_stage(self._iteration)
        for key, st in saved["sparsifiers"].items():
            if key in self._sparsifiers:
                self._sparsifiers[key].load_state_dict(st)

    def signature(self):
        return (self._iteration, 0 if self._engine is None else self._engine.crc)

    def shared_state(self) -> dict:
        return {"iteration": self._iteration,
                "plan": None if self.plan is None else self.plan.to_json(),
                "sparsifiers": {k: s.state_dict() for k, s in self._sparsifiers.items()
                                if s.state_dict()}}

    def state_dict(self) -> dict:
        """The plan, the iteration count, residuals and the recipe's local state per
        parameter name, and sparsifier state. Residuals differ per rank: every rank saves
        its own."""
        state = self.shared_state()
        state.update(self._engine.memory.named_state() if self._engine is not None
                     else {"residuals": {}})
        return state

    def adopt_shared(self, shared: dict, keep_local: bool, all_keep: bool) -> None:
        if not keep_local:  # the root's plan and step; residuals and rule state from zero
            self.reset()
            self.load_state_dict(dict(shared, residuals={}))

    def load_state_dict(self, state: dict) -> None:
        self._iteration = int(state["iteration"])
        if state["plan"] is None:
            self.close()
            self._engine = None
            self._last_sparse = frozenset()
            self._warmup = WarmupPhase(self.config, self._trainable, self._device)
            return
        self._adopt(Plan.from_json(state["plan"]))
        self._engine.memory.load_named_state(state, self._device)
        for key, s in state["sparsifiers"].items():
            self._sparsifiers[key].load_state_dict(s)
