"""The default job: the digits CNN trains under horovodrun and reports what the README says."""
import json
import re
import subprocess
import sys

import pytest

from hvdrun import HOROVODRUN, launch

pytestmark = pytest.mark.multiworker


def test_horovod_build_has_pytorch_and_gloo():
    out = subprocess.run([HOROVODRUN, "--check-build"], capture_output=True, text=True, check=True).stdout
    assert re.search(r"\[X\] PyTorch", out) and re.search(r"\[X\] Gloo", out), out


def test_default_training_job_learns():
    rc, out = launch([sys.executable, "-m", "ssfusion_hvd.examples.train", "--epochs", "8",
                      "--no-progress"], np=2, timeout=300)
    assert rc == 0, out[-4000:]
    rows = re.findall(r"epoch\s+(\d+)/8\s+loss ([\d.]+)\s+test_acc\s+([\d.]+)%\s+samples/s\s+([\d.]+)", out)
    assert [int(r[0]) for r in rows] == list(range(1, 9)), out[-4000:]  # rank 0 only, once per epoch
    losses = [float(r[1]) for r in rows]
    assert losses[-1] < losses[0]
    # digits at density 0.01: the recipe's warm-up ends in epoch 3 and the sparse run dips
    # below dense there (epoch 4: 83.3 % vs 96.4 %), then catches up; epoch 8 measured
    # 97.5 / 97.5 / 97.8 % for seeds 0 / 1 / 2 (dense: 98.6 %)
    assert float(rows[-1][2]) >= 95.0
    assert all(float(r[3]) > 0 for r in rows)
    # the default scheme is ssfusion_oi: planned after the warm-up, plan table printed once
    assert out.count("plan: scheme=ssfusion_oi") == 1, out[-4000:]
    assert re.search(r"last iteration: planned, sent \d+ of \d+ elements .* 0 missing", out)


def test_compare_line(tmp_path):
    from ssfusion_hvd.examples import compare

    def write(name, scheme, speeds, accs, **extra):
        hist = [{"epoch": i + 1, "loss": 1.0, "test_acc": a, "samples_per_s": v}
                for i, (v, a) in enumerate(zip(speeds, accs))]
        path = tmp_path / name
        path.write_text(json.dumps({"args": {"scheme": scheme}, "history": hist, **extra}))
        return str(path)

    ours = compare.summary(write("a.json", "ssfusion_oi", [1.0, 300.0, 100.0, 200.0], [0.5, 0.8, 0.9, 0.97]))
    base = compare.summary(write("b.json", "dense", [1.0, 100.0, 100.0, 100.0], [0.5, 0.8, 0.9, 0.98]))
    assert ours["samples_per_s"] == 200.0  # median after the first epoch
    assert compare.line(ours, base) == (
        "ssfusion_oi vs dense (4 epochs each): samples/s 200.0 vs 100.0 (2.00x), "
        "test accuracy 97.00% vs 98.00% (-1.00 points)")
    # a plan that fell back to Horovod's dense buckets says so
    assert compare.line(dict(ours, tensors_sparse=0), base).endswith(
        "; ssfusion_oi sent every tensor dense: on this link its planner predicted no gain "
        "from sparsifying (the plan table above)")
    assert compare.line(dict(ours, tensors_sparse=3), base) == compare.line(ours, base)
    # with the test set's size (train.py records it) the difference is also in images
    assert compare.line(dict(ours, held_out=300), dict(base, held_out=300)).endswith(
        "test accuracy 97.00% vs 98.00% (-1.00 points, -3 of 300 test images)")
    # summary() reads the count train.py writes
    held = compare.summary(write("c.json", "dense", [1.0, 100.0], [0.5, 0.98], held_out=360))
    assert held["held_out"] == 360 and ours["held_out"] == 0
    # ... only when both runs scored the same set
    assert compare.line(dict(ours, held_out=300), dict(base, held_out=360)) == compare.line(ours, base)


def test_compare_line_over_seeds(tmp_path, capsys):
    """The demo's line over several seeds a side: the median throughput, the mean accuracy,
    each seed's listed; a side whose planner kept everything dense in some runs says so."""
    from ssfusion_hvd.examples import compare

    def write(name, scheme, speed, acc, sparse):
        hist = [{"epoch": 1, "loss": 1.0, "test_acc": 0.5, "samples_per_s": 1.0},
                {"epoch": 2, "loss": 0.5, "test_acc": acc, "samples_per_s": speed}]
        path = tmp_path / name
        path.write_text(json.dumps({"args": {"scheme": scheme}, "history": hist, "held_out": 360,
                                    "stats": {"tensors_sparse": sparse}}))
        return str(path)

    ours = [write(f"o{i}.json", "ssfusion_oi", v, a, 8)
            for i, (v, a) in enumerate([(300.0, 0.975), (100.0, 0.99), (200.0, 0.98)])]
    base = [write(f"b{i}.json", "dense", 100.0, a, 0) for i, a in enumerate([0.99, 0.98, 0.985])]
    compare.main(ours + ["--"] + base)
    assert capsys.readouterr().out.strip() == (
        "ssfusion_oi vs dense (2 epochs each, mean of 3 seeds): samples/s 200.0 vs 100.0 "
        "(2.00x), test accuracy 98.17% vs 98.50% (-0.33 points); per seed 97.50/99.00/98.00 "
        "vs 99.00/98.00/98.50")
    some_dense = [write("d.json", "ssfusion_oi", 100.0, 0.98, 0)] + ours[1:]
    compare.main(some_dense + ["--"] + base)
    assert capsys.readouterr().out.strip().endswith(
        "; in 1 of the 3 runs its planner kept every tensor dense (no gain predicted on this link)")
    compare.main([ours[0], base[0]])  # one run a side: the line as before
    assert "(-1.50 points, -5 of 360 test images)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        compare.main(ours)


def test_scripts_pass_an_option_only_to_the_schemes_that_take_it():
    """train.py, bench.py and bench_e2e.py pass --min-k through SchemeInfo.options_taken:
    the SSFusion schemes and auto get it, the others (the demo's dense run) do not."""
    from ssfusion_hvd import SCHEMES

    for name in ("ssfusion", "ssfusion_o", "ssfusion_i", "ssfusion_oi", "auto"):
        assert SCHEMES[name].options_taken(min_k=32) == {"min_k": 32}, name
        assert SCHEMES[name].options_taken(min_k=None) is None, name
    for name in ("dense", "per_tensor", "multi_tensor", "zen", "spardl", "exdyna"):
        assert SCHEMES[name].options_taken(min_k=32) is None, name
    from ssfusion_hvd.registry import options_for

    assert options_for("ssfusion_oi", min_k=32) == {"min_k": 32}
    assert options_for("no_such_scheme", min_k=32) is None  # the optimizer names the error
