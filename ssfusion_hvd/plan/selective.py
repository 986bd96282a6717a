"""Selective sparsification and its two extensions (SSFusion §IV-B, §IV-C, §IV-D).

All functions take a plan whose groups are already fixed (by :func:`optimal_fusion`,
SSFusion §IV-B Step-1) and return a new plan; they never change the groups.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .cost import CostModel, index_size, nominal_k
from .plan import ALLGATHER, ALLREDUCE, Plan
from .timeline import _run

__all__ = [
    "MIN_DENSITY",
    "choose_offload",
    "compensate_density",
    "select_sparsified",
    "split_interleaved",
    "split_objective",
]

#: Lower bound on any sparsified tensor's density (SSFusion §IV-B, "to avoid over-sparsification").
MIN_DENSITY = 0.001


def _replace(plan: Plan, scheme: str, **per_tensor) -> Plan:
    return dataclasses.replace(plan, scheme=scheme, **{k: list(v) for k, v in per_tensor.items()})


def select_sparsified(plan: Plan, cost: CostModel, scheme: str = "ssfusion") -> Plan:
    """Overlap-maximized selection (SSFusion §IV-B Step-2, Eq. 2).

    ``plan`` has every tensor sparsified per tensor. Groups are visited in submission
    (backward) order; the first group has no previous communication to hide behind and
    stays sparsified. For group ``i ≥ 2`` the tensors are sorted by ascending size and,
    from the smallest, left dense while the group's computation
    ``Σ (T_b + T_sparsify)`` still exceeds ``T_cm`` of the previous group (as selected),
    i.e. until Eq. 2 ``T_cm^{i-1} ≥ Σ (T_b^j + T_gpu^j)`` holds.

    A tensor is only left dense while it is *small* in the cost model's sense: sending
    it dense adds no more link time than its sparsification takes,
    ``β_ag · (dense bytes − sparse bytes) ≤ h_gpu(bytes)``. This is the profiled cutoff
    that §III-B's 200 KB heuristic stands for ("the actual cutoffs are determined via
    online profiling"); without it a group whose backward alone outlasts the previous
    communication would be sent entirely dense. The densities of the tensors left
    sparsified are then raised by :func:`compensate_density`.
    """
    es = cost.element_size
    _, beta_ag = cost.allgather
    bwd = cost.backward_s
    sparse = list(plan.sparse)
    k = list(plan.k)
    prev_comm = None
    for g in plan.groups:
        idx = list(g.indices())
        if prev_comm is not None:
            h = {i: cost.sparsify_s(plan.sparsifier, "gpu", plan.sizes[i] * es) for i in idx}
            compute = sum(bwd[i] + h[i] for i in idx)
            for i in sorted(idx, key=lambda j: (plan.sizes[j], j)):
                dense_extra = plan.sizes[i] * es - k[i] * (es + index_size(plan.sizes[i]))
                if compute <= prev_comm or beta_ag * dense_extra > h[i]:
                    break
                sparse[i], k[i] = False, plan.sizes[i]
                compute -= h[i]
        prev_comm = cost.allgather_s(sum(
            k[i] * (es + index_size(plan.sizes[i])) if sparse[i] else plan.sizes[i] * es for i in idx))
    selected = _replace(plan, scheme, sparse=sparse, k=k)
    return compensate_density(selected, plan.density)


def compensate_density(plan: Plan, density: float, min_density: float = MIN_DENSITY) -> Plan:
    """Density-aware sparsification (SSFusion §IV-B): give the sparsified tensors a
    common lower density so that the elements sent in total, dense tensors included,
    equal ``round(density · all elements)``.

    The common density is ``d' = (target − dense elements) / sparsified elements``,
    never below ``min_density``; the target count is split over the sparsified tensors
    by largest remainder, then every tensor is raised to at least
    ``max(1, ceil(min_density · n))`` so no tensor goes missing and none is
    over-sparsified. Hence the total overshoots the target only by those raises (at
    most one element per sparsified tensor) or, when ``d'`` hits the bound, because
    the dense tensors alone already exceed it.
    """
    sizes = np.asarray(plan.sizes, dtype=np.int64)
    sparse = np.asarray(plan.sparse, dtype=bool)
    if not sparse.any():
        return plan
    target = int(round(density * int(sizes.sum())))
    sparse_elems = int(sizes[sparse].sum())
    budget = target - int(sizes[~sparse].sum())
    if budget >= min_density * sparse_elems:
        quota = sizes[sparse] * (budget / sparse_elems)
        k = np.floor(quota).astype(np.int64)
        short = budget - int(k.sum())
        if short > 0:  # largest remainders first, ties to the earlier tensor
            order = np.argsort(-(quota - k), kind="stable")[:short]
            k[order] += 1
    else:
        k = np.zeros(int(sparse.sum()), dtype=np.int64)
    floor_k = np.maximum(1, np.ceil(sizes[sparse] * min_density - 1e-9)).astype(np.int64)
    k = np.minimum(np.maximum(k, floor_k), sizes[sparse])
    new_k = list(plan.k)
    for i, ki in zip(np.flatnonzero(sparse), k):
        new_k[int(i)] = int(ki)
    return dataclasses.replace(plan, k=new_k)


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


def split_objective(plan: Plan, cost: CostModel, group: int) -> np.ndarray:
    """``T1 + T2`` of group ``group`` for every split ``l = 0..n`` (SSFusion §IV-D Step-2).

    Split ``l`` sends the ``l`` smallest tensors of the group dense by allreduce
    (``Buffer_AR``) and sparsifies the others (top-``ceil(density · n)``) into the
    allgather (``Buffer_AG``). ``T1`` is the computation until ``Buffer_AR`` is complete
    (backward of the group up to its last dense tensor, with the sparsifications in
    between); ``T2 = max(T_AR, remaining computation) + T_AG``. ``T1 + T2`` is the time
    the group takes on its own, what :func:`simulate` gives for a one-group plan.
    """
    g = plan.groups[group]
    es = cost.element_size
    sizes = np.asarray(plan.sizes[g.start:g.end], dtype=np.int64)
    n = len(sizes)
    bwd = np.asarray(cost.backward_s[g.start:g.end])
    alpha_h, beta_h = cost.sparsify_fit(plan.sparsifier, "gpu")
    h = alpha_h + beta_h * (sizes * es)
    rank = np.empty(n, dtype=np.int64)
    rank[np.argsort(sizes, kind="stable")] = np.arange(n)
    cuts = np.arange(n + 1)
    dense = rank[None, :] < cuts[:, None]                      # (n+1, n): split l, tensor j
    finish = np.cumsum(bwd[None, :] + np.where(dense, 0.0, h[None, :]), axis=1)
    last_dense = np.where(dense, np.arange(n)[None, :], -1).max(axis=1)
    t1 = finish[cuts, np.maximum(last_dense, 0)]
    compute = finish[:, -1]
    sparse_bytes = nominal_k(sizes, plan.density) * (es + np.where(sizes < 2**31, 4, 8))
    ar_bytes = np.where(dense, sizes * es, 0).sum(axis=1)
    ag_bytes = np.where(dense, 0, sparse_bytes).sum(axis=1)
    t_ar = cost.allreduce[0] + cost.allreduce[1] * ar_bytes
    t_ag = cost.allgather[0] + cost.allgather[1] * ag_bytes
    both = np.maximum(t1 + t_ar, compute) + t_ag
    return np.where(cuts == 0, compute + t_ag, np.where(cuts == n, compute + t_ar, both))


def split_interleaved(plan: Plan, cost: CostModel, scheme: str = "ssfusion_i") -> Plan:
    """SSFusion-I buffer separation (§IV-D Steps 1–3): per group, the split minimizing
    ``T1 + T2`` (:func:`split_objective`; ties to the fewest dense tensors).

    Dense tensors go to the group's allreduce part, sparsified ones to its allgather
    part. The split scans the group in ascending size, the order in which §IV-B leaves
    tensors dense, so Eq. 2's cut is one of the candidates and the split re-decides it
    with the cheaper allreduce priced in. Densities are then compensated
    (:func:`compensate_density`).
    """
    sparse, k, coll = list(plan.sparse), list(plan.k), list(plan.collective)
    for gi, g in enumerate(plan.groups):
        if g.buffer_k is not None:
            raise ValueError("SSFusion-I splits per-tensor sparsified groups, not multi-tensor buffers")
        cut = int(np.argmin(split_objective(plan, cost, gi)))
        order = sorted(g.indices(), key=lambda j: (plan.sizes[j], j))
        for pos, i in enumerate(order):
            n = plan.sizes[i]
            if pos < cut:
                sparse[i], k[i], coll[i] = False, n, ALLREDUCE
            else:
                sparse[i], k[i], coll[i] = True, nominal_k(n, plan.density), ALLGATHER
    split = _replace(plan, scheme, sparse=sparse, k=k, collective=coll, offload=[False] * len(plan))
    return compensate_density(split, plan.density)
