"""Runs a test function on real Horovod workers (``horovodrun --gloo``) and collects results.

``run_workers(workers_dense.equivalence, np=2, steps=20)`` launches ``np`` processes;
each calls ``hvd.init()`` then that function (imported there by its module and name) with
the keyword arguments, and returns a picklable result. The test names the function
itself, not a string: a renamed or missing worker fails where the test is collected. The call returns the per-rank results (rank order) or raises
``WorkerError`` with the workers' output; a run past ``timeout`` is killed with its whole
process group, so a hang fails the test instead of freezing the suite.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent
HOROVODRUN = str(Path(sys.executable).with_name("horovodrun"))
CLUSTER = TESTS.parent / "scripts" / "cluster.py"
#: namespace prefix of the clusters tests start (not cluster.py's default, so a test never
#: meets a user's running cluster)
CLUSTER_PREFIX = "ssfct"


class WorkerError(RuntimeError):
    pass


def mpi_built() -> bool:
    """Whether this Horovod has its MPI controller (scripts/install.sh builds it when it
    could install OpenMPI)."""
    import horovod.torch as hvd

    return bool(hvd.mpi_built())


def gpu_built(ranks: int = 2) -> bool:
    """Whether a GPU job of ``ranks`` ranks can run here: a CUDA device, a Horovod built
    with CUDA (``hvd.cuda_built()``), and a GPU per rank where its GPU operations are
    NCCL's (NCCL refuses two ranks on one GPU). A Horovod with CUDA but without GPU
    operations stages GPU tensors through host memory; one built without CUDA at all
    aborts a GPU job in those collectives' callbacks (the H100 machine, 2026-11-25;
    docs/kernels.md, "GPU")."""
    if not torch.cuda.is_available():
        return False
    try:
        import horovod.torch as hvd
    except ImportError:
        return False
    if not hvd.cuda_built():
        return False
    return torch.cuda.device_count() >= ranks or not hvd.nccl_built()


def launch(args, np: int, timeout: float, env=None, controller: str = "gloo", hosts: int = 1):
    """Runs ``horovodrun -np N --gloo|--mpi <args>``; returns (returncode, output).

    ``hosts > 1``: the job runs through ``scripts/cluster.py`` as ``np / hosts`` ranks on
    each of ``hosts`` namespaced hosts over ssh (needs root; see test_cluster.py)."""
    if controller not in ("gloo", "mpi"):
        raise ValueError(f"controller must be 'gloo' or 'mpi', got {controller!r}")
    if hosts > 1:
        if np % hosts:
            raise ValueError(f"np={np} is not a multiple of hosts={hosts}")
        cmd = [sys.executable, str(CLUSTER), "--hosts", str(hosts), "--slots", str(np // hosts),
               "--prefix", CLUSTER_PREFIX, "--timeout", str(timeout)] \
            + (["--mpi"] if controller == "mpi" else []) + ["--"] + list(args)
    else:
        cmd = [HOROVODRUN, "-np", str(np), "-H", f"localhost:{np}", f"--{controller}"] + list(args)
    # PYTHONFAULTHANDLER: a worker that aborts (Gloo's timeout in Horovod's background loop
    # ends in SIGABRT) prints every thread's Python stack, so a hang says where it was
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    if controller == "mpi":  # Open MPI refuses root unless told twice (CI runs as root)
        full_env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, start_new_session=True)
    try:
        # cluster.py enforces the timeout itself and then removes its namespaces; the
        # margin lets it, and SIGTERM (which it handles) comes before SIGKILL
        out, _ = proc.communicate(timeout=timeout + (60 if hosts > 1 else 0))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        raise WorkerError(f"workers did not finish within {timeout}s:\n{out[-12000:]}")
    if hosts > 1 and proc.returncode == 124:
        raise WorkerError(f"workers did not finish within {timeout}s:\n{out[-12000:]}")
    return proc.returncode, out


#: what each rank prints when Gloo times out inside Horovod's background loop
_LOOP_TIMEOUT = re.compile(r"\[(\d+)\]: Horovod background loop uncaught exception: .*"
                           r"Timed out waiting \d+ms for (?:recv|send) operation")


def gloo_loop_timeout_on_every_rank(out: str, np: int) -> bool:
    """Whether every rank's Horovod background loop ended in a Gloo transport timeout
    (``HOROVOD_GLOO_TIMEOUT_SECONDS``, 30 s), which is not how a rank gone astray in our
    code shows: a collective that some ranks of a set never submit leaves the background
    loops cycling (Horovod's stall warning, then this module's ``timeout``), and a
    mismatch raises. All of them timing out together means they were all inside Gloo
    operations that never met, below anything the plugin submits."""
    return {int(r) for r in _LOOP_TIMEOUT.findall(out)} == set(range(np))


def run_workers(fn, np: int = 2, timeout: float = 180, env=None,
                controller: str = "gloo", hosts: int = 1, rerun_on_gloo_timeout: bool = False,
                **kwargs):
    """``rerun_on_gloo_timeout``: run the job once more (with a warning) when it failed by
    :func:`gloo_loop_timeout_on_every_rank` and nothing else. Only the tests with dynamic
    process sets over Gloo ask for it: there, Horovod 0.28.1 has timed out so twice in
    about 50 three-rank jobs under pytest (2026-11-29/30, docs/horovod.md "Process sets"),
    never in 77 direct launches of the same job, nor in 120 add/use/remove cycles of
    Horovod alone; the cause is not found."""
    if not callable(fn) or "." in fn.__qualname__ or fn.__module__ == "__main__":
        raise TypeError(f"run_workers takes a module-level function of an importable module, "
                        f"got {fn!r}")
    target = f"{fn.__module__}:{fn.__name__}"
    for attempt in (1, 2):
        with tempfile.TemporaryDirectory(prefix="ssf-workers-") as outdir:
            rc, out = launch([sys.executable, str(TESTS / "_worker.py"), target, outdir,
                              json.dumps(kwargs)], np, timeout, env, controller, hosts)
            if rc == 0:
                return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False)
                        for r in range(np)]
        if attempt == 1 and rerun_on_gloo_timeout and gloo_loop_timeout_on_every_rank(out, np):
            warnings.warn(f"{target}: every rank's Horovod background loop timed out in Gloo; "
                          f"running the job once more:\n{out[-3000:]}")
            continue
        raise WorkerError(f"horovodrun exited {rc}:\n{out[-12000:]}")
