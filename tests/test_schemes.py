"""Every planned scheme against a reference built from the same inputs, on real Horovod workers.

The reference knows only the plan and, per rank, the local gradients and residuals: it
error-compensates (acc = grad + residual), selects by the plan's rules with the torch
reference top-k (per tensor, or over the whole fusion buffer for multi-tensor), sums over
ranks and scales by ``op``. The synchronized gradients must match up to float rounding,
and the next residual must be acc minus what was sent (nothing lost).
"""
import math
import zlib

import numpy as np
import pytest
import torch

from hvdrun import gpu_built, run_workers
import workers_schemes
from ssfusion_hvd import ops
from ssfusion_hvd.plan import Plan, nominal_k
from ssfusion_hvd.plan.schemes import AUTO_PREFERENCE, AUTO_TIE
from ssfusion_hvd.sparsify import make_sparsifier

pytestmark = pytest.mark.multiworker

SCHEMES = ["per_tensor", "multi_tensor", "ssfusion", "ssfusion_o", "ssfusion_i", "ssfusion_oi"]


def adam_denominator(adam, names, root=True):
    """The shared Adam rule's denominators from a recorded state ``{name: (step,
    exp_avg_sq)}``: sqrt(v) / sqrt(1 - 0.999^t) + 1e-8 (torch's defaults), flat in
    ``names``' order, the square root correctly rounded (numpy's; torch's CPU one is not);
    None where a tensor has no state yet (before Adam's first step; SGD). ``root`` (the
    default's key, by the gain): their square roots, what the selection divides by."""
    if not adam or set(adam) != set(names):
        return None
    parts = []
    for n in names:
        t, v = adam[n]
        b2s = math.sqrt(1.0 - 0.999 ** max(t, 1.0))
        parts.append(torch.from_numpy(np.sqrt(v.reshape(-1).float().numpy())) / b2s + 1e-8)
    den = torch.cat(parts)
    return torch.from_numpy(np.sqrt(den.numpy())) if root else den


def group_select(acc, sizes, k, floors):
    """The group budget by brute force: tensor i (``sizes[i]`` elements of ``acc``, back to
    back) keeps its ``floors[i]`` largest magnitudes, then the ``k - sum(floors)`` largest of
    all other elements join them; ties to the lower index. (index order)"""
    n = acc.numel()
    order = ops.magnitude_key(acc).long() * 2**32 + (2**32 - 1 - torch.arange(n))
    chosen = torch.zeros(n, dtype=torch.bool)
    lo = 0
    for size, f in zip(sizes, floors):
        chosen[lo + torch.topk(order[lo:lo + size], f).indices] = True
        lo += size
    chosen[torch.topk(order.masked_fill(chosen, -1), k - sum(floors)).indices] = True
    idx = chosen.nonzero().flatten()
    return acc[idx], idx.to(torch.int32)


def _select(sparsifier, acc, k, key, call):
    """The reference selection: torch top-k, the group budget (``k``: (budget, floors,
    sizes)), or random-k as the scheme seeds it (by the tensor's name or the fusion buffer's
    part key, identical on every rank) at its ``call``-th planned step."""
    if isinstance(k, tuple):
        budget, floors, sizes = k
        return group_select(acc, sizes, budget, floors)
    if sparsifier == "topk":
        return ops.topk(acc, k, backend="torch")
    s = make_sparsifier(sparsifier, seed=zlib.crc32(key.encode()))
    s.calls = call
    return s.select(acc, k)


