"""SparDL (ssfusion_hvd/schemes/spardl/) on real Horovod workers and in simulation.

The live scheme and :func:`spardl.simulate` run the same per-rank generator; the simulator
only replaces Horovod's alltoall/allgather by an in-memory exchange. On 2, 3 and 4 gloo
workers, for every team count d dividing P (d = 1: SRS + all-gather; powers of two: R-SAG;
others: B-SAG), each recorded step must give:

1. the synchronized gradient of every rank == the simulation of all ranks from the recorded
   local gradients, residuals and B-SAG state (and the new residuals and B-SAG state ==
   the simulation's);
2. nothing lost: delivered sum + all new residuals == all gradients + old residuals, from the
   live data alone, up to float rounding;
3. a state_dict/load_state_dict round trip resumes bit for bit;
4. training the tiny model decreases the loss, with Average and Sum.
"""
import copy

import pytest
import torch

from hvdrun import run_workers
from test_schemes import adam_denominator
import workers_spardl
from ssfusion_hvd.schemes.spardl import (BSAGState, Layout, SparDLScheme, output_scale,
                                         simulate)

STATS_KEYS = {"phase", "allreduce_bytes", "allgather_bytes", "tensors_dense", "tensors_sparse",
              "elements", "elements_sent", "density", "tensors_missing", "nonfinite",
              "sparsify_s", "offload_s", "communicate_s", "wait_s"}


def _flat(d, names):
    return torch.cat([d[n].reshape(-1) for n in names])


def check_record(runs, exact=True, by_step=0, key="gain", unlike_gain=0):
    """Checks one recorded case (per-rank results); returns the number of steps checked.
    ``by_step``: the steps (an Adam run's, shared moments) whose every selection ranks by
    the pending step, the simulation's being given the recorded state's denominators
    (``key``: ``"gain"``, their square roots, or ``"step"``); on each of them the gain's
    selection must differ from the magnitude's. ``unlike_gain``: under the step's key, at
    least that many steps whose selection the gain's key would have made otherwise (so
    the check tells the two keys apart)."""
    P = len(runs)
    r0 = runs[0]
    names, d, op = r0["names"], r0["teams"], r0["op"]
    dtype = r0["steps"][0]["synced"][names[0]].dtype
    scale = output_scale(op != "sum", P)
    nsteps = len(r0["steps"])
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    for s in range(nsteps):
        steps = [run["steps"][s] for run in runs]
        synced = [_flat(st["synced"], names) for st in steps]
        for x in synced[1:]:  # every rank holds the same gradient, bit for bit
            assert torch.equal(x, synced[0]), s
        accs = []
        for st in steps:  # the recipe: float32 accumulation
            acc = _flat(st["local"], names).float()
            if st["residual"]:
                acc.add_(_flat(st["residual"], names))
            accs.append(acc)
        nxt = [run["steps"][s + 1] if s + 1 < nsteps else
               {"residual": run["final_residual"], "bsag": run["final_bsag"]} for run in runs]
        new_res = [_flat(x["residual"], names) for x in nxt]
        # (2) nothing lost, from the live data alone
        delivered = synced[0].double() / scale
        lhs = delivered + torch.stack(new_res).double().sum(0)
        rhs = torch.stack(accs).double().sum(0)
        torch.testing.assert_close(lhs, rhs, **tol, msg=lambda m: f"step {s}: {m}")
        # (1) the simulation of the same algorithm on the same inputs
        # the density in force (the recipe's warm-up) and float32 values on the wire
        target = steps[0]["stats"]["density_target"]
        layout = Layout(accs[0].numel(), P, d, target, torch.float32)
        states = None
        if layout.sag == "bsag":
            changed = s > 0 and r0["steps"][s - 1]["stats"]["density_target"] != target
            states = [BSAGState.initial(layout, layout.pos_of(r)) if changed
                      else BSAGState(**st["bsag"]) for r, st in enumerate(steps)]
        else:
            assert all(st["bsag"] is None for st in steps)
        den = adam_denominator(steps[0].get("adam"), names, root=key == "gain")
        if den is not None:
            by_step -= 1
            other = None if key == "gain" else adam_denominator(steps[0]["adam"], names)
            plain = simulate(layout, [a.clone() for a in accs],
                             None if states is None else copy.deepcopy(states), den=other)
        sim = simulate(layout, [a.clone() for a in accs], states, den=den)
        if den is not None:  # (so the check tells the two selections apart)
            same = torch.equal(plain[0].final, sim[0].final)
            assert key != "gain" or not same, s
            unlike_gain -= not same
        want = sim[0].delivered.mul_(scale) if scale != 1.0 else sim[0].delivered
        want = want.to(dtype)
        if exact:
            assert torch.equal(synced[0], want), (s, (synced[0] - want).abs().max())
        else:
            torch.testing.assert_close(synced[0], want, **tol)
        for r in range(P):
            if exact:
                assert torch.equal(new_res[r], sim[r].residual), (s, r)
            else:
                torch.testing.assert_close(new_res[r], sim[r].residual, **tol)
            if states is not None:
                assert nxt[r]["bsag"] == states[r].as_dict(), (s, r)
        st = steps[0]["stats"]
        assert STATS_KEYS <= set(st), STATS_KEYS - set(st)
        assert st["phase"] == "sparse" and st["teams"] == d and st["nonfinite"] == 0
        assert st["elements"] == accs[0].numel() and st["allgather_bytes"] > 0
        assert st["delivered"] == sim[0].final.numel()
    assert by_step <= 0, f"{by_step} steps fewer by the pending step than expected"
    assert unlike_gain <= 0, f"{unlike_gain} steps fewer that the gain's key selects otherwise"
    return nsteps


