#!/usr/bin/env python3
"""Scale what-if (SIMULATION): every scheme at 8-64 workers and 10-100 Gbit/s.

    .venv/bin/python scripts/whatif.py                        # the tracked cost model (below)
    .venv/bin/python scripts/whatif.py --e2e docs/results/validate.json   # one a bench run measured
    .venv/bin/python scripts/whatif.py --profile cost.json    # or any CostModel JSON

The default cost model, ``docs/results/cost_model_gpt2_w4.json``, is the start-up profile
of the GPT-2 ssfusion_oi run at 4 workers of ``docs/results.md`` §3a, extracted from that
sweep's raw output so the page's table regenerates from a fresh clone.

Nothing here runs a collective. The planner's timeline simulator (``plan/timeline.py``) and
the closed forms of SparDL, ZEN and ExDyna (``plan/formulas.py``) are evaluated on the
layer lists of ResNet-152, BERT-large and GPT2-large, with a cost model whose parts come
from:

* **measured** (the start-up profile of a planned run in the shaped-network benchmark,
  ``scripts/bench_e2e.py``): the fixed cost of one collective (its fitted α: Horovod's
  cycle and the launch path) and the CPU selection kernel's fit (``cpu``: the offload
  path of SSFusion-O);
* **scaled**: ring collectives over the target bandwidth with 25 us per hop (SSFusion
  Eq. 3-4, ``CostModel.from_network``), plus the measured fixed cost once per collective
  call: in the α of every allreduce and allgather of the planned schemes, and
  ``formulas.collectives(scheme, P)`` times for SparDL, ZEN and ExDyna, whose closed forms
  are evaluated on the ring model alone;
* **assumed** (no GPU was measured): backward time 20 us + 1 ns per element per tensor,
  inline (GPU) selection fitted to SSFusion Table III (per call: one call per group for
  top-k, which the engine runs as one segmented kernel), decode 20 us + 20 GB/s per
  group (``DEFAULT_DECODE``), and an offload worker with cores of its own (a GPU job).

Gains are reported as SSFusion-(O+I)'s throughput over the best of the other sparse
schemes (the papers' "state of the art": per_tensor, multi_tensor, spardl, zen, exdyna),
beside the SSFusion paper's measured 27.5-106.7 %. Output: ``<out>/whatif.json`` and
``whatif.md``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

from ssfusion_hvd.plan.cost import (  # noqa: E402
    DEFAULT_DECODE,
    DEFAULT_SPARSIFY,
    CostModel,
    default_backward_times,
)
from ssfusion_hvd.plan.formulas import FORMULA_SCHEMES, iteration_s  # noqa: E402
from ssfusion_hvd.plan.models import model_tensors  # noqa: E402
from ssfusion_hvd.plan.schemes import build_plan  # noqa: E402
from ssfusion_hvd.plan.timeline import simulate  # noqa: E402

PLANNED = ("dense", "per_tensor", "multi_tensor", "ssfusion", "ssfusion_o", "ssfusion_i", "ssfusion_oi")
BASELINES = ("per_tensor", "multi_tensor", "spardl", "zen", "exdyna")
#: the baselines scored by the same timeline simulator as SSFusion (the others by formulas)
ENGINE_BASELINES = ("per_tensor", "multi_tensor")
#: the SSFusion paper's Fig. 11 gains of SSFusion-(O+I) over the state of the art, per model
PAPER = {"resnet152": "28.7-74.2 %", "bert-large": "29.1-106.7 %", "gpt2-large": "27.5-84.1 %"}
HOP_LATENCY_S = 25e-6


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default=str(REPO / "docs" / "results" / "cost_model_gpt2_w4.json"),
                   help="a CostModel JSON (ignored with --e2e)")
    p.add_argument("--e2e", help="a bench_e2e.py output: the cost model of its planned run with the "
                                 "most workers (gpt2 first, ssfusion_oi first)")
    p.add_argument("--models", default="resnet152,bert-large,gpt2-large")
    p.add_argument("--workers", default="8,16,32,64")
    p.add_argument("--bandwidths", default="10,25,100", help="Gbit/s")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--sparsifier", default="topk")
    p.add_argument("--out", default=str(REPO / "docs" / "results"))
    return p.parse_args(argv)


def measured_profile(args) -> tuple[dict, str]:
    """(CostModel dict, where it came from): the planned run of ``--e2e`` with the most
    workers (gpt2 first, ssfusion_oi first), else ``--profile``."""
    if not args.e2e:
        path = Path(args.profile).resolve()
        shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        return json.loads(path.read_text()), str(shown)
    doc = json.loads(Path(args.e2e).read_text())
    runs = [r for r in doc["runs"] if r.get("cost_model")]
    if not runs:
        raise SystemExit(f"{args.e2e} has no measured cost model; run scripts/bench_e2e.py or pass --profile")
    rank = lambda r: (r["workers"], r["model"] == "gpt2", r["scheme"] == "ssfusion_oi")  # noqa: E731
    best = max(runs, key=rank)
    return best["cost_model"], f"{args.e2e}: {best['model']} x{best['workers']} {best['scheme']}"


def fixed_cost(measured: dict) -> tuple[float, float]:
    """The measured fixed cost of one allreduce and of one allgather call (fitted α)."""
    return max(measured["allreduce"][0], 0.0), max(measured["allgather"][0], 0.0)


def scaled_cost(measured: dict, sparsifier: str, bandwidth_bps: float, workers: int, sizes,
                with_fixed: bool = True) -> CostModel:
    """The ring model at (bandwidth, workers), plus (``with_fixed``) the measured fixed cost
    in every collective's α; measured CPU selection; assumed GPU selection and backward
    times (see module doc)."""
    ring = CostModel.from_network(bandwidth_bps, HOP_LATENCY_S, workers, default_backward_times(sizes))
    cpu = measured["sparsify"].get(sparsifier, {}).get("cpu")
    if cpu is None:
        raise SystemExit(f"the measured profile has no CPU fit for {sparsifier!r}: {sorted(measured['sparsify'])}")
    gpu = DEFAULT_SPARSIFY["dgc"]["gpu"]
    ar, ag = fixed_cost(measured) if with_fixed else (0.0, 0.0)
    return CostModel(
        world_size=workers,
        allreduce=(ring.allreduce[0] + ar, ring.allreduce[1]),
        allgather=(ring.allgather[0] + ag, ring.allgather[1]),
        sparsify={sparsifier: {"gpu": tuple(gpu), "cpu": tuple(cpu)}},
        backward_s=ring.backward_s, element_size=4, decode=DEFAULT_DECODE, shared_cores=False,
        notes={"source": "what-if: measured fixed costs and CPU selection, ring bandwidth, "
                         "assumed backward, GPU selection and decode"})


def evaluate(model: str, workers: int, gbit: float, measured: dict, args) -> dict:
    tensors = model_tensors(model)
    names, sizes = [n for n, _ in tensors], [n for _, n in tensors]
    cost = scaled_cost(measured, args.sparsifier, gbit * 1e9, workers, sizes)
    t = {s: simulate(build_plan(s, sizes, cost, args.density, names, args.sparsifier), cost).iteration_s
         for s in PLANNED}
    ring = scaled_cost(measured, args.sparsifier, gbit * 1e9, workers, sizes, with_fixed=False)
    per_call = sum(fixed_cost(measured)) / 2
    for s in FORMULA_SCHEMES:
        t[s] = iteration_s(s, ring, sizes, args.density, args.sparsifier, per_collective_s=per_call)
    best = min(BASELINES, key=lambda s: t[s])
    engine = min(ENGINE_BASELINES, key=lambda s: t[s])
    # no scheme beats forward + backward: the most any could gain over the best baseline
    floor = cost.forward_s + sum(cost.backward_s)
    return {"model": model, "workers": workers, "gbit_s": gbit, "iteration_s": t,
            "compute_floor_s": floor, "headroom": t[best] / floor - 1,
            "best_baseline": best, "gain_over_best": t[best] / t["ssfusion_oi"] - 1,
            "best_engine_baseline": engine, "gain_over_engine": t[engine] / t["ssfusion_oi"] - 1,
            "speedup_over_dense": t["dense"] / t["ssfusion_oi"]}


def grid(rows: list, cell, paper: bool = False) -> list[str]:
    """A markdown table, one row per (model, workers), one column per bandwidth:
    ``cell(row)`` for each evaluated configuration; ``paper`` adds the paper's gains."""
    bws = sorted({r["gbit_s"] for r in rows})
    lines = ["| model | workers | " + " | ".join(f"{b:g} Gbit/s" for b in bws) + " |"
             + (" paper (measured) |" if paper else ""),
             "|---|---:|" + "---:|" * len(bws) + ("---|" if paper else "")]
    for m in dict.fromkeys(r["model"] for r in rows):
        for w in sorted({r["workers"] for r in rows if r["model"] == m}):
            at = {r["gbit_s"]: r for r in rows if r["model"] == m and r["workers"] == w}
            lines.append(f"| {m} | {w} | " + " | ".join(cell(at[b]) for b in bws) + " |"
                         + (f" {PAPER.get(m, '')} |" if paper else ""))
    return lines


