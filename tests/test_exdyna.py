"""ExDyna (scheme="exdyna"): the state machine alone, then real Horovod workers (2, 3, 4).

The workers' run is checked against a reference rebuilt from what each rank recorded
before the step (threshold, partitions, iteration, residual) and its local gradient:
partition ``(t % P + r) % P`` of the recorded blocks, ``|acc| >= threshold`` inside it (exact
top-k per partition in the calibration step), the union of the ranks' selections, every
rank's acc summed there and scaled by ``op``. Tolerance: float rounding.
"""
import math

import pytest
import torch

from hvdrun import run_workers
from test_schemes import adam_denominator
import workers_exdyna
from ssfusion_hvd import ops
from ssfusion_hvd.schemes.exdyna import ExDynaState
from ssfusion_hvd.sparsify import Threshold

# --------------------------------------------------------------------------- the state alone


def _bounds_ok(st):
    b = st.bounds()
    assert b[0] == 0 and b[-1] == st.numel and all(x <= y for x, y in zip(b, b[1:]))
    return b


def test_block_partitioning():
    st = ExDynaState(3041, 2, 0.05)  # the tiny Net
    assert (st.block_size, st.num_blocks, st.blocks) == (32, 95, [48, 47])
    assert _bounds_ok(st) == [0, 48 * 32, 3041]
    st = ExDynaState(10**6, 4, 0.01)  # ~128 blocks per worker, size a multiple of 32
    assert st.block_size % 32 == 0 and st.blocks == [128] * 4
    assert 0 <= st.numel - st.num_blocks * st.block_size < st.block_size  # tail < one block
    _bounds_ok(st)
    st = ExDynaState(10**6 + 7, 3, 0.01)
    assert max(st.blocks) - min(st.blocks) <= 1 and sum(st.blocks) == st.num_blocks
    _bounds_ok(st)
    st = ExDynaState(50, 2, 0.1)  # smaller than 32 per rank
    assert st.bounds() == [0, 25, 50]
    st = ExDynaState(3, 4, 0.5)  # fewer elements than ranks: one partition stays empty
    assert st.bounds() == [0, 1, 2, 3, 3]


def test_cyclic_allocation():
    st = ExDynaState(10_000, 4, 0.01)
    for t in range(9):
        st.iteration = t
        alloc = [st.allocation(r) for r in range(4)]
        assert sorted(alloc) == [0, 1, 2, 3]  # exclusive: one partition per rank
        assert alloc == [(t + r) % 4 for r in range(4)]  # partition 0 to rank 0 at t=0, ...


def test_rebalance_algorithm3():
    st = ExDynaState(30 * 32, 3, 0.05)
    assert st.blocks == [10, 10, 10] and st.block_size == 32
    st.rebalance([30, 5, 10])  # 0 heavy, 1 light: one block 0 -> 1; then 1 vs 2 balanced
    assert st.blocks == [9, 11, 10]
    st.blocks = [10, 10, 10]
    # 0 light, 1 heavy: one block 1 -> 0; k[1] becomes 30 - 1.5 (k_move = 32 * 45/960),
    # still heavy against light 2: one block 1 -> 2
    st.rebalance([5, 30, 10])
    assert st.blocks == [11, 8, 11]
    st.blocks = [1, 10, 19]
    st.rebalance([30, 5, 10])  # would leave partition 0 below min_blocks
    assert st.blocks == [1, 10, 19]
    for counts in ([15, 15, 15], [16, 14, 15], [0, 0, 0]):  # balanced / nothing selected
        st.blocks = [10, 10, 10]
        st.rebalance(counts)
        assert st.blocks == [10, 10, 10]


