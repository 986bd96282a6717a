"""Live profiling (ssfusion_hvd/profile/): fits, backward timer, sparsifier timing, and
the cost model measured on real gloo workers or read from a JSON profile."""
import subprocess
import sys
import time

import numpy as np
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
    import workers_profile

    results = run_workers(workers_profile.measure, np=2, timeout=120, sparsifier="dgc")
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
    # the allgather's measured curve: every probe size, the curve's own included, by size
    assert [x for x, _ in m.allgather_curve] == [4096.0, 1048576.0, 2097152.0, 16777216.0]
    assert all(t > 0.0 for _, t in m.allgather_curve)
    # the broadcast model is rank 0's own measurement
    for r in results:
        assert all(v >= 0.0 for c in ("allreduce", "allgather") for v in r["local"][c])
        assert [x for x, _ in r["local"]["allgather_curve"]] == [4096.0, 65536.0]


@pytest.mark.multiworker
def test_measured_on_a_process_set_broadcasts_from_its_first_rank():
    """Ranks 1 and 2 of 3 measure on their own process set: the model comes from rank 1
    (Horovod's broadcast takes global ranks) and has world_size 2."""
    from hvdrun import run_workers
    import workers_profile

    results = run_workers(workers_profile.measure, np=3, timeout=150, sparsifier="topk",
                          subset=[1, 2], env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"},
                          rerun_on_gloo_timeout=True)
    assert results[0] is None
    assert results[1]["json"] == results[2]["json"]
    m = CostModel.from_json(results[1]["json"])
    assert m.world_size == 2 and set(m.sparsify) == {"topk"}


# -- the slowest rank's times ---------------------------------------------------------------
def test_ready_times_rows_from_the_start_of_each_timed_iteration():
    timer = BackwardTimer()
    _iteration(timer, [("a", 0.0), ("b", 0.0)], start=False)  # no start: not a row
    for _ in range(2):
        _iteration(timer, [("a", 0.002), ("b", 0.004)])
    ready = timer.ready_times(["b", "a", "never"], rows=3)
    assert ready.shape == (3, 3)
    assert np.isnan(ready[0]).all()  # only two iterations had a start
    assert np.isnan(ready[1:, 2]).all()  # "never" was not marked
    assert (ready[1:, 1] >= 0.002).all() and (ready[1:, 0] >= ready[1:, 1] + 0.004).all()
    assert timer.ready_times(["a"], rows=1).shape == (1, 1)  # the last one only
    assert timer.ready_times(["a"], rows=0).shape == (0, 1)


def test_slowest_rank_times_by_hand():
    nan = float("nan")
    # 2 ranks, 2 iterations, 3 tensors in backward order; times since the step before
    ready = np.array([
        [[1.0, 1.2, 1.5], [1.1, 1.3, 1.4]],  # rank 0
        [[1.4, 1.5, 1.6], [1.0, 1.2, 1.9]],  # rank 1: late in iteration 0, last in 1
    ])
    forward, backward = profile.slowest_rank_times(ready)
    # latest per iteration: [1.4, 1.5, 1.6] and [1.1, 1.3, 1.9]; median: [1.25, 1.4, 1.75]
    steps = [1.4 - 1.25, 1.75 - 1.4]
    first = float(np.median(steps))
    assert backward == pytest.approx([first] + steps)
    assert forward == pytest.approx(1.25 - first)
    # a tensor never ready anywhere costs nothing; an iteration not timed is left out
    ready = np.array([[[0.5, nan, 0.9], [nan, nan, nan]], [[0.7, nan, 0.8], [nan, nan, nan]]])
    forward, backward = profile.slowest_rank_times(ready)
    assert backward == pytest.approx([0.1, 0.0, 0.2]) and forward == pytest.approx(0.6)
    assert profile.slowest_rank_times(np.full((2, 1, 3), nan)) is None  # nothing timed


WARMUP_ORDER = r"""
import torch, horovod.torch as hvd
hvd.init()
from ssfusion_hvd.schemes.base import SyncConfig
from ssfusion_hvd.schemes.warmup import WarmupPhase
from ssfusion_hvd import profile
profile.COLLECTIVE_SIZES, profile.SPARSIFY_SIZES, profile.DECODE_SIZES = (4096, 65536), (8000, 80000), (8000, 80000)
profile.ALLGATHER_CURVE_SIZES = ()
a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (2, 3, 4))
cfg = SyncConfig(names={a: "a", b: "b", c: "c"}, order=[a, b, c], declared=[a, b, c],
                 compression=hvd.Compression.none, op=hvd.Average, gradient_predivide_factor=1.0,
                 groups=None, sparse_as_dense=False, process_set=hvd.global_process_set,
                 sparsifier="topk", density=0.5, warmup_steps=3)
phase = WarmupPhase(cfg, [a, b, c], torch.device("cpu"))
events = []
class Recorder:  # stands in for the dense scheme: records what reaches the communicator
    def submit(self, p): events.append(("submit", cfg.names[p]))
    def finish(self): events.append(("finish",))
    def pending(self): return False
    def reset(self): pass
    last_stats = type("S", (), {})()
phase.dense = Recorder()
for step in range(3):
    for p in (c, a, b):  # backward order
        p.grad = torch.ones_like(p)
        phase.submit(p)
        events.append(("ready", cfg.names[p]))
        assert phase.pending()
    phase.finish(step + 1)
    assert not phase.pending()
assert events[:8] == [("ready", "c"), ("ready", "a"), ("ready", "b"), ("submit", "c"),
                      ("submit", "a"), ("submit", "b"), ("finish",), ("ready", "c")], events
ready = phase.timer.ready_times([a, b, c], rows=3)
import numpy as np
assert np.isnan(ready[0]).all() and not np.isnan(ready[1:]).any()
order, cost = phase.measure()  # one rank: its own times are the slowest rank's
assert order == [c, a, b] and len(cost.backward_s) == 3 and cost.forward_s >= 0.0
# the gathered ready times ride the cost model, in its order, and give back its estimate
from ssfusion_hvd.schemes.warmup import READY_NOTE
kept = profile.ready_from_note(cost.notes[READY_NOTE])
assert kept.shape == (1, 3, 3) and np.isnan(kept[0, 0]).all()
np.testing.assert_allclose(kept[0, 1:], ready[1:][:, [2, 0, 1]], atol=1e-6)
fwd, bwd = profile.slowest_rank_times(kept)
assert abs(fwd - cost.forward_s) < 1e-5 and np.allclose(bwd, cost.backward_s, atol=1e-5)
assert type(cost).from_json(cost.to_json()).notes[READY_NOTE] == cost.notes[READY_NOTE]
print("ok")
"""


def test_warmup_sends_after_backward_and_times_from_the_step_before():
    """The warm-up's dense steps send their gradients once backward is over (no collective
    beside the timed backward), in ready order, and every step after the first is timed
    from the end of the one before (a row of ready times each)."""
    out = subprocess.run([sys.executable, "-c", WARMUP_ORDER], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
