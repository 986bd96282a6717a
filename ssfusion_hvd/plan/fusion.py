"""Optimal tensor fusion (Cupcake §4, Algorithm 1), solved exactly by dynamic programming.

Cupcake partitions the tensors, in backward order, into consecutive groups and picks the
partition ``X`` minimizing the iteration time ``f(X)`` (Eq. 1). Algorithm 1 searches the
``2^(N-1)`` partitions depth-first with two prunings and needs 2.8–6.6 s for 161–314
tensors (Cupcake Table 1). This module finds the same optimum in polynomial time.

Why a DP is exact. Let the groups covering tensors ``[0, e)`` be ``m`` groups. With
compression on the compute stream costing ``a`` per group plus ``c_t`` per tensor (a
group's cost ``h(x) = α_h + β_h·x`` is affine in bytes, so a group selected in one call —
a multi-tensor buffer, or per-tensor top-k by one segmented call — has ``a = α_h``;
per-tensor calls and dense groups have ``a = 0``), the compute
cursor after those groups is ``A + Σ_{t<e} (T_b + c_t) + m·a``: it depends on ``(e, m)``
only. The rest of the timeline depends on the past only through that cursor and through
the time ``E`` the link becomes free, and it is non-decreasing in both. So for each
``(e, m)`` only the smallest ``E`` matters: ``best[m][e] = min E`` (Cupcake's ``M.comp``
and ``M.delay`` are exactly the cursor and ``E``). Transition to ``e' > e``:
``E' = max(cursor(e', m+1), E) + g(e, e')``, with ``g`` any function of the interval
(here: α + β·bytes, where multi-tensor bytes involve ``ceil(density · elements)``).

Dominance pruning: a pair ``(m, E)`` at ``e`` is dropped when some ``(m', E')`` with
``m' ≤ m`` and ``E' ≤ E`` exists (its cursor is no later and its link no busier), so only
the Pareto front with ``E`` strictly falling in ``m`` is expanded; with ``a = 0`` the front
is a single pair. Each expansion is one numpy pass over all ``e'``; the cost is
``O(Σ_e |front(e)| · (N - e))``.

The objective is the simulator's (``plan/timeline.py``): packing on the compute cursor,
and the last group's decode (or the optimizer's agreement allreduce, which follows it on
the link, if that takes longer) added to its collective. Exact when ``cost.decode`` is
zero; with a decode fit, exact while every earlier group's decode is done before the
last group's collective ends.
"""
from __future__ import annotations

from typing import Literal, Sequence

import numpy as np

from .cost import SEGMENTED_SPARSIFIERS, CostModel, nominal_k
from .plan import ALLGATHER, ALLREDUCE, Group, Plan
from .timeline import CHECK_BYTES

__all__ = ["SPARSIFICATIONS", "fused_plan", "optimal_fusion"]

Sparsification = Literal["none", "per_tensor", "multi_tensor"]
#: ``none``: dense groups, allreduce. ``per_tensor``: every tensor keeps its own top-k
#: (no tensor missing), allgather. ``multi_tensor``: one top-k per fusion buffer
#: (Cupcake), allgather.
SPARSIFICATIONS = ("none", "per_tensor", "multi_tensor")


def fused_plan(
    sizes: Sequence[int],
    bounds: Sequence[tuple[int, int]],
    sparsification: Sparsification,
    density: float,
    scheme: str,
    names: Sequence[str] | None = None,
    sparsifier: str = "dgc",
) -> Plan:
    """The plan with groups ``bounds`` and one sparsification mode for every tensor."""
    if sparsification not in SPARSIFICATIONS:
        raise ValueError(f"sparsification must be one of {SPARSIFICATIONS}, got {sparsification!r}")
    sizes = [int(n) for n in sizes]
    n = len(sizes)
    names = list(names) if names is not None else [f"t{i}" for i in range(n)]
    if sparsification == "none":
        groups = [Group(s, e) for s, e in bounds]
        return Plan(scheme, names, sizes, groups, [False] * n, list(sizes), [ALLREDUCE] * n,
                    [False] * n, density, sparsifier)
    if sparsification == "per_tensor":
        groups = [Group(s, e) for s, e in bounds]
        k = [int(x) for x in nominal_k(np.asarray(sizes), density)] if n else []
        return Plan(scheme, names, sizes, groups, [True] * n, k, [ALLGATHER] * n,
                    [False] * n, density, sparsifier)
    groups = [Group(s, e, nominal_k(sum(sizes[s:e]), density)) for s, e in bounds]
    return Plan(scheme, names, sizes, groups, [True] * n, [None] * n, [ALLGATHER] * n,
                [False] * n, density, sparsifier)