def test_threshold_scaling_algorithm5():
    scale = Threshold().scale_factor  # the one implementation, in sparsify/threshold.py
    for counts in ([100, 100], [60, 45], [40, 10], [50, 45], [50, 50]):
        st = ExDynaState(10_000, 2, 0.01)
        assert st.k == 100
        st.threshold = 2.0
        st.observe(counts)
        assert st.threshold == 2.0 * scale(sum(counts) / 100) and st.iteration == 1
    assert scale(2.0) == 1.05 and scale(1.1) == 1.0125 and scale(0.5) == 0.95 \
        and scale(0.95) == 0.9875 and scale(1.0) == 1.0
    st = ExDynaState(10_000, 3, 0.01)
    st.observe([34, 33, 33], kth=[1.0, 3.0, math.nan])  # calibration: mean of the finite ones
    assert st.threshold == 2.0
    st = ExDynaState(10_000, 2, 0.01)
    st.observe([50, 50], kth=[0.0, math.inf])  # nothing usable: calibrate again
    assert st.threshold is None


def test_state_roundtrip():
    st = ExDynaState(10_000, 3, 0.01)
    st.threshold, st.iteration, st.blocks = 0.25, 7, [30, 40, 28]
    st2 = ExDynaState(10_000, 3, 0.01)
    st2.load_state_dict(st.state_dict())
    assert st2.state_dict() == st.state_dict()
    st3 = ExDynaState(10_000, 2, 0.01)  # another world size: equal partitions again
    st3.load_state_dict(st.state_dict())
    assert st3.threshold == 0.25 and st3.blocks == ExDynaState(10_000, 2, 0.01).blocks
    with pytest.raises(ValueError):
        ExDynaState(9_999, 3, 0.01).load_state_dict(st.state_dict())


# --------------------------------------------------------------------------- the reference


def _bounds(s):
    """Partition offsets from a recorded state dict (rebuilt here, not by ExDynaState)."""
    b, pos = [0], 0
    for nb in s["blocks"]:
        pos += nb
        b.append(min(pos * s["block_size"], s["numel"]))
    b[-1] = s["numel"]
    return b


def _flat(d, names, like):
    return torch.cat([(d[n] if d.get(n) is not None else torch.zeros_like(like[n])).reshape(-1)
                      for n in names])


def reference_step(ranks, density, op="average", key="gain"):
    """Expected (synced flat gradient, per-rank selections, per-rank new residuals).

    The recipe applies: the density in force is the warm-up's (``density_target``; a new
    density recalibrates the threshold), float16 gradients accumulate in float32 and the
    values travel as float16, their rounding staying in the residual. ``key``: Adam's
    selection key, ``"gain"`` (the default's: the denominator's square root) or
    ``"step"``."""
    nranks = len(ranks)
    names = sorted(ranks[0]["synced"])  # canonical order: sorted by name
    s = ranks[0]["state"]["exdyna"]
    b = _bounds(s)
    final, density = density, ranks[0]["stats"]["density_target"]
    # Adam's shared denominators (its state before the step): the threshold on the step,
    # recalibrated at a change of unit and, on the key, every step of the density warm-up
    den = adam_denominator(ranks[0]["state"].get("adam"), names, root=key == "gain")
    keyed = den is not None
    threshold = s["threshold"] if (s["density"] == density
                                   and s.get("keyed", False) == (keyed and key)
                                   and not (keyed and density > final)) else None
    k = max(1, math.ceil(s["numel"] * density - 1e-9))
    wire = ranks[0]["synced"][names[0]].dtype
    accs, sels = [], []
    for r, rank in enumerate(ranks):
        acc = _flat(rank["local"], names, rank["synced"]).float()
        if rank["state"]["residuals"]:
            acc = _flat(rank["state"]["residuals"], names, rank["synced"]) + acc
        a = (s["iteration"] % nranks + r) % nranks
        lo, hi = b[a], b[a + 1]
        sel = acc[lo:hi] if den is None else (acc[lo:hi] / den[lo:hi]).abs()
        if threshold is None:  # calibration: exact top-k of the partition
            kk = min(hi - lo, math.ceil(k * (hi - lo) / s["numel"] - 1e-9))
            _, idx = ops.topk(sel, kk, backend="torch")
        else:
            mask = (sel.double().abs() >= threshold) | sel.isnan()
            idx = mask.nonzero().flatten()
            cap = max(1, int(1.2 * k * (hi - lo) / s["numel"] + 1e-9))  # the rank's capacity
            if idx.numel() > cap:  # trimmed to its largest
                idx = idx[ops.topk(sel[idx], cap, backend="torch")[1].long()]
        accs.append(acc)
        sels.append(idx.long() + lo)
    union = torch.cat(sels)
    total = torch.zeros(s["numel"], dtype=torch.float64)
    total[union] = sum(acc[union].to(wire).double() for acc in accs)
    if op == "average":
        total /= nranks
    residuals = []
    for acc in accs:
        kept = acc.clone()
        kept[union] = acc[union] - acc[union].to(wire).float()
        residuals.append(kept)
    return total, sels, residuals


