"""The planner's exact searches against brute force, both scored by ``simulate``.

* ``optimal_fusion`` (Cupcake §4.2) against all ``2^(N-1)`` partitions, N <= 14.
* ``split_interleaved`` (SSFusion §IV-D) against every split of every group.
"""
import itertools
import math
import random

import numpy as np
import pytest

from ssfusion_hvd.plan import (
    ALLGATHER,
    ALLREDUCE,
    CostModel,
    Group,
    Plan,
    SPARSIFICATIONS,
    fused_plan,
    nominal_k,
    optimal_fusion,
    simulate,
    floor_density,
    select_sparsified,
    split_interleaved,
    split_objective,
    wire_budget,
    wire_time,
)


def random_sizes(rng: random.Random, n: int) -> list[int]:
    """Mix of small (norm/bias-like) and large (weight-like) tensors."""
    return [rng.randint(1, 5000) if rng.random() < 0.5 else rng.randint(10**4, 5 * 10**6) for _ in range(n)]


def random_cost(rng: random.Random, n: int, decode: bool = False) -> CostModel:
    """Random fits; "topk" (one segmented call per group) and "dgc" (one call per tensor)
    share them. ``decode``: a random decode fit (the fusion DP is exact without one)."""
    def ab(alpha_max, beta_max):
        return (rng.choice([0.0, rng.uniform(0, alpha_max)]), rng.uniform(0, beta_max))
    fits = {"gpu": ab(2e-3, 2e-10), "cpu": ab(4e-3, 2e-9)}
    return CostModel(
        world_size=rng.choice([2, 4, 8, 16, 64]),
        allreduce=ab(2e-3, 2e-9),
        allgather=ab(4e-3, 1e-8),
        sparsify={"dgc": fits, "topk": fits},
        backward_s=[rng.choice([0.0, rng.uniform(0, 3e-3)]) for _ in range(n)],
        forward_s=rng.uniform(0, 1e-2),
        decode=ab(1e-4, 1e-10) if decode else (0.0, 0.0),
    )