def report(doc: dict) -> str:
    rows = doc["rows"]
    main = grid(rows, lambda r: f"{100 * r['gain_over_best']:+.1f} % [{r['best_baseline']}] / "
                                f"{r['speedup_over_dense']:.2f}x", paper=True)
    gains = [r["gain_over_best"] for r in rows]
    heads = [r["headroom"] for r in rows]
    lines = [f"SIMULATION, not a measurement. Cost model: {doc['source']} (see scripts/whatif.py "
             f"for which parts are measured, scaled and assumed). Density {doc['density']}.\n",
             "SSFusion-(O+I) throughput gain over the best other sparse scheme (which one in "
             "brackets) and, after the slash, its speedup over dense:\n", *main,
             f"\nRange of the simulated gain: {100 * min(gains):+.1f} % to {100 * max(gains):+.1f} % "
             "(paper, measured on GPU clusters: 27.5-106.7 %).\n",
             "Headroom: how much faster than the best other sparse scheme ANY scheme could be, "
             "i.e. that scheme's iteration over the compute floor (forward + backward, "
             "nothing exposed), minus 1:\n",
             *grid(rows, lambda r: f"{100 * r['headroom']:.1f} %"),
             "\nThe same gain against the baselines the timeline simulator scores like SSFusion "
             "(per_tensor, multi_tensor: same engine, same costs), the others being closed forms:\n",
             *grid(rows, lambda r: f"{100 * r['gain_over_engine']:+.1f} % [{r['best_engine_baseline']}]"),
             f"\nRange of the headroom: {100 * min(heads):.1f} % to {100 * max(heads):.1f} %.\n"]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    measured, source = measured_profile(args)
    rows = [evaluate(m, w, b, measured, args)
            for m in args.models.split(",") for w in map(int, args.workers.split(","))
            for b in map(float, args.bandwidths.split(","))]
    doc = {"command": ".venv/bin/python scripts/whatif.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "source": source, "measured": measured, "density": args.density,
           "sparsifier": args.sparsifier, "hop_latency_s": HOP_LATENCY_S,
           "date": time.strftime("%Y-%m-%d", time.gmtime()), "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "whatif.json").write_text(json.dumps(doc, indent=1))
    text = report(doc)
    (out / "whatif.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
