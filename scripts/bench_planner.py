#!/usr/bin/env python
"""Planner wall time on real layer lists (median of several runs).

Targets (issue 4): N = 300 tensors under 0.1 s, N = 1000 under 1 s; Cupcake's
Algorithm 1 reports 2.8-6.6 s for 161-314 tensors (Cupcake Table 1).

Layer lists are the real ones from ``ssfusion_hvd.plan.models`` in backward order. A
model with more tensors than N is trimmed to its first N tensors in backward order (the
tail of the network); one with fewer is repeated cyclically until it has N (as if the
network were stacked). Costs: ring collectives over 10 Gbit/s, 25 us latency, 16
workers, the CLI's default backward and DGC rates, density 0.01.

Columns: ``fusion`` is :func:`optimal_fusion` with multi-tensor sparsification (Cupcake's
problem), ``ssfusion_oi`` the whole SSFusion-O+I planner (optimal fusion, AR/AG split,
density compensation, offloading). Pass/fail is judged on the whole planner.

    python scripts/bench_planner.py [--runs 7]
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time

from ssfusion_hvd.plan import CostModel, build_plan, default_backward_times, model_tensors, optimal_fusion

ROWS = [  # (N, model)
    (100, "resnet50"), (100, "gpt2"), (100, "bert-base"),
    (300, "resnet152"), (300, "gpt2"), (300, "bert-large"),
    (1000, "resnet152"), (1000, "gpt2-large"), (1000, "bert-large"),
]
TARGET_S = {100: 0.1, 300: 0.1, 1000: 1.0}


def layer_list(model: str, n: int) -> tuple[list[int], str]:
    sizes = [numel for _, numel in model_tensors(model)]
    how = "as is" if len(sizes) == n else (f"trimmed from {len(sizes)}" if len(sizes) > n
                                           else f"repeated from {len(sizes)}")
    return list(itertools.islice(itertools.cycle(sizes), n)), how


def median_wall(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    print(f"{'N':>5}  {'model':<11} {'layer list':<20} {'fusion s':>9} {'ssfusion_oi s':>14} {'target s':>9}  result")
    for n, model in ROWS:
        sizes, how = layer_list(model, n)
        cost = CostModel.from_network(10e9, 25e-6, 16, default_backward_times(sizes))
        fusion = median_wall(lambda: optimal_fusion(sizes, cost, "multi_tensor", 0.01), args.runs)
        planner = median_wall(lambda: build_plan("ssfusion_oi", sizes, cost, 0.01), args.runs)
        verdict = "pass" if planner < TARGET_S[n] else "FAIL"
        print(f"{n:>5}  {model:<11} {how:<20} {fusion:>9.4f} {planner:>14.4f} {TARGET_S[n]:>9.1f}  {verdict}")


if __name__ == "__main__":
    main()
