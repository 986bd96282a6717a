"""Planner unit tests: simulator on hand-computed timelines, density-aware compensation,
offloading, scheme builders, JSON, the plan table, the models and the CLI."""
import dataclasses
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ssfusion_hvd.plan.schemes import AUTO_PREFERENCE, AUTO_TIE
from ssfusion_hvd.plan import (
    ALLGATHER,
    ALLREDUCE,
    MIN_DENSITY,
    PLANNERS,
    CostModel,
    Group,
    Plan,
    build_plan,
    choose_offload,
    compensate_density,
    decode_bytes,
    default_backward_times,
    floor_density,
    wire_budget,
    wire_time,
    fused_plan,
    keep_small_dense,
    model_tensors,
    nominal_k,
    optimal_fusion,
    parse_bandwidth,
    simulate,
    threshold_groups,
)
from ssfusion_hvd.plan.__main__ import main as cli_main


def cost(backward, ar=(0.0, 0.0), ag=(0.0, 0.0), gpu=(0.0, 0.0), cpu=(0.0, 0.0), forward=0.0, es=4):
    return CostModel(4, ar, ag, {"dgc": {"gpu": gpu, "cpu": cpu}}, backward, es, forward)


def plan(sizes, groups, sparse, k, coll=None, offload=None, buffer_k=None):
    n = len(sizes)
    return Plan("hand", [f"t{i}" for i in range(n)], sizes,
                [Group(s, e, (buffer_k or {}).get(gi)) for gi, (s, e) in enumerate(groups)],
                sparse, k, coll or [ALLGATHER] * n, offload or [False] * n, 0.01)


# -- simulator: timelines computed by hand (all numbers exact in binary) ---------------------

def test_dense_groups_wait_for_backward_and_for_the_link():
    # group 0: backward 0-1-3, then an allreduce of 1024 B costing 0.5 + 1024/1024
    p = plan([128, 128, 256], [(0, 2), (2, 3)], [False] * 3, [128, 128, 256], [ALLREDUCE] * 3)
    c = cost([1.0, 2.0, 3.0], ar=(0.5, 1 / 1024))
    t = simulate(p, c)
    g0, g1 = t.groups
    assert (g0.backward_start, g0.backward_end, g0.ready) == (0.0, 3.0, 3.0)
    assert (g0.ar_start, g0.ar_end, g0.ag_start) == (3.0, 4.5, None)       # 0.5 + 1024 B
    assert (g1.backward_start, g1.ready, g1.ar_start, g1.ar_end) == (3.0, 6.0, 6.0, 7.5)
    # then the optimizer's agreement of 56 B: 0.5 + 56/1024
    assert t.iteration_s == 7.5 + 0.5 + 56 / 1024 and t.compute_end == 6.0


def test_per_tensor_sparsification_occupies_the_compute_stream_and_link_is_fifo():
    p = plan([100, 100], [(0, 1), (1, 2)], [True, True], [1, 1])
    t = simulate(p, cost([1.0, 1.0], ag=(2.0, 0.0), gpu=(0.25, 0.0)))
    g0, g1 = t.groups
    assert (g0.ready, g0.ag_start, g0.ag_end) == (1.25, 1.25, 3.25)
    # tensor 1's backward starts after tensor 0's sparsification; its allgather waits for the link
    assert (g1.backward_start, g1.backward_end, g1.ready) == (1.25, 2.25, 2.5)
    assert (g1.ag_start, g1.ag_end, t.iteration_s) == (3.25, 5.25, 5.25)


def test_offloaded_tensors_run_on_one_fifo_cpu_worker():
    c = cost([1.0, 1.0], ag=(1.0, 0.0), gpu=(0.25, 0.0), cpu=(0.5, 0.0))
    one = simulate(plan([100, 100], [(0, 2)], [True, True], [1, 1], offload=[True, False]), c)
    assert one.cpu_end == 1.5 and one.compute_end == 2.25          # t1: backward 1-2, GPU 2-2.25
    assert (one.groups[0].ready, one.iteration_s) == (2.25, 3.25)
    c = cost([1.0, 1.0], ag=(1.0, 0.0), cpu=(1.5, 0.0))
    both = simulate(plan([100, 100], [(0, 2)], [True, True], [1, 1], offload=[True, True]), c)
    assert both.compute_end == 2.0 and both.cpu_end == 4.0         # t1 queues behind t0: 2.5-4
    assert both.iteration_s == 5.0


def test_interleaved_group_allgather_waits_for_allreduce_and_sparse_tensors():
    p = plan([100, 100], [(0, 2)], [False, True], [100, 1], [ALLREDUCE, ALLGATHER])
    c = cost([1.0, 1.0], ar=(0.5, 0.0), ag=(1.0, 0.0), gpu=(0.25, 0.0))
    g = simulate(p, c, check=False).groups[0]
    assert (g.ar_start, g.ar_end) == (1.0, 1.5)
    assert (g.ag_start, g.ag_end) == (2.25, 3.25)
    slow = simulate(p, cost([1.0, 1.0], ar=(2.0, 0.0), ag=(1.0, 0.0), gpu=(0.25, 0.0)), check=False)
    assert (slow.groups[0].ag_start, slow.iteration_s) == (3.0, 4.0)
    # the optimizer's agreement allreduce, submitted once backward is done, goes last
    t = simulate(p, c)
    g = t.groups[0]
    assert (g.ar_start, g.ar_end, g.ag_start, g.ag_end) == (1.0, 1.5, 2.25, 3.25)
    assert t.iteration_s == 3.25 + 0.5


def test_packing_a_group_costs_a_memory_pass_on_the_compute_thread():
    # decode's per-byte rate, 1/400 s per byte: packing the allreduce part (400 B) when t0
    # is done, 1-2; t1's backward 2-3; its 400 B staged 3-4, selected 4-4.25
    p = plan([100, 100], [(0, 2)], [False, True], [100, 1], [ALLREDUCE, ALLGATHER])
    t = simulate(p, _model([1.0, 1.0], ar=(0.5, 0.0), ag=(1.0, 0.0), gpu=(0.25, 0.0),
                           decode=(0.0, 1 / 400)), check=False)
    g = t.groups[0]
    assert (g.ar_start, g.backward_end, g.ag_start, t.compute_end) == (2.0, 3.0, 4.25, 4.25)


