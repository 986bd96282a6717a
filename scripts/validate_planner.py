#!/usr/bin/env python3
"""Planner validation: the simulator's prediction against the measured iteration.

    sudo .venv/bin/python scripts/validate_planner.py               # run, then compare
    sudo .venv/bin/python scripts/validate_planner.py --models gpt2 --workers 4
    .venv/bin/python scripts/validate_planner.py --from docs/results/validate.json

Runs every planned scheme (``auto`` included) through ``scripts/bench_e2e.py`` on its
shaped network (output ``<out>/validate.json``; ``--hosts/--slots`` for a cluster), then,
for every run, simulates the plan that ran on the cost model that run measured at start-up
(the bench worker records both; ``plan/timeline.py``) and prints predicted / measured.

What is compared. The simulator's iteration runs from the end of one step to the end of
the next, as the live profile times it (``CostModel.forward_s``: the wrapped optimizer's
update, the loop's code and forward; then backward, selection and submissions,
collectives, decode), on the slowest rank's compute times
(``profile.slowest_rank_times``). Its measured counterpart is the benchmark's median
iteration, each iteration timed on its slowest rank: the throughput a user sees. Runs that
recorded it also show the timed window's wall time per iteration (``period_s``: the loop's
own code and ``stats()`` included), which the median should match when nothing outside the
step is slow. The issue's target: median |error| within 15 % across the planned schemes,
per model and worker count. Output: ``<out>/validate.md``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

import bench_e2e  # noqa: E402  (runs the sweep; prediction(): the simulator on a run's own plan and costs)
from ssfusion_hvd.plan import PLANNERS  # noqa: E402

#: the schemes whose plan our engine runs (dense is Horovod's optimizer: no plan)
VALIDATED = tuple(s for s in PLANNERS if s != "dense")
TARGET = 0.15


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", help="compare the runs of this bench_e2e JSON; run nothing")
    p.add_argument("--models", default="gpt2,resnet")
    p.add_argument("--workers", default="2,4")
    p.add_argument("--out", default=str(REPO / "docs" / "results"))
    p.add_argument("--name", default="validate")
    p.add_argument("bench_args", nargs=argparse.REMAINDER,
                   help="-- further bench_e2e.py options (e.g. --hosts 2 --slots 2)")
    return p.parse_args(argv)


def measurement(run: dict) -> float:
    """The median iteration (each iteration timed on its slowest rank)."""
    return run["iteration_s"]


def halves_drift(iterations: list) -> float:
    """How far the measurement moved within its own run: the median of the second half of
    the timed iterations over that of the first half, minus 1. A plan that does not change
    should give 0; on a loaded machine it does not, and this is the floor under which no
    prediction's error can be told from the measurement's own."""
    h = len(iterations) // 2
    if h == 0:
        return 0.0
    return statistics.median(iterations[-h:]) / statistics.median(iterations[:h]) - 1.0


def rows(runs: list) -> list[dict]:
    out = []
    for r in runs:
        if "error" in r or r["scheme"] not in VALIDATED:
            continue
        pred = bench_e2e.prediction(r)
        if pred is None:
            continue
        meas = measurement(r)
        plan = r["plan"]
        its = r.get("iteration_s_all") or [meas]
        out.append({"model": r["model"], "workers": r["workers"], "hosts": r.get("hosts", 1),
                    "scheme": r["scheme"], "ran": plan["scheme"],
                    "sparse_tensors": sum(plan["sparse"]), "tensors": len(plan["sparse"]),
                    "predicted_s": pred, "measured_s": meas, "error": pred / meas - 1.0,
                    "spread_s": (min(its), max(its)), "drift": halves_drift(its),
                    "period_s": r.get("period_s")})
    return out


def table(found: list[dict]) -> str:
    lines = ["| model | workers | scheme (plan run) | sparse tensors | predicted ms | measured ms "
             "(spread) | predicted / measured | measurement's drift | timed window / iterations ms |",
             "|---|---:|---|---:|---:|---|---:|---:|---:|"]
    for r in found:
        ran = r["scheme"] + ("" if r["ran"] == r["scheme"] else f" ({r['ran']})")
        where = f"{r['workers']}" + (f" ({r['hosts']} hosts)" if r["hosts"] > 1 else "")
        lo, hi = r["spread_s"]
        lines.append(f"| {r['model']} | {where} | {ran} | {r['sparse_tensors']}/{r['tensors']} | "
                     f"{1e3 * r['predicted_s']:.0f} | {1e3 * r['measured_s']:.0f} "
                     f"({1e3 * lo:.0f}-{1e3 * hi:.0f}) | {r['predicted_s'] / r['measured_s']:.2f} | "
                     f"{100 * r['drift']:+.0f} % | "
                     f"{'-' if not r['period_s'] else format(1e3 * r['period_s'], '.0f')} |")
    lines.append("")
    groups = sorted({(r["model"], r["workers"], r["hosts"]) for r in found})
    for key in groups:
        mine = [r for r in found if (r["model"], r["workers"], r["hosts"]) == key]
        med = statistics.median(abs(r["error"]) for r in mine)
        inside = sum(r["spread_s"][0] <= r["predicted_s"] <= r["spread_s"][1] for r in mine)
        drift = statistics.median(abs(r["drift"]) for r in mine)
        lines.append(f"- {key[0]}, {key[1]} workers{f' on {key[2]} hosts' if key[2] > 1 else ''}: "
                     f"median |error| {100 * med:.1f} % over {len(mine)} schemes "
                     f"({'within' if med <= TARGET else 'OUTSIDE'} {100 * TARGET:.0f} %); "
                     f"{inside} of {len(mine)} predictions inside the measured spread; the "
                     f"measurements' own median |drift| {100 * drift:.1f} %")
    if found:
        med = statistics.median(abs(r["error"]) for r in found)
        lines.append(f"- all runs: median |error| {100 * med:.1f} % over {len(found)} runs")
    return "\n".join(lines) + "\n"


def compute_rows(runs: list) -> list[dict]:
    """Where a prediction's compute comes from, for runs that recorded every step
    (``steps_s``: each rank's forward and backward of every step): the profile's compute
    (``forward_s`` + the backward times: the slowest rank's typical time from a step's end
    to its last gradient, from the warm-up), the same steps as the benchmark timed them
    (forward + backward on the slowest rank of each step, median over the profiled warm-up
    steps), and the timed steps' (median over the steps the measurement is taken from).
    The first two differ by the estimate; the last two by the phase."""
    out = []
    for r in runs:
        if "error" in r or r["scheme"] not in VALIDATED or not r.get("steps_s") \
                or not r.get("cost_model"):
            continue
        steps = r["steps_s"]
        n = min(len(rank) for rank in steps)
        slowest = [max(rank[i][0] + rank[i][1] for rank in steps) for i in range(n)]
        warm = int(r["args"].get("warmup_steps", 0))
        timed = slowest[n - len(r.get("iteration_s_all") or []):]
        profiled = slowest[1:warm]  # the warm-up steps timed from the step before
        if not profiled or not timed:
            continue
        cost = r["cost_model"]
        out.append({"model": r["model"], "workers": r["workers"], "scheme": r["scheme"],
                    "profile_s": cost["forward_s"] + sum(cost["backward_s"]),
                    "warmup_s": statistics.median(profiled),
                    "timed_s": statistics.median(timed)})
    return out


def compute_table(found: list[dict]) -> str:
    lines = ["| model | workers | scheme | profile's compute ms | warm-up steps, as the bench timed "
             "them ms | timed steps ms | profile / warm-up | warm-up / timed |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in found:
        lines.append(f"| {r['model']} | {r['workers']} | {r['scheme']} | {1e3 * r['profile_s']:.0f} | "
                     f"{1e3 * r['warmup_s']:.0f} | {1e3 * r['timed_s']:.0f} | "
                     f"{r['profile_s'] / r['warmup_s']:.2f} | {r['warmup_s'] / r['timed_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    source = Path(args.source) if args.source else out / f"{args.name}.json"
    if not args.source:
        extra = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
        bench_e2e.main(["--models", args.models, "--workers", args.workers, "--schemes",
                        ",".join(VALIDATED), "--name", args.name, "--out", str(out), *extra])
    runs = json.loads(source.read_text())["runs"]
    found = rows(runs)
    if not found:
        raise SystemExit(f"no planned run with a recorded plan and cost model in {source}")
    text = (f"Predicted (simulator on the run's own cost model and plan) against measured "
            f"(the median iteration, timed on its slowest rank), from `{source.name}`:\n\n" + table(found))
    compute = compute_rows(runs)
    if compute:
        text += ("\nCompute (forward + backward, the slowest rank) behind each prediction:\n\n"
                 + compute_table(compute))
    (out / f"{args.name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
