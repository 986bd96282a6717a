"""Live profiling (ssfusion_hvd/profile.py): fits, backward timer, sparsifier timing, and
the cost model measured on real gloo workers or read from a JSON profile."""
import subprocess
import sys
import time

import pytest

from ssfusion_hvd import profile
from ssfusion_hvd.plan import CostModel
from ssfusion_hvd.profile import BackwardTimer, fit_affine, measure_cost_model, time_sparsifier


# -- fit_affine ---------------------------------------------------------------------------
def test_fit_affine_exact_on_affine_data():
    xs = [1e3, 1e4, 1e5, 1e6]
    a, b = fit_affine(xs, [2e-5 + 3e-9 * x for x in xs])
    assert a == pytest.approx(2e-5, rel=1e-9)
    assert b == pytest.approx(3e-9, rel=1e-9)


def test_fit_affine_clamps_negative_slope():
    a, b = fit_affine([100, 200, 300], [3.0, 2.0, 1.0])
    assert (a, b) == (pytest.approx(2.0), 0.0)


def test_fit_affine_clamps_negative_intercept_and_refits_slope():
    xs, ts = [1.0, 2.0, 3.0], [0.5, 2.5, 4.5]  # least squares: t = -1.5 + 2x
    a, b = fit_affine(xs, ts)
    assert a == 0.0
    assert b == pytest.approx((0.5 + 5.0 + 13.5) / 14.0)  # through the origin


def test_fit_affine_noisy_data_non_negative():
    import random
    rng = random.Random(3)
    for _ in range(50):
        xs = [rng.uniform(0, 1e6) for _ in range(5)]
        ts = [rng.uniform(-1e-6, 1e-3) for _ in xs]
        a, b = fit_affine(xs, ts)
        assert a >= 0.0 and b >= 0.0


def test_fit_affine_single_point_and_single_size():
    assert fit_affine([1000], [2e-3]) == (0.0, pytest.approx(2e-6))
    assert fit_affine([4096, 4096], [1.0, 3.0]) == (0.0, pytest.approx(2.0 / 4096))
    assert fit_affine([0], [5e-6]) == (5e-6, 0.0)
    with pytest.raises(ValueError):
        fit_affine([], [])
    with pytest.raises(ValueError):
        fit_affine([1, 2], [1.0])


# -- BackwardTimer ------------------------------------------------------------------------
def _iteration(timer, plan, start=True):
    if start:
        timer.start_iteration()
    for key, sleep in plan:
        time.sleep(sleep)
        timer.mark(key)
    timer.end_iteration()


def test_backward_timer_order_and_times():
    timer = BackwardTimer()
    plan = [("c", 0.002), ("b", 0.030), ("a", 0.012)]
    for _ in range(3):
        _iteration(timer, plan)
    assert timer.iterations == 3
    assert timer.order() == ["c", "b", "a"]
    tc, tb, ta, tz = timer.backward_times(["c", "b", "a", "never"])
    assert tz == 0.0
    assert tb > ta > tc > 0.0
    assert tb == pytest.approx(0.030, abs=0.015)
    assert ta == pytest.approx(0.012, abs=0.010)


def test_backward_timer_first_key_without_start_gets_median():
    timer = BackwardTimer()
    for _ in range(2):
        _iteration(timer, [("x", 0.050), ("y", 0.010), ("z", 0.020), ("w", 0.030)], start=False)
    tx, ty, tz, tw = timer.backward_times(["x", "y", "z", "w"])
    assert tx == pytest.approx(tz, rel=1e-12)  # median of y, z, w -> z
    assert ty < tz < tw


def test_backward_timer_order_is_last_iteration_and_empty_ignored():
    timer = BackwardTimer()
    _iteration(timer, [("a", 0.0), ("b", 0.001)])
    timer.start_iteration()
    timer.end_iteration()  # no marks: ignored
    _iteration(timer, [("b", 0.0), ("a", 0.001)])
    assert timer.iterations == 2
    assert timer.order() == ["b", "a"]
    assert BackwardTimer().order() == [] and BackwardTimer().backward_times(["a"]) == [0.0]


# -- time_sparsifier ----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["topk", "dgc"])
def test_time_sparsifier_non_negative(name):
    a, b = time_sparsifier(name, sizes_bytes=(8_000, 80_000, 400_000), repeats=2)
    assert a >= 0.0 and b >= 0.0 and a + b * 400_000 > 0.0


