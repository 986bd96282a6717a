#!/usr/bin/env python3
"""End-to-end throughput of every scheme on a shaped network (run as root).

    sudo .venv/bin/python scripts/bench_e2e.py                 # the full table set
    sudo .venv/bin/python scripts/bench_e2e.py --models demo --workers 2 --iters 5

Creates a network namespace, brings its loopback up and shapes it with ``tc`` (``--rate``,
default 1 Gbit/s, by ``tbf``; ``--delay``, default 100 us, by ``netem`` where the kernel has
it, otherwise reported as not applied), then for every (model, workers, scheme) runs
``horovodrun --gloo`` inside the namespace on ``python -m ssfusion_hvd.examples.bench``.
All worker traffic stays on the namespace's loopback; note that this is one shared link:
the workers share ``--rate`` between them, like hosts behind one slow uplink, rather than
each having a link of its own. ``--shaper pace`` needs neither root nor ``tc``: each rank
is put behind its own ``--rate`` egress link by ``scripts/pace.c`` (``LD_PRELOAD``), as on
the lent GPU machines (``docs/gpu.md``).

``--hosts H --slots S`` runs every job on a ``scripts/cluster.py`` cluster instead: H
namespaced hosts with S ranks each, each host with its own ``--rate`` link, launched over
ssh with ``horovodrun -H h1:S,...``. ``--controller mpi`` uses Horovod's MPI controller,
``--hierarchical`` sets ``HOROVOD_HIERARCHICAL_ALLREDUCE`` and ``HOROVOD_HIERARCHICAL_ALLGATHER``.
Runs of different topologies and settings merge into one file (``--merge``) and get their
own tables; ratios are against the dense run of the same topology and setting.

Output under ``--out`` (default ``docs/results``): ``e2e.json`` (every run, the shaping and
link measurement, machine and versions; rewritten after each run so a partial sweep
survives), ``e2e.md`` (one table per model and worker count: samples/s as the median of
the timed iterations, ratio to the dense run of the same sweep, time blocked on
communication, bytes on the wire) and ``e2e_<model>.png``. Worker logs go to
``<out>/logs/``. The namespace is deleted on exit, on error and on Ctrl-C / SIGTERM.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
from cluster import (  # noqa: E402
    MPI_AS_ROOT,
    Cluster,
    ClusterError,
    horovodrun_binary,
    measure_link,
    shape,
)
from ssfusion_hvd.plan import CostModel, Plan, simulate  # noqa: E402
from ssfusion_hvd.registry import SCHEMES  # noqa: E402  (display order: the registry's)
from ssfusion_hvd.examples.peers import PEERS, POWERSGD_START  # noqa: E402  (what a user would pick instead)
#: model -> (untimed iterations, timed iterations); sparse schemes profile 5 of the former
#: (the library's default warmup_steps)
ITERATIONS = {"gpt2": (6, 7), "resnet": (7, 10), "resnet50": (7, 10), "demo": (7, 30)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="1gbit", help="tc rate of the namespace loopback")
    p.add_argument("--shaper", choices=("netns", "pace"), default="netns",
                   help="netns: a namespace whose loopback tc shapes (root; one shared link); "
                        "pace: each rank behind its own --rate egress link, by the LD_PRELOAD "
                        "library scripts/pace.c (no root, no tc, no delay; the GPU machines)")
    p.add_argument("--delay", default="100us", help="one-way delay (netem); '0' for none")
    p.add_argument("--models", default="gpt2,resnet,demo")
    p.add_argument("--workers", default="2,4", help="worker counts (one host; with --hosts: H*S)")
    p.add_argument("--hosts", type=int, default=1,
                   help="> 1: a scripts/cluster.py cluster of this many hosts, each with its own "
                        "--rate link, instead of one shared loopback")
    p.add_argument("--slots", type=int, default=1, help="ranks per host (with --hosts)")
    p.add_argument("--controller", choices=("gloo", "mpi"), default="gloo")
    p.add_argument("--hierarchical", action="store_true",
                   help="set HOROVOD_HIERARCHICAL_ALLREDUCE=1 and HOROVOD_HIERARCHICAL_ALLGATHER=1")
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--sparsifier", default="topk")
    p.add_argument("--min-k", type=int, default=None,
                   help="scheme_options['min_k'] for the schemes that take it (SSFusion, auto)")
    p.add_argument("--iters", type=int, default=0, help="timed iterations (0: per-model default)")
    p.add_argument("--warmup", type=int, default=0, help="untimed iterations (0: per-model default)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    p.add_argument("--deadline", type=float, default=0,
                   help="> 0: start no run once this many seconds have passed (a sweep that "
                        "must fit a time budget runs in the order given)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="bench.py --device")
    p.add_argument("--amp", default="none", choices=("none", "float16", "bfloat16"), help="bench.py --amp")
    p.add_argument("--batch-size", type=int, default=0, help="bench.py --batch-size (0: the model's)")
    p.add_argument("--seq-len", type=int, default=64, help="bench.py --seq-len (gpt2)")
    p.add_argument("--warmup-steps", type=int, default=5,
                   help="bench.py --warmup-steps: the sparse schemes' profiling iterations")
    p.add_argument("--powersgd-start", type=int, default=POWERSGD_START,
                   help="bench.py --powersgd-start (the PowerSGD peers' plain steps, untimed)")
    p.add_argument("--agreement", default="on", choices=("on", "off", "both"),
                   help="bench.py --agreement; both: every run twice, the A/B of its cost")
    p.add_argument("--out", default=str(REPO / "docs" / "results"))
    p.add_argument("--name", default="e2e", help="file stem of the outputs")
    p.add_argument("--netns", default=f"ssfbench{os.getpid()}", help="namespace name")
    p.add_argument("--merge", action="store_true",
                   help="keep the runs already in <out>/<name>.json; the runs of this call replace "
                        "those of the same (model, workers, hosts, scheme, controller, hierarchical)")
    return p.parse_args(argv)


def choices(text: str, allowed, what: str) -> list:
    """The comma-separated ``text`` as a list, each item checked against ``allowed``."""
    items = [x for x in text.split(",") if x]
    for x in items:
        if x not in allowed:
            raise SystemExit(f"unknown {what} {x!r}; choose from {','.join(allowed)}")
    return items


# ------------------------------------------------------------------ namespace
def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True)


class ShapedNamespace:
    """A network namespace whose loopback is rate-limited (and delayed where netem exists).
    A context manager: the namespace is deleted on exit, whatever the exit."""

    def __init__(self, name: str, rate: str, delay: str):
        self.name, self.rate, self.delay = name, rate, delay
        self.shaping = ""
        self.delay_applied = False

    def exec_prefix(self) -> list:
        return ["ip", "netns", "exec", self.name]

    def __enter__(self):
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise SystemExit(f"bench_e2e needs `{tool}` (iproute2)")
        if os.geteuid() != 0:
            raise SystemExit("bench_e2e needs root to create a network namespace (run with sudo)")
        sh("ip", "netns", "add", self.name)
        try:
            sh(*self.exec_prefix(), "ip", "link", "set", "lo", "up")
            self.shaping, self.delay_applied = shape(self.exec_prefix(), "lo", self.rate, self.delay)
            if not self.delay_applied and self.delay not in ("", "0", "0us", "0ms"):
                print(f"[bench_e2e] netem unavailable: delay {self.delay} NOT applied; shaping "
                      "the rate only", flush=True)
        except BaseException:
            self.__exit__()
            raise
        return self

    def command(self, argv: list, np: int, controller: str = "gloo", env=None) -> list:
        """argv running ``horovodrun -np N -H localhost:N`` inside the namespace."""
        env = dict(env or {})
        if controller == "mpi":
            env.update(MPI_AS_ROOT)
        return (self.exec_prefix() + ["env", *(f"{k}={v}" for k, v in env.items()), horovodrun_binary(),
                                      "-np", str(np), "-H", f"localhost:{np}", f"--{controller}"]
                + list(argv))

    def measure_link(self) -> dict:
        return measure_link(self.exec_prefix(), self.exec_prefix(), "127.0.0.1")

    def describe(self) -> str:
        return f"namespace {self.name}, one shared loopback: {self.shaping}"

    def __exit__(self, *exc) -> None:
        # kill anything left in the namespace, then delete it
        pids = sh("ip", "netns", "pids", self.name, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        sh("ip", "netns", "del", self.name, check=False)


def rate_bytes_per_s(rate: str) -> float:
    """tc's rate notation (``1gbit``, ``500mbit``, ``100kbit``, ``10mbps``) in bytes per second."""
    text = rate.strip().lower()
    units = (("gbit", 1e9 / 8), ("mbit", 1e6 / 8), ("kbit", 1e3 / 8), ("gbps", 1e9),
             ("mbps", 1e6), ("kbps", 1e3), ("bit", 1 / 8), ("bps", 1.0))
    for unit, scale in units:
        if text.endswith(unit):
            return float(text[:-len(unit)]) * scale
    raise SystemExit(f"rate {rate!r}: expected e.g. 1gbit, 500mbit")