def check_launch(results, teams):
    P = len(results)
    for r in results:  # teams = P + 1: a ValueError on every rank, and the launch went on
        assert f"{P + 1} teams for {P} workers" in r["bad_teams"], r["bad_teams"]
        assert "scheme_options={'teams': d}" in r["bad_teams"]
    for d in teams:
        for op in ("average", "sum"):
            assert check_record([r[("record", d, op)] for r in results]) == 4, (d, op)
        # Adam with shared moments: after its first step, every cut by the pending step
        assert check_record([r[("record", d, "adam")] for r in results], by_step=3) == 4, d
        # (3) checkpoint round trip
        for r in results:
            ck = r[("checkpoint", d)]
            assert ck["saved"]["iteration"] == ck["loaded"]["iteration"] == 3
            assert ck["saved"]["bsag"] == ck["loaded"]["bsag"]
            assert ck["saved"]["residuals"].keys() == ck["loaded"]["residuals"].keys()
            assert ck["saved"]["residuals"]
            for n, t in ck["saved"]["residuals"].items():
                assert torch.equal(t, ck["loaded"]["residuals"][n]), n
            for n, t in ck["first"].items():
                assert torch.equal(t, ck["second"][n]), (d, n)
        # (4) training decreases the loss; every rank ends with the same parameters
        for op in ("average", "sum"):
            runs = [r[("train", d, op)] for r in results]
            losses = runs[0]["losses"]
            first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
            assert last < 0.9 * first, (d, op, first, last)
            for run in runs[1:]:
                for n, t in run["params"].items():
                    assert torch.equal(t, runs[0]["params"][n]), (d, op, n)
            st = runs[0]["stats"]
            assert st["tensors_sparse"] == 8 and st["allreduce_bytes"] == 0
    # select_by="step": at density 0.2 over 8 steps the gain's key selects otherwise on
    # some of them (on 2026-11-29: 4 of the 7 keyed steps at 2 and 4 workers, 2 at 3)
    assert check_record([r["adam_step"] for r in results], by_step=7, key="step",
                        unlike_gain=2) == 8
    if 1 in teams:
        assert check_record([r[("record", 1, "predivide")] for r in results]) == 3
        assert check_record([r[("record", 1, "float16")] for r in results]) == 3
    return P


@pytest.mark.multiworker
@pytest.mark.parametrize("np_,teams", [(2, [1, 2]), (3, [1, 3]), (4, [1, 2, 4])])
def test_spardl_live_matches_simulation(np_, teams):
    results = run_workers(workers_spardl.run_all, np=np_, timeout=300, teams=teams)
    assert check_launch(results, teams) == np_


# ------------------------------------------------------------------ pure (no Horovod)