def test_multi_tensor_buffer_is_sparsified_once_after_its_last_backward():
    p = plan([300, 200], [(0, 2)], [True, True], [None, None], buffer_k={0: 5})
    t = simulate(p, cost([1.0, 1.0], ag=(1.0, 1 / 1024), gpu=(0.25, 1 / 2000), forward=0.5))
    g = t.groups[0]
    # backward 0.5-2.5, buffer of 2000 B sparsified 2.5-3.75, 5 values + 5 int32 indices = 40 B
    assert (g.backward_start, g.backward_end, g.ready) == (0.5, 2.5, 3.75)
    assert t.iteration_s == 3.75 + 1.0 + 40 / 1024


def _model(backward, ar=(0.0, 0.0), ag=(0.0, 0.0), gpu=(0.0, 0.0), cpu=(0.0, 0.0),
           decode=(0.0, 0.0), shared_cores=False):
    """A cost model with the same fits for "topk" (segmented) and "dgc" (per tensor)."""
    fits = {"gpu": gpu, "cpu": cpu}
    return CostModel(4, ar, ag, {"dgc": fits, "topk": fits}, backward, 4, 0.0,
                     decode=decode, shared_cores=shared_cores)


def _with(p: Plan, sparsifier: str) -> Plan:
    return Plan.from_json(p.to_json().replace('"sparsifier": "dgc"', f'"sparsifier": "{sparsifier}"'))


def test_a_group_is_selected_once_it_is_complete_in_one_segmented_call():
    # two sparsified tensors of 400 B: backward 0-2, then top-k of both in ONE call
    # (0.5 + 800 B / 800), allgather 3.5-4.5, decode 0.25; dgc calls once per tensor
    p = plan([100, 100], [(0, 2)], [True, True], [1, 1])
    c = _model([1.0, 1.0], ag=(1.0, 0.0), gpu=(0.5, 1 / 800), decode=(0.25, 0.0))
    seg = simulate(_with(p, "topk"), c)
    assert (seg.compute_end, seg.groups[0].ag_start, seg.iteration_s) == (3.5, 3.5, 4.75)
    per_tensor = simulate(_with(p, "dgc"), c)
    assert (per_tensor.compute_end, per_tensor.iteration_s) == (4.0, 5.25)


def test_the_allreduce_part_leaves_when_its_last_tensor_is_ready():
    # t1 rides the allreduce: it leaves at 2 (t1's backward), before the group's selection
    p = _with(plan([100, 100, 100], [(0, 3)], [True, False, True], [1, 100, 1],
                   [ALLGATHER, ALLREDUCE, ALLGATHER]), "topk")
    t = simulate(p, _model([1.0] * 3, ar=(0.5, 0.0), ag=(1.0, 0.0), gpu=(0.25, 0.0)))
    g = t.groups[0]
    assert (g.ar_start, g.ar_end, g.ag_start, g.ag_end) == (2.0, 2.5, 3.25, 4.25)
    assert t.iteration_s == 4.25 + 0.5  # the optimizer's agreement follows on the link


def test_decode_runs_after_backward_group_by_group():
    # the dense groups of the first test, 1024 B each; a memory pass costs 1 s per 1024 B,
    # a decode 0.25 more. Group 0: backward 0-3, packed 3-4, allreduce 4-5.5; group 1:
    # backward 4-7, packed 7-8, allreduce 8-9.5. Decode: group 0 waits for backward's end
    # (8): 8-9.25; group 1 for its allreduce: 9.5-10.75, the end of the iteration
    p = plan([128, 128, 256], [(0, 2), (2, 3)], [False] * 3, [128, 128, 256], [ALLREDUCE] * 3)
    t = simulate(p, _model([1.0, 2.0, 3.0], ar=(0.5, 1 / 1024), decode=(0.25, 1 / 1024)))
    assert [(g.ar_start, g.ar_end) for g in t.groups] == [(4.0, 5.5), (8.0, 9.5)]
    assert [g.decode_end for g in t.groups] == [9.25, 10.75] and t.iteration_s == 10.75
    # a sparse group's decode touches its output and the P gathered records: 400 + 4 x 8 B
    sparse = plan([100], [(0, 1)], [True], [1])
    assert decode_bytes(sparse, 0, 4, 4) == 432
    # entries that carry their sender's wait (scheme_options["waits"]): 9 B each
    assert decode_bytes(sparse, 0, 4, 4, entry_extra=1) == 436


def test_the_wait_byte_lengthens_the_sparse_allgather():
    """A cost model with ``entry_extra=1`` (the planned schemes' ``waits``) charges a
    sparse entry its value, its index and one byte: the allgather of 50 + 10 entries
    takes 60 x 9 B instead of 60 x 8 B; dense tensors are unchanged."""
    p = _with(plan([1000, 200, 30], [(0, 3)], [True, True, False], [50, 10, 30],
                   [ALLGATHER] * 3), "topk")
    plain = _model([1.0] * 3, ag=(0.0, 1 / 1024))
    waits = dataclasses.replace(plain, entry_extra=1)
    assert waits.entry_size(1000) == plain.entry_size(1000) + 1 == 9
    g0, g1 = simulate(p, plain).groups[0], simulate(p, waits).groups[0]
    assert (g0.ag_end - g0.ag_start) * 1024 == pytest.approx(60 * 8 + 30 * 4)
    assert (g1.ag_end - g1.ag_start) * 1024 == pytest.approx(60 * 9 + 30 * 4)


def test_the_link_runs_collectives_in_submission_order():
    # group 0's tensor is offloaded (worker 1-4): group 1's allreduce, submitted at 2,
    # crosses the link before group 0's allgather, submitted at 4
    p = plan([100, 100], [(0, 1), (1, 2)], [True, False], [1, 100], [ALLGATHER, ALLREDUCE],
             offload=[True, False])
    c = _model([1.0, 1.0], ar=(0.5, 0.0), ag=(1.0, 0.0), cpu=(3.0, 0.0), decode=(0.25, 0.0))
    t = simulate(p, c)
    g0, g1 = t.groups
    assert (g1.ar_start, g1.ar_end, g0.ready, g0.ag_start, g0.ag_end) == (2.0, 2.5, 4.0, 4.0, 5.0)
    assert (t.cpu_end, [g.decode_end for g in t.groups], t.iteration_s) == (4.0, [5.25, 5.5], 5.5)


