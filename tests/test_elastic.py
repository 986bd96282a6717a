"""Horovod elastic (``hvd.elastic.run`` with ``hvd.elastic.TorchState(model, optimizer)``)
with every scheme, as a user runs it: ``horovodrun --gloo --min-np 1 --max-np 3
--host-discovery-script``, on local host names (``localhost``, ``127.0.0.1``, and this
machine's name or address for the worker that joins).

A worker exits without warning at step 20 (a preempted machine): the job goes on with one
rank, from its last commit. At step 30 a new host appears: the job grows back to two
ranks, the new one synchronized from rank 0. Checked: the job ends (no hang), both ranks
end with identical, finite parameters, they trained at sizes 2, then 1, then 2, and the
loss fell; the planned schemes profiled and planned again after each resize.
``scheme="dense"`` ends bit for bit where Horovod's own optimizer does. A third shape: the
preempted worker's machine is replaced by a new one, and the job gets its size back with
one fresh process.
"""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.multiworker

REPO = Path(__file__).resolve().parent.parent
HOROVODRUN = Path(sys.executable).with_name("horovodrun")
SCHEMES = ["horovod", "dense", "ssfusion_oi", "ssfusion", "per_tensor", "multi_tensor",
           "spardl", "zen", "exdyna"]


def _spare_host() -> str:
    """A third name for this machine that Horovod runs locally (its address is one of
    this machine's interfaces) and that differs from ``localhost`` and ``127.0.0.1``."""
    import psutil

    local = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs
             if a.family == socket.AF_INET}
    name = socket.gethostname()
    try:
        if socket.gethostbyname(name) in local and name not in ("localhost",):
            if socket.gethostbyname(name) != "127.0.0.1":
                return name
    except OSError:
        pass
    others = sorted(a for a in local if not a.startswith("127."))
    if not others:
        pytest.skip("no third local host name (an interface other than loopback)")
    return others[0]


def _run(tmp_path, scheme, extra=(), grow_at=30):
    d = tmp_path / scheme
    d.mkdir()
    (d / "hosts").write_text("localhost:1\n127.0.0.1:1\n")
    (d / "spare").write_text(_spare_host() + "\n")
    discover = d / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {d / 'hosts'}\n")
    discover.chmod(0o755)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [str(HOROVODRUN), "-np", "2", "--min-np", "1", "--max-np", "3",
           "--host-discovery-script", str(discover), "--gloo", "--elastic-timeout", "60",
           sys.executable, str(REPO / "tests" / "workers_elastic.py"), "--scheme", scheme,
           "--dir", str(d), "--kill-at", "20", "--victim", "127.0.0.1", "--grow-at", str(grow_at),
           *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    results = {p.name: torch.load(p) for p in d.glob("result.*.pt")}
    assert proc.returncode == 0 and len(results) == 2, (
        f"rc {proc.returncode}, results {sorted(results)}\n{proc.stdout[-3000:]}\n"
        f"{proc.stderr[-3000:]}")
    return list(results.values())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_elastic_shrinks_and_grows(tmp_path, scheme):
    a, b = _run(tmp_path, scheme)
    for x, y in zip(a["params"], b["params"]):
        assert torch.isfinite(x).all()
        assert torch.equal(x, y), f"{scheme}: ranks differ after the job"
    sizes = a["sizes"]
    # compressed runs of sizes: 2 (start), 1 (after the exit), 2 (after the new host)
    runs = [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s]
    assert runs == [2, 1, 2], f"{scheme}: sizes {sizes}"
    if scheme.startswith("ssfusion") or scheme in ("per_tensor", "multi_tensor"):
        # a new world, a new plan: the planned schemes profile again after each resize
        for i in range(1, len(sizes)):
            if sizes[i] != sizes[i - 1]:
                assert a["phases"][i] == "warmup", f"{scheme}: phases {a['phases']}"
        assert a["phases"][-1] == "planned", f"{scheme}: phases {a['phases']}"
    losses = a["losses"]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, f"{scheme}: loss {losses}"


def test_elastic_dense_equals_horovods_optimizer(tmp_path):
    ours = _run(tmp_path, "dense")[0]
    theirs = _run(tmp_path, "horovod")[0]
    assert ours["sizes"] == theirs["sizes"]
    for x, y in zip(ours["params"], theirs["params"]):
        assert torch.equal(x, y)


def test_elastic_shared_moments_adam(tmp_path):
    a, b = _run(tmp_path, "ssfusion_oi", ["--optimizer", "adam", "--moments", "shared"])
    for x, y in zip(a["params"], b["params"]):
        assert torch.isfinite(x).all() and torch.equal(x, y)


def test_elastic_with_a_given_plan(tmp_path):
    """``plan=`` on every rank: a rank that joins adopts it without a collective in its
    constructor (the others are past theirs), and the job grows as with a measured plan."""
    a, b = _run(tmp_path, "ssfusion_oi", ["--fixed-plan"])
    for x, y in zip(a["params"], b["params"]):
        assert torch.isfinite(x).all() and torch.equal(x, y)
    runs = [s for i, s in enumerate(a["sizes"]) if i == 0 or a["sizes"][i - 1] != s]
    assert runs == [2, 1, 2], a["sizes"]
    assert set(a["phases"]) == {"planned"}, a["phases"]


@pytest.mark.parametrize("scheme,extra", [("ssfusion_oi", ["--moments", "shared"]),
                                          ("zen", ["--optimizer", "adam", "--moments", "shared"])])
def test_elastic_worker_replaced_at_the_same_size(tmp_path, scheme, extra):
    """A preempted worker's machine is replaced by a new one: the world gets its size back,
    but one rank is a new process with a fresh optimizer. It must take rank 0's plan and
    state (TorchState's sync), and the shared moments' ages must agree again: the job ends
    with identical, finite parameters and a falling loss, on the survivor and the new
    machine."""
    a, b = _run(tmp_path, scheme, ["--replace", *extra], grow_at=-1)
    d = tmp_path / scheme  # the preempted worker wrote nothing; its replacement finished
    assert not (d / "result.127.0.0.1.pt").exists()
    assert (d / f"result.{(d / 'spare').read_text().strip()}.pt").exists()
    for x, y in zip(a["params"], b["params"]):
        assert torch.isfinite(x).all()
        assert torch.equal(x, y), f"{scheme}: ranks differ after the job"
    # the job is at one rank at most until the replacement is in (the driver may see the
    # host change before or after the worker's loss), and at two from then on
    assert a["size"] == b["size"] == 2 and a["sizes"][-1] == 2, a["sizes"]
    losses = a["losses"]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, f"{scheme}: loss {losses}"