class PacedLinks:
    """Each rank behind its own egress link of ``rate``: the ranks run in this machine's
    own network, with scripts/pace.c loaded into each (``LD_PRELOAD``), which lets every
    TCP byte a rank writes leave at ``rate`` at most. Needs no root, tc or namespace: the
    shaper of machines that have none (the lent GPU machines run under gVisor, without
    iproute2). No delay is added; the byte counter is the machine's loopback, which other
    processes may also use. A context manager, for symmetry with ShapedNamespace."""

    SOURCE = REPO / "scripts" / "pace.c"
    LIBRARY = REPO / "build" / "pace" / "libssfpace.so"

    def __init__(self, rate: str):
        self.rate = rate
        self.bytes_per_s = rate_bytes_per_s(rate)
        self.shaping = f"pace {rate} per rank (LD_PRELOAD scripts/pace.c, egress, burst 256 KiB)"
        self.delay_applied = False

    def __enter__(self):
        lib = self.LIBRARY
        if not lib.exists() or lib.stat().st_mtime < self.SOURCE.stat().st_mtime:
            lib.parent.mkdir(parents=True, exist_ok=True)
            cc = shutil.which("cc") or shutil.which("gcc")
            if cc is None:
                raise SystemExit("--shaper pace needs a C compiler (cc) to build scripts/pace.c")
            r = sh(cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(self.SOURCE), "-ldl",
                   "-lpthread", check=False)
            if r.returncode != 0:
                raise SystemExit(f"building scripts/pace.c failed:\n{r.stderr}")
        return self

    def env(self) -> dict:
        return {"LD_PRELOAD": str(self.LIBRARY), "SSF_PACE_BYTES_PER_S": f"{self.bytes_per_s:.0f}"}

    def command(self, argv: list, np: int, controller: str = "gloo", env=None) -> list:
        """horovodrun on this machine's loopback, every worker started paced."""
        env = dict(env or {})
        if controller == "mpi":
            env.update(MPI_AS_ROOT)
        worker = ["env", *(f"{k}={v}" for k, v in self.env().items())] + list(argv)
        return (["env", *(f"{k}={v}" for k, v in env.items()), horovodrun_binary(), "-np", str(np),
                 "-H", f"localhost:{np}", f"--{controller}"] + worker)

    def measure_link(self) -> dict:
        return measure_link([], ["env", *(f"{k}={v}" for k, v in self.env().items())], "127.0.0.1")

    def describe(self) -> str:
        return f"this machine's loopback, each rank paced to {self.rate} (its own link)"

    def __exit__(self, *exc) -> None:
        pass