def _interval_bytes(sizes: np.ndarray, cost: CostModel, sparsification: str, density: float):
    """(a function of ``e`` giving the bytes one worker sends for ``[e, e')``, every
    ``e' > e``; the time of the collective that sends them, of an array of byte counts)."""
    es = cost.element_size
    if sparsification == "multi_tensor":
        cum_elems = np.concatenate(([0], np.cumsum(sizes)))

        def sent(e: int) -> np.ndarray:
            elems = cum_elems[e + 1:] - cum_elems[e]
            idx = np.where(elems < 2**31, 4, 8)  # index width follows the buffer length
            return nominal_k(elems, density) * (es + idx + cost.entry_extra)
        return sent, cost.allgather_many
    if sparsification == "per_tensor":
        k = nominal_k(sizes, density)
        entry = np.array([cost.entry_size(n) for n in sizes], dtype=np.int64)
        per_tensor, time_of = k * entry, cost.allgather_many
    else:
        alpha, beta = cost.allreduce
        per_tensor, time_of = sizes * es, (lambda nbytes: alpha + beta * nbytes)
    cum_bytes = np.concatenate(([0], np.cumsum(per_tensor)))
    return (lambda e: cum_bytes[e + 1:] - cum_bytes[e]), time_of


def optimal_fusion(
    sizes: Sequence[int],
    cost: CostModel,
    sparsification: Sparsification = "multi_tensor",
    density: float = 0.01,
    scheme: str | None = None,
    names: Sequence[str] | None = None,
    sparsifier: str = "dgc",
) -> Plan:
    """The fusion plan minimizing the simulated iteration time (Cupcake §4.2), exactly.

    Args:
        sizes: element count of every gradient tensor, in backward order.
        cost: the cost model; ``cost.backward_s`` must have one entry per tensor.
        sparsification: how every group is compressed (see :data:`SPARSIFICATIONS`).
        density: top-k density (ignored for ``"none"``).
    Returns:
        The plan of the optimal partition; score it with :func:`simulate`.
    """
    sizes_arr = np.asarray(sizes, dtype=np.int64)
    n = len(sizes_arr)
    if n == 0:
        raise ValueError("no tensors to fuse")
    if len(cost.backward_s) != n:
        raise ValueError(f"cost model has {len(cost.backward_s)} backward times for {n} tensors")
    es = cost.element_size
    compute = np.asarray(cost.backward_s, dtype=np.float64)
    per_group = 0.0
    if sparsification != "none":
        # the engine selects a group once it is complete: one call per group (a fusion
        # buffer, or a segmented sparsifier's per-tensor top-k), else one per tensor
        alpha_h, beta_h = cost.sparsify_fit(sparsifier, "gpu")
        compute = compute + beta_h * (sizes_arr * es)
        if sparsification == "per_tensor" and sparsifier not in SEGMENTED_SPARSIFIERS:
            compute = compute + alpha_h
        else:
            per_group = alpha_h
    compute = compute + cost.copy_s(sizes_arr * es)  # every tensor is packed once
    cursor = cost.forward_s + np.concatenate(([0.0], np.cumsum(compute)))
    sent, time_of = _interval_bytes(sizes_arr, cost, sparsification, density)
    cum_out = np.concatenate(([0], np.cumsum(sizes_arr * es)))
    world = cost.world_size if sparsification != "none" else 0

    def comm(e: int) -> np.ndarray:
        """``g`` of ``[e, e')`` for every ``e' > e``, plus, for ``e' = n``, the decode of
        that last group or the agreement after it (either ends the iteration;
        decode_bytes in plan/timeline.py)."""
        nbytes = sent(e)
        g = time_of(nbytes)
        g[-1] += max(cost.decode_s(cum_out[n] - cum_out[e] + world * nbytes[-1]), check_s)
        return g

    # best[m, e]: earliest link-free time after tensors [0, e) in m groups (for e = n: the
    # end of the last group's decode or of the agreement after it).
    check_s = cost.allreduce_s(CHECK_BYTES)
    best = np.full((n + 1, n + 1), np.inf)
    parent = np.full((n + 1, n + 1), -1, dtype=np.int32)
    best[0, 0] = cost.forward_s
    for e in range(n):
        col = best[: e + 1, e]
        if per_group == 0.0:
            front = (int(np.argmin(col)),)  # the cursor ignores m: only the least E matters
        else:
            prefix_min = np.minimum.accumulate(col)
            keep = np.isfinite(col)
            keep[1:] &= col[1:] < prefix_min[:-1]
            front = np.flatnonzero(keep)
        g = comm(e)
        for m in front:
            m = int(m)
            ends = np.maximum(cursor[e + 1:] + (m + 1) * per_group, col[m]) + g
            row = best[m + 1, e + 1:]
            better = ends < row
            row[better] = ends[better]
            parent[m + 1, e + 1:][better] = e
    m = int(np.argmin(best[:, n]))
    bounds = []
    e = n
    while e > 0:
        start = int(parent[m, e])
        bounds.append((start, e))
        e, m = start, m - 1
    bounds.reverse()
    return fused_plan(sizes_arr.tolist(), bounds, sparsification, density,
                      scheme or f"optimal_fusion[{sparsification}]", names, sparsifier)