@pytest.mark.parametrize("P", range(1, 9))
def test_simulation_conserves_and_agrees(P):
    """Every d dividing P (R-SAG and B-SAG included), odd sizes: all ranks decode the same
    gradient and residuals + delivered == sum of inputs; a few iterations of error feedback
    and B-SAG adjustment."""
    g = torch.Generator().manual_seed(P)
    for d in [x for x in range(1, P + 1) if P % x == 0]:
        for n, density in [(1000, 0.05), (37, 0.3), (10, 0.5)]:
            if n < P // d:
                continue
            layout = Layout(n, P, d, density)
            states = ([BSAGState.initial(layout, layout.pos_of(r)) for r in range(P)]
                      if layout.sag == "bsag" else None)
            residual = [torch.zeros(n) for _ in range(P)]
            for _ in range(3):
                accs = [torch.randn(n, generator=g) + residual[r] for r in range(P)]
                out = simulate(layout, [a.clone() for a in accs], states)
                for r in out[1:]:
                    assert torch.equal(r.delivered, out[0].delivered)
                total = torch.stack(accs).double().sum(0)
                got = out[0].delivered.double() + sum(r.residual.double() for r in out)
                torch.testing.assert_close(got, total, rtol=1e-6, atol=1e-5)
                assert out[0].final.unique().numel() == out[0].final.numel()
                assert out[0].final.numel() == sum(layout.block_k)
                residual = [r.residual for r in out]
                if states is not None:  # one h per position group
                    for r in range(P):
                        assert states[r] == states[layout.rank_of(0, layout.pos_of(r))]


@pytest.mark.parametrize("P,d", [(3, 1), (4, 2), (6, 3), (8, 8)])
def test_full_density_is_the_exact_sum(P, d):
    n = 50
    layout = Layout(n, P, d, 1.0)
    accs = [torch.randn(n) for _ in range(P)]
    out = simulate(layout, [a.clone() for a in accs],
                   [BSAGState(h=n / P * d, step=1.0) for _ in range(P)]
                   if layout.sag == "bsag" else None)
    torch.testing.assert_close(out[0].delivered, torch.stack(accs).sum(0), rtol=1e-6, atol=1e-6)
    for r in out:
        assert r.residual.abs().max() < 1e-5


def test_bsag_adjustment_moves_h_toward_the_target():
    layout = Layout(3000, 3, 3, 0.1)  # L = 300 per block, h in [100, 300]
    st = BSAGState.initial(layout, 0)
    assert st.h == 100.0 and st.step == pytest.approx(0.01 * 300 * 2 / 3)
    hs = []
    for _ in range(12):  # too few gradients after B-SAG: h grows, faster and faster
        st.adjust(layout, 0, count=150)
        hs.append(st.h)
    assert all(b >= a for a, b in zip(hs, hs[1:])) and hs[-1] > 110
    h = st.h
    st.adjust(layout, 0, count=400)  # too many: turn back, half the step
    assert st.h < h and st.step < 0
    for _ in range(200):
        st.adjust(layout, 0, count=10**6)
    assert st.h == 100.0  # clamped to the paper's range
    for _ in range(200):
        st.adjust(layout, 0, count=0)
    assert st.h == 300.0


def test_teams_option():
    """Teams are a scheme option: a positive int (checked without Horovod), dividing P
    (checked when the layout is built: the live case is in the launches above)."""
    assert SparDLScheme.parse_options(None) == {"teams": 1, "select_by": "auto",
                                                "spread": "auto"}
    assert SparDLScheme.parse_options({"teams": 3, "select_by": "magnitude", "spread": False}) == \
        {"teams": 3, "select_by": "magnitude", "spread": False}
    with pytest.raises(ValueError, match="select_by"):
        SparDLScheme.parse_options({"select_by": "velocity"})
    with pytest.raises(ValueError, match="spread"):
        SparDLScheme.parse_options({"spread": 1})
    for bad in (0, -2, "2", 1.5, True, None):
        with pytest.raises(ValueError, match="teams"):
            SparDLScheme.parse_options({"teams": bad})
    with pytest.raises(ValueError, match="has no option 'team'"):
        SparDLScheme.parse_options({"team": 2})
    with pytest.raises(ValueError, match=r"3 teams for 4 workers.*scheme_options=\{'teams': d\}"):
        Layout(100, 4, 3, 0.1)
