"""Entry point of one Horovod worker launched by tests/hvdrun.py (not a test module)."""
import importlib
import json
import os
import sys
import traceback

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402


def main():
    target, outdir, kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    torch.set_num_threads(1)
    comm = kwargs.pop("mpi_comm", None)  # "world" or "split": hvd.init(comm=...) via mpi4py
    if comm is None:
        hvd.init()
    else:
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        # "split": two sub-communicators, even and odd world ranks
        hvd.init(comm=world if comm == "world" else world.Split(color=world.rank % 2,
                                                                 key=world.rank))
    module, func = target.split(":")
    try:
        result = getattr(importlib.import_module(module), func)(**kwargs)
    except BaseException:
        sys.stderr.write(f"[rank {hvd.rank()}] {traceback.format_exc()}")
        sys.stderr.flush()
        os._exit(1)  # do not wait for peers in shutdown
    rank = hvd.rank() if comm in (None, "world") else MPI.COMM_WORLD.rank
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
