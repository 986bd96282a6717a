#!/usr/bin/env python3
"""The accuracy suite: does a scheme train as well as dense on models it was not tuned for?

    .venv/bin/python scripts/accuracy_suite.py                     # every cell, 3 seeds
    .venv/bin/python scripts/accuracy_suite.py --cells mlp-sgd-0.01-6 --seeds 0
    .venv/bin/python scripts/accuracy_suite.py --list               # the cells

A *cell* is one training setup: task, optimizer, density, epochs, workers, and for some
a learning rate (``-lr0.008``: Adam at dense's own best rate). Every scheme of
``--schemes`` runs every cell with the same seeds and equal epochs through
``bench_convergence.run_one`` (``horovodrun -np W --gloo python -m
ssfusion_hvd.examples.train``; the planned schemes plan on the 1 Gbit/s profile, so they
sparsify what they would there). Peers (``examples/peers.py``: DDP with PowerSGD or fp16
compression, Horovod with fp16) run as schemes of the same name. Tasks
(``examples/train.py``): four image models on the
bundled digits (an MLP 64-256-256-10, a wide one 64-1024-10, a deep one with four hidden
layers of 128, and a GRU reading the rows), the digits CNN, and the byte-level GPT-2 LM.

Scheme labels are ``scheme`` or ``scheme/variant``: ``ssfusion_oi/uniform`` is
ssfusion_oi with every tensor at its own k (``scheme_options={"floor": None}``, the
paper's per-tensor density) instead of the group budget; ``ssfusion_oi/waits`` (and
``/nowaits``) with each sender's wait on the wire (``scheme_options["waits"]``) or
without it; ``ssfusion_oi/slack=0.2`` and
``ssfusion_oi/floor=0.5`` set ``scheme_options`` ``slack`` and ``floor``,
``ssfusion_oi/warmup=150`` the recipe's ``density_warmup_steps``, ``dense/lr=1e-3``
the learning rate, ``ssfusion_oi/density=0.015`` the density in place of the cell's,
``ssfusion_oi/min_k=32`` the small tensors dense (``scheme_options["min_k"]``).

Output: ``<out>/<name>.json`` (every run, rewritten after each; ``--merge`` keeps the
runs of an earlier file that this invocation does not repeat) and ``<name>.md``: per cell
the mean ± std of the last epoch's metric, its difference to dense, and the density
actually sent over the whole run (warm-up included). ``--pair ssfusion_oi,multi_tensor``
adds the two labels compared seed by seed (per cell and over all), on the metric or, with
``--pair-on loss``, on the last epoch's training loss; ``--from a.json,b.json`` reports runs
already made, together, and runs nothing.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent

from bench_convergence import run_one  # noqa: E402
from bench_e2e import environment  # noqa: E402

#: (task, optimizer, density, epochs, workers[, learning rate]), in the order they run;
#: without a rate the task's default (SGD 0.05, Adam 1e-3, the LM 2e-3)
CELLS = [
    *[(t, "sgd", 0.01, 6, 2) for t in ("mlp", "mlp_wide", "mlp_deep", "digits", "gru")],
    *[(t, "sgd", 0.001, 6, 2) for t in ("mlp", "mlp_wide", "mlp_deep", "digits", "gru")],
    *[(t, "adam", 0.01, 6, 2) for t in ("mlp", "gru")],
    ("lm", "adam", 0.01, 3, 2),
    *[(t, "sgd", 0.01, 20, 2) for t in ("mlp", "mlp_deep", "gru")],
    *[(t, "sgd", 0.01, 6, 4) for t in ("mlp", "gru", "digits")],
    # Adam beyond the MLP and the GRU (added with the selection by the pending step)
    *[(t, "adam", 0.01, 6, 2) for t in ("mlp_wide", "mlp_deep", "digits")],
    ("gru", "adam", 0.01, 20, 2),
    *[(t, "adam", 0.01, 6, 4) for t in ("mlp", "gru")],
    ("lm", "adam", 0.01, 3, 4),
    # Adam at dense's own best rate, where a user who tuned dense runs us (swept at 5e-4 to
    # 8e-3, 3-8 seeds: docs/results/accuracy_adam_lr.md; the LM at 3 epochs: 1e-3)
    *[(t, "adam", 0.01, 6, 2, 8e-3) for t in ("mlp", "mlp_wide", "mlp_deep", "digits", "gru")],
    *[(t, "adam", 0.01, 6, 4, 8e-3) for t in ("mlp", "gru")],
    ("lm", "adam", 0.01, 3, 2, 1e-3),
    # Adam at density 0.001 (the grid is both densities with both optimizers), at
    # dense's best rate
    *[(t, "adam", 0.001, 6, 2, 8e-3) for t in ("mlp", "mlp_wide", "mlp_deep", "digits", "gru")],
]
#: scheme label -> (scheme, extra train.py arguments)
VARIANTS = {"uniform": ["--floor", "none"], "shared": ["--moments", "shared"],
            "local": ["--moments", "local"], "waits": ["--waits", "on"],
            "nowaits": ["--waits", "off"], "spread": ["--spread", "on"],
            "nospread": ["--spread", "off"], "bystep": ["--select-by", "step"],
            "bymagnitude": ["--select-by", "magnitude"], "bygain": ["--select-by", "gain"]}


def cell_name(cell) -> str:
    task, opt, density, epochs, workers, *lr = cell
    return (f"{task}-{opt}-{density:g}-{epochs}" + (f"-w{workers}" if workers != 2 else "")
            + (f"-lr{lr[0]:g}" if lr else ""))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", default="", help="comma-separated cell names (default: all; --list)")
    p.add_argument("--schemes", default="dense,ssfusion_oi,multi_tensor,ssfusion_oi/uniform")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--epochs", type=int, default=0, help="every cell's epochs (0: the cell's own)")
    p.add_argument("--profile", default=str(REPO / "docs" / "results" / "profile_1gbit.json"))
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--out", default=str(REPO / "docs" / "results"))
    p.add_argument("--name", default="accuracy_suite")
    p.add_argument("--merge", action="store_true")
    p.add_argument("--pair", default="",
                   help="two labels 'a,b': the report adds a by-seed comparison, a - b on the "
                        "seeds both ran, per cell and over all cells")
    p.add_argument("--pair-on", default="metric", choices=("metric", "loss"),
                   help="what --pair compares: the cell's metric (default) or the last epoch's "
                        "training loss (the mean over its steps: the seed's test-set luck "
                        "left out, so a lag in optimization shows with fewer seeds)")
    p.add_argument("--from", dest="sources", default="",
                   help="comma-separated suite JSON files: report their runs together (a later "
                        "file's run of the same cell, label and seed wins); runs nothing")
    p.add_argument("--list", action="store_true")
    return p.parse_args(argv)


def scheme_of(label: str):
    """(scheme, extra train.py arguments) of a label: ``scheme``, ``scheme/uniform``,
    ``scheme/slack=x`` or ``scheme/floor=x`` (``scheme_options["slack"]``, ``["floor"]``),
    ``scheme/warmup=n`` (``density_warmup_steps``), ``scheme/lr=x`` (the learning rate),
    ``scheme/density=x`` (the density, in place of the cell's: a run at a peer's bytes),
    ``scheme/min_k=n`` (``scheme_options["min_k"]``: tensors whose top-k would be below n
    sent dense);
    variants joined by ``+`` combine (``ssfusion_oi/bymagnitude+lr=1e-3``)."""
    scheme, _, variants = label.partition("/")
    extra = []
    for variant in [v for v in variants.split("+") if v]:
        for option, flag in (("slack", "--slack"), ("floor", "--floor"),
                             ("warmup", "--density-warmup-steps"), ("lr", "--lr"),
                             ("density", "--density"), ("min_k", "--min-k")):
            if variant.startswith(option + "="):
                extra += [flag, variant[len(option) + 1:]]
                break
        else:
            if variant not in VARIANTS:
                raise SystemExit(f"unknown variant {variant!r} of {label!r}; known: "
                                 f"{sorted(VARIANTS)}, slack=x, floor=x, warmup=n, lr=x, density=x, "
                                 f"min_k=n")
            extra += VARIANTS[variant]
    return scheme, extra


def run_cell(args, cell, label: str, seed: int, logs: Path) -> dict:
    task, opt, density, epochs, workers, *lr = cell
    scheme, extra = scheme_of(label)
    if lr and "--lr" not in extra:  # the cell's rate, unless the label sets one
        extra = ["--lr", f"{lr[0]:g}", *extra]
    ns = SimpleNamespace(
        workers=workers, sparsifier="topk", density=density, epochs=args.epochs or epochs, plan="",
        profile=args.profile, momentum_correction="auto", density_warmup_steps=None,
        min_k=None, timeout=args.timeout, optimizer=opt, extra=extra,
        name=f"{args.name}-{cell_name(cell)}-{label.replace('/', '_')}")
    if "--density" in extra:  # the label's density in place of the cell's (the last flag wins)
        density = float(extra[extra.index("--density") + 1])
    r = run_one(ns, task, scheme, seed, logs)
    r.update(cell=cell_name(cell), label=label, optimizer=opt, density=density,
             epochs=args.epochs or epochs, workers=workers)
    return r


def _final(r):
    return r["history"][-1][r["metric"]]


def _sent(row) -> float:
    """One epoch's bytes per step against a dense float32 allreduce's (a peer's elements
    are not ours to count), or, in runs that predate the byte count, the density sent."""
    if row.get("bytes_per_step") is not None and row.get("dense_bytes_per_step"):
        return row["bytes_per_step"] / row["dense_bytes_per_step"]
    return row.get("density_sent", 1.0)


def report(doc: dict) -> str:
    lines = [f"Seeds {doc['seeds']}; last epoch's metric, mean ± std; 'vs dense': difference "
             "of the means (points of test accuracy, or the perplexity ratio); 'sent': bytes "
             "one rank sent per step against a dense float32 allreduce, over the whole run "
             "(warm-up and dense profiling steps included; a peer's once it compresses), or "
             "elements sent / elements in runs without byte counts.\n",
             "| cell | scheme | metric | vs dense | sent | runs |", "|---|---|---:|---:|---:|---:|"]
    cells = list(dict.fromkeys(r["cell"] for r in doc["runs"]))
    for c in cells:
        mine = [r for r in doc["runs"] if r["cell"] == c]
        dense = [_final(r) for r in mine if r["label"] == "dense" and "error" not in r]
        base = statistics.mean(dense) if dense else None
        for label in dict.fromkeys(r["label"] for r in mine):
            runs = [r for r in mine if r["label"] == label]
            ok = [r for r in runs if "error" not in r]
            if not ok:
                lines.append(f"| {c} | {label} | failed | | | {len(runs)} |")
                continue
            acc = ok[0]["metric"] == "test_acc"
            xs = [_final(r) for r in ok]
            m, sd = statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)
            scale = 100 if acc else 1
            diff = "" if base is None or label == "dense" else (
                f"{scale * (m - base):+.2f}" if acc else f"{m / base:.3f}x")
            sent = statistics.mean(statistics.mean(_sent(h) for h in r["history"]) for r in ok)
            failed = len(runs) - len(ok)
            lines.append(f"| {c} | {label} | {scale * m:.2f} ± {scale * sd:.2f} | {diff} | "
                         f"{sent:.4f} | {len(ok)}{f' ({failed} failed)' if failed else ''} |")
    return "\n".join(lines) + "\n"


def paired(runs, a: str, b: str, on: str = "metric"):
    """Label ``a`` against ``b`` seed by seed, on the seeds both ran without error: per cell
    ``(cell, n, mean a, mean b, mean of a - b, its standard error, median, ahead, behind)``,
    then the same over every pair of every cell (cell ``"all"``; the means there are of
    the pairs). Differences in points for accuracy, metric units otherwise. Pairing removes
    the seed's share of the spread (data order, initialization), which on the short jobs
    is most of it. ``on="loss"`` compares the last epoch's training loss instead ("ahead"
    then means a higher loss)."""
    ok = [r for r in runs if "error" not in r]  # a failed run has no metric
    value = _final if on == "metric" else (lambda r: r["history"][-1]["loss"])
    final = {(r["cell"], r["label"], r["seed"]): value(r) for r in ok}
    metric = {r["cell"]: r["metric"] for r in ok}
    rows, everything = [], []
    for cell in dict.fromkeys(r["cell"] for r in runs):
        seeds = sorted(s for (c, label, s) in final if c == cell and label == a
                       and (cell, b, s) in final)
        if not seeds:
            continue
        scale = 100 if on == "metric" and metric[cell] == "test_acc" else 1
        xa = [scale * final[(cell, a, s)] for s in seeds]
        xb = [scale * final[(cell, b, s)] for s in seeds]
        rows.append(_paired_row(cell, xa, xb))
        everything.append((xa, xb))
    if len(rows) > 1:
        rows.append(_paired_row("all", [x for xa, _ in everything for x in xa],
                                [x for _, xb in everything for x in xb]))
    return rows


def _paired_row(cell, xa, xb):
    d = [x - y for x, y in zip(xa, xb)]
    se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
    return (cell, len(d), statistics.mean(xa), statistics.mean(xb), statistics.mean(d), se,
            statistics.median(d), sum(x > 0 for x in d), sum(x < 0 for x in d))


def paired_report(runs, a: str, b: str, on: str = "metric") -> str:
    if on == "metric":
        intro = ("seed by seed: mean of the differences ± its standard error, median, and on "
                 "how many seeds each was ahead")
        signs, fmt = "ahead / behind", ".2f"
    else:  # the "all" row then mixes the cells' loss scales, as the metric's mixes units
        intro = (f"seed by seed, the last epoch's training loss: mean of the differences ± its "
                 f"standard error, median, and on how many seeds {a}'s was higher / lower")
        signs, fmt = "higher / lower", ".4f"
    lines = [f"\n{a} against {b}, {intro}.\n",
             f"| cell | seeds | {a} | {b} | difference | median | {signs} |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for cell, n, ma, mb, md, se, med, above, below in paired(runs, a, b, on):
        lines.append(f"| {cell} | {n} | {ma:{fmt}} | {mb:{fmt}} | {md:+{fmt}} ± {se:{fmt}} | "
                     f"{med:+{fmt}} | {above} / {below} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    by_name = {cell_name(c): c for c in CELLS}
    if args.list:
        print("\n".join(by_name))
        return
    pair = [x for x in args.pair.split(",") if x]
    if args.pair and len(pair) != 2:
        raise SystemExit(f"--pair takes two labels 'a,b', got {args.pair!r}")
    if args.pair_on != "metric" and not pair:
        raise SystemExit("--pair-on needs --pair a,b")
    if args.sources:  # report only
        runs = {}
        for f in [x for x in args.sources.split(",") if x]:
            for r in json.loads(Path(f).read_text())["runs"]:
                runs[(r["cell"], r["label"], r["seed"])] = r
        doc = {"seeds": sorted({r["seed"] for r in runs.values()}), "runs": list(runs.values())}
        print(report(doc) + (paired_report(doc["runs"], *pair, args.pair_on) if pair else ""))
        return
    names = [c for c in args.cells.split(",") if c] or list(by_name)
    for n in names:
        if n not in by_name:
            raise SystemExit(f"unknown cell {n!r}; --list shows them")
    labels = [s for s in args.schemes.split(",") if s]
    for label in labels:
        scheme_of(label)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.name}.json"
    doc = {"command": ".venv/bin/python scripts/accuracy_suite.py "
                      + " ".join(sys.argv[1:] if argv is None else argv),
           "seeds": seeds, "profile": args.profile, "environment": environment(), "runs": []}
    if args.merge and path.exists():
        rerun = {(n, label, seed) for n in names for label in labels for seed in seeds}
        doc["runs"] = [r for r in json.loads(path.read_text())["runs"]
                       if (r["cell"], r["label"], r["seed"]) not in rerun]
    for n in names:
        for label in labels:
            for seed in seeds:
                r = run_cell(args, by_name[n], label, seed, logs)
                r["command"] = doc["command"]
                doc["runs"].append(r)
                status = r.get("error") or f"{r['metric']} {_final(r):.4f}"
                print(f"[suite] {n} {label} seed {seed}: {status} ({r['run_s']:.0f} s)", flush=True)
                path.write_text(json.dumps(doc, indent=1))
    text = report(doc) + (paired_report(doc["runs"], *pair, args.pair_on) if pair else "")
    (out / f"{args.name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