def test_an_offload_worker_sharing_the_cores_takes_its_time_from_backward():
    # the same plan on a CPU-only job: t0's selection runs on the compute thread, 1-4,
    # so t1's backward runs 4-5; offloading frees nothing, and is never chosen there
    p = plan([100, 100], [(0, 1), (1, 2)], [True, False], [1, 100], [ALLGATHER, ALLREDUCE],
             offload=[True, False])
    c = _model([1.0, 1.0], ar=(0.5, 0.0), ag=(1.0, 0.0), cpu=(3.0, 0.0), decode=(0.25, 0.0),
               shared_cores=True)
    t = simulate(p, c)
    g0, g1 = t.groups
    assert (g0.ag_start, g1.backward_end, g1.ar_start, g1.decode_end) == (4.0, 5.0, 5.0, 5.75)
    assert t.iteration_s == 6.0  # the optimizer's agreement follows the allreduce: 5.5-6
    base = fused_plan([10**6] * 4, [(0, 2), (2, 4)], "per_tensor", 0.01, "ssfusion")
    roomy = _model([1.0] * 4, ag=(1e-3, 1e-9), gpu=(0.5, 0.0), cpu=(1e-3, 0.0))
    assert any(choose_offload(base, roomy).offload)
    shared = _model([1.0] * 4, ag=(1e-3, 1e-9), gpu=(0.5, 0.0), cpu=(1e-3, 0.0), shared_cores=True)
    assert not any(choose_offload(base, shared).offload)


def test_simulate_rejects_mismatched_cost_model():
    with pytest.raises(ValueError, match="backward times"):
        simulate(plan([1, 2], [(0, 2)], [False] * 2, [1, 2]), cost([1.0]))


def test_plan_validation():
    with pytest.raises(ValueError, match="cover"):
        plan([1, 2], [(0, 1)], [False] * 2, [1, 2])
    with pytest.raises(ValueError, match="inconsistent"):       # a sparse tensor cannot be allreduced
        plan([10, 2], [(0, 2)], [True, False], [1, 2], [ALLREDUCE, ALLREDUCE])
    with pytest.raises(ValueError, match="inconsistent"):       # k >= 1: no tensor missing
        plan([10], [(0, 1)], [True], [0])


def test_warmup_stages_scale_each_tensors_share_not_its_floor():
    # at the plan's density 0.01: t0 (32 elements, share 0.32) held at its floor of 1, t1
    # compensated below its share (80 of 10000), t2 dense, t3 a multi-tensor buffer of 5000
    p = plan([32, 10_000, 64, 5000], [(0, 3), (3, 4)], [True, True, False, True],
             [1, 80, 64, None], [ALLGATHER, ALLGATHER, ALLREDUCE, ALLGATHER], buffer_k={1: 50})
    assert p.at_density(0.01) is p
    for d, want in [(0.25, [8, 2000, 64]), (0.02, [1, 160, 64]), (0.05, [2, 400, 64]),
                    (1.0, [32, 8000, 64])]:
        at = p.at_density(d)
        assert at.k[:3] == want, d
        assert at.k[3] is None and at.groups[1].buffer_k == min(5000, round(50 * d / 0.01))
        # the floored tensor sends what global top-k would give it at the stage
        assert at.k[0] == max(1, nominal_k(32, d))
        assert at.density == d and at.sparse == p.sparse and at.collective == p.collective


# -- density-aware compensation (SSFusion §IV-B) ------------------------------------------

@settings(max_examples=300, deadline=None)
@given(
    tensors=st.lists(st.tuples(st.integers(1, 3_000_000), st.booleans(), st.booleans()),
                     min_size=1, max_size=40),
    density=st.sampled_from([0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5]),
    betas=st.sampled_from([(1e-9, 1e-9), (2e-9, 1e-8), (1e-9, 6.3e-8), (0.0, 0.0)]),
)
def test_compensation_invariants(tensors, density, betas):
    """Link time equalized to every tensor sparsified at d; no sparsified tensor below the
    floor; only tensors that were dense can change kind, and only to sparsified."""
    sizes = [n for n, _, _ in tensors]
    n = len(sizes)
    sparse = [s for _, s, _ in tensors]
    coll = [ALLGATHER if s or ag else ALLREDUCE for _, s, ag in tensors]
    k = [nominal_k(size, density) if s else size for size, s, _ in tensors]
    p = Plan("x", [f"t{i}" for i in range(n)], sizes, [Group(0, n)], sparse, k, coll,
             [False] * n, density)
    c = cost([0.0] * n, ar=(1e-4, betas[0]), ag=(1e-4, betas[1]))
    out = compensate_density(p, c)
    floor = floor_density(density)
    assert floor >= min(density, MIN_DENSITY) and floor >= density / 2
    for i in range(n):
        if out.sparse[i]:
            assert out.k[i] >= nominal_k(sizes[i], floor) and 1 <= out.k[i] <= sizes[i]
            assert out.collective[i] == ALLGATHER
        else:
            assert not sparse[i] and out.k[i] == sizes[i] and out.collective[i] == coll[i]
    budget, spent = wire_budget(p, c), wire_time(out, c)
    b_ag = betas[1] if betas[1] > 0 and betas[0] > 0 else 1.0
    # never over the budget by more than rounding: one element (4 B value + 4 B index)
    # per sparsified tensor, from largest-remainder rounding and the floor's ceil()
    assert spent <= budget + b_ag * 8 * sum(out.sparse) + 1e-9 * budget


def test_compensation_equalizes_link_time_not_elements():
    """Two 1e6 tensors sparsified at 1 %, one dense: the dense one is paid for in link
    time (allreduce bytes vs allgather value+index bytes), not in elements."""
    def compensate(dense_numel, beta_ar):
        sizes = [10**6, 10**6, dense_numel]
        p = Plan("x", ["a", "b", "c"], sizes, [Group(0, 3)], [True, True, False],
                 [10_000, 10_000, dense_numel], [ALLGATHER, ALLGATHER, ALLREDUCE],
                 [False] * 3, 0.01)
        return compensate_density(p, cost([0.0] * 3, ar=(0.0, beta_ar), ag=(0.0, 1e-9)))

    # budget: 20 050 elements x 8 B = 160 400 B of allgather time. Dense 5 000 x 4 B by an
    # allreduce costing as much per byte: 20 000 B -> 140 400 B / 8 = 17 550 sparse elements
    out = compensate(5_000, 1e-9)
    assert out.k == [8_775, 8_775, 5_000] and out.sparse == [True, True, False]
    # the same dense tensor on an allreduce half as dear per byte costs half
    out = compensate(5_000, 0.5e-9)
    assert out.k == [9_400, 9_400, 5_000]
    # a dense tensor that would push the others below d/2 = 0.005 goes sparsified instead
    out = compensate(30_000, 1e-9)
    assert out.sparse == [True, True, True] and out.collective[2] == ALLGATHER
    assert out.k[2] >= nominal_k(30_000, 0.005) and min(out.k[:2]) >= 5_000
    # the old element count would have left 'a' and 'b' at the 0.001 floor (k = 1 000)
    assert floor_density(0.01) == 0.005 and floor_density(0.001) == 0.001


