"""One line comparing two runs of ``ssfusion_hvd.examples.train --json``:

    python -m ssfusion_hvd.examples.compare ours.json baseline.json

Throughput is the median samples/s over the epochs after the first (the first holds
start-up, warm-up and profiling); accuracy is the last epoch's test accuracy.
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
    return {"scheme": run["args"]["scheme"], "samples_per_s": statistics.median(steady),
            "test_acc": hist[-1]["test_acc"], "epochs": len(hist)}


def line(ours: dict, base: dict) -> str:
    return (f"{ours['scheme']} vs {base['scheme']} ({ours['epochs']} epochs each): samples/s "
            f"{ours['samples_per_s']:.1f} vs {base['samples_per_s']:.1f} "
            f"({ours['samples_per_s'] / base['samples_per_s']:.2f}x), test accuracy "
            f"{100 * ours['test_acc']:.2f}% vs {100 * base['test_acc']:.2f}% "
            f"({100 * (ours['test_acc'] - base['test_acc']):+.2f} points)")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit("usage: python -m ssfusion_hvd.examples.compare OURS.json BASELINE.json")
    print(line(summary(argv[0]), summary(argv[1])))


if __name__ == "__main__":
    main()