def check_run(runs, density, op="average", rtol=1e-5, atol=1e-6, key="gain"):
    """Checks every step of a recorded run on all ranks; returns per-step densities."""
    nranks = len(runs)
    names = sorted(runs[0]["steps"][0]["synced"])
    densities = []
    for s in range(len(runs[0]["steps"])):
        ranks = [run["steps"][s] for run in runs]
        for r in ranks[1:]:  # same decisions and the same synchronized gradient everywhere
            assert r["state"]["exdyna"] == ranks[0]["state"]["exdyna"], s
            for n in names:
                assert torch.equal(r["synced"][n], ranks[0]["synced"][n]), (s, n)
        want, sels, residuals = reference_step(ranks, density, op, key)
        # (1) exclusive: no index selected by two ranks; each rank's selection as rebuilt
        got = [r["selected"].long() for r in ranks]
        for r in range(nranks):
            assert torch.equal(got[r], sels[r]), (s, r)
        union = torch.cat(got)
        assert union.unique().numel() == union.numel(), f"step {s}: an index selected twice"
        # (3) the synchronized gradient equals the reference
        flat = _flat(ranks[0]["synced"], names, ranks[0]["synced"])
        torch.testing.assert_close(flat.double(), want, rtol=rtol, atol=atol,
                                   msg=lambda m: f"step {s}: {m}")
        assert torch.count_nonzero(flat[torch.ones_like(flat, dtype=torch.bool).index_fill_(
            0, union, False)]) == 0  # nothing outside the selected indices
        # nothing lost: the next residual is acc minus what was sent, bit for bit
        if s + 1 < len(runs[0]["steps"]):
            for r, run in enumerate(runs):
                nxt = _flat(run["steps"][s + 1]["state"]["residuals"], names, ranks[0]["synced"])
                assert torch.equal(nxt, residuals[r]), (s, r)
        st = ranks[0]["stats"]
        assert st["elements_sent"] == union.numel() and st["nonfinite"] == 0
        assert sum(st["counts"]) == union.numel()
        densities.append(union.numel() / flat.numel())
    return densities


# --------------------------------------------------------------------------- real workers

_RESULTS = {}
STATS_KEYS = {"phase", "allreduce_bytes", "allgather_bytes", "tensors_dense", "tensors_sparse",
              "elements", "elements_sent", "density", "tensors_missing", "nonfinite",
              "sparsify_s", "offload_s", "communicate_s", "wait_s"}  # those of every scheme


@pytest.fixture(scope="module", params=[2, 3, 4])
def results(request):
    np_ = request.param
    if np_ not in _RESULTS:
        _RESULTS[np_] = run_workers(workers_exdyna.all_cases, np=np_, timeout=300)
    return _RESULTS[np_]