def test_compensation_sends_fewer_dense_costliest_first():
    sizes = [10**6, 4_000, 3_000, 2_000]
    p = Plan("x", list("abcd"), sizes, [Group(0, 4)], [True, False, False, False],
             [10_000, 4_000, 3_000, 2_000], [ALLGATHER] + [ALLREDUCE] * 3, [False] * 4, 0.01)
    out = compensate_density(p, cost([0.0] * 4, ar=(0.0, 1e-9), ag=(0.0, 1e-9)))
    # budget 10 090 x 8 B = 80 720 B; all dense: 36 000 B leaves 44 720 B = 5 590 elements
    # for 'a', above the floor 5 000: everything may stay dense
    assert out.sparse == [True, False, False, False] and out.k[0] == 5_590
    sizes[0] = 6 * 10**5
    p = Plan("x", list("abcd"), sizes, [Group(0, 4)], [True, False, False, False],
             [6_000, 4_000, 3_000, 2_000], [ALLGATHER] + [ALLREDUCE] * 3, [False] * 4, 0.01)
    out = compensate_density(p, cost([0.0] * 4, ar=(0.0, 1e-9), ag=(0.0, 1e-9)))
    # budget 6 090 x 8 = 48 720 B: 36 000 dense leaves 1 590 < 3 000: 'b' (the costliest)
    # goes sparsified, then 20 000 B dense leaves (48 720 - 20 000) / 8 = 3 590 elements
    # shared by 604 000 at one density (0.0059 >= the floor): 3 566 + 24
    assert out.sparse == [True, True, False, False]
    assert out.k[:2] == [3_566, 24]
    assert min(out.k[0] / 6e5, out.k[1] / 4e3) >= 0.005


def test_compensation_pays_the_floors_from_the_budget():
    """Small tensors whose share is below their floor of one element keep that element,
    and it comes out of the large tensor's share: the plan sends ``d·Σn`` elements. (It
    used to budget ``Σ ceil(d·n)`` and add the floors on top: 608 here, and the density
    warm-up multiplies the plan's k, so a small MLP at 0.001 sent 1.24x its density in
    every stage.)"""
    sizes = [60_000, 50, 50, 50, 50, 10]
    p = Plan("x", [f"t{i}" for i in range(6)], sizes, [Group(0, 6)], [True] * 6,
             [int(nominal_k(n, 0.01)) for n in sizes], [ALLGATHER] * 6, [False] * 6, 0.01)
    c = cost([0.0] * 6, ar=(0.0, 1e-9), ag=(0.0, 1e-9))
    out = compensate_density(p, c)
    # 602.1 elements of budget; 0.5 and 0.1 of them for the small ones, which keep 1 each
    assert out.k == [597, 1, 1, 1, 1, 1]
    assert sum(out.k) == round(0.01 * sum(sizes))
    assert wire_time(out, c) <= wire_budget(p, c)
    # without small tensors nothing changes: the exact budget is the large tensor's k
    alone = Plan("x", ["a"], [60_000], [Group(0, 1)], [True], [600], [ALLGATHER], [False], 0.01)
    assert compensate_density(alone, c).k == [600]


# -- offloading (SSFusion-O) -------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_offload_fits_the_backward_window_and_never_slows_down(data):
    n = data.draw(st.integers(1, 12))
    sizes = data.draw(st.lists(st.integers(1, 10**6), min_size=n, max_size=n))
    bwd = data.draw(st.lists(st.floats(0, 5e-3), min_size=n, max_size=n))
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
    c = cost(bwd, ag=(1e-3, 1e-9), gpu=(data.draw(st.floats(0, 2e-3)), 1e-10),
             cpu=(data.draw(st.floats(0, 4e-3)), 1e-9))
    base = fused_plan(sizes, list(zip([0] + cuts, cuts + [n])), "per_tensor", 0.01, "ssfusion")
    off = choose_offload(base, c)
    assert simulate(off, c).iteration_s <= simulate(base, c).iteration_s + 1e-15
    # replay the decisions: each offloaded tensor's CPU finish lies inside its group's window
    cpu, compute = 0.0, 0.0
    for g in off.groups:
        window_end = compute + sum(bwd[g.start:g.end])
        inline = []
        for i in g.indices():
            compute += bwd[i]
            if off.offload[i]:
                cpu = max(cpu, compute) + c.sparsify_s("dgc", "cpu", sizes[i] * 4)
                assert cpu <= window_end
            else:
                inline.append(sizes[i] * 4)
        compute += c.select_s("dgc", "gpu", inline)  # the rest, once the group is complete


# -- scheme builders on real layer lists --------------------------------------------------

@pytest.fixture(scope="module")
def resnet50():
    tensors = model_tensors("resnet50")
    sizes = [n for _, n in tensors]
    c = CostModel.from_network(10e9, 25e-6, 16, default_backward_times(sizes))
    return [name for name, _ in tensors], sizes, c


