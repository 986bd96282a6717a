"""One line comparing two runs of ``ssfusion_hvd.examples.train --json``:

    python -m ssfusion_hvd.examples.compare ours.json baseline.json

Throughput is the median samples/s over the epochs after the first (the first holds
start-up, warm-up and profiling); quality is the last epoch's metric (digits: test
accuracy, its difference also as a count of test images, since one image moves it by
100/360 points; lm: validation perplexity).
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


def line(ours: dict, base: dict) -> str:
    head = (f"{ours['scheme']} vs {base['scheme']} ({ours['epochs']} epochs each): samples/s "
            f"{ours['samples_per_s']:.1f} vs {base['samples_per_s']:.1f} "
            f"({ours['samples_per_s'] / base['samples_per_s']:.2f}x), ")
    m = ours["metric"]
    if m == "test_acc":
        diff = f"{100 * (ours[m] - base[m]):+.2f} points"
        held = ours.get("held_out", 0)
        if held and held == base.get("held_out"):  # the same test set: in whole images
            images = round((ours[m] - base[m]) * held)
            diff += f", {images:+d} of {held} test images"
        text = head + (f"test accuracy {100 * ours[m]:.2f}% vs {100 * base[m]:.2f}% ({diff})")
    else:
        text = head + f"{m} {ours[m]:.3f} vs {base[m]:.3f} ({ours[m] / base[m]:.3f}x)"
    if ours["scheme"] != base["scheme"] and ours.get("tensors_sparse") == 0:
        # the planner chose Horovod's dense buckets: both runs synchronized alike
        text += (f"; {ours['scheme']} sent every tensor dense: on this link its planner "
                 "predicted no gain from sparsifying (the plan table above)")
    return text


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit("usage: python -m ssfusion_hvd.examples.compare OURS.json BASELINE.json")
    print(line(summary(argv[0]), summary(argv[1])))


if __name__ == "__main__":
    main()
