"""One line comparing runs of ``ssfusion_hvd.examples.train --json``:

    python -m ssfusion_hvd.examples.compare ours.json baseline.json
    python -m ssfusion_hvd.examples.compare ours0.json ours1.json ours2.json -- base0.json base1.json base2.json

Throughput is the median samples/s over the epochs after the first (the first holds
start-up, warm-up and profiling); quality is the last epoch's metric (digits: test
accuracy, its difference also as a count of test images, since one image moves it by
100/360 points; lm: validation perplexity). With several runs a side (one per seed), the
median of their throughputs and the mean of their metrics, each seed's metric listed: one
seed's last epoch moves by about a point on the digits (docs/status.md, "The demo").
"""
from __future__ import annotations

import json
import statistics
import sys


def summary(path: str) -> dict:
    with open(path) as f:
        run = json.load(f)
    hist = run["history"]
    steady = [h["samples_per_s"] for h in (hist[1:] or hist)]
    metric = run.get("metric", "test_acc")
    return {"scheme": run["args"]["scheme"], "samples_per_s": statistics.median(steady),
            "metric": metric, metric: hist[-1][metric], "epochs": len(hist),
            "held_out": run.get("held_out", 0),
            # the last step's sparse tensor count (None when the run did not record it)
            "tensors_sparse": run.get("stats", {}).get("tensors_sparse")}


def combine(runs: list) -> dict:
    """Several seeds' :func:`summary` as one: the median of their throughputs, the mean of
    their metrics (``seeds``: each run's), and every run's sparse tensor count summed
    (None when a run did not record it)."""
    if len(runs) == 1:
        return runs[0]
    out = dict(runs[0])
    m = out["metric"]
    out["samples_per_s"] = statistics.median(r["samples_per_s"] for r in runs)
    out[m] = statistics.mean(r[m] for r in runs)
    out["seeds"] = [r[m] for r in runs]
    counts = [r.get("tensors_sparse") for r in runs]
    out["tensors_sparse"] = None if None in counts else sum(counts)
    out["runs_dense"] = sum(c == 0 for c in counts)
    return out


def line(ours: dict, base: dict) -> str:
    seeds = len(ours.get("seeds", [0]))
    each = f"{ours['epochs']} epochs each" + (f", mean of {seeds} seeds" if seeds > 1 else "")
    head = (f"{ours['scheme']} vs {base['scheme']} ({each}): samples/s "
            f"{ours['samples_per_s']:.1f} vs {base['samples_per_s']:.1f} "
            f"({ours['samples_per_s'] / base['samples_per_s']:.2f}x), ")
    m = ours["metric"]
    if m == "test_acc":
        diff = f"{100 * (ours[m] - base[m]):+.2f} points"
        held = ours.get("held_out", 0)
        if held and held == base.get("held_out") and seeds == 1:  # one test set: whole images
            images = round((ours[m] - base[m]) * held)
            diff += f", {images:+d} of {held} test images"
        text = head + (f"test accuracy {100 * ours[m]:.2f}% vs {100 * base[m]:.2f}% ({diff})")
        if seeds > 1:
            per = lambda r: "/".join(f"{100 * x:.2f}" for x in r["seeds"])  # noqa: E731
            text += f"; per seed {per(ours)} vs {per(base)}"
    else:
        text = head + f"{m} {ours[m]:.3f} vs {base[m]:.3f} ({ours[m] / base[m]:.3f}x)"
    if ours["scheme"] != base["scheme"] and ours.get("tensors_sparse") == 0:
        # the planner chose Horovod's dense buckets: both runs synchronized alike
        every = "every tensor" if seeds == 1 else f"every tensor in all {seeds} runs"
        text += (f"; {ours['scheme']} sent {every} dense: on this link its planner "
                 "predicted no gain from sparsifying (the plan table above)")
    elif ours["scheme"] != base["scheme"] and ours.get("runs_dense"):
        text += (f"; in {ours['runs_dense']} of the {seeds} runs its planner kept every tensor "
                 "dense (no gain predicted on this link)")
    return text


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        cut = argv.index("--")
        ours, base = argv[:cut], argv[cut + 1:]
    else:
        ours, base = argv[:1], argv[1:]
    if not ours or not base or ("--" not in argv and len(argv) != 2):
        raise SystemExit("usage: python -m ssfusion_hvd.examples.compare OURS.json BASELINE.json\n"
                         "       python -m ssfusion_hvd.examples.compare OURS.json... -- BASELINE.json...")
    print(line(combine([summary(p) for p in ours]), combine([summary(p) for p in base])))


if __name__ == "__main__":
    main()