def test_every_scheme_on_resnet50(resnet50):
    names, sizes, c = resnet50
    plans = {s: build_plan(s, sizes, c, 0.01, names) for s in PLANNERS}
    times = {s: simulate(p, c).iteration_s for s, p in plans.items()}
    assert all(p.scheme == s for s, p in plans.items() if s != "auto")
    assert plans["auto"].scheme in PLANNERS and plans["auto"].notes["chosen_by"] == "auto"
    # no tensor missing outside multi-tensor sparsification
    for s in ("per_tensor", "ssfusion", "ssfusion_o", "ssfusion_i", "ssfusion_oi"):
        assert all(k is not None and k >= 1 for k in plans[s].k), s
    assert plans["dense"].sent_elements() == sum(sizes)
    assert plans["per_tensor"].sent_elements() == sum(nominal_k(n, 0.01) for n in sizes)
    assert len(plans["per_tensor"].groups) == len(sizes)
    mt = plans["multi_tensor"]
    assert all(g.buffer_k == nominal_k(sum(sizes[g.start:g.end]), 0.01) for g in mt.groups)
    # SSFusion's fusion buffers are the optimal fusion of per-tensor sparsified tensors
    # (§IV-B Step-1, optimized for what runs in them)
    per_tensor_fusion = optimal_fusion(sizes, c, "per_tensor", 0.01)
    for s in ("ssfusion", "ssfusion_o", "ssfusion_i", "ssfusion_oi"):
        assert [(g.start, g.end) for g in plans[s].groups] == \
            [(g.start, g.end) for g in per_tensor_fusion.groups], s
    # density-aware compensation holds link time to every tensor sparsified at 0.01 (up to
    # one element of rounding per tensor) and keeps every sparsified tensor >= 0.005
    slack = c.allgather[1] * 8 * len(sizes)
    for s in ("ssfusion", "ssfusion_o", "ssfusion_i", "ssfusion_oi"):
        assert wire_time(plans[s], c) <= wire_budget(plans[s], c) + slack, s
        assert all(k >= nominal_k(n, 0.005) for k, n, sp in zip(plans[s].k, sizes, plans[s].sparse)
                   if sp), s
    # SSFusion-I splits what §IV-B's selection left dense, never more
    dense_i = {i for i, sp in enumerate(plans["ssfusion_i"].sparse) if not sp}
    assert dense_i <= {i for i, sp in enumerate(plans["ssfusion"].sparse) if not sp}
    # offloading only ever helps; interleaved groups send their dense part by allreduce
    assert times["ssfusion_o"] <= times["ssfusion"]
    assert times["ssfusion_oi"] <= times["ssfusion_i"]
    assert any(x == ALLREDUCE for x in plans["ssfusion_i"].collective)


def test_keep_small_dense_sends_tensors_with_tiny_k_dense(resnet50):
    """The accuracy rule: a per-tensor sparsified tensor whose top-k at the user's density
    would keep fewer than min_k elements (norms, biases) is sent dense; nothing else
    changes, so the other tensors keep their compensated k. The dense ones ride the
    group's allreduce part when it has one, else its allgather (no collective added)."""
    names, sizes, c = resnet50
    for s in ("ssfusion", "ssfusion_o", "ssfusion_i", "ssfusion_oi"):
        paper = build_plan(s, sizes, c, 0.01, names)
        ruled = build_plan(s, sizes, c, 0.01, names, min_k=32)
        small = {i for i, n in enumerate(sizes) if nominal_k(n, 0.01) < 32}
        assert small and all(sizes[i] < 3200 for i in small)
        assert ruled.groups == paper.groups, s
        assert ruled.notes["min_k"] == "32" and "min_k" not in paper.notes, s
        for i in range(len(sizes)):
            if i in small:
                assert not ruled.sparse[i] and ruled.k[i] == sizes[i] and not ruled.offload[i], (s, i)
            elif ruled.sparse[i]:  # the time-based decisions stand, k included
                assert (paper.sparse[i], paper.k[i]) == (True, ruled.k[i]), (s, i)
        for g in ruled.groups:
            members = list(g.indices())
            had_ar = any(paper.collective[i] == ALLREDUCE for i in members)
            for i in members:
                if i in small and paper.sparse[i]:
                    assert ruled.collective[i] == (ALLREDUCE if had_ar else ALLGATHER), (s, i)
        # simulated never slower than Horovod's dense buckets (the fallback still applies)
        dense = build_plan("dense", sizes, c, 0.01, names)
        assert simulate(ruled, c).iteration_s <= simulate(dense, c).iteration_s
    # the same rule as a function; 0 is the paper's planner; multi-tensor buffers untouched
    p = build_plan("ssfusion_oi", sizes, c, 0.01, names)
    assert keep_small_dense(p, 0) is p
    mt = build_plan("multi_tensor", sizes, c, 0.01, names)
    assert keep_small_dense(mt, 10**9) == mt
    assert build_plan("per_tensor", sizes, c, 0.01, names, min_k=32).sparse == [True] * len(sizes)
    assert all(not keep_small_dense(p, 10**9).sparse[i] for i in range(len(sizes)))
    # auto compares the ruled SSFusion plans
    auto = build_plan("auto", sizes, c, 0.01, names, min_k=32)
    if auto.scheme.startswith("ssfusion"):
        assert all(not auto.sparse[i] for i in small)


def test_keep_small_dense_by_hand():
    # density 0.01: k = 1, 2, 11, 100 for these sizes; min_k 2 keeps the first dense only
    p = plan([100, 150, 1050, 10_000], [(0, 2), (2, 4)], [True, True, True, False],
             [1, 2, 11, 10_000], coll=[ALLGATHER, ALLGATHER, ALLGATHER, ALLREDUCE],
             offload=[True, False, False, False])
    q = keep_small_dense(p, 2)
    assert q.sparse == [False, True, True, False] and q.k == [100, 2, 11, 10_000]
    assert q.collective == [ALLGATHER] * 3 + [ALLREDUCE] and q.offload == [False] * 4
    q = keep_small_dense(p, 12)  # the second group has an allreduce part: joins it
    assert q.sparse == [False, False, False, False] and q.k == [100, 150, 1050, 10_000]
    assert q.collective == [ALLGATHER, ALLGATHER, ALLREDUCE, ALLREDUCE]
    assert p.sparse == [True, True, True, False]  # the input is not changed


def test_dense_groups_follow_horovods_cycle_and_threshold():
    """Horovod fuses what became ready in one cycle (1 ms), up to the threshold."""
    from ssfusion_hvd.plan.schemes import horovod_groups
    c = CostModel(4, (0, 0), (0, 0), {}, [0.4e-3, 0.4e-3, 0.4e-3, 0.9e-3, 0.1e-3])
    # ready at 0.4, 0.8 | 1.2 | 2.1, 2.2 ms
    assert horovod_groups([10] * 5, c, 1 << 20) == [(0, 2), (2, 3), (3, 5)]
    assert horovod_groups([10] * 5, c, 60) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert horovod_groups([10] * 5, c, 1 << 20, cycle_s=0) == [(0, 5)]
    plan = build_plan("dense", [10] * 5, c)
    assert [(g.start, g.end) for g in plan.groups] == [(0, 2), (2, 3), (3, 5)]