# ------------------------------------------------------------------ runs
_child: subprocess.Popen | None = None


def _on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def setting(args, agreement: str = "on") -> dict:
    """What distinguishes this call's runs besides (model, workers, scheme)."""
    return {"hosts": args.hosts, "slots": args.slots if args.hosts > 1 else None,
            "controller": args.controller, "hierarchical": args.hierarchical,
            "min_k": args.min_k, "agreement": agreement}


def run_key(r: dict) -> tuple:
    return (r["model"], r["workers"], r.get("hosts", 1), r["scheme"], r.get("controller", "gloo"),
            r.get("hierarchical", False), r.get("min_k"), r.get("agreement", "on"))


def run_one(topo, args, model: str, workers: int, scheme: str, logs: Path,
            agreement: str = "on") -> dict:
    global _child
    warmup, iters = ITERATIONS.get(model, (5, 10))
    warmup, iters = args.warmup or warmup, args.iters or iters
    warmup = max(warmup, args.warmup_steps + 1)  # the timed window starts after planning
    if scheme.startswith("ddp_powersgd"):  # time PowerSGD compressing, not its plain first steps
        warmup = max(warmup, args.powersgd_start + 1)
    where = setting(args, agreement)
    stem = "-".join([model, str(workers), scheme]
                    + ([f"mink{args.min_k}"] if args.min_k is not None else [])
                    + ([f"{args.hosts}x{args.slots}"] if args.hosts > 1 else [])
                    + ([args.controller] if args.controller != "gloo" else [])
                    + (["hier"] if args.hierarchical else [])
                    + (["noagree"] if agreement == "off" else []))
    tmp = logs / f"{stem}.json"
    tmp.unlink(missing_ok=True)
    env = {"OMP_NUM_THREADS": max(1, (os.cpu_count() or 1) // workers), "HOROVOD_CYCLE_TIME": 1,
           "HOROVOD_FUSION_THRESHOLD": 67108864, "PYTHONPATH": REPO}
    if args.hierarchical:
        env.update(HOROVOD_HIERARCHICAL_ALLREDUCE=1, HOROVOD_HIERARCHICAL_ALLGATHER=1)
    cmd = topo.command([sys.executable, "-m", "ssfusion_hvd.examples.bench", "--model", model,
                        "--scheme", scheme, "--density", str(args.density), "--sparsifier",
                        args.sparsifier, "--warmup", str(warmup), "--iters", str(iters),
                        "--json", str(tmp), "--device", args.device, "--amp", args.amp,
                        "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
                        "--warmup-steps", str(args.warmup_steps),
                        "--powersgd-start", str(args.powersgd_start), "--agreement", agreement]
                       + (["--min-k", str(args.min_k)] if args.min_k is not None else [])
                       + (["--interfaces", "lo,eth0"] if args.hosts > 1 else []),
                       np=workers, controller=args.controller, env=env)
    log = logs / f"{stem}.log"
    t0 = time.time()
    with open(log, "w") as f:
        _child = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = _child.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            if _child.poll() is None:
                os.killpg(_child.pid, signal.SIGKILL)
                _child.wait()
            _child = None
    if rc == 0 and tmp.exists():
        res = json.loads(tmp.read_text())
        res.update(where, run_s=time.time() - t0)
        return res
    tail = log.read_text().splitlines()[-15:]
    return {"model": model, "workers": workers, "scheme": scheme, **where,
            "error": f"exit {rc}", "log_tail": tail, "run_s": time.time() - t0}


def environment() -> dict:
    import torch

    try:
        from importlib.metadata import version
        hvd = version("horovod")
    except Exception:  # noqa: BLE001
        hvd = "?"
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem, 1),
            "kernel": platform.release(), "python": platform.python_version(),
            "torch": torch.__version__, "horovod": hvd,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


