"""Runs a test function on ``np`` torch.distributed (gloo) processes and collects results:
the DDP counterpart of ``hvdrun.run_workers``. Each process joins a process group (gloo
unless told otherwise, a file store in a fresh directory), calls ``fn(rank=..., world=..., **kwargs)`` and saves what it
returns; a run past ``timeout`` is killed, so a hang fails the test."""
from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class DDPWorkerError(RuntimeError):
    pass


def _entry(rank: int, world: int, store: str, outdir: str, backend: str, fn, kwargs: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = fn(rank=rank, world=world, **kwargs)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
        # every rank's last collective is done on every rank before any tears its group
        # down: a rank that left while a peer's receive was still in flight made that
        # peer abort in gloo ("terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # A rank whose work is saved leaves without running the interpreter's teardown: gloo's
    # threads, destroyed there while still joinable, aborted one rank of 3 in about one run
    # of 20 ("terminate called without an active exception") after every result was saved.
    # An exception above still propagates and fails the run.
    os._exit(0)


def run_ddp(fn, np: int = 2, timeout: float = 120, backend: str = "gloo", **kwargs):
    """Per-rank results of ``fn`` (a module-level function), in rank order, on a process
    group of ``backend`` ("gloo", or "nccl" on a GPU machine)."""
    with tempfile.TemporaryDirectory(prefix="ssf-ddp-") as outdir:
        ctx = mp.start_processes(_entry, args=(np, os.path.join(outdir, "store"), outdir, backend,
                                               fn, kwargs),
                                 nprocs=np, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise DDPWorkerError(f"{fn.__name__} on {np} ranks ran past {timeout} s")
        except mp.ProcessRaisedException as e:
            raise DDPWorkerError(str(e)) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False)
                for r in range(np)]


def run_torchrun(script: str, np: int, args, timeout: float = 120):
    """``torchrun --standalone --nproc_per_node=np script args outdir``; the per-rank
    results the script saved as ``<outdir>/rank<r>.pt``."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    torchrun = str(Path(sys.executable).with_name("torchrun"))
    with tempfile.TemporaryDirectory(prefix="ssf-torchrun-") as outdir:
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(Path(__file__).parent),
                                               os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.Popen([torchrun, "--standalone", f"--nproc_per_node={np}", script,
                                 *args, outdir], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise DDPWorkerError(f"torchrun {script} ran past {timeout} s") from None
        if proc.returncode != 0:
            raise DDPWorkerError(f"torchrun exited {proc.returncode}:\n{out[-6000:]}")
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False)
                for r in range(np)]