def test_threshold_groups():
    assert threshold_groups([10, 10, 10, 50, 1], 80) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert threshold_groups([3, 3, 3], 0) == [(0, 1), (1, 2), (2, 3)]
    assert threshold_groups([], 64) == []


def test_build_plan_rejects_bad_arguments(resnet50):
    _, sizes, c = resnet50
    with pytest.raises(ValueError, match="unknown scheme"):
        build_plan("allgather_everything", sizes, c)
    with pytest.raises(ValueError, match="density"):
        build_plan("ssfusion", sizes, c, density=0.0)


# -- JSON and text ----------------------------------------------------------------------

def test_cost_model_json_round_trip(tmp_path, resnet50):
    _, _, c = resnet50
    assert CostModel.from_json(c.to_json()) == c
    c.save(tmp_path / "profile.json")
    assert CostModel.load(tmp_path / "profile.json") == c


@pytest.mark.parametrize("scheme", PLANNERS)
def test_plan_json_round_trip_and_table(tmp_path, resnet50, scheme):
    names, sizes, c = resnet50
    p = build_plan(scheme, sizes, c, 0.01, names)
    assert Plan.from_json(p.to_json()) == p
    p.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == p
    t = simulate(p, c)
    text = p.table(t)
    assert f"scheme={p.scheme}" in text and f"groups={len(p.groups)}" in text
    assert (p.scheme == scheme) == (scheme != "auto")
    assert ("(chosen by auto)" in text) == (scheme == "auto")
    assert all(name in text for name in names)
    assert text.count(" group [") == len(p.groups)
    rows = [cells for cells in map(str.split, text.splitlines())  # one per tensor
            if len(cells) > 2 and cells[0].isdigit() and cells[1].isdigit()]
    assert len(rows) == len(p) and [r[-1] for r in rows] == [
        "worker" if p.offload[i] else ("inline" if p.sparse[i] else "-") for i in range(len(p))]
    assert f"simulated iteration time: {t.iteration_s * 1e3:.3f} ms" in text


# -- cost model ----------------------------------------------------------------------------

def test_from_network_ring_formulas():
    c = CostModel.from_network(8e9, 1e-5, 4, [0.0])           # 1 GB/s
    assert c.allreduce == pytest.approx((6e-5, 1.5e-9))       # 2(P-1)·lat, 2(P-1)/P / B
    assert c.allgather == pytest.approx((3e-5, 3e-9))         # (P-1)·lat, (P-1) / B
    gpu_alpha, gpu_beta = c.sparsify["dgc"]["gpu"]            # SSFusion Table III, DGC on GPU
    assert gpu_alpha + gpu_beta * 10_000 * 1024 == pytest.approx(1.82e-3, rel=0.05)


def test_parse_bandwidth_and_nominal_k():
    assert parse_bandwidth("10Gbps") == 1e10
    assert parse_bandwidth("25 gbit") == 2.5e10
    assert parse_bandwidth("1e9") == 1e9
    assert nominal_k(100, 0.07) == 7 and nominal_k(5, 0.01) == 1 and nominal_k(3, 1.0) == 3
    assert list(nominal_k(np.array([100, 5, 250]), 0.01)) == [1, 1, 3]


# -- models --------------------------------------------------------------------------------

@pytest.mark.parametrize("model, count, total", [
    ("resnet50", 161, 25_557_032),
    ("resnet152", 467, 60_192_808),
    ("gpt2", 148, 124_439_808),
    ("bert-large", 391, 334_094_338),
])
def test_model_tensor_lists(model, count, total):
    tensors = model_tensors(model)
    assert len(tensors) == count and sum(n for _, n in tensors) == total
    last_forward = {"resnet50": "fc.bias", "resnet152": "fc.bias", "gpt2": "transformer.ln_f.bias",
                    "bert-large": "qa_outputs.bias"}[model]
    assert tensors[0][0] == last_forward                      # backward order


# -- CLI -----------------------------------------------------------------------------------

