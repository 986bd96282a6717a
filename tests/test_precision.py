"""Mixed precision as users train it, on real Horovod workers, for every scheme: float16
autocast with GradScaler (Horovod's documented pattern and the short one) and an overflow
on one rank; a loss scale that changes; bfloat16 autocast. A hang fails the test (the
workers are killed at the timeout)."""
import math

import pytest
import torch

from hvdrun import gpu_built, run_workers
import workers_precision

pytestmark = pytest.mark.multiworker

SCHEMES = ["dense", "per_tensor", "multi_tensor", "ssfusion", "ssfusion_oi", "zen", "exdyna",
           "spardl"]
SPARSE = [s for s in SCHEMES if s != "dense"]


def _assert_same(a, b, what, exact=True):
    assert a.keys() == b.keys(), what
    for k in a:
        x, y = a[k], b[k]
        if torch.is_tensor(x):
            if exact:
                assert torch.equal(x, y), f"{what}: {k}"
            else:
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7, msg=f"{what}: {k}")
        else:
            assert x == y, f"{what}: {k}"


def _assert_ranks_equal(ranks, key, exact=True):
    for r in ranks[1:]:
        _assert_same(ranks[0][key]["params"], r[key]["params"], "ranks differ", exact)


def _assert_trains_like_float32(ranks, scheme, exact=True):
    """Ranks identical, nothing skipped, and the parameters within bfloat16's rounding of
    the float32 run's (``ref``)."""
    runs = [r[scheme] for r in ranks]
    _assert_ranks_equal(runs, "run", exact)
    run, ref = runs[0]["run"], runs[0]["ref"]
    assert not any(s.get("skipped") for s in run["stats"])
    for n in ref["params"]:
        moved = (ref["params"][n] - run["params"][n].float()).abs().max().item()
        assert moved < 0.05, (scheme, n, moved)


@pytest.fixture(scope="module")
def overflow():
    return run_workers(workers_precision.overflow_cases, np=2, timeout=600,
                       schemes=SCHEMES, kinds=["sgd", "adam"])


@pytest.mark.parametrize("pattern", ["long", "short"])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_an_overflow_step_never_happened(overflow, scheme, kind, pattern):
    """Float16 autocast and GradScaler; rank 1's loss is infinite at steps 0 (a planned
    scheme's warm-up), 3 (its first sparse step) and 6. Every rank skips those steps, and
    the run then equals, bit for bit, a reference that left those batches out (and halved
    its scale where the scaler halved it): parameters, the optimizer's state, residuals and
    the local rule's buffers, the iteration. The skip is in stats()."""
    for rank in overflow:
        case = rank[scheme, kind, pattern]
        run, ref = case["run"], case["ref"]
        for what in ("params", "torch", "own"):
            _assert_same(run[what], ref[what], f"{what} after the overflow")
        assert run["scales"][-1] == ref["scales"][-1] == 2.0 ** 10 / 8
        assert all(math.isfinite(p.abs().max().item()) for p in run["params"].values())
        if scheme != "dense":
            skipped = [s["skipped"] for s in run["stats"]]
            assert [i for i, s in enumerate(skipped) if s] == [0, 3, 6]
            assert run["stats"][-1]["steps_skipped"] == 3
    _assert_ranks_equal([r[scheme, kind, pattern] for r in overflow], "run")


@pytest.fixture(scope="module")
def scale_change():
    return run_workers(workers_precision.scale_change_cases, np=2, timeout=600,
                       schemes=SPARSE)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("scheme", SPARSE)
def test_the_loss_scale_does_not_reach_the_state(scale_change, scheme, kind):
    """A GradScaler whose scale doubles every second step (2**8 to 2**11) against the run
    without loss scaling: the same parameters, optimizer state and residuals (kept in
    unscaled units, so a scale change needs no rescaling)."""
    for rank in scale_change:
        run, ref = rank[scheme, kind]["run"], rank[scheme, kind]["ref"]
        assert run["scales"][-1] > run["scales"][0]  # the scale did change
        for what in ("params", "torch", "own"):
            _assert_same(run[what], ref[what], what, exact=False)
    _assert_ranks_equal([r[scheme, kind] for r in scale_change], "run")