def reference_step(plan: Plan, ranks, op="average", predivide=1.0, sent_out=None,
                   sparsifier="topk", call=0):
    """(expected synced grads, expected new residual per rank) of one planned step;
    ``sent_out`` (a list), when given, receives per rank {name: indices sent}."""
    nranks = len(ranks)
    grads = [{n: (g if g is not None else torch.zeros_like(r["synced"][n])).reshape(-1)
              for n, g in r["local"].items() if n in plan.names} for r in ranks]
    dtype = next(iter(grads[0].values())).dtype
    # the recipe's fp32 accumulation: 16-bit gradients are compensated and selected in
    # float32; the sent values are rounded to 16 bits and the rounding stays behind
    acc_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    total = {n: torch.zeros(plan.sizes[i], dtype=torch.float64) for i, n in enumerate(plan.names)}
    new_residual = [dict() for _ in ranks]
    sent_idx = [dict() for _ in ranks]
    for gi, g in enumerate(plan.groups):
        members = [plan.names[i] for i in g.indices()]
        if g.buffer_k is not None:
            units = [(members, g.buffer_k, f"g{gi}")]
        else:
            units = [([plan.names[i]], plan.k[i], plan.names[i]) for i in g.indices()
                     if plan.sparse[i]]
            inline = [i for i in g.indices() if plan.sparse[i] and not plan.offload[i]]
            if plan.group_floor is not None and sparsifier == "topk" and len(inline) > 1:
                # the group budget: the inline tensors share their k by magnitude
                budget = (sum(plan.k[i] for i in inline), plan.floors(inline),
                          [plan.sizes[i] for i in inline])
                units = [([plan.names[i] for i in inline], budget, f"g{gi}.s")] + [
                    u for u, i in zip(units, [i for i in g.indices() if plan.sparse[i]])
                    if plan.offload[i]]
            for i in g.indices():
                if not plan.sparse[i]:
                    for r in range(nranks):
                        total[plan.names[i]] += grads[r][plan.names[i]].double()
        for names, k, key in units:
            for r, rank in enumerate(ranks):
                acc = torch.cat([grads[r][n] for n in names]).to(acc_dtype)
                res = [rank["residual"].get(n) for n in names]
                if all(x is not None for x in res):
                    acc = acc + torch.cat([x.reshape(-1) for x in res])
                values, idx = _select(sparsifier, acc, k, key, call)
                wire = values.to(dtype).to(acc_dtype)
                sent = torch.zeros_like(acc)
                sent[idx.long()] = wire
                kept = acc.clone()
                kept[idx.long()] = values - wire
                lo = 0
                for n in names:
                    size = grads[r][n].numel()
                    total[n] += sent[lo:lo + size].double()
                    new_residual[r][n] = kept[lo:lo + size]
                    mine = idx.long()[(idx.long() >= lo) & (idx.long() < lo + size)]
                    sent_idx[r][n] = mine - lo
                    lo += size
    scale = 1.0 / nranks if op == "average" else 1.0
    if sent_out is not None:
        sent_out.extend(sent_idx)
    return {n: (t * scale).to(dtype) for n, t in total.items()}, new_residual


def check_run(runs, op="average", predivide=1.0, rtol=1e-5, atol=1e-6, sparsifier="topk"):
    """Checks every step of one scheme's run; returns the number of planned steps checked."""
    nsteps = len(runs[0]["steps"])
    checked = 0
    for s in range(nsteps):
        ranks = [run["steps"][s] for run in runs]
        for r in ranks[1:]:  # every rank holds the same synchronized gradient, bit for bit
            for n, t in r["synced"].items():
                assert torch.equal(t, ranks[0]["synced"][n]), (s, n)
        if ranks[0]["plan"] is None:  # warm-up: dense average
            for n, t in ranks[0]["synced"].items():
                local = [r["local"][n] for r in ranks]
                local = [torch.zeros_like(t) if x is None else x for x in local]
                want = sum(x.double() for x in local) / (len(ranks) if op == "average" else 1)
                torch.testing.assert_close(t.double(), want, rtol=rtol, atol=atol)
            continue
        # the plan in force: the density warm-up's stage (stats say which density)
        plan = Plan.from_json(ranks[0]["plan"]).at_density(ranks[0]["stats"]["density_target"])
        want, new_res = reference_step(plan, ranks, op, predivide, sparsifier=sparsifier,
                                       call=checked)
        for n, t in want.items():
            got = ranks[0]["synced"][n].reshape(-1)
            torch.testing.assert_close(got.double(), t.double(), rtol=rtol, atol=atol,
                                       msg=lambda m: f"step {s} tensor {n}: {m}")
        if s + 1 < nsteps:  # nothing lost: the next residual is acc minus what was sent
            for r, run in enumerate(runs):
                nxt = run["steps"][s + 1]["residual"]
                for n, kept in new_res[r].items():
                    assert torch.equal(nxt[n].reshape(-1), kept), (s, r, n)
        checked += 1
    return checked