@pytest.mark.multiworker
def test_matches_reference(results):
    for case, density, op in [("stream", 0.05, "average"), ("stream_predivide", 0.02, "average"),
                              ("stream_sum", 0.05, "sum"), ("net", 0.05, "average"),
                              ("net_sum", 0.05, "sum"), ("net_fp16", 0.05, "average"),
                              ("net_adam", 0.05, "average"), ("net_adam_step", 0.05, "average")]:
        runs = [r[case] for r in results]
        tol = dict(rtol=2e-3, atol=2e-3) if case == "net_fp16" else {}
        key = "step" if case == "net_adam_step" else "gain"
        check_run(runs, density, op, key=key, **tol)
        assert runs[0]["steps"][0]["stats"]["phase"] == "calibration"
        if case.startswith("net_adam"):  # thresholds on the key, which select otherwise
            steps = [[run["steps"][s] for run in runs] for s in range(len(runs[0]["steps"]))]
            keyed = [st[0]["state"]["exdyna"].get("keyed") for st in steps[1:]]
            assert keyed[-1] == key and sum(map(bool, keyed)) >= 3, keyed
            phases = [st[0]["stats"]["phase"] for st in steps]
            assert phases[:9] == ["calibration"] * 9 and phases[9:] == ["sparse"] * 2, phases
            differ = 0  # keyed steps where rank 0's selection is not its largest |acc|
            names = sorted(steps[0][0]["synced"])
            for st in steps[3:]:
                got = st[0]["selected"].long()
                acc = _flat(st[0]["local"], names, st[0]["synced"]).float() + _flat(
                    st[0]["state"]["residuals"], names, st[0]["synced"])
                b = _bounds(st[0]["state"]["exdyna"])
                a = st[0]["state"]["exdyna"]["iteration"] % len(runs)
                top = ops.topk(acc[b[a]:b[a + 1]], got.numel(), backend="torch")[1].long() + b[a]
                differ += not torch.equal(top, got)
            assert differ >= 1, differ
        if case.startswith("net"):  # the density warm-up ran through its stages
            targets = [st["stats"]["density_target"] for st in runs[0]["steps"]]
            assert targets[0] == 0.25 and targets[-1] == 0.05 and targets == sorted(targets)[::-1]
        assert STATS_KEYS <= set(runs[0]["steps"][-1]["stats"])
        assert runs[0]["steps"][-1]["stats"]["phase"] == "sparse"
        for r in runs[1:]:  # every rank ends with bit-identical parameters
            for n, t in r["params"].items():
                assert torch.equal(t, runs[0]["params"][n]), (case, n)


@pytest.mark.multiworker
def test_density_follows_target(results):
    """(2) a stationary stream: after 50 iterations the achieved global density (mean of
    the last 10) is within +-20 % of the target; partitions were rebalanced on the way."""
    runs = [r["stream"] for r in results]
    steps = runs[0]["steps"]
    assert len(steps) == 50
    dens = [s["stats"]["density"] for s in steps]
    k = math.ceil(0.05 * steps[0]["stats"]["elements"] - 1e-9)
    sent0 = steps[0]["stats"]["elements_sent"]  # calibration: exact top-k per partition
    assert k <= sent0 <= k + len(runs) - 1
    last = sum(dens[-10:]) / 10
    assert 0.8 * 0.05 <= last <= 1.2 * 0.05, dens
    blocks = [s["state"]["exdyna"]["blocks"] for s in steps]
    assert any(b != blocks[0] for b in blocks), "Algorithm 3 never moved a block"


@pytest.mark.multiworker
def test_density_capped_under_the_default_recipe(results):
    """Momentum correction (a velocity ~10x a gradient) and the density warm-up (a new
    threshold at every stage) once made ExDyna send 3-5x its density: with the per-rank
    cap no step after a calibration sends more than 1.2x the density in force, the
    threshold still tracks the demand (the last 20 steps send at least half the target),
    and the demand that passed the threshold is reported."""
    for r in results:
        run = r["density_momentum"]
        assert run["recipe"] == "momentum"
        steps = run["steps"]
        sparse = [s for s in steps if s["phase"] == "sparse"]
        assert len(sparse) > 100
        for i, s in enumerate(steps):
            k = math.ceil(s["density_target"] * s["elements"] - 1e-9)
            if s["phase"] == "sparse":
                assert s["elements_sent"] <= 1.2 * k, (i, s)
            assert len(s["demand"]) == len(results)
        tail = [s["elements_sent"] / (s["density_target"] * s["elements"]) for s in steps[-20:]]
        assert min(tail) >= 0.5, tail
    # the cap binds somewhere: the demand exceeded it, what was sent did not
    assert any(sum(s["demand"]) > s["elements_sent"] for r in results
               for s in r["density_momentum"]["steps"] if s["phase"] == "sparse")


