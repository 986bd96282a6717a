#!/usr/bin/env python3
"""Convergence of every scheme on real data, several seeds (no root, unshaped network).

    .venv/bin/python scripts/bench_convergence.py                       # both tasks, 3 seeds
    .venv/bin/python scripts/bench_convergence.py --tasks digits --schemes dense,ssfusion_oi --seeds 0

For each task (``digits``: test accuracy of the digits CNN; ``lm``: validation perplexity
of a small GPT-2 on the standard library's docstrings), scheme and seed it runs
``horovodrun -np W --gloo python -m ssfusion_hvd.examples.train --json ...`` with the same
epochs, density and hyper-parameters, and records the per-epoch curves and the tensor
missing rate (tensors that sent nothing in a step / tensors, averaged over every step).
Accuracy does not depend on the network's speed, but what SSFusion's planner decides to
sparsify does: the planned schemes plan with ``--profile`` (default: the cost model that
``bench_e2e.py`` measured on the 1 Gbit/s shaped namespace), so they send what they would
send there, while the runs themselves use the plain loopback.

Output under ``--out`` (default ``docs/results``): ``convergence.json`` (every run;
rewritten after each), ``convergence.md`` (mean ± std over seeds, difference to dense,
missing rate) and ``convergence_<task>.png`` (mean curves).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

from bench_e2e import SCHEMES, choices, environment, save_figure  # noqa: E402

#: task -> epochs (the image tasks of the accuracy suite as digits)
EPOCHS = {"digits": 10, "mlp": 10, "mlp_wide": 10, "mlp_deep": 10, "gru": 10, "lm": 3, "code": 3}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="digits,lm")
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--sparsifier", default="topk")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"),
                   help="the image tasks' optimizer (train.py --optimizer; text tasks: Adam)")
    p.add_argument("--momentum-correction", default="auto", choices=("auto", "on", "off"),
                   help="the recipe's local rule (train.py --momentum-correction)")
    p.add_argument("--density-warmup-steps", type=int, default=None,
                   help="the recipe's density warm-up (default: the optimizer's; 0: off)")
    p.add_argument("--epochs", type=int, default=0, help="0: per-task default (digits 10, lm 3, code 3)")
    p.add_argument("--profile", default=str(REPO / "docs" / "results" / "profile_1gbit.json"),
                   help="CostModel JSON the planned schemes plan with ('' : probe the loopback)")
    p.add_argument("--plan", default="",
                   help="a Plan JSON every planned scheme runs instead of planning (train.py --plan)")
    p.add_argument("--min-k", type=int, default=None,
                   help="train.py --min-k (SSFusion schemes and auto; default: theirs)")
    p.add_argument("--amp", default="none", choices=("none", "float16", "bfloat16"),
                   help="train.py --amp: autocast dtype (float16 with GradScaler)")
    p.add_argument("--init-scale", type=float, default=None,
                   help="train.py --init-scale (GradScaler's initial scale, --amp float16)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=str(REPO / "docs" / "results"))
    p.add_argument("--name", default="convergence")
    p.add_argument("--merge", action="store_true",
                   help="keep the runs of <name>.json whose (task, scheme, seed) this invocation "
                        "does not rerun (each run records its own command line)")
    return p.parse_args(argv)


def run_one(args, task: str, scheme: str, seed: int, logs: Path) -> dict:
    stem = f"{args.name}-{task}-{scheme}-{seed}"
    out, log = logs / f"{stem}.json", logs / f"{stem}.log"
    out.unlink(missing_ok=True)
    horovodrun = shutil.which("horovodrun", path=str(Path(sys.executable).parent)) or "horovodrun"
    cmd = [horovodrun, "-np", str(args.workers), "-H", f"localhost:{args.workers}", "--gloo",
           sys.executable, "-m", "ssfusion_hvd.examples.train", "--task", task, "--scheme", scheme,
           "--sparsifier", args.sparsifier, "--density", str(args.density), "--seed", str(seed),
           "--epochs", str(args.epochs or EPOCHS[task]), "--no-progress", "--json", str(out),
           "--optimizer", getattr(args, "optimizer", "sgd")]
    if args.plan:
        cmd += ["--plan", args.plan]
    elif args.profile:
        cmd += ["--profile", args.profile]
    cmd += ["--momentum-correction", args.momentum_correction]
    if args.density_warmup_steps is not None:
        cmd += ["--density-warmup-steps", str(args.density_warmup_steps)]
    if args.min_k is not None:  # train.py passes it to the schemes that take it
        cmd += ["--min-k", str(args.min_k)]
    if getattr(args, "amp", "none") != "none":
        cmd += ["--amp", args.amp]
    if getattr(args, "init_scale", None) is not None:
        cmd += ["--init-scale", str(args.init_scale)]
    cmd += list(getattr(args, "extra", ()))  # the accuracy suite's scheme variants
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.workers)),
               HOROVOD_CYCLE_TIME="1", PYTHONPATH=str(REPO))
    t0 = time.time()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc == 0 and out.exists():
        run = json.loads(out.read_text())
        return {"task": task, "scheme": scheme, "seed": seed, "metric": run["metric"],
                "history": run["history"], "stats": run["stats"], "run_s": time.time() - t0}
    return {"task": task, "scheme": scheme, "seed": seed, "error": f"exit {rc}",
            "log_tail": log.read_text().splitlines()[-15:], "run_s": time.time() - t0}


def _mean_std(xs):
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarize(runs: list) -> dict:
    """(task, scheme) -> final metric mean/std, missing rate, density, seeds, failures."""
    out = {}
    for r in runs:
        key = (r["task"], r["scheme"])
        d = out.setdefault(key, {"finals": [], "missing": [], "density": [], "failed": 0, "metric": None})
        if "error" in r:
            d["failed"] += 1
            continue
        d["metric"] = r["metric"]
        d["finals"].append(r["history"][-1][r["metric"]])
        d["missing"].append(statistics.mean(h.get("missing_rate", 0.0) for h in r["history"]))
        # elements sent / elements over every step of the run, warm-up included
        d["density"].append(statistics.mean(h.get("density_sent", r["stats"].get("density", 1.0))
                                             for h in r["history"]))
    return out


def table(runs: list, task: str) -> str:
    summ = summarize(runs)
    rows = [(s, d) for (t, s), d in summ.items() if t == task]
    if not rows:
        return ""
    metric = next((d["metric"] for _, d in rows if d["metric"]), "test_acc")
    acc = metric == "test_acc"
    dense = summ.get((task, "dense"))
    base = statistics.mean(dense["finals"]) if dense and dense["finals"] else None
    name = "test accuracy %" if acc else "validation perplexity"
    lines = [f"**{task}** ({name}, mean ± std over seeds; last epoch)\n",
             f"| scheme | {name} | vs dense | tensor missing rate | density sent (whole run) | seeds |",
             "|---|---:|---:|---:|---:|---:|"]
    for s, d in rows:
        if not d["finals"]:
            lines.append(f"| {s} | failed ({d['failed']} runs) | | | | |")
            continue
        m, sd = _mean_std(d["finals"])
        scale = 100 if acc else 1
        diff = ""
        if base is not None:
            diff = f"{scale * (m - base):+.2f} points" if acc else f"{m / base:.3f}x"
        seeds = f"{len(d['finals'])}" + (f" ({d['failed']} failed)" if d["failed"] else "")
        lines.append(f"| {s} | {scale * m:.2f} ± {scale * sd:.2f} | {diff} | "
                     f"{statistics.mean(d['missing']):.4f} | {statistics.mean(d['density']):.4f} | "
                     f"{seeds} |")
    return "\n".join(lines) + "\n"


def plot(runs: list, task: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    metric = None
    for s in SCHEMES:
        mine = [r for r in runs if r["task"] == task and r["scheme"] == s and "error" not in r]
        if not mine:
            continue
        metric = mine[0]["metric"]
        epochs = [h["epoch"] for h in mine[0]["history"]]
        ys = [statistics.mean(r["history"][i][metric] for r in mine) for i in range(len(epochs))]
        if metric == "test_acc":
            ys = [100 * y for y in ys]
        ax.plot(epochs, ys, marker="o", ms=3, label=s, lw=2.2 if s in ("dense", "ssfusion_oi") else 1.2)
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy %" if metric == "test_acc" else "validation perplexity")
    if metric != "test_acc":
        ax.set_yscale("log")
    ax.set_title(f"{task}: mean over seeds, density sent 0.01 for the sparse schemes")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    save_figure(fig, path)


def report(doc: dict, out: Path, name: str) -> str:
    tasks = list(dict.fromkeys(r["task"] for r in doc["runs"]))
    warm = doc.get("density_warmup_steps")
    parts = [f"{doc['workers']} workers, density {doc['density']}, sparsifier {doc['sparsifier']}, "
             f"momentum correction {doc.get('momentum_correction', 'auto')}, density warm-up "
             f"{'default' if warm is None else warm} steps, seeds {doc['seeds']}.\n"]
    for t in tasks:
        parts.append(table(doc["runs"], t))
        try:
            plot(doc["runs"], t, out / f"{name}_{t}.png")
            parts.append(f"![{t}]({name}_{t}.png)\n")
        except ImportError:
            pass
    text = "\n".join(parts)
    (out / f"{name}.md").write_text(text)
    return text


def main(argv=None) -> None:
    args = parse_args(argv)
    tasks = choices(args.tasks, EPOCHS, "task")
    schemes = choices(args.schemes, SCHEMES, "scheme")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    doc = {"command": ".venv/bin/python scripts/bench_convergence.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "workers": args.workers, "density": args.density, "sparsifier": args.sparsifier,
           "momentum_correction": args.momentum_correction,
           "density_warmup_steps": args.density_warmup_steps,
           "seeds": seeds, "profile": args.profile, "plan": args.plan, "environment": environment(), "runs": []}
    path = out / f"{args.name}.json"
    if args.merge and path.exists():
        rerun = {(t, s, seed) for t in tasks for s in schemes for seed in seeds}
        doc["runs"] = [r for r in json.loads(path.read_text())["runs"]
                       if (r["task"], r["scheme"], r["seed"]) not in rerun]
    for t in tasks:
        for s in schemes:
            for seed in seeds:
                r = run_one(args, t, s, seed, logs)
                r["command"] = doc["command"]
                doc["runs"].append(r)
                status = r.get("error") or f"{r['metric']} {r['history'][-1][r['metric']]:.4f}"
                print(f"[convergence] {t} {s} seed {seed}: {status} ({r['run_s']:.0f} s)", flush=True)
                path.write_text(json.dumps(doc, indent=1))
    print(report(doc, out, args.name))


if __name__ == "__main__":
    main()
