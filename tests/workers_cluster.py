"""Workers for tests/test_cluster.py, run on every rank of a scripts/cluster.py job."""
import socket
from pathlib import Path

import horovod.torch as hvd
import torch


def _eth0_tx_bytes() -> int:
    return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())


def topology(numel=1 << 20):
    """Where this rank runs and what Horovod makes of it, plus the bytes its host sent on
    eth0 during one allreduce of ``numel`` floats (ranks on other hosts are only reachable
    over that link)."""
    before = _eth0_tx_bytes()
    x = torch.full((numel,), float(hvd.rank() + 1))
    total = hvd.allreduce(x, op=hvd.Sum)
    hvd.barrier()  # every rank's sends are done before the counter is read again
    after = _eth0_tx_bytes()
    return {"host": socket.gethostname(), "rank": hvd.rank(), "size": hvd.size(),
            "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
            "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
            "sum_ok": bool(torch.all(total == hvd.size() * (hvd.size() + 1) / 2)),
            "eth0_tx_bytes": after - before}