@pytest.mark.multiworker
def test_checkpoint_roundtrip(results):
    for r in results:
        ck = r["checkpoint"]
        assert ck["saved"]["exdyna"] == ck["restored"]["exdyna"]
        assert ck["saved"]["exdyna"]["threshold"] is not None
        assert ck["saved"]["residuals"].keys() == ck["restored"]["residuals"].keys()
        for n, t in ck["saved"]["residuals"].items():
            assert torch.equal(t, ck["restored"]["residuals"][n]), n
        for n, t in ck["uninterrupted"].items():
            assert torch.equal(t, ck["resumed"][n]), n


@pytest.mark.multiworker
def test_nonfinite_reaches_everyone(results):
    """A NaN in rank 1's gradient at step 2 falls in a partition rank 1 does not own, so
    ExDyna's exclusive selection would never send it (it used to sit in rank 1's residual
    for up to P - 1 steps). The ranks' non-finite flags reach everyone in that step: every
    rank undoes it (``stats()["skipped"]``), finds NaN in its synchronized gradient (so
    GradScaler, or the user, skips the step) and keeps no NaN in its state; the other steps
    are finite and equal on every rank."""
    runs = [r["nonfinite"] for r in results]
    for run in runs:
        assert [s for s in range(len(run)) if math.isnan(run[s]["value"])] == [2]
        for s, step in enumerate(run):
            assert step["stats"]["skipped"] == (s == 2), s
            assert step["stats"]["steps_skipped"] == (1 if s >= 2 else 0), s
    for s in range(len(runs[0])):
        if s != 2:
            assert len({run[s]["value"] for run in runs}) == 1, s


@pytest.mark.multiworker
@pytest.mark.parametrize("op", ["average", "sum"])
def test_trains(results, op):
    """(5) the tiny Net's global loss falls, by at least half of what dense achieves."""
    for r in results:
        t, dense = r[f"train_{op}"], r[f"dense_{op}"]
        assert t["before"] == dense["before"]
        assert t["after"] < t["before"] - 0.03, t
        assert t["before"] - t["after"] >= 0.5 * (dense["before"] - dense["after"]), (t, dense)
        assert t["stats"]["phase"] == "sparse" and t["stats"]["nonfinite"] == 0
        for n, p in t["params"].items():
            assert torch.equal(p, results[0][f"train_{op}"]["params"][n]), n


@pytest.mark.multiworker
def test_ranks_on_different_units_raise_alike(results):
    """A rank whose optimizer lost its Adam state would put its threshold on the magnitude
    while the others put theirs on the pending step, and only some would calibrate: every
    rank raises at that step instead of hanging (ExDynaScheme.signature)."""
    for r in results:
        got = r["keyed_disagreement"]
        assert got["step"] == 2, got
        assert "different plans or optimizer states" in got["error"], got["error"]


def test_a_change_of_key_recalibrates_and_old_checkpoints_read_as_the_step():
    """The threshold's unit is the key it was tuned on: the magnitude, Adam's step or its
    gain. Switching from one key to another drops the threshold (the next step
    recalibrates by exact top-k), and a checkpoint from before the gain (``keyed: True``)
    loads as the step's, so resuming it under the gain's default recalibrates too."""
    st = ExDynaState(3041, 2, 0.05)
    st.set_keyed("step")
    st.threshold = 0.5
    st.set_keyed("step")
    assert st.threshold == 0.5  # same unit: kept
    st.set_keyed("gain")
    assert st.threshold is None and st.keyed == "gain"
    old = dict(st.state_dict(), keyed=True, threshold=0.5)
    fresh = ExDynaState(3041, 2, 0.05)
    fresh.load_state_dict(old)
    assert fresh.keyed == "step" and fresh.threshold == 0.5
    fresh.set_keyed("gain")
    assert fresh.threshold is None
    fresh.set_keyed(False)
    assert fresh.keyed is False