# ------------------------------------------------------------------ report

def save_figure(fig, path) -> None:
    """Write a matplotlib figure as a 64-colour PNG and close it. The figures are tracked in
    ``docs/results/`` and line plots need no more colours: a third of the bytes of
    matplotlib's RGBA output, and the tracked results stay small (issue 35)."""
    import io

    from PIL import Image
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png")
    plt.close(fig)
    buf.seek(0)
    Image.open(buf).convert("RGB").quantize(colors=64).save(path, optimize=True)

def checked(r: dict) -> bool:
    """Whether a run had the per-step agreement check (runs before --agreement all did)."""
    return r.get("agreement", "on") == "on"


def variant(r: dict) -> tuple:
    """(controller, hierarchical) of a run; runs before these fields existed were Gloo, flat."""
    return r.get("controller", "gloo"), bool(r.get("hierarchical", False))


def label(r: dict) -> str:
    ctrl, hier = variant(r)
    extra = ([ctrl] if ctrl != "gloo" else []) + (["hierarchical"] if hier else []) \
        + ([f"min_k {r['min_k']}"] if r.get("min_k") is not None else []) \
        + (["no agreement check"] if not checked(r) else [])
    return r["scheme"] + (f" [{', '.join(extra)}]" if extra else "")


def group(rows: list, model: str, workers: int, hosts: int = 1) -> list:
    """The runs of (model, workers, hosts), in variant then registry order."""
    order = {s: i for i, s in enumerate(SCHEMES)}
    return sorted((r for r in rows if r["model"] == model and r["workers"] == workers
                   and r.get("hosts", 1) == hosts),
                  key=lambda r: (variant(r), order.get(r["scheme"], len(order)), not checked(r)))