def test_auto_runs_dense_on_a_fast_link_and_a_sparse_plan_on_a_slow_one():
    """scheme="auto" on 2 workers: on a 100 Tbit/s, 0.1 us link Horovod's dense fusion wins
    the simulation, on 10 Mbit/s with 50 us a sparse plan does; every rank runs the same
    plan, and its gradients equal the reference of that plan."""
    links = [(1e5, 1e-7), (0.01, 5e-5)]
    results = run_workers(workers_schemes.auto_runs, np=2, timeout=300, links=links,
                          steps=5, warmup=2)
    for i, want_sparse in ((0, False), (1, True)):
        gbit = links[i][0]
        runs = [r[i] for r in results]
        assert check_run(runs) == 3, gbit
        plans = {run["steps"][-1]["plan"] for run in runs}
        assert len(plans) == 1  # rank 0's choice, broadcast
        plan = Plan.from_json(plans.pop())
        st = runs[0]["steps"][-1]["stats"]
        assert st["scheme_chosen"] == plan.scheme and plan.notes["chosen_by"] == "auto"
        predicted = st["predicted_s"]  # the fastest, or the preferred of a near-tie with it
        tied = [s for s in AUTO_PREFERENCE
                if predicted[s] <= min(predicted.values()) * (1 + AUTO_TIE)]
        assert plan.scheme == tied[0], predicted
        assert any(plan.sparse) == want_sparse, (gbit, plan.scheme)
        assert (st["tensors_sparse"] > 0) == want_sparse


@pytest.mark.parametrize("np_", [2, 3])
def test_every_scheme_matches_reference(np_):
    results = run_workers(workers_schemes.record_all, np=np_, timeout=300,
                          schemes=SCHEMES, steps=5, warmup=2, min_k=True)
    # scheme_options {"min_k": 32}: every tensor whose top-k at density 0.05 would keep
    # fewer than 32 elements is sent dense (which plans the rule changes: tests/test_plan.py;
    # here the plan depends on measured backward times)
    plan = Plan.from_json(results[0]["min_k"]["steps"][-1]["plan"])
    small = [i for i, n in enumerate(plan.sizes) if nominal_k(n, 0.05) < 32]
    assert small and len(small) < len(plan.sizes)
    assert all(not plan.sparse[i] for i in small)
    for scheme in SCHEMES + ["forced", "forced_segmented", "min_k", "floor_none"]:
        runs = [r[scheme] for r in results]
        assert check_run(runs) == (5 if scheme.startswith("forced") else 3), scheme
        # the SSFusion schemes plan the group budget by default; floor None: per-tensor k
        if scheme.startswith("ssfusion") or scheme in ("min_k", "floor_none"):
            floor = Plan.from_json(runs[0]["steps"][-1]["plan"]).group_floor
            assert floor == (None if scheme == "floor_none" else 0.0), (scheme, floor)
        st = runs[0]["steps"][-1]["stats"]
        assert st["phase"] == "planned" and st["nonfinite"] == 0
        assert st["allreduce_bytes"] + st["allgather_bytes"] > 0
        if scheme in ("per_tensor", "multi_tensor", "forced"):
            assert st["allgather_bytes"] > 0
        if scheme == "forced":  # every part kind ran, the offload worker included
            assert st["allreduce_bytes"] > 0 and st["offload_s"] > 0
        if scheme != "multi_tensor":
            assert st["tensors_missing"] == 0, scheme
        # every rank ends with bit-identical parameters
        for r in runs[1:]:
            for n, t in r["params"].items():
                assert torch.equal(t, runs[0]["params"][n]), (scheme, n)


