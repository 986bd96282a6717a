"""scheme="dense" behaves exactly like hvd.DistributedOptimizer, on real gloo workers."""
import pytest
import torch

from hvdrun import run_workers
import workers_dense

pytestmark = pytest.mark.multiworker


def _check(results, np):
    assert len(results) == np
    for r in results:
        for ours, ref, init in zip(r["ours"], r["ref"], r["initial"]):
            assert torch.allclose(ours, ref, rtol=0, atol=1e-6), (ours - ref).abs().max()
            assert not torch.equal(ours, init)  # training really moved the weights
    for r in results[1:]:  # every rank holds bit-identical parameters
        for a, b in zip(r["ours"], results[0]["ours"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(passes=2),
    dict(op="sum"),
    dict(predivide=2.0),
    dict(groups=2),
], ids=["average", "passes2", "sum", "predivide", "groups"])
def test_dense_matches_horovod(kwargs):
    _check(run_workers(workers_dense.equivalence, np=2, steps=20, **kwargs), 2)


def test_dense_matches_horovod_three_workers():
    _check(run_workers(workers_dense.equivalence, np=3, steps=10, passes=2), 3)


def test_bad_inputs_raise_on_every_rank_without_hang():
    results = run_workers(workers_dense.bad_inputs, np=2, timeout=120)
    expected = {"scheme": "no-such-scheme", "sparsifier": "no-such-sparsifier",
                "density0": "0.0", "density_big": "1.5", "density_nan": "nan",
                "density_str": "'0.1'", "passes": "0", "duplicate": "w", "missing": "not named",
                "predivide": "gradient_predivide_factor",
                "warmup_negative": "density_warmup_steps", "warmup_float": "density_warmup_steps",
                "warmup_str": "density_warmup_steps",
                "correction_value": "momentum_correction must be",
                "correction_no_momentum": "no momentum", "correction_rmsprop": "RMSprop",
                "correction_amsgrad": "amsgrad", "correction_groups": "different momentum",
                "fp32": "fp32_accumulation", "masking": "momentum_masking"}
    for r in results:
        assert r["total"] == 2.0
        assert set(r["messages"]) == set(expected)
        for case, needle in expected.items():
            assert needle in r["messages"][case], (case, r["messages"][case])