def test_time_sparsifier_bad_name_or_density():
    with pytest.raises(ValueError):
        time_sparsifier("no-such-sparsifier")
    with pytest.raises(ValueError):
        time_sparsifier("topk", density=0.0)


# -- JSON profile: no probing, no Horovod ---------------------------------------------------
def _saved(tmp_path, backward=(1e-3, 2e-3, 3e-3)):
    model = CostModel(world_size=4, allreduce=(1e-4, 2e-9), allgather=(5e-5, 3e-9),
                      sparsify={"topk": {"gpu": (1e-4, 1e-10), "cpu": (2e-4, 5e-10)}},
                      backward_s=backward, notes={"source": "bench"})
    path = tmp_path / "profile.json"
    model.save(path)
    return model, path


def test_profile_path_used_as_is(tmp_path, monkeypatch):
    saved, path = _saved(tmp_path)

    def boom(*a, **k):
        raise AssertionError("probed although a profile was given")
    monkeypatch.setattr(profile, "probe_collectives", boom)
    monkeypatch.setattr(profile, "time_sparsifier", boom)
    model = measure_cost_model([9.0, 9.0, 9.0], "topk", profile=str(path))
    assert (model.allreduce, model.allgather, model.sparsify) == (
        saved.allreduce, saved.allgather, saved.sparsify)
    assert model.world_size == 4
    assert model.backward_s == saved.backward_s  # same length: the profile's are kept
    assert model.notes["source"] == str(path)
    model2 = measure_cost_model([9.0, 9.0, 9.0], "topk", profile=saved)
    assert model2 == saved and model2 is not saved


def test_profile_backward_length_mismatch_replaced(tmp_path):
    saved, path = _saved(tmp_path)
    model = measure_cost_model([1.0, 2.0], "topk", profile=path)
    assert model.backward_s == (1.0, 2.0)
    assert model.allreduce == saved.allreduce


def test_profile_without_sparsifier_fit_raises(tmp_path):
    _, path = _saved(tmp_path)
    with pytest.raises(ValueError, match="dgc"):
        measure_cost_model([1.0], "dgc", profile=path)
    assert measure_cost_model([1.0], None, profile=path).sparsify  # dense: fine


def test_profile_path_and_import_never_touch_horovod(tmp_path):
    _, path = _saved(tmp_path)
    code = (
        "import sys\n"
        "from ssfusion_hvd.profile import measure_cost_model\n"
        f"m = measure_cost_model([1.0, 2.0], 'topk', profile={str(path)!r})\n"
        "assert m.backward_s == (1.0, 2.0)\n"
        "assert not [k for k in sys.modules if k.startswith('horovod')], 'horovod imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- real gloo workers --------------------------------------------------------------------
@pytest.mark.multiworker
def test_measured_model_identical_on_every_rank():
    from hvdrun import run_workers

    results = run_workers("workers_profile:measure", np=2, timeout=120, sparsifier="dgc")
    models = [CostModel.from_json(r["json"]) for r in results]
    assert results[0]["json"] == results[1]["json"]
    m = models[0]
    assert m.world_size == 2
    assert m.allreduce[1] > 0.0 and m.allgather[1] > 0.0
    assert min(m.allreduce + m.allgather) >= 0.0
    assert set(m.sparsify) == {"dgc"} and set(m.sparsify["dgc"]) == {"gpu", "cpu"}
    assert m.sparsify["dgc"]["gpu"] == m.sparsify["dgc"]["cpu"]  # CPU-only job
    assert m.backward_s == pytest.approx([1e-4, 2e-4, 3e-4, 4e-4])
    assert m.notes["source"] == "measured"
    assert m.notes["probe_sizes"] == "4096,1048576,16777216"
    # the broadcast model is rank 0's own measurement
    for r in results:
        assert all(v >= 0.0 for fit in r["local"].values() for v in fit)


@pytest.mark.multiworker
def test_measured_on_a_process_set_broadcasts_from_its_first_rank():
    """Ranks 1 and 2 of 3 measure on their own process set: the model comes from rank 1
    (Horovod's broadcast takes global ranks) and has world_size 2."""
    from hvdrun import run_workers

    results = run_workers("workers_profile:measure", np=3, timeout=150, sparsifier="topk",
                          subset=[1, 2], env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    assert results[0] is None
    assert results[1]["json"] == results[2]["json"]
    m = CostModel.from_json(results[1]["json"])
    assert m.world_size == 2 and set(m.sparsify) == {"topk"}
