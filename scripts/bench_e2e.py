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
each having a link of its own.

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
sys.path.insert(0, str(REPO))

from ssfusion_hvd.registry import SCHEMES  # noqa: E402  (display order: the registry's)
#: model -> (untimed iterations, timed iterations); sparse schemes profile 2 of the former
ITERATIONS = {"gpt2": (4, 7), "resnet": (5, 10), "demo": (6, 30)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="1gbit", help="tc rate of the namespace loopback")
    p.add_argument("--delay", default="100us", help="one-way delay (netem); '0' for none")
    p.add_argument("--models", default="gpt2,resnet,demo")
    p.add_argument("--workers", default="2,4")
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--sparsifier", default="topk")
    p.add_argument("--iters", type=int, default=0, help="timed iterations (0: per-model default)")
    p.add_argument("--warmup", type=int, default=0, help="untimed iterations (0: per-model default)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    p.add_argument("--out", default=str(REPO / "docs" / "results"))
    p.add_argument("--name", default="e2e", help="file stem of the outputs")
    p.add_argument("--netns", default=f"ssfbench{os.getpid()}", help="namespace name")
    p.add_argument("--merge", action="store_true",
                   help="keep the runs already in <out>/<name>.json; the runs of this call replace "
                        "those of the same (model, workers, scheme)")
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
            tc = self.exec_prefix() + ["tc", "qdisc", "add", "dev", "lo"]
            sh(*self.exec_prefix(), "ip", "link", "set", "lo", "up")
            tbf = ["tbf", "rate", self.rate, "burst", "256kb", "latency", "50ms"]
            if self.delay not in ("", "0", "0us", "0ms"):
                r = sh(*tc, "root", "handle", "1:", "netem", "delay", self.delay, check=False)
                if r.returncode == 0:
                    sh(*tc, "parent", "1:", "handle", "2:", *tbf)
                    self.delay_applied = True
                else:
                    print(f"[bench_e2e] netem unavailable ({r.stderr.strip()}): delay {self.delay} "
                          "NOT applied; shaping the rate only", flush=True)
            if not self.delay_applied:
                sh(*tc, "root", *tbf)
            self.shaping = sh(*self.exec_prefix(), "tc", "qdisc", "show", "dev", "lo").stdout.strip()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        # kill anything left in the namespace, then delete it
        pids = sh("ip", "netns", "pids", self.name, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        sh("ip", "netns", "del", self.name, check=False)


_LINK_PROBE = r"""
import socket, threading, time, statistics
N = 64 << 20
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
port = srv.getsockname()[1]
def sink():
    c, _ = srv.accept()
    while True:
        b = c.recv(1 << 20)
        if not b: break
        if b == b"p": c.sendall(b"q")
    c.close()
threading.Thread(target=sink, daemon=True).start()
s = socket.create_connection(("127.0.0.1", port))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtt = []
for _ in range(50):
    t = time.perf_counter(); s.sendall(b"p"); s.recv(1); rtt.append(time.perf_counter() - t)
buf = b"\0" * (1 << 20)
t = time.perf_counter()
for _ in range(N >> 20): s.sendall(buf)
s.shutdown(socket.SHUT_WR); s.recv(1)
dt = time.perf_counter() - t
print(8 * N / dt / 1e9, statistics.median(rtt) * 1e6)
"""


def measure_link(ns: ShapedNamespace) -> dict:
    """TCP throughput of a 64 MiB transfer and the median small-message round trip."""
    out = subprocess.run(ns.exec_prefix() + [sys.executable, "-c", _LINK_PROBE], check=True,
                         capture_output=True, text=True, timeout=120).stdout.split()
    return {"tcp_gbit_s": float(out[0]), "rtt_us": float(out[1])}


# ------------------------------------------------------------------ runs
_child: subprocess.Popen | None = None


def _on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run_one(ns: ShapedNamespace, args, model: str, workers: int, scheme: str, logs: Path) -> dict:
    global _child
    warmup, iters = ITERATIONS.get(model, (5, 10))
    warmup, iters = args.warmup or warmup, args.iters or iters
    tmp = logs / f"{model}-{workers}-{scheme}.json"
    tmp.unlink(missing_ok=True)
    venv_bin = Path(sys.executable).parent
    horovodrun = shutil.which("horovodrun", path=str(venv_bin)) or shutil.which("horovodrun")
    env = [f"OMP_NUM_THREADS={max(1, (os.cpu_count() or 1) // workers)}",
           "HOROVOD_CYCLE_TIME=1", "HOROVOD_FUSION_THRESHOLD=67108864",
           f"PYTHONPATH={REPO}"]
    cmd = ns.exec_prefix() + ["env", *env, horovodrun, "-np", str(workers), "-H",
                              f"localhost:{workers}", "--gloo", sys.executable, "-m",
                              "ssfusion_hvd.examples.bench", "--model", model, "--scheme", scheme,
                              "--density", str(args.density), "--sparsifier", args.sparsifier,
                              "--warmup", str(warmup), "--iters", str(iters), "--json", str(tmp)]
    log = logs / f"{model}-{workers}-{scheme}.log"
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
        res["run_s"] = time.time() - t0
        return res
    tail = log.read_text().splitlines()[-15:]
    return {"model": model, "workers": workers, "scheme": scheme,
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
def ratio_table(rows: list, model: str, workers: int) -> str:
    """One markdown table: the runs of (model, workers), ratios against its dense run."""
    order = {s: i for i, s in enumerate(SCHEMES)}
    mine = sorted((r for r in rows if r["model"] == model and r["workers"] == workers),
                  key=lambda r: order.get(r["scheme"], len(order)))
    if not mine:
        return ""
    dense = next((r for r in mine if r["scheme"] == "dense" and "error" not in r), None)
    head = (f"**{model}, {workers} workers**\n\n"
            "| scheme | samples/s | x dense | iteration ms | comm window % | blocked % | "
            "wire MB/iter | density | missing rate |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in mine:
        if "error" in r:
            lines.append(f"| {r['scheme']} | failed: {r['error']} | | | | | | | |")
            continue
        x = f"{r['samples_per_s'] / dense['samples_per_s']:.2f}x" if dense else "n/a"
        it = r["iteration_s"]
        lines.append(
            f"| {r['scheme']} | {r['samples_per_s']:.2f} | {x} | {1e3 * it:.0f} | "
            f"{100 * min(r['communicate_s'] / it, 1):.0f} | {100 * r['wait_share']:.0f} | "
            f"{r['wire_bytes'] / 1e6:.1f} | {r['achieved_density']:.4f} | {r['missing_rate']:.3f} |")
    return "\n".join(lines) + "\n"


def speedups(rows: list, model: str, workers: int) -> dict:
    """scheme -> samples/s ratio against the dense run of (model, workers)."""
    mine = {r["scheme"]: r for r in rows if r["model"] == model and r["workers"] == workers
            and "error" not in r}
    if "dense" not in mine:
        return {}
    return {s: r["samples_per_s"] / mine["dense"]["samples_per_s"] for s, r in mine.items()}


#: issue 7's throughput targets on the GPT-2-shaped model at 4 workers: (baseline, ratio)
TARGETS = (("dense", 1.5), ("per_tensor", 1.2), ("multi_tensor", 1.2))


def targets(rows: list, model: str = "gpt2", workers: int = 4, ours: str = "ssfusion_oi") -> str:
    """The targets as met / missed lines (empty if the runs are not in ``rows``)."""
    runs = {r["scheme"]: r for r in rows if r["model"] == model and r["workers"] == workers
            and "error" not in r}
    if ours not in runs:
        return ""
    out = [f"Targets ({model}, {workers} workers, {ours}):\n"]
    for base, want in TARGETS:
        if base in runs:
            got = runs[ours]["samples_per_s"] / runs[base]["samples_per_s"]
            out.append(f"- >= {want}x {base}: {got:.2f}x, {'met' if got >= want else 'MISSED'}")
    out.append(f"- tensor missing rate 0: {runs[ours]['missing_rate']:.3f}"
               + (f" (multi_tensor: {runs['multi_tensor']['missing_rate']:.3f})" if "multi_tensor" in runs else ""))
    return "\n".join(out) + "\n"


def breakdown(rows: list, model: str = "gpt2", workers: int = 4) -> str:
    """Rank 0's median iteration split (seconds) of every run of (model, workers)."""
    order = {s: i for i, s in enumerate(SCHEMES)}
    mine = sorted((r for r in rows if r["model"] == model and r["workers"] == workers
                   and "error" not in r and "forward_s" in r), key=lambda r: order.get(r["scheme"], 99))
    if not mine:
        return ""
    lines = [f"Where the time goes ({model}, {workers} workers; rank 0, medians, seconds):\n",
             "| scheme | iteration | forward | backward (+ hooks) | step | of which blocked | "
             "selection inline | selection offloaded |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in mine:
        lines.append(f"| {r['scheme']} | {r['iteration_s']:.2f} | {r['forward_s']:.2f} | "
                     f"{r['backward_s']:.2f} | {r['step_s']:.2f} | {r['wait_s']:.2f} | "
                     f"{r['sparsify_s']:.2f} | {r['offload_s']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list, model: str, workers: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schemes = [s for s in SCHEMES if any(r["scheme"] == s and r["model"] == model for r in rows)]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / max(len(workers), 1)
    for j, w in enumerate(workers):
        sp = speedups(rows, model, w)
        ax.bar([i + j * width for i in range(len(schemes))], [sp.get(s, 0) for s in schemes],
               width, label=f"{w} workers")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + width * (len(workers) - 1) / 2 for i in range(len(schemes))], schemes,
                  rotation=30, ha="right")
    ax.set_ylabel("samples/s relative to dense")
    ax.set_title(f"{model}: throughput on the shaped network (median of timed iterations)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(doc: dict, out: Path, name: str) -> str:
    rows = doc["runs"]
    models = [m for m in ITERATIONS if any(r["model"] == m for r in rows)]
    workers = sorted({r["workers"] for r in rows})
    link = doc.get("link", {})
    parts = [f"Shaping: `{doc['shaping']}` (delay {'applied' if doc['delay_applied'] else 'NOT applied: no netem'}); "
             f"measured TCP {link.get('tcp_gbit_s', float('nan')):.2f} Gbit/s, "
             f"round trip {link.get('rtt_us', float('nan')):.0f} us. Density {doc['density']}, "
             f"sparsifier {doc['sparsifier']}.\n"]
    for m in models:
        for w in workers:
            parts.append(ratio_table(rows, m, w))
        try:
            plot(rows, m, workers, out / f"{name}_{m}.png")
            parts.append(f"![{m}]({name}_{m}.png)\n")
        except ImportError:
            pass
    parts.append(targets(rows))
    parts.append(breakdown(rows))
    text = "\n".join(parts)
    (out / f"{name}.md").write_text(text)
    return text


def main(argv=None) -> None:
    args = parse_args(argv)
    models = choices(args.models, ITERATIONS, "model")
    workers = [int(w) for w in args.workers.split(",") if w]
    schemes = choices(args.schemes, SCHEMES, "scheme")
    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # explicit for SIGINT too: a job started in the background (nohup, CI) inherits an
    # ignored SIGINT, and Python then never raises KeyboardInterrupt
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, _on_sigterm)
    doc = {"command": "sudo .venv/bin/python scripts/bench_e2e.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "rate": args.rate, "delay": args.delay, "density": args.density,
           "sparsifier": args.sparsifier, "environment": environment(), "runs": []}
    previous = out / f"{args.name}.json"
    if args.merge and previous.exists():
        doc["runs"] = json.loads(previous.read_text())["runs"]
    try:
        with ShapedNamespace(args.netns, args.rate, args.delay) as ns:
            doc.update(shaping=ns.shaping, delay_applied=ns.delay_applied, link=measure_link(ns))
            print(f"[bench_e2e] namespace {ns.name}: {ns.shaping}; link {doc['link']}", flush=True)
            for model in models:
                for w in workers:
                    for scheme in schemes:
                        res = run_one(ns, args, model, w, scheme, logs)
                        key = (model, w, scheme)
                        doc["runs"] = [r for r in doc["runs"]
                                       if (r["model"], r["workers"], r["scheme"]) != key] + [res]
                        status = res.get("error") or f"{res['samples_per_s']:.2f} samples/s"
                        print(f"[bench_e2e] {model} x{w} {scheme}: {status} ({res['run_s']:.0f} s)", flush=True)
                        (out / f"{args.name}.json").write_text(json.dumps(doc, indent=1))
    except KeyboardInterrupt:
        if _child is not None and _child.poll() is None:
            os.killpg(_child.pid, signal.SIGKILL)
        print("[bench_e2e] interrupted; namespace removed", file=sys.stderr, flush=True)
        raise SystemExit(130)
    (out / f"{args.name}.json").write_text(json.dumps(doc, indent=1))
    print(report(doc, out, args.name))


if __name__ == "__main__":
    main()
