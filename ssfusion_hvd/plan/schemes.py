"""Plan builders, one per synchronization scheme.

==============  ==========================================================================
``dense``       Horovod: dense allreduce of groups packed up to the fusion threshold in
                backward order (threshold 0: one allreduce per tensor).
``per_tensor``  every tensor sparsified on its own (``k = ceil(density · n)``), one
                allgather per tensor; no tensor missing (SSFusion §III-A).
``multi_tensor`` Cupcake: optimal fusion (§4.2), one top-k per fusion buffer with
                ``k = ceil(density · buffer elements)``, allgather; tensors may go missing.
``ssfusion``    groups by optimal fusion of per-tensor sparsified tensors (SSFusion §IV-B
                Step-1), selective sparsification (Eq. 2) and density-aware compensation;
                Horovod's dense buckets where the plan is predicted slower than them.
``ssfusion_o``  ``ssfusion`` plus sparsification offloading (SSFusion-O, §IV-C).
``ssfusion_i``  the same groups split into allreduce/allgather parts (SSFusion-I, §IV-D).
``ssfusion_oi`` ``ssfusion_i`` plus offloading.
``auto``        the plan of whichever scheme above (``dense`` included) the simulator
                predicts fastest on this cost model: never one predicted slower than
                Horovod's dense buckets (:func:`choose_plan`).
==============  ==========================================================================
"""
from __future__ import annotations

import dataclasses
import json
from typing import Sequence

from .cost import CostModel
from .fusion import fused_plan, optimal_fusion
from .plan import Plan
from .selective import choose_offload, keep_small_dense, select_sparsified, split_interleaved
from .timeline import simulate

__all__ = ["AUTO_PREFERENCE", "AUTO_TIE", "PLANNERS", "DEFAULT_CYCLE_S", "DEFAULT_FUSION_THRESHOLD",
           "SSFusionSteps", "build_plan", "choose_plan", "horovod_groups", "threshold_groups"]

#: Horovod's default ``HOROVOD_FUSION_THRESHOLD`` (64 MiB).
DEFAULT_FUSION_THRESHOLD = 64 * 1024 * 1024
#: Horovod's default ``HOROVOD_CYCLE_TIME`` (1 ms; ``operations.cc``).
DEFAULT_CYCLE_S = 1e-3


def threshold_groups(sizes: Sequence[int], threshold_bytes: int, element_size: int = 4) -> list[tuple[int, int]]:
    """Consecutive groups of at most ``threshold_bytes`` (a larger tensor goes alone)."""
    bounds, start, filled = [], 0, 0
    for i, n in enumerate(sizes):
        nbytes = int(n) * element_size
        if i > start and filled + nbytes > threshold_bytes:
            bounds.append((start, i))
            start, filled = i, 0
        filled += nbytes
    if len(sizes):
        bounds.append((start, len(sizes)))
    return bounds