@pytest.mark.parametrize("variant", [
    dict(passes=2), dict(op="sum"), dict(predivide=2.0),
    dict(dtype="float16"), dict(dtype="bfloat16"),
])
def test_variants_match_reference(variant):
    """bfloat16: its records travel as raw 16-bit words and its dense parts are summed in
    float32 (Horovod 0.28.1 reduces no bfloat16); the sum is rounded to bfloat16 once."""
    schemes = ["per_tensor", "multi_tensor", "ssfusion_oi"]
    results = run_workers(workers_schemes.record_all, np=2, timeout=300, schemes=schemes,
                          steps=4, warmup=1, **variant)
    tol = {"float16": dict(rtol=2e-3, atol=2e-3),
           "bfloat16": dict(rtol=1.6e-2, atol=1.6e-2)}.get(variant.get("dtype"), {})
    for scheme in schemes + ["forced", "forced_segmented"]:
        runs = [r[scheme] for r in results]
        assert check_run(runs, op=variant.get("op", "average"),
                         predivide=variant.get("predivide", 1.0), **tol) == \
            (4 if scheme.startswith("forced") else 3), scheme


@pytest.mark.skipif(not gpu_built(2), reason="needs a CUDA device and a Horovod built with "
                    "CUDA (with NCCL operations: a GPU per rank)")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_every_scheme_matches_reference_on_a_gpu(dtype):
    """The same reference on a GPU job (two ranks: on one GPU through Horovod's host
    staging, or one GPU each under NCCL): gradients, selection kernels, packing and decode
    on the device; the offloaded selections (ssfusion_o, ssfusion_oi and the forced plan)
    staged into pinned host memory by a copy on the worker's side stream, selected on the
    CPU and sent back. CI has no GPU; it has not run yet (docs/kernels.md, "GPU": the lent
    machine had no Horovod built with CUDA)."""
    results = run_workers(workers_schemes.record_all, np=2, timeout=300, schemes=SCHEMES,
                          steps=5, warmup=2, device="cuda", dtype=dtype)
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == "float16" else {}
    for scheme in SCHEMES + ["forced", "forced_segmented"]:
        runs = [r[scheme] for r in results]
        assert check_run(runs, **tol) == (5 if scheme.startswith("forced") else 3), scheme
        st = runs[0]["steps"][-1]["stats"]
        assert st["phase"] == "planned" and st["nonfinite"] == 0, scheme
        if scheme == "forced" or (scheme in ("ssfusion_o", "ssfusion_oi") and any(
                Plan.from_json(runs[0]["steps"][-1]["plan"]).offload)):
            assert st["offload_s"] > 0, scheme  # the forced plan always offloads two
        for r in runs[1:]:
            for n, t in r["params"].items():
                assert torch.equal(t, runs[0]["params"][n]), (scheme, n)


def test_bfloat16_models_are_accepted_by_every_scheme():
    """Horovod 0.28.1 reduces and gathers no bfloat16; every scheme accepts a bfloat16
    model all the same (Transport moves its records as raw 16-bit words and sums its
    dense values in float32: test_variants_match_reference, tests/test_precision.py)."""
    [errors] = run_workers(workers_schemes.dtype_errors, np=1, timeout=120,
                           schemes=SCHEMES + ["exdyna", "zen", "spardl"])
    assert all(e is None for e in errors.values()), errors


def test_randomk_sends_values_only_and_matches_reference():
    """Random-k's indices are the same on every rank (shared seed): a sparse part sends
    its values alone, and the synchronized gradient still equals the reference that draws
    the same indices."""
    out = run_workers(workers_schemes.record_all, np=2, timeout=600,
                      schemes=["multi_tensor"], sparsifier="randomk", steps=5, warmup=2)
    for scheme in ("multi_tensor", "forced"):
        runs = [r[scheme] for r in out]
        assert check_run(runs, sparsifier="randomk") >= 3, scheme
        step = runs[0]["steps"][-1]
        plan = Plan.from_json(step["plan"]).at_density(step["stats"]["density_target"])
        # allgather bytes: dense allgather parts plus one value (no index) per sparse element
        dense_ag = sum(n for n, s, c in zip(plan.sizes, plan.sparse, plan.collective)
                       if not s and c == "allgather")
        sparse_k = sum(g.buffer_k for g in plan.groups if g.buffer_k is not None) + sum(
            k for i, k in enumerate(plan.k) if plan.sparse[i]
            and plan.groups[plan.group_of()[i]].buffer_k is None)
        assert step["stats"]["allgather_bytes"] == 4 * (dense_ag + sparse_k), scheme
