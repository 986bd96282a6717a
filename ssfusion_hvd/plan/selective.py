"""Selective sparsification and its two extensions (SSFusion §IV-B, §IV-C, §IV-D).

All functions take a plan whose groups are already fixed (by :func:`optimal_fusion`,
SSFusion §IV-B Step-1) and return a new plan; they never change the groups.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .cost import SEGMENTED_SPARSIFIERS, CostModel, nominal_k
from .plan import ALLGATHER, ALLREDUCE, Plan
from .timeline import _run

__all__ = [
    "DEFAULT_ACCURACY_SLACK",
    "DEFAULT_GROUP_FLOOR",
    "DEFAULT_MIN_K",
    "MIN_DENSITY",
    "choose_offload",
    "compensate_density",
    "keep_small_dense",
    "select_sparsified",
    "split_interleaved",
    "split_objective",
]

#: The paper's absolute lower bound on a sparsified tensor's density (§IV-B, "to avoid
#: over-sparsification").
MIN_DENSITY = 0.001
#: Compensation never takes a sparsified tensor below this fraction of the user's density
#: (see :func:`floor_density`).
FLOOR_FRACTION = 0.5
#: The SSFusion schemes' default ``scheme_options["min_k"]`` (:func:`keep_small_dense`):
#: 0, the paper's planner. The rule is opt-in because the live jobs measured no gain from
#: it (``docs/schemes.md``, "Small tensors").
DEFAULT_MIN_K = 0
#: The SSFusion schemes' default ``scheme_options["floor"]`` (:attr:`Plan.group_floor`):
#: a fusion buffer's budget is shared by magnitude, each tensor keeping at least one
#: element (``docs/schemes.md``, "Group budget").
DEFAULT_GROUP_FLOOR = 0.0
#: The SSFusion schemes' default ``scheme_options["slack"]``: a plan whose sparse parts
#: share larger budgets is taken when predicted within 20 % of the fastest
#: (``plan/schemes.py: _larger_budgets``; ``docs/schemes.md``, "Group budget").
DEFAULT_ACCURACY_SLACK = 0.2


def floor_density(density: float) -> float:
    """The least density compensation may give a sparsified tensor:
    ``max(min(d, 0.001), d / 2)``. The paper's 0.001 alone is 10x below the default
    density: on the digits CNN it left ``fc1`` (87 % of the parameters) at a tenth of its
    budget and cost 9 points of accuracy (``docs/recipe.md``). Half the user's density
    bounds what small dense tensors may take from large ones; when that is not enough,
    fewer tensors stay dense (:func:`compensate_density`)."""
    return max(min(density, MIN_DENSITY), FLOOR_FRACTION * density)


def _replace(plan: Plan, scheme: str, **per_tensor) -> Plan:
    return dataclasses.replace(plan, scheme=scheme, **{k: list(v) for k, v in per_tensor.items()})


def select_sparsified(plan: Plan, cost: CostModel, scheme: str = "ssfusion") -> Plan:
    """Overlap-maximized selection (SSFusion §IV-B Step-2, Eq. 2).

    ``plan`` has every tensor sparsified per tensor. Groups are visited in submission
    (backward) order; the first group has no previous communication to hide behind and
    stays sparsified. For group ``i ≥ 2`` the tensors are sorted by ascending size and,
    from the smallest, left dense while the group's computation — its backward plus its
    selection as the engine runs it, ``Σ T_b + h(sparsified tensors)`` (one segmented
    call, or one call per tensor: :meth:`CostModel.select_s`) — still exceeds ``T_cm`` of
    the previous group (as selected), i.e. until Eq. 2 ``T_cm^{i-1} ≥ Σ T_b + h`` holds.

    A tensor is only left dense while it is *small* in the cost model's sense: sending
    it dense adds no more link time than leaving it out of the selection saves,
    ``β_ag · (dense bytes − sparse bytes) ≤ h(with it) − h(without it)``. This is the
    profiled cutoff that §III-B's 200 KB heuristic stands for ("the actual cutoffs are
    determined via online profiling"); without it a group whose backward alone outlasts
    the previous communication would be sent entirely dense. The densities of the tensors
    left sparsified are then set by :func:`compensate_density`, which may send some of
    the dense ones sparsified again.
    """
    es = cost.element_size
    _, beta_ag = cost.allgather
    bwd = cost.backward_s
    sparse = list(plan.sparse)
    k = list(plan.k)
    prev_comm = None
    alpha_h, beta_h = cost.sparsify_fit(plan.sparsifier, "gpu")
    per_tensor_calls = plan.sparsifier not in SEGMENTED_SPARSIFIERS

    def saved(i: int, remaining: int) -> float:
        """What dropping tensor ``i`` (one of ``remaining``) from the group's selection
        saves: the marginal of :meth:`CostModel.select_s`."""
        calls = 1 if per_tensor_calls or remaining == 1 else 0
        return calls * alpha_h + beta_h * plan.sizes[i] * es

    for g in plan.groups:
        idx = list(g.indices())
        if prev_comm is not None:
            chosen = [i for i in idx if sparse[i]]
            remaining = len(chosen)
            compute = sum(bwd[i] for i in idx) + cost.copy_s(sum(plan.sizes[i] for i in idx) * es) \
                + cost.select_s(plan.sparsifier, "gpu", [plan.sizes[i] * es for i in chosen])
            for i in sorted(idx, key=lambda j: (plan.sizes[j], j)):
                cut = saved(i, remaining)
                dense_extra = plan.sizes[i] * es - k[i] * cost.entry_size(plan.sizes[i])
                if compute <= prev_comm or beta_ag * dense_extra > cut:
                    break
                sparse[i], k[i] = False, plan.sizes[i]
                remaining, compute = remaining - 1, compute - cut
        prev_comm = cost.allgather_s(sum(
            k[i] * cost.entry_size(plan.sizes[i]) if sparse[i] else plan.sizes[i] * es for i in idx))
    selected = _replace(plan, scheme, sparse=sparse, k=k)
    return compensate_density(selected, cost)


def _betas(cost: CostModel) -> tuple:
    """(β_allreduce, β_allgather) in seconds per byte a worker contributes; plain bytes
    when the model has no per-byte cost (then time cannot rank anything)."""
    b_ar, b_ag = float(cost.allreduce[1]), float(cost.allgather[1])
    return (b_ar, b_ag) if b_ar > 0 and b_ag > 0 else (1.0, 1.0)


def wire_time(plan: Plan, cost: CostModel) -> float:
    """Per-byte link time of ``plan``'s per-tensor decisions (the part density changes;
    the fixed cost per collective call depends on the groups, not on ``k``): dense by
    allreduce ``β_ar·n·es``, dense by allgather ``β_ag·n·es``, sparsified
    ``β_ag·k·(es + index bytes)``."""
    b_ar, b_ag = _betas(cost)
    es = cost.element_size
    t = 0.0
    for n, sp, k, coll in zip(plan.sizes, plan.sparse, plan.k, plan.collective):
        if sp:
            t += b_ag * k * cost.entry_size(n)
        else:
            t += (b_ar if coll == ALLREDUCE else b_ag) * n * es
    return t


def wire_budget(plan: Plan, cost: CostModel) -> float:
    """The link time of every tensor sparsified at exactly the user's density,
    ``β_ag · d · n`` entries each: what density-aware compensation holds ``plan`` to.

    Exact, not ``nominal_k``'s ``ceil``: on a model of many small tensors at a low
    density, rounding each up (and adding the floors after) is a budget well above
    ``d·Σn`` (``docs/schemes.md``). The floors are paid from this budget instead
    (:func:`_common_k`)."""
    _, b_ag = _betas(cost)
    return sum(b_ag * plan.density * n * cost.entry_size(n) for n in plan.sizes)


def _common_k(sizes, sparse, cost: CostModel, available: float, least):
    """k of the sparsified tensors sharing a common density that spends ``available``
    link time, each at least its ``least`` (its floor: ``least`` has one entry per
    sparsified tensor); (k array, the density of the tensors above their floors).

    The floors are paid from ``available`` (water-filling: a tensor whose share at the
    common density is below its floor is fixed there and the density recomputed for the
    others), so the plan's elements stay at its budget (within the half element that
    rounding the total may add), not the budget plus a floor per small tensor. Shares are
    split by largest remainder, ties to the earlier tensor. When every tensor is held at
    its floor the density returned is 0: nothing is left above the floors (the caller's
    floor check then sends fewer tensors dense)."""
    _, b_ag = _betas(cost)
    sizes = np.asarray(sizes, dtype=np.int64)
    sparse = np.asarray(sparse, dtype=bool)
    n = sizes[sparse]
    least = np.minimum(np.asarray(least, dtype=np.int64), n)
    per = b_ag * np.asarray([cost.entry_size(int(x)) for x in n], dtype=np.float64)
    fixed = np.zeros(len(n), dtype=bool)
    while True:
        free = ~fixed
        left = max(available - float((per[fixed] * least[fixed]).sum()), 0.0)
        weight = float((per[free] * n[free]).sum())
        dens = left / weight if weight > 0 else 0.0
        quota = np.where(fixed, least.astype(np.float64), np.minimum(n * dens, n.astype(np.float64)))
        below = free & (quota < least)
        if not below.any():
            break
        fixed |= below
    k = np.floor(quota).astype(np.int64)
    short = int(round(float(quota.sum()))) - int(k.sum())
    if short > 0:  # largest remainders first, ties to the earlier tensor
        order = np.argsort(-(quota - k), kind="stable")[:short]
        k[order] += 1
    return np.minimum(np.maximum(k, least), n), dens


def compensate_density(plan: Plan, cost: CostModel) -> Plan:
    return _compensate(plan, cost)[0]


compensate_density.__doc__ = """Density-aware sparsification (SSFusion §IV-B), by link time; see :func:`_compensate`."""


def _compensate(plan: Plan, cost: CostModel):
    """Density-aware sparsification (SSFusion §IV-B), by link time.

    Tensors left dense lengthen the transmission; the paper lowers the density of the
    large sparsified tensors to compensate. Here the budget is link time, not element
    count: the plan must not spend more than every tensor sparsified at the user's
    density (:func:`wire_budget`), with a dense tensor charged what it costs on its
    collective (an allreduce moves ``2(P−1)/P`` of the bytes a ring allgather of ``P``
    records does) and a sparsified element its value plus its index. The sparsified
    tensors share the density that spends what the dense ones leave (higher than the
    user's when dense tensors are cheap; never above 1), split by largest remainder.

    No sparsified tensor goes below :func:`floor_density`: when it would, the plan
    sends **fewer tensors dense** (the costliest dense tensor is sparsified again, then
    the next) instead of overshooting or starving the large tensors. The floors are paid
    from the budget (:func:`_common_k`). Deterministic for a given plan and cost model.
    Returns (plan, the common density of its sparsified tensors above their floors,
    before rounding).
    """
    sizes = plan.sizes
    floor = floor_density(plan.density)
    dens = plan.density
    b_ar, b_ag = _betas(cost)
    es = cost.element_size
    sparse, k, coll = list(plan.sparse), list(plan.k), list(plan.collective)
    budget = wire_budget(plan, cost)
    ks = np.zeros(0, dtype=np.int64)

    def dense_cost(i: int) -> float:
        return (b_ar if coll[i] == ALLREDUCE else b_ag) * sizes[i] * es

    while True:
        dense_idx = [i for i, sp in enumerate(sparse) if not sp]
        dense_t = sum(dense_cost(i) for i in dense_idx)
        if any(sparse):
            least = [int(nominal_k(n, floor)) for n, sp in zip(sizes, sparse) if sp]
            ks, dens = _common_k(sizes, sparse, cost, budget - dense_t, least)
            if dens >= floor - 1e-12 or not dense_idx:
                break
        elif dense_t <= budget:
            break
        # the floor binds: send the costliest dense tensor sparsified instead
        worst = max(dense_idx, key=lambda i: (dense_cost(i), -i))
        sparse[worst], coll[worst] = True, ALLGATHER
        k[worst] = int(nominal_k(sizes[worst], plan.density))
    new_k = list(k)
    for i, ki in zip([i for i, sp in enumerate(sparse) if sp], ks):
        new_k[i] = int(ki)
    for i, sp in enumerate(sparse):
        if not sp:
            new_k[i] = sizes[i]
    return dataclasses.replace(plan, sparse=sparse, k=new_k, collective=coll), dens


def keep_small_dense(plan: Plan, min_k: int) -> Plan:
    """Sends dense every per-tensor sparsified tensor whose top-k at the user's density,
    ``ceil(density · n)``, is below ``min_k``: with 32 at density 0.01, tensors of at most
    3,100 elements (norms, biases, small weight matrices; a 128-element LayerNorm weight
    would send 2 elements per step).

    An accuracy rule, not a time one: Eq. 2 keeps small tensors dense only where that
    pays in time. In the one-process replica of the example jobs it helped
    (``scripts/recipe_ablation.py --variants auto,auto_min_k``); in the live jobs, 8 seeds
    each, it changed nothing measurable, so it is off by default (``docs/schemes.md``,
    "Small tensors").

    They are not charged to the density budget of :func:`compensate_density`: the other
    tensors keep their k. A tensor joins its group's allreduce part when the group has one
    (SSFusion-I), else it is sent dense inside the allgather, so no collective is added.
    Multi-tensor buffers are left alone. Deterministic: sizes and density only."""
    if min_k <= 0:
        return plan
    sparse, k = list(plan.sparse), list(plan.k)
    coll, offload = list(plan.collective), list(plan.offload)
    for g in plan.groups:
        if g.buffer_k is not None:
            continue
        idx = list(g.indices())
        part = ALLREDUCE if any(coll[i] == ALLREDUCE for i in idx) else ALLGATHER
        for i in idx:
            if sparse[i] and int(nominal_k(plan.sizes[i], plan.density)) < min_k:
                sparse[i], k[i], coll[i], offload[i] = False, plan.sizes[i], part, False
    return dataclasses.replace(plan, sparse=sparse, k=k, collective=coll, offload=offload)


def choose_offload(plan: Plan, cost: CostModel, scheme: str = "ssfusion_o") -> Plan:
    """SSFusion-O Step-1 (§IV-C): offload a sparsified tensor to the CPU worker only if
    ``T_offload`` — from the start of its group's first backward to the end of its CPU
    sparsification — fits in the group's backward time ``Σ T_b``.

    Decided greedily in backward order inside the simulator, so each decision sees the
    timeline the earlier ones produced. Every accepted offload finishes within the
    group's backward window, which the compute stream needs anyway, so the group is
    never ready later and the iteration never gets slower.
    """
    _, offload = _run(plan, cost, decide_offload=True)
    return _replace(plan, scheme, offload=offload)


def split_objective(plan: Plan, cost: CostModel, group: int, ks=None, candidates=None) -> np.ndarray:
    """``T1 + T2`` of group ``group`` for every split ``l = 0..m`` (SSFusion §IV-D Step-2).

    ``candidates`` (plan indices; default: the whole group) are the tensors that may go
    dense, ``m`` of them; split ``l`` sends the ``l`` smallest candidates dense by
    allreduce (``Buffer_AR``) and sparsifies every other tensor of the group into the
    allgather (``Buffer_AG``) with ``ks[i]`` elements (default ``ceil(density · n)``).
    As the engine runs it (``plan/timeline.py``): ``T1`` is the backward up to the last
    dense tensor plus packing ``Buffer_AR``, when it is submitted; the group's packing
    and selection run after its last backward; ``Buffer_AG`` goes when the selection is
    done and the allreduce has left the link; then the group is decoded. The result is
    the time the group takes on its own from the start of its backward: what
    ``simulate(..., check=False)`` gives for a one-group plan, less ``forward_s``.
    """
    g = plan.groups[group]
    es = cost.element_size
    members = list(g.indices())
    sizes = np.asarray(plan.sizes[g.start:g.end], dtype=np.int64)
    n = len(sizes)
    if ks is None:
        kk = nominal_k(sizes, plan.density)
    else:
        kk = np.asarray([ks[i] for i in members], dtype=np.int64)
    cand = set(members if candidates is None else candidates)
    bwd_end = np.cumsum(np.asarray(cost.backward_s[g.start:g.end], dtype=np.float64))
    alpha_h, beta_h = cost.sparsify_fit(plan.sparsifier, "gpu")
    big = n + 1
    rank = np.full(n, big, dtype=np.int64)
    order = sorted((j for j, i in enumerate(members) if i in cand), key=lambda j: (sizes[j], j))
    for r, j in enumerate(order):
        rank[j] = r
    cuts = np.arange(len(order) + 1)
    dense = rank[None, :] < cuts[:, None]                      # (m+1, n): split l, tensor j
    sparse = ~dense
    calls = (sparse.any(axis=1) if plan.sparsifier in SEGMENTED_SPARSIFIERS
             else sparse.sum(axis=1))
    compute = (bwd_end[-1] + cost.copy_s(int(sizes.sum()) * es) + calls * alpha_h
               + beta_h * np.where(sparse, sizes * es, 0).sum(axis=1))
    last_dense = np.where(dense, np.arange(n)[None, :], -1).max(axis=1)
    sparse_bytes = kk * (es + np.where(sizes < 2**31, 4, 8))
    ar_bytes = np.where(dense, sizes * es, 0).sum(axis=1)
    t1 = bwd_end[np.maximum(last_dense, 0)] + cost.copy_s(ar_bytes)
    ag_bytes = np.where(dense, 0, sparse_bytes).sum(axis=1)
    t_ar = cost.allreduce[0] + cost.allreduce[1] * ar_bytes
    t_ag = cost.allgather_many(ag_bytes)
    both = np.maximum(t1 + t_ar, compute) + t_ag
    has_ar, has_ag = dense.any(axis=1), sparse.any(axis=1)
    comm_end = np.where(~has_ar, compute + t_ag, np.where(~has_ag, t1 + t_ar, both))
    decode = cost.decode[0] + cost.decode[1] * (int(sizes.sum()) * es + cost.world_size * ag_bytes)
    return np.maximum(comm_end, compute) + decode


def _interleaved(plan: Plan, dense: set, ks) -> Plan:
    sparse = [i not in dense for i in range(len(plan))]
    k = [plan.sizes[i] if i in dense else int(ks[i]) for i in range(len(plan))]
    coll = [ALLREDUCE if i in dense else ALLGATHER for i in range(len(plan))]
    return dataclasses.replace(plan, sparse=sparse, k=k, collective=coll,
                               offload=[False] * len(plan))


def split_interleaved(plan: Plan, cost: CostModel, scheme: str = "ssfusion_i",
                      max_passes: int = 8) -> Plan:
    """SSFusion-I buffer separation (§IV-D Steps 1–3), built on §IV-B's selection.

    ``plan`` is the output of :func:`select_sparsified`: the tensors Eq. 2 left dense
    (small ones, by its guard) are the only *candidates* for the allreduce part. Per
    group the split minimizing ``T1 + T2`` (:func:`split_objective`; ties to the fewest
    dense tensors) sends the ``l`` smallest candidates dense by allreduce and sparsifies
    the rest into the allgather, scored with the k that compensation gives (the
    sparsified tensors' own k, and for a candidate the common compensated density).
    Then :func:`compensate_density` sets every k by link time (and may sparsify
    candidates again when the floor binds); the split is repeated on the new k until the
    dense set stops changing (at most ``max_passes``). Deterministic.
    """
    for g in plan.groups:
        if g.buffer_k is not None:
            raise ValueError("SSFusion-I splits per-tensor sparsified groups, not multi-tensor buffers")
    candidates = [[i for i in g.indices() if not plan.sparse[i]] for g in plan.groups]
    floor = floor_density(plan.density)
    current, dens = _compensate(_interleaved(plan, {i for c in candidates for i in c}, plan.k), cost)
    for _ in range(max_passes):
        ks = [current.k[i] if current.sparse[i] else
              int(min(n, max(int(nominal_k(n, floor)), round(dens * n))))
              for i, n in enumerate(current.sizes)]
        dense = set()
        for gi, g in enumerate(current.groups):
            if not candidates[gi]:
                continue
            cut = int(np.argmin(split_objective(current, cost, gi, ks, candidates[gi])))
            dense.update(sorted(candidates[gi], key=lambda j: (plan.sizes[j], j))[:cut])
        nxt, dens = _compensate(_interleaved(current, dense, ks), cost)
        done = {i for i, sp in enumerate(nxt.sparse) if not sp} == \
            {i for i, sp in enumerate(current.sparse) if not sp}
        current = nxt
        if done:
            break
    return _replace(current, scheme)