def horovod_groups(sizes: Sequence[int], cost: CostModel,
                   threshold_bytes: int = DEFAULT_FUSION_THRESHOLD,
                   cycle_s: float = DEFAULT_CYCLE_S) -> list[tuple[int, int]]:
    """The fusion buffers Horovod's own dense allreduce forms: every ``cycle_s`` its
    background loop fuses the tensors that became ready since the last cycle (backward
    order, ``cost.backward_s``), up to ``threshold_bytes`` per buffer."""
    bounds, start, t = [], 0, cost.forward_s
    cycle = lambda x: int(x // cycle_s) if cycle_s > 0 else 0  # noqa: E731
    for i, b in enumerate(cost.backward_s):
        t += b
        if i + 1 == len(sizes) or cycle(t) != cycle(t + cost.backward_s[i + 1]):
            bounds += [(start + s, start + e) for s, e in
                       threshold_groups(sizes[start:i + 1], threshold_bytes, cost.element_size)]
            start = i + 1
    return bounds


@dataclasses.dataclass(frozen=True)
class _Options:
    """:func:`build_plan`'s keywords, handed to every builder."""

    density: float
    names: Sequence[str] | None
    sparsifier: str
    fusion_threshold_bytes: int
    min_k: int
    group_floor: float | None
    accuracy_slack: float


def _dense(name: str, sizes, cost: CostModel, o: _Options) -> Plan:
    """What hvd.DistributedOptimizer sends: Horovod's cycle-wise fusion buffers."""
    bounds = horovod_groups(sizes, cost, o.fusion_threshold_bytes)
    return fused_plan(sizes, bounds, "none", o.density, name, o.names, o.sparsifier)


def _per_tensor(name: str, sizes, cost: CostModel, o: _Options) -> Plan:
    return fused_plan(sizes, [(i, i + 1) for i in range(len(sizes))], "per_tensor", o.density,
                      name, o.names, o.sparsifier)


def _multi_tensor(name: str, sizes, cost: CostModel, o: _Options) -> Plan:
    return optimal_fusion(sizes, cost, "multi_tensor", o.density, name, o.names, o.sparsifier)


def _auto(name: str, sizes, cost: CostModel, o: _Options) -> Plan:
    return choose_plan(sizes, cost, **{f.name: getattr(o, f.name)
                                       for f in dataclasses.fields(o)})


@dataclasses.dataclass(frozen=True)
class SSFusionSteps:
    """The SSFusion family's planner: Cupcake's optimal fusion of per-tensor sparsified
    tensors (§IV-B Step-1), selective sparsification and density-aware compensation, and
    two switches: ``interleave``, each group split into allreduce and allgather parts
    (§IV-D, the -I schemes); ``offload``, large tensors selected on a CPU worker (§IV-C,
    the -O schemes)."""

    interleave: bool
    offload: bool

    def __call__(self, name: str, sizes, cost: CostModel, o: _Options) -> Plan:
        fused = optimal_fusion(sizes, cost, "per_tensor", o.density, name, o.names, o.sparsifier)
        plan = self.steps(name, fused, cost, o.min_k, offload=self.offload)
        if o.group_floor is not None:
            plan = _larger_budgets(self, name, plan, sizes, cost, o)
        plan.group_floor = None if o.group_floor is None else float(o.group_floor)
        # SSFusion's premise is to sparsify only where it pays: a plan predicted slower
        # than Horovod's own dense allreduce is not run; those buffers are (every rank
        # decides alike: the cost model is rank 0's)
        dense = _dense("dense", sizes, cost, o)
        if simulate(dense, cost).iteration_s < simulate(plan, cost).iteration_s:
            return dataclasses.replace(dense, scheme=name)
        return plan

    def steps(self, name: str, fused: Plan, cost: CostModel, min_k: int, offload: bool) -> Plan:
        """The per-tensor decisions on fixed groups: selective sparsification (§IV-B), the
        -I split (§IV-D), the small-tensor rule and, when ``offload``, offloading (§IV-C)."""
        plan = select_sparsified(fused, cost, scheme="ssfusion")
        if self.interleave:  # §IV-D builds on §IV-B's selection
            plan = split_interleaved(plan, cost, scheme="ssfusion_i")
        # the accuracy rule last among the per-tensor decisions, so the time-based steps
        # above cannot sparsify those tensors again; before offloading (they would never
        # be offloaded)
        if min_k > 0:  # recorded, so a saved plan says how it was made
            plan = keep_small_dense(plan, min_k)
            plan.notes = dict(plan.notes, min_k=str(int(min_k)))
        if offload and self.offload:
            plan = choose_offload(plan, cost, scheme=name)
        return dataclasses.replace(plan, scheme=name)


#: scheme name -> the builder of its plan, ``(name, sizes, cost, options) -> Plan``: the
#: one table of what the planner can build (``dense`` too, for comparisons and ``auto``)
PLANNERS = {
    "dense": _dense,
    "per_tensor": _per_tensor,
    "multi_tensor": _multi_tensor,
    "ssfusion": SSFusionSteps(interleave=False, offload=False),
    "ssfusion_o": SSFusionSteps(interleave=False, offload=True),
    "ssfusion_i": SSFusionSteps(interleave=True, offload=False),
    "ssfusion_oi": SSFusionSteps(interleave=True, offload=True),
    "auto": _auto,
}


def build_plan(
    scheme: str,
    sizes: Sequence[int],
    cost: CostModel,
    density: float = 0.01,
    names: Sequence[str] | None = None,
    sparsifier: str = "dgc",
    fusion_threshold_bytes: int = DEFAULT_FUSION_THRESHOLD,
    min_k: int = 0,
    group_floor: float | None = None,
    accuracy_slack: float = 0.0,
) -> Plan:
    """The plan of ``scheme`` (a name in :data:`PLANNERS`) for gradient tensors ``sizes``
    (element counts, backward order).

    ``min_k`` (SSFusion schemes only; the live schemes pass ``scheme_options["min_k"]``,
    default 0): tensors whose top-k at ``density`` would be below it are sent dense
    (:func:`keep_small_dense`). ``group_floor`` (SSFusion schemes only; the live schemes
    pass ``scheme_options["floor"]``): None, each sparsified tensor sends its own ``k``
    (the paper); a share, each group's inline sparsified tensors share their budget by
    magnitude above that floor (:attr:`Plan.group_floor`). ``accuracy_slack`` (SSFusion
    schemes under the group budget; ``scheme_options["slack"]``): the plan with the largest
    shared budgets predicted within that share of the fastest (:func:`_larger_budgets`).
    The paper's baselines (per_tensor, multi_tensor) sparsify every tensor, as published."""
    if scheme not in PLANNERS:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {tuple(PLANNERS)}")
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    return PLANNERS[scheme](scheme, sizes, cost, _Options(
        density, names, sparsifier, fusion_threshold_bytes, min_k, group_floor, accuracy_slack))


def _sparse_parts(plan: Plan) -> int:
    """How many sparse parts ``build_group`` makes of ``plan``: per group one for the
    tensors selected inline, one per offloaded tensor."""
    return sum(any(plan.sparse[i] and not plan.offload[i] for i in g.indices())
               + sum(plan.offload[i] for i in g.indices()) for g in plan.groups)


def _larger_budgets(planner: SSFusionSteps, name: str, fastest: Plan, sizes, cost: CostModel,
                    o: _Options) -> Plan:
    """The accuracy rule of the group budget: of the candidate plans the simulator predicts
    within ``1 + o.accuracy_slack`` of the fastest of them, the one with the fewest sparse parts
    (each part's tensors share one budget; fewer parts, larger shared budgets), the faster
    one on a tie.

    Under the group budget a sparse part's k goes where the magnitudes are, but only
    inside the part; a time-optimal plan may cut a model into single-tensor parts (many
    groups, each offloaded tensor a part of its own), and then every tensor sends exactly
    its own k. The candidates, all with SSFusion's per-tensor steps: ``fastest`` (the
    fusion optimal for per-tensor selection, offloading where it pays); the same groups
    with nothing offloaded; Cupcake's fusion optimal for one selection per buffer (what a
    group budget selects like) with nothing offloaded; every tensor in one group."""
    n = len(sizes)

    def steps(bounds):
        return planner.steps(name, fused_plan(sizes, bounds, "per_tensor", o.density, name,
                                              o.names, o.sparsifier), cost, o.min_k,
                             offload=False)

    cupcake = optimal_fusion(sizes, cost, "multi_tensor", o.density, name, o.names, o.sparsifier)
    candidates = {"fastest": fastest,
                  "fastest, no offload": steps([(g.start, g.end) for g in fastest.groups]),
                  "Cupcake's groups": steps([(g.start, g.end) for g in cupcake.groups]),
                  "one group": steps([(0, n)])}
    times = {label: simulate(p, cost).iteration_s for label, p in candidates.items()}
    best = min(times.values())
    ok = [label for label in candidates if times[label] <= best * (1 + o.accuracy_slack)]
    label = min(ok, key=lambda c: (_sparse_parts(candidates[c]), times[c]))
    plan = candidates[label]
    plan.notes = dict(plan.notes, budget=label, budget_candidates=json.dumps(
        {c: {"predicted_s": times[c], "sparse_parts": _sparse_parts(p)}
         for c, p in candidates.items()}))
    return plan


#: ``auto``'s order of preference among the plans predicted within :data:`AUTO_TIE` of the
#: fastest: dense (nothing sparsified), then SSFusion's (no tensor ever missing; the full
#: scheme first), per-tensor, and multi-tensor last (its buffers' top-k can leave tensors
#: out for many steps: docs/results.md §2).
AUTO_PREFERENCE = ("dense", "ssfusion_oi", "ssfusion_i", "ssfusion_o", "ssfusion", "per_tensor",
                   "multi_tensor")
#: Relative margin within which ``auto`` counts two predictions as a tie (the simulator's
#: own error is far larger: docs/results.md §3a).
AUTO_TIE = 0.01


def choose_plan(sizes: Sequence[int], cost: CostModel, **options) -> Plan:
    """``scheme="auto"``: the plan of every other planned scheme, ``dense`` (Horovod's own
    fusion) included, simulated on ``cost``; the fastest wins. Plans predicted within
    :data:`AUTO_TIE` of the fastest tie, and a tie goes by :data:`AUTO_PREFERENCE` (dense
    first, multi-tensor last), so a plan that can leave tensors out never wins by a
    microsecond. ``options`` are :func:`build_plan`'s. The plan's ``scheme`` is the
    winner's; ``notes["chosen_by"] = "auto"`` and ``notes["predicted_s"]`` (JSON: scheme
    -> simulated iteration seconds) say why."""
    # the offloading schemes need a CPU fit (a live profile always has one)
    offload_ok = "cpu" in cost.sparsify.get(options.get("sparsifier", "dgc"), {})
    plans = {s: build_plan(s, sizes, cost, **options) for s, planner in PLANNERS.items()
             if s != "auto" and (offload_ok or not getattr(planner, "offload", False))}
    predicted = {s: simulate(p, cost).iteration_s for s, p in plans.items()}
    fastest = min(predicted.values())
    order = AUTO_PREFERENCE + tuple(s for s in predicted if s not in AUTO_PREFERENCE)
    best = next(s for s in order if s in predicted and predicted[s] <= fastest * (1 + AUTO_TIE))
    plan = plans[best]
    plan.notes = dict(plan.notes, chosen_by="auto", predicted_s=json.dumps(predicted))
    return plan