def test_cli_compares_every_scheme(capsys, tmp_path):
    assert cli_main(["--model", "resnet50", "--world-size", "16", "--bandwidth", "10Gbps",
                     "--density", "0.01", "--save-plan", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "assumption: backward time" in out and "scheme=ssfusion_oi" in out
    assert all(f"\n{s} " in out for s in PLANNERS)
    assert all(f"\n{s} " in out for s in ("spardl", "zen", "exdyna"))
    assert Plan.load(tmp_path / "p.json").scheme == "ssfusion_oi"
    # the CLI plans as the live scheme does: the paper's planner by default (min_k 0), the
    # small-tensor rule with --min-k
    saved = Plan.load(tmp_path / "p.json")
    small = [i for i, n in enumerate(saved.sizes) if nominal_k(n, 0.01) < 32]
    assert small and any(saved.sparse[i] for i in small)
    assert cli_main(["--model", "resnet50", "--world-size", "16", "--bandwidth", "10Gbps",
                     "--min-k", "32", "--save-plan", str(tmp_path / "q.json")]) == 0
    ruled = Plan.load(tmp_path / "q.json")
    assert ruled.sizes == saved.sizes and all(not ruled.sparse[i] for i in small)
    with pytest.raises(SystemExit, match="min-k"):
        cli_main(["--model", "resnet50", "--min-k", "-1"])


def test_cli_with_profile(capsys, tmp_path, resnet50):
    _, _, c = resnet50
    c.save(tmp_path / "profile.json")
    assert cli_main(["--model", "resnet50", "--profile", str(tmp_path / "profile.json"),
                     "--scheme", "multi_tensor"]) == 0
    out = capsys.readouterr().out
    assert "profile.json (world size 16)" in out and "scheme=multi_tensor" in out
    assert "assumption" not in out


# -- closed-form costs of the non-plan schemes ---------------------------------------------

def test_formulas_match_the_papers():
    from ssfusion_hvd.plan import formulas

    bw, lat, p = 1e9, 1e-4, 4
    cost = CostModel.from_network(bw, lat, p, backward_s=[1e-3, 2e-3])
    alpha, beta = formulas.message_cost(cost)
    assert alpha == pytest.approx(lat) and beta == pytest.approx(8 / bw)
    n, k = 1_000_000, 10_000
    # SparDL Eq. 4: 2 ceil(log2 P) alpha + 4k (P-1)/P beta, one unit = 4 bytes (value or index)
    want = 2 * 2 * lat + 4 * k * (3 / 4) * 4 * (8 / bw)
    assert formulas.spardl_comm_s(cost, n, k) == pytest.approx(want)
    # P = 3: ceil(log2 3) = 2 steps
    c3 = CostModel.from_network(bw, lat, 3, backward_s=[])
    assert formulas.spardl_comm_s(c3, n, k) == pytest.approx(4 * lat + 4 * k * (2 / 3) * 4 * 8 / bw)
    # ZEN: densification between 1 (full overlap) and P (disjoint)
    g = formulas.zen_densification(0.01, p)
    assert 1 < g <= p and g == pytest.approx((1 - 0.99 ** 4) / 0.01)
    want = 2 * lat + (3 / 4) * (g + 1) * n * 0.01 * 8 * (8 / bw)
    assert formulas.zen_comm_s(cost, n, 0.01) == pytest.approx(want)
    assert formulas.exdyna_comm_s(cost, n, k) == pytest.approx(cost.allgather_s(2500 * 4)
                                                               + cost.allreduce_s(k * 4))
    single = CostModel.from_network(bw, lat, 1, backward_s=[])
    assert formulas.spardl_comm_s(single, n, k) == formulas.zen_comm_s(single, n, 0.01) == 0.0
    t = formulas.iteration_s("spardl", cost, [n], 0.01, "dgc")
    assert t == pytest.approx(3e-3 + cost.sparsify_s("dgc", "gpu", 4 * n)
                              + formulas.spardl_comm_s(cost, n, k))
    with pytest.raises(ValueError, match="no cost formula"):
        formulas.iteration_s("dense", cost, [n], 0.01, "dgc")


@pytest.mark.parametrize("gbit", [1, 10, 100, 10_000])
def test_ssfusion_plans_never_lose_to_horovods_dense_buckets(gbit):
    """Selective sparsification decides per tensor; the plan as a whole must still be at
    least as fast, under its own cost model, as Horovod's dense allreduce of 64 MiB
    buckets. On a network fast enough that sparsification never pays, it is those
    buckets."""
    tensors = model_tensors("resnet152")
    names, sizes = [n for n, _ in tensors], [n for _, n in tensors]
    c = CostModel.from_network(gbit * 1e9, 25e-6, 16, default_backward_times(sizes))
    horovod = build_plan("dense", sizes, c, 0.01, names)
    for s in ("ssfusion", "ssfusion_o", "ssfusion_i", "ssfusion_oi"):
        p = build_plan(s, sizes, c, 0.01, names)
        assert simulate(p, c).iteration_s <= simulate(horovod, c).iteration_s, (s, gbit)
        assert p.scheme == s
        if gbit == 10_000:
            assert not any(p.sparse), s
            assert p.groups == horovod.groups and p.collective == horovod.collective, s


@pytest.mark.parametrize("gbit, expect_dense", [(10_000, True), (0.1, False)])
def test_auto_picks_the_fastest_simulated_plan_never_slower_than_dense(gbit, expect_dense):
    """scheme="auto": every planned scheme's plan and Horovod's dense buckets, simulated on
    the same cost model; the fastest runs. A very fast link: dense. A slow one: sparse."""
    tensors = model_tensors("resnet50")
    names, sizes = [n for n, _ in tensors], [n for _, n in tensors]
    c = CostModel.from_network(gbit * 1e9, 25e-6, 8, default_backward_times(sizes))
    auto = build_plan("auto", sizes, c, 0.01, names)
    predicted = json.loads(auto.notes["predicted_s"])
    assert auto.notes["chosen_by"] == "auto"
    assert set(predicted) == set(PLANNERS) - {"auto"}
    assert predicted[auto.scheme] <= min(predicted.values()) * (1 + AUTO_TIE)
    assert simulate(auto, c).iteration_s == predicted[auto.scheme] <= predicted["dense"]
    assert (auto.scheme == "dense") == expect_dense
    assert any(auto.sparse) != expect_dense
    # the plan is exactly that scheme's plan
    assert auto.groups == build_plan(auto.scheme, sizes, c, 0.01, names).groups


def test_auto_breaks_near_ties_by_preference_never_for_multi_tensor():
    """Plans predicted within AUTO_TIE of the fastest tie; the tie goes to dense, then the
    SSFusion family (no tensor missing), multi-tensor last. A compute-bound job where every
    sparse plan hides its communication under backward is such a tie."""
    sizes = [4_000_000, 1000, 2_000_000, 500, 30_000_000]
    names = [f"t{i}" for i in range(len(sizes))]
    # backward far longer than any sparse collective; dense far slower than sparse
    c = CostModel.from_network(1e8, 25e-6, 4, [0.5] * len(sizes),
                               sparsify={"topk": {"gpu": (1e-5, 1e-11), "cpu": (1e-5, 1e-11)}})
    auto = build_plan("auto", sizes, c, 0.01, names, "topk")
    predicted = json.loads(auto.notes["predicted_s"])
    fastest = min(predicted.values())
    tied = [s for s in AUTO_PREFERENCE if predicted[s] <= fastest * (1 + AUTO_TIE)]
    assert "multi_tensor" in tied and len(tied) > 1, predicted
    assert auto.scheme == tied[0] != "multi_tensor"
    assert AUTO_PREFERENCE.index(auto.scheme) < AUTO_PREFERENCE.index("multi_tensor")
    assert set(AUTO_PREFERENCE) == set(PLANNERS) - {"auto"}


# -- the group budget's planner rule ------------------------------------------------------

def _parts(p):
    """Sparse parts build_group makes: per group one for the inline tensors, one per
    offloaded tensor."""
    return sum(any(p.sparse[i] and not p.offload[i] for i in g.indices())
               + sum(p.offload[i] for i in g.indices()) for g in p.groups)


@pytest.mark.parametrize("model", ["resnet50", "gpt2", "bert-base"])
@pytest.mark.parametrize("scheme", ["ssfusion", "ssfusion_oi"])
def test_group_budget_plans_the_fewest_parts_within_the_slack(model, scheme):
    """Under the group budget the planner takes, among its candidates (the fastest plan;
    its groups without offloading; Cupcake's groups; one group), the one with the fewest
    sparse parts predicted within 1 + slack of the fastest candidate. Never slower than
    that bound, never more parts than the fastest plan; slack 0 with ties aside is the
    fastest candidate; floor None is the paper's planner."""
    tensors = model_tensors(model)
    names, sizes = [n for n, _ in tensors], [n for _, n in tensors]
    c = CostModel.from_network(1e9, 25e-6, 4, default_backward_times(sizes))
    paper = build_plan(scheme, sizes, c, 0.01, names, "dgc")
    assert paper.group_floor is None and "budget" not in paper.notes
    assert build_plan(scheme, sizes, c, 0.01, names, "dgc", group_floor=None,
                      accuracy_slack=0.2).to_json() == paper.to_json()
    t_paper = simulate(paper, c).iteration_s
    for slack in (0.0, 0.2, 10.0):
        p = build_plan(scheme, sizes, c, 0.01, names, "dgc", group_floor=0.0,
                       accuracy_slack=slack)
        assert p.group_floor == 0.0 and p.scheme == scheme
        t = simulate(p, c).iteration_s
        cands = json.loads(p.notes["budget_candidates"])
        assert set(cands) == {"fastest", "fastest, no offload", "Cupcake's groups", "one group"}
        assert cands["fastest"]["predicted_s"] == t_paper  # the paper's plan is a candidate
        best = min(v["predicted_s"] for v in cands.values())
        ok = {k: v for k, v in cands.items() if v["predicted_s"] <= best * (1 + slack)}
        assert cands[p.notes["budget"]]["predicted_s"] == t <= best * (1 + slack)
        assert _parts(p) == cands[p.notes["budget"]]["sparse_parts"] == min(
            v["sparse_parts"] for v in ok.values())
        assert _parts(p) <= _parts(paper)
        if slack == 10.0:  # anything goes: one group, one part
            assert len(p.groups) == 1 and _parts(p) == 1 and not any(p.offload)
    # on these models at 1 Gbit/s Cupcake's groups beat the per-tensor fusion: fewer parts
    # and faster
    p = build_plan(scheme, sizes, c, 0.01, names, "dgc", group_floor=0.0, accuracy_slack=0.2)
    assert _parts(p) < _parts(paper) and simulate(p, c).iteration_s < t_paper


def test_group_budget_takes_one_group_for_a_small_model():
    """A model whose one-group plan is predicted within the slack of the fastest plan runs
    as one group with nothing offloaded: every sparsified tensor shares one budget."""
    sizes = [10, 2560, 256, 65536, 256, 16384]  # an MLP's gradients, backward order
    names = [f"t{i}" for i in range(len(sizes))]
    c = CostModel.from_network(1e9, 25e-6, 2, [1e-4] * len(sizes),
                               sparsify={"topk": {"gpu": (2e-5, 2e-10), "cpu": (2e-5, 2e-10)}})
    fastest = build_plan("ssfusion_oi", sizes, c, 0.01, names, "topk", group_floor=0.0,
                         accuracy_slack=0.0)
    one = build_plan("ssfusion_oi", sizes, c, 0.01, names, "topk", group_floor=0.0,
                     accuracy_slack=10.0)
    assert len(one.groups) == 1 and not any(one.offload) and one.notes["budget"] == "one group"
    ratio = simulate(one, c).iteration_s / simulate(fastest, c).iteration_s
    within = build_plan("ssfusion_oi", sizes, c, 0.01, names, "topk", group_floor=0.0,
                        accuracy_slack=ratio - 1 + 1e-9)
    assert within.to_json() == one.to_json()


def test_the_allgather_curve_prices_what_the_fit_misses():
    """A measured allgather curve above the affine fit (Gloo's large messages) raises the
    allgather's cost there, and only there: below the smallest probe and where the curve is
    under the fit, the fit; between points, linear; beyond the last, its last segment's
    slope. The optimal fusion reads the same curve, so it can split a record the curve
    prices above its parts."""
    import dataclasses

    import numpy as np

    mib = float(1 << 20)
    fit = CostModel(world_size=2, allreduce=(1e-4, 1e-9), allgather=(1e-4, 1e-8),
                    sparsify={}, backward_s=(0.0,))
    curved = dataclasses.replace(fit, allgather_curve=((mib, 0.005), (4 * mib, 0.08),
                                                       (16 * mib, 0.34)))
    for x in (1000.0, mib):  # below the smallest probe; where the curve is under the fit
        assert curved.allgather_s(x) == fit.allgather_s(x)
    assert curved.allgather_s(2 * mib) == pytest.approx(0.005 + (0.08 - 0.005) / 3)
    assert curved.allgather_s(32 * mib) == pytest.approx(0.34 + (0.34 - 0.08) / 12 * 16)
    xs = np.array([1000.0, 2 * mib, 32 * mib])
    assert list(curved.allgather_many(xs)) == [curved.allgather_s(x) for x in xs]
    assert CostModel.from_json(curved.to_json()).allgather_curve == curved.allgather_curve


def test_the_optimal_fusion_splits_records_a_convex_allgather_prices_higher():
    """Four tensors whose records are 2 MiB each, no backward time: under the affine fit
    one group (one α) is optimal; under a curve whose slope doubles past 1 MiB (Gloo's
    large messages) the fusion splits them."""
    import dataclasses

    mib = float(1 << 20)
    a, b = 1e-4, 1e-8
    affine = CostModel(world_size=2, allreduce=(a, b), allgather=(a, b),
                       sparsify={"topk": {"gpu": (0.0, 0.0), "cpu": (0.0, 0.0)}},
                       backward_s=(0.0,) * 4)
    curve = tuple((x, a + b * min(x, mib) + 2 * b * max(0.0, x - mib))
                  for x in (4096.0, mib, 4 * mib, 16 * mib))
    convex = dataclasses.replace(affine, allgather_curve=curve)
    n = int(2 * mib / 8 / 0.01)  # k = 0.01 n entries of 8 bytes: 2 MiB a tensor
    one = optimal_fusion([n] * 4, affine, "multi_tensor", density=0.01, sparsifier="topk")
    split = optimal_fusion([n] * 4, convex, "multi_tensor", density=0.01, sparsifier="topk")
    assert len(one.groups) == 1 and len(split.groups) > 1
    assert simulate(split, convex).iteration_s < simulate(one, convex).iteration_s