def topology_name(workers: int, hosts: int) -> str:
    return f"{workers} workers" + (f" on {hosts} hosts x {workers // hosts} slots" if hosts > 1 else "")


def prediction(run: dict) -> float | None:
    """Simulated seconds per iteration of the run's plan on the cost model it measured at
    start-up, at the density in force in the timed iterations (None: no plan of ours)."""
    if not run.get("plan") or not run.get("cost_model"):
        return None
    plan = Plan.from_json(json.dumps(run["plan"]))
    cost = CostModel.from_json(json.dumps(run["cost_model"]))
    plan = plan.at_density(run.get("density_target", plan.density))
    return simulate(plan, cost).iteration_s


def plan_label(run: dict) -> str:
    """Which plan a run used: the scheme that planned it (auto: the one it chose) and its
    sparse tensors; "-" for runs without a plan of ours (dense, the peers)."""
    plan = run.get("plan")
    if not plan:
        return "-"
    return f"{plan['scheme']}, {sum(plan['sparse'])}/{len(plan['sparse'])} sparse"


def ratio_table(rows: list, model: str, workers: int, hosts: int = 1) -> str:
    """One markdown table: the runs of (model, workers, hosts), each against the dense run of
    the same controller and collective setting."""
    mine = group(rows, model, workers, hosts)
    if not mine:
        return ""
    dense = {variant(r): r for r in mine if r["scheme"] == "dense" and "error" not in r
             and checked(r)}
    # one host: every worker's bytes cross the one loopback, counted there; a cluster: the
    # bytes each worker hands to its collectives (rank 0's host counters see only its own)
    volume = "wire MB/iter" if hosts == 1 else "sent MB/iter/worker"
    head = (f"**{model}, {topology_name(workers, hosts)}**\n\n"
            "| scheme | samples/s | x dense | iteration ms | comm window % | blocked % | "
            f"{volume} | density | missing rate | plan | predicted ms |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    lines = [head]
    for r in mine:
        if "error" in r:
            lines.append(f"| {label(r)} | failed: {r['error']} | | | | | | | | | |")
            continue
        pred = prediction(r)
        d = dense.get(variant(r))
        x = f"{r['samples_per_s'] / d['samples_per_s']:.2f}x" if d else "n/a"
        it = r["iteration_s"]
        lines.append(
            f"| {label(r)} | {r['samples_per_s']:.2f} | {x} | {1e3 * it:.0f} | "
            f"{100 * min(r['communicate_s'] / it, 1):.0f} | {100 * r['wait_share']:.0f} | "
            f"{(r['wire_bytes'] if hosts == 1 else r['payload_bytes']) / 1e6:.1f} | "
            f"{r['achieved_density']:.4f} | {r['missing_rate']:.3f} | {plan_label(r)} | "
            f"{'-' if pred is None else format(1e3 * pred, '.0f')} |")
    return "\n".join(lines) + "\n"


def _flat_gloo(rows: list, model: str, workers: int, hosts: int) -> dict:
    return {r["scheme"]: r for r in group(rows, model, workers, hosts)
            if "error" not in r and variant(r) == ("gloo", False) and checked(r)}


def agreement_table(rows: list, model: str, workers: int, hosts: int = 1) -> str:
    """The per-step agreement check's cost: each scheme run with it and without it in the
    same sweep, as the ratio of median iterations, with each run's spread."""
    mine = [r for r in group(rows, model, workers, hosts) if "error" not in r]
    off = {r["scheme"]: r for r in mine if not checked(r)}
    pairs = [(r, off[r["scheme"]]) for r in mine
             if checked(r) and r["scheme"] in off]
    if not pairs:
        return ""

    def spread(r: dict) -> str:
        its = sorted(r["iteration_s_all"])
        q = lambda f: its[min(len(its) - 1, int(f * len(its)))]  # noqa: E731
        return f"{1e3 * q(0.25):.1f}-{1e3 * q(0.75):.1f}"
    lines = [f"Agreement check A/B ({model}, {topology_name(workers, hosts)}; iteration ms, "
             "median and interquartile range of the timed iterations; blocked: rank 0's "
             "median time blocked reading the agreement, all the check costs SparDL, ZEN "
             "and ExDyna, shared with the non-finite flags it carries elsewhere):\n",
             "| scheme | with check | without | with / without | blocked ms (% of step) |",
             "|---|---:|---:|---:|---:|"]
    for on, no in pairs:
        blocked = on.get("agreement_s")  # (runs before 2026-11-27 did not record it)
        lines.append(f"| {on['scheme']} | {1e3 * on['iteration_s']:.1f} ({spread(on)}) | "
                     f"{1e3 * no['iteration_s']:.1f} ({spread(no)}) | "
                     f"{on['iteration_s'] / no['iteration_s']:.3f} | "
                     + ("n/a |" if blocked is None else
                        f"{1e3 * blocked:.2f} ({100 * blocked / on['iteration_s']:.1f} %) |"))
    return "\n".join(lines) + "\n"


def speedups(rows: list, model: str, workers: int, hosts: int = 1) -> dict:
    """scheme -> samples/s ratio against the dense run of (model, workers, hosts), Gloo, flat."""
    mine = _flat_gloo(rows, model, workers, hosts)
    if "dense" not in mine:
        return {}
    return {s: r["samples_per_s"] / mine["dense"]["samples_per_s"] for s, r in mine.items()}


#: issue 7's throughput targets on the GPT-2-shaped model at 4 workers: (baseline, ratio)
TARGETS = (("dense", 1.5), ("per_tensor", 1.2), ("multi_tensor", 1.2))


def targets(rows: list, model: str = "gpt2", workers: int = 4, ours: str = "ssfusion_oi",
            hosts: int = 1) -> str:
    """The targets as met / missed lines (empty if the runs are not in ``rows``)."""
    runs = _flat_gloo(rows, model, workers, hosts)
    if ours not in runs:
        return ""
    out = [f"Targets ({model}, {topology_name(workers, hosts)}, {ours}):\n"]
    for base, want in TARGETS:
        if base in runs:
            got = runs[ours]["samples_per_s"] / runs[base]["samples_per_s"]
            out.append(f"- >= {want}x {base}: {got:.2f}x, {'met' if got >= want else 'MISSED'}")
    out.append(f"- tensor missing rate 0: {runs[ours]['missing_rate']:.3f}"
               + (f" (multi_tensor: {runs['multi_tensor']['missing_rate']:.3f})" if "multi_tensor" in runs else ""))
    return "\n".join(out) + "\n"


def breakdown(rows: list, model: str = "gpt2", workers: int = 4, hosts: int = 1) -> str:
    """Rank 0's median iteration split (seconds) of every run of (model, workers, hosts)."""
    mine = [r for r in group(rows, model, workers, hosts) if "error" not in r and "forward_s" in r]
    if not mine:
        return ""
    lines = [f"Where the time goes ({model}, {topology_name(workers, hosts)}; rank 0, medians, seconds):\n",
             "| scheme | iteration | forward | backward (+ hooks) | step | of which blocked | "
             "selection inline | selection offloaded |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in mine:
        lines.append(f"| {label(r)} | {r['iteration_s']:.2f} | {r['forward_s']:.2f} | "
                     f"{r['backward_s']:.2f} | {r['step_s']:.2f} | {r['wait_s']:.2f} | "
                     f"{r['sparsify_s']:.2f} | {r['offload_s']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list, model: str, topologies: list, path: Path) -> None:
    """Bars of every scheme's speedup (Gloo, flat) per (workers, hosts) of ``topologies``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schemes = [s for s in SCHEMES if any(r["scheme"] == s and r["model"] == model for r in rows)]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / max(len(topologies), 1)
    for j, (w, h) in enumerate(topologies):
        sp = speedups(rows, model, w, h)
        ax.bar([i + j * width for i in range(len(schemes))], [sp.get(s, 0) for s in schemes],
               width, label=topology_name(w, h))
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + width * (len(topologies) - 1) / 2 for i in range(len(schemes))], schemes,
                  rotation=30, ha="right")
    ax.set_ylabel("samples/s relative to dense")
    ax.set_title(f"{model}: throughput on the shaped network (median of timed iterations)")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)


def cost_table(rows: list, model: str, scheme: str = "ssfusion_oi") -> str:
    """The cost model each ``scheme`` run of ``model`` measured at start-up, in the job's own
    topology and setting: what its planner believed the network costs."""
    mine = sorted((r for r in rows if r["model"] == model and r["scheme"] == scheme
                   and r.get("cost_model") and checked(r)), key=lambda r: (r["workers"], r.get("hosts", 1), variant(r)))
    if not mine:
        return ""
    mib = float(1 << 20)
    lines = [f"Cost model measured inside each {scheme} job ({model}; g(x) = α + β·x, x = bytes "
             "one worker contributes):\n",
             "| topology | setting | allreduce α ms | allreduce 16 MiB ms | allgather α ms | "
             "allgather 1 MiB each ms |", "|---|---|---:|---:|---:|---:|"]
    for r in mine:
        ar, ag = r["cost_model"]["allreduce"], r["cost_model"]["allgather"]
        ctrl, hier = variant(r)
        lines.append(f"| {topology_name(r['workers'], r.get('hosts', 1))} | {ctrl}"
                     f"{', hierarchical' if hier else ''} | {1e3 * ar[0]:.2f} | "
                     f"{1e3 * (ar[0] + 16 * mib * ar[1]):.0f} | {1e3 * ag[0]:.2f} | "
                     f"{1e3 * (ag[0] + mib * ag[1]):.1f} |")
    return "\n".join(lines) + "\n"


def network_line(net: dict) -> str:
    link = net.get("link", {})
    shaping = f"`{net['shaping']}`"
    if isinstance(net["shaping"], dict):  # a cluster: every host's link is shaped alike, both ways
        shaping = f"`{next(iter(net['shaping'].values()))['uplink']}` on each host's link, each way"
    return (f"{net.get('topology', '')}; shaping {shaping} (delay "
            f"{'applied' if net['delay_applied'] else 'NOT applied: no netem'}); measured TCP "
            f"{link.get('tcp_gbit_s', float('nan')):.2f} Gbit/s, round trip "
            f"{link.get('rtt_us', float('nan')):.0f} us")


def report(doc: dict, out: Path, name: str) -> str:
    rows = doc["runs"]
    models = [m for m in ITERATIONS if any(r["model"] == m for r in rows)]
    topologies = sorted({(r["workers"], r.get("hosts", 1)) for r in rows})
    networks = doc.get("networks") or {"1": doc}  # files before --hosts: one namespace
    parts = ["Network: " + "; ".join(f"{network_line(n)}" for n in networks.values())
             + f". Density {doc['density']}, sparsifier {doc['sparsifier']}.\n"]
    for m in models:
        for w, h in topologies:
            parts.append(ratio_table(rows, m, w, h))
            parts.append(agreement_table(rows, m, w, h))
        parts.append(cost_table(rows, m))
        try:
            plot(rows, m, topologies, out / f"{name}_{m}.png")
            parts.append(f"![{m}]({name}_{m}.png)\n")
        except ImportError:
            pass
    for w, h in topologies:
        if w == 4:
            parts.append(targets(rows, hosts=h))
            parts.append(breakdown(rows, hosts=h))
    text = "\n".join(parts)
    (out / f"{name}.md").write_text(text)
    return text


def main(argv=None) -> None:
    args = parse_args(argv)
    models = choices(args.models, ITERATIONS, "model")
    workers = [int(w) for w in args.workers.split(",") if w]
    schemes = choices(args.schemes, tuple(SCHEMES) + PEERS, "scheme")
    if args.hosts > 1:
        workers = [args.hosts * args.slots]
    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # explicit for SIGINT too: a job started in the background (nohup, CI) inherits an
    # ignored SIGINT, and Python then never raises KeyboardInterrupt
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, _on_sigterm)
    started = time.time()
    doc = {"command": "sudo .venv/bin/python scripts/bench_e2e.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "rate": args.rate, "delay": args.delay, "density": args.density,
           "sparsifier": args.sparsifier, "environment": environment(), "networks": {}, "runs": []}
    previous = out / f"{args.name}.json"
    if args.merge and previous.exists():
        old = json.loads(previous.read_text())
        doc["runs"] = old["runs"]
        doc["networks"] = old.get("networks", {})
    if args.hosts > 1:
        topo_cm = Cluster(args.hosts, args.slots, args.rate, args.delay)
    elif args.shaper == "pace":
        topo_cm = PacedLinks(args.rate)
    else:
        topo_cm = ShapedNamespace(args.netns, args.rate, args.delay)
    try:
        with topo_cm as topo:
            net = {"topology": topo.describe(), "shaping": topo.shaping,
                   "delay_applied": topo.delay_applied, "link": topo.measure_link()}
            doc["networks"][f"{args.hosts}x{args.slots}" if args.hosts > 1 else "1"] = net
            print(f"[bench_e2e] {network_line(net)}", flush=True)
            agreements = ("on", "off") if args.agreement == "both" else (args.agreement,)
            # the check is our sparse schemes' (dense and the peers have none to switch off)
            runs = [(m, w, s, a) for m in models for w in workers for s in schemes for a in agreements
                    if a == "on" or (s in SCHEMES and s != "dense")]
            for i, (model, w, scheme, agreement) in enumerate(runs):
                if args.deadline and time.time() - started > args.deadline:
                    print(f"[bench_e2e] deadline: {len(runs) - i} runs not started", flush=True)
                    break
                res = run_one(topo, args, model, w, scheme, logs, agreement)
                doc["runs"] = [r for r in doc["runs"] if run_key(r) != run_key(res)] + [res]
                status = res.get("error") or f"{res['samples_per_s']:.2f} samples/s"
                print(f"[bench_e2e] {model} x{w} {label(res)}: {status} ({res['run_s']:.0f} s)",
                      flush=True)
                (out / f"{args.name}.json").write_text(json.dumps(doc, indent=1))
    except ClusterError as e:
        raise SystemExit(f"[bench_e2e] {e}")
    except KeyboardInterrupt:
        if _child is not None and _child.poll() is None:
            os.killpg(_child.pid, signal.SIGKILL)
        print("[bench_e2e] interrupted; namespace removed", file=sys.stderr, flush=True)
        raise SystemExit(130)
    (out / f"{args.name}.json").write_text(json.dumps(doc, indent=1))
    print(report(doc, out, args.name))


if __name__ == "__main__":
    main()