def partitions(n: int):
    """All 2^(n-1) ways to cut [0, n) into consecutive groups."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        bounds, start = [], 0
        for i, cut in enumerate(cuts, start=1):
            if cut:
                bounds.append((start, i))
                start = i
        yield bounds + [(start, n)]


# N = 1..12 for every seed, plus N = 13, 14 on every tenth: 240 instances, all modes.
@pytest.mark.parametrize("seed", range(240))
def test_optimal_fusion_matches_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(13, 14) if seed % 10 == 0 else rng.randint(1, 12)
    sparsification = SPARSIFICATIONS[seed % 3]
    density = rng.choice([0.001, 0.01, 0.05, 0.3, 1.0])
    sizes = random_sizes(rng, n)
    cost = random_cost(rng, n)
    sparsifier = rng.choice(["dgc", "topk"])

    plan = optimal_fusion(sizes, cost, sparsification, density, sparsifier=sparsifier)
    got = simulate(plan, cost).iteration_s
    brute = min(simulate(fused_plan(sizes, b, sparsification, density, "brute", sparsifier=sparsifier),
                         cost).iteration_s for b in partitions(n))
    assert math.isclose(got, brute, rel_tol=1e-12, abs_tol=1e-15), (got, brute)


def test_optimal_fusion_extremes():
    """Comm as long as a backward step but no start-up cost: one group per tensor; pure
    start-up cost: a single group."""
    sizes = [16, 16, 16, 16]  # 64 B: 0.25 s each; the 32 B agreement allreduce 0.125 s
    per_byte = CostModel(4, (0.0, 1 / 256), (0.0, 1 / 256), {"dgc": {"gpu": (0.0, 0.0)}}, [1.0] * 4)
    plan = optimal_fusion(sizes, per_byte, "none")
    assert [(g.start, g.end) for g in plan.groups] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    # the last allreduce ends at 4.25; the optimizer's agreement (56 B) follows it
    assert simulate(plan, per_byte).iteration_s == 4.25 + 56 / 256
    latency_bound = CostModel(4, (1.0, 0.0), (1.0, 0.0), {"dgc": {"gpu": (0.0, 0.0)}}, [0.0] * 4)
    for mode in SPARSIFICATIONS:
        assert [(g.start, g.end) for g in optimal_fusion(sizes, latency_bound, mode).groups] == [(0, 4)]


def test_optimal_fusion_charges_the_last_groups_decode():
    """Three 1 KiB tensors, 0.1 s of backward each, allreduce 2 s + 1 s/KiB, decode and
    packing 2 s/KiB. Two groups free the link first ((0, 1), (1, 3)), then decode 2 KiB
    after it; the DP, charging the last group's decode, takes three groups and matches
    brute force."""
    sizes = [256, 256, 256]
    c = CostModel(4, (2.0, 1 / 1024), (0.0, 0.0), {"dgc": {"gpu": (0.0, 0.0)}},
                  [0.1] * 3, decode=(0.0, 2 / 1024))
    runs = {tuple(b): simulate(fused_plan(sizes, b, "none", 1.0, "b"), c) for b in partitions(3)}
    link_first = min(runs, key=lambda b: runs[b].groups[-1].ar_end)
    assert link_first == ((0, 1), (1, 3))
    plan = optimal_fusion(sizes, c, "none")
    dp = simulate(plan, c).iteration_s
    best = min(t.iteration_s for t in runs.values())
    assert len(plan.groups) == 3
    assert math.isclose(dp, best) and dp < runs[link_first].iteration_s - 1.0


def one_group_split(plan: Plan, group: Group, dense: set[int], ks) -> Plan:
    """``group`` of ``plan`` alone, ``dense`` tensors by allreduce, the rest sparsified by
    allgather with ``ks[i]`` elements."""
    idx = list(group.indices())
    sizes = [plan.sizes[i] for i in idx]
    return Plan(
        "split", [plan.names[i] for i in idx], sizes, [Group(0, len(idx))],
        [i not in dense for i in idx],
        [plan.sizes[i] if i in dense else ks[i] for i in idx],
        [ALLREDUCE if i in dense else ALLGATHER for i in idx], [False] * len(idx), plan.density,
        plan.sparsifier,
    )


@pytest.mark.parametrize("seed", range(200))
def test_split_objective_is_the_one_group_timeline(seed):
    """T1 + T2 of every split of every group, for any candidate set and any k, equals the
    simulated timeline of that group alone."""
    rng = random.Random(1000 + seed)
    n = rng.randint(1, 24)
    sizes = random_sizes(rng, n)
    cost = random_cost(rng, n, decode=True)
    density = rng.choice([0.001, 0.01, 0.1])
    cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 3)))) if n > 1 else []
    bounds = list(zip([0] + cuts, cuts + [n]))
    plan = fused_plan(sizes, bounds, "per_tensor", density, "fused",
                      sparsifier=rng.choice(["dgc", "topk"]))
    ks = [rng.randint(1, x) for x in sizes]
    for gi, g in enumerate(plan.groups):
        cand = [i for i in g.indices() if rng.random() < 0.6]
        alone = cost.with_backward(cost.backward_s[g.start:g.end])
        alone.forward_s = 0.0
        by_size = sorted(cand, key=lambda j: (sizes[j], j))
        simulated = [simulate(one_group_split(plan, g, set(by_size[:cut]), ks), alone,
                              check=False).iteration_s for cut in range(len(cand) + 1)]
        np.testing.assert_allclose(split_objective(plan, cost, gi, ks, cand), simulated,
                                   rtol=1e-12, atol=1e-15)
    # defaults: every tensor a candidate, k = ceil(density n)
    g = plan.groups[0]
    alone = cost.with_backward(cost.backward_s[g.start:g.end])
    alone.forward_s = 0.0
    by_size = sorted(g.indices(), key=lambda j: (sizes[j], j))
    nominal = [nominal_k(x, density) for x in sizes]
    simulated = [simulate(one_group_split(plan, g, set(by_size[:cut]), nominal), alone,
                          check=False).iteration_s for cut in range(len(g) + 1)]
    np.testing.assert_allclose(split_objective(plan, cost, 0), simulated, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("seed", range(100))
def test_split_interleaved_builds_on_the_selection(seed):
    """SSFusion-I starts from §IV-B: only tensors Eq. 2 left dense can go to the allreduce
    part; every k is compensated (>= d/2, link time within the budget); deterministic."""
    rng = random.Random(5000 + seed)
    n = rng.randint(1, 24)
    sizes = random_sizes(rng, n)
    cost = random_cost(rng, n)
    density = rng.choice([0.001, 0.01, 0.1])
    cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 3)))) if n > 1 else []
    plan = fused_plan(sizes, list(zip([0] + cuts, cuts + [n])), "per_tensor", density, "fused")
    eq2 = select_sparsified(plan, cost)
    split = split_interleaved(eq2, cost)
    assert split.to_json() == split_interleaved(eq2, cost).to_json()
    left_dense = {i for i in range(n) if not eq2.sparse[i]}
    for i in range(n):
        if not split.sparse[i]:
            assert i in left_dense and split.collective[i] == ALLREDUCE and split.k[i] == sizes[i]
        else:
            assert split.collective[i] == ALLGATHER
            assert split.k[i] >= nominal_k(sizes[i], floor_density(density))
    b_ag = cost.allgather[1] if cost.allgather[1] > 0 and cost.allreduce[1] > 0 else 1.0
    assert wire_time(split, cost) <= wire_budget(split, cost) + b_ag * 8 * n + 1e-9