@pytest.fixture(scope="module")
def bf16_autocast():
    return run_workers(workers_precision.autocast_cases, np=2, timeout=600, schemes=SCHEMES)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_bfloat16_autocast_trains_like_float32(bf16_autocast, scheme):
    """bfloat16 autocast on the float32 model: ranks identical, nothing skipped, and the
    parameters within bfloat16's rounding of the float32 run's."""
    _assert_trains_like_float32(bf16_autocast, scheme)


@pytest.fixture(scope="module")
def bf16_model():
    return run_workers(workers_precision.bf16_model_cases, np=2, timeout=600, schemes=SCHEMES)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_bfloat16_model_trains_like_its_float32_reference(bf16_model, scheme):
    """A model held in bfloat16 (its gradients, values sent and parameters bfloat16; the
    residuals and the local rule's state float32): ranks identical, nothing skipped, the
    residuals float32, and the parameters within bfloat16's rounding of the float32 run
    from the same weights."""
    _assert_trains_like_float32(bf16_model, scheme)
    run = bf16_model[0][scheme]["run"]
    assert all(t.dtype == torch.float32 for t in run["own"].values() if torch.is_tensor(t))
    assert all(p.dtype == torch.bfloat16 for p in run["params"].values())
    if scheme != "dense":
        assert any(k.startswith("residuals.") for k in run["own"])
        assert run["stats"][-1]["phase"] in ("planned", "sparse")


@pytest.mark.skipif(not gpu_built(2), reason="needs a CUDA device and a Horovod built with "
                    "CUDA (scripts/gpu_setup.sh)")
@pytest.mark.parametrize("case", ["float16_overflow", "bfloat16_autocast", "bfloat16_model"])
def test_mixed_precision_on_a_gpu(case):
    """The same cases with CUDA autocast and GradScaler("cuda") on the model's GPU, every
    scheme. Against the reference within float tolerance (atomic sums on the GPU need not
    add in the same order twice), the ranks identical likewise, the overflow steps skipped."""
    if case == "float16_overflow":
        ranks = run_workers(workers_precision.overflow_cases, np=2, timeout=900,
                            schemes=SCHEMES, kinds=["sgd", "adam"], device="cuda")
        for key in ranks[0]:
            for rank in ranks:
                run, ref = rank[key]["run"], rank[key]["ref"]
                for what in ("params", "torch", "own"):
                    _assert_same(run[what], ref[what], f"{key} {what}", exact=False)
                if key[0] != "dense":
                    assert [i for i, s in enumerate(run["stats"]) if s["skipped"]] == [0, 3, 6]
            _assert_ranks_equal([r[key] for r in ranks], "run", exact=False)
    else:
        worker = {"bfloat16_model": "bf16_model_cases", "bfloat16_autocast": "autocast_cases"}
        ranks = run_workers(getattr(workers_precision, worker[case]), np=2, timeout=900,
                            schemes=SCHEMES, device="cuda")
        for scheme in SCHEMES:
            _assert_trains_like_float32(ranks, scheme, exact=False)


def test_a_float64_model_is_refused_on_every_rank_before_any_collective():
    """Sparse schemes take float32, float16 and bfloat16: a float64 model gets a
    ValueError naming the dtype on every rank, before the optimizer's first collective,
    and the ranks are still together afterwards."""
    ranks = run_workers(workers_precision.float64_errors, np=2, timeout=120, schemes=SPARSE)
    for r in ranks:
        assert r["_after"] == 2.0
        for scheme in SPARSE:
            assert r[scheme] and "torch.float64" in r[scheme] and "dense" in r[scheme], \
                (scheme, r[scheme])
