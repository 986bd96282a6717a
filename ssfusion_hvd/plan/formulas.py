"""Closed-form communication costs of the schemes that do not use fusion plans.

SparDL, ZEN and ExDyna synchronize the whole model gradient after backward with their own
collective algorithms, so the timeline simulator does not apply; their papers give the
communication time in the α-β model instead. These functions evaluate those formulas on a
:class:`CostModel`, whose collective fits are turned into one point-to-point message's
``α`` and ``β`` (ring model, SSFusion Eq. 4: an allgather is ``P-1`` messages in sequence).

Sizes are elements; a sparse entry costs ``value bytes + index bytes`` (COO).
"""
from __future__ import annotations

import math

from .cost import CostModel, index_size, nominal_k

__all__ = ["iteration_s", "message_cost", "spardl_comm_s", "zen_comm_s", "exdyna_comm_s",
           "zen_densification", "collectives", "FORMULA_SCHEMES"]

FORMULA_SCHEMES = ("spardl", "zen", "exdyna")


def collectives(scheme: str, world_size: int) -> int:
    """Collective calls one iteration of a formula scheme makes in this package (each pays
    the framework's fixed cost once, e.g. a Horovod cycle): SparDL ``⌈log2 P⌉``
    Spar-Reduce-Scatter steps plus one allgather (d = 1); ZEN a push alltoall and two pull
    allgathers (bitmaps, values); ExDyna an allgather of indices and an allreduce of values."""
    if world_size <= 1:
        return 0
    return {"spardl": math.ceil(math.log2(world_size)) + 1, "zen": 3, "exdyna": 2}[scheme]


def message_cost(cost: CostModel) -> tuple[float, float]:
    """``(α, β)`` of one point-to-point message, from the allgather fit (ring: P-1 steps)."""
    steps = max(cost.world_size - 1, 1)
    return cost.allgather[0] / steps, cost.allgather[1] / steps


def spardl_comm_s(cost: CostModel, n: int, k: int) -> float:
    """SparDL Eq. 4 (d = 1): ``2⌈log2 P⌉α + 4k(P-1)/P β``, where the paper's ``2k`` counts
    values and indices as one unit each: here ``2k β`` is ``k·(value+index bytes)·β``."""
    p = cost.world_size
    if p == 1:
        return 0.0
    alpha, beta = message_cost(cost)
    entry = cost.element_size + index_size(n)
    return 2 * math.ceil(math.log2(p)) * alpha + 2 * k * entry * (p - 1) / p * beta


def zen_densification(density: float, world_size: int) -> float:
    """``γ`` of ZEN Eq. 1: non-zeros of the sum of P sparse tensors over those of one, for
    independent uniformly placed indices, ``(1 - (1-d)^P) / d`` (an upper bound: top-k
    selections of real gradients overlap more, which only lowers ZEN's cost)."""
    return (1.0 - (1.0 - density) ** world_size) / density


def zen_comm_s(cost: CostModel, n: int, density: float) -> float:
    """ZEN Eq. 1 (Balanced Parallelism): ``(P-1)/P (γ+1) 2 M d_G / b`` with the COO entry
    size in place of ``2``, plus one message latency per step (push, pull), which Eq. 1
    leaves out."""
    p = cost.world_size
    if p == 1:
        return 0.0
    alpha, beta = message_cost(cost)
    entry = cost.element_size + index_size(n)
    gamma = zen_densification(density, p)
    return 2 * alpha + (p - 1) / p * (gamma + 1) * n * density * entry * beta


def exdyna_comm_s(cost: CostModel, n: int, k: int) -> float:
    """ExDyna (its Algorithm 1): partitions are exclusive, so each worker selects about
    ``k/P`` indices; one allgather of those indices, then one allreduce of every worker's
    values at the union of ``k`` indices, in sequence."""
    p = cost.world_size
    if p == 1:
        return 0.0
    return (cost.allgather_s(math.ceil(k / p) * index_size(n))
            + cost.allreduce_s(k * cost.element_size))


def iteration_s(scheme: str, cost: CostModel, sizes, density: float, sparsifier: str,
                per_collective_s: float = 0.0) -> float:
    """Iteration time of a formula scheme: forward, all of backward, one selection over the
    whole gradient (on the compute stream), then its communication, with no overlap (these
    schemes start once the last gradient is ready). ``per_collective_s`` is a fixed cost
    paid once per collective call (:func:`collectives`) on top of the α-β formulas."""
    n = int(sum(sizes))
    k = int(nominal_k(n, density))
    comm = {"spardl": lambda: spardl_comm_s(cost, n, k),
            "zen": lambda: zen_comm_s(cost, n, density),
            "exdyna": lambda: exdyna_comm_s(cost, n, k)}
    if scheme not in comm:
        raise ValueError(f"no cost formula for scheme {scheme!r}; have {FORMULA_SCHEMES}")
    select = cost.sparsify_s(sparsifier, "gpu", n * cost.element_size)
    fixed = per_collective_s * collectives(scheme, cost.world_size)
    return cost.forward_s + sum(cost.backward_s) + select + comm[scheme]() + fixed
