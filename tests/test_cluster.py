"""Multi-host jobs on scripts/cluster.py: namespaced hosts with shaped links, an sshd each,
and ``horovodrun -H h1:S,h2:S`` over ssh, the way a user's cluster runs.

Needs root, iproute2 and openssh (scripts/install.sh installs them when run as root);
skipped with the reason otherwise."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvdrun import CLUSTER, CLUSTER_PREFIX, launch, mpi_built, run_workers
import workers_cluster
import workers_dense
import workers_schemes
from test_optimizer_dense import _check
from test_schemes import check_run

import cluster  # noqa: E402


def _why_not() -> str:
    try:
        cluster.Cluster.requirements(CLUSTER_PREFIX)
    except cluster.ClusterError as e:
        return str(e)
    return ""


pytestmark = [pytest.mark.multiworker, pytest.mark.skipif(bool(_why_not()), reason=_why_not() or "-")]


def _clean() -> bool:
    return not cluster.leftovers(CLUSTER_PREFIX) and not list(
        Path(os.environ.get("TMPDIR", "/tmp")).glob(f"{CLUSTER_PREFIX}-cluster-*"))


@pytest.fixture(autouse=True)
def no_leftovers():
    """Every test starts and ends with no namespaces, /etc/netns entries or key directories
    of the test prefix."""
    assert _clean(), cluster.leftovers(CLUSTER_PREFIX)
    yield
    ok = _clean()
    cluster.cleanup(CLUSTER_PREFIX)
    assert ok, "the cluster left state behind"


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_ranks_are_spread_over_hosts_and_cross_the_links(controller):
    if controller == "mpi" and not mpi_built():
        pytest.skip("Horovod built without MPI")
    results = run_workers(workers_cluster.topology, np=4, hosts=2, controller=controller,
                          timeout=120)
    assert [r["host"] for r in results] == ["h1", "h1", "h2", "h2"]
    assert [(r["local_rank"], r["local_size"], r["cross_rank"], r["cross_size"])
            for r in results] == [(0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]
    assert all(r["sum_ok"] for r in results)
    # a 4 MiB allreduce between the hosts puts megabytes on each host's link
    assert min(r["eth0_tx_bytes"] for r in results) > 1 << 20


def test_dense_matches_horovod_across_two_hosts():
    _check(run_workers(workers_dense.equivalence, np=4, hosts=2, steps=8, timeout=300), 4)


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_sparse_scheme_matches_reference_across_two_hosts(controller):
    if controller == "mpi" and not mpi_built():
        pytest.skip("Horovod built without MPI")
    results = run_workers(workers_schemes.record_all, np=4, hosts=2, controller=controller,
                          timeout=400, schemes=["ssfusion_oi"], steps=4, warmup=2)
    for scheme in ("ssfusion_oi", "forced"):  # live plan after a warm-up; every part kind
        assert check_run([r[scheme] for r in results]) == (4 if scheme == "forced" else 2), scheme


def test_failed_job_tears_the_cluster_down():
    """A rank that fails ends the job with a non-zero status and nothing left behind."""
    fail = ("import os, sys, horovod.torch as hvd; hvd.init(); "
            "sys.exit(3 if hvd.rank() == 2 else 0)")
    rc, out = launch([sys.executable, "-c", fail], np=4, timeout=120, hosts=2)
    assert rc not in (0, 124), out
    assert "cluster removed" in out, out


def test_sigterm_tears_the_cluster_down():
    """SIGTERM (and Ctrl-C) while ranks run: the job is killed, the cluster removed, 130."""
    proc = subprocess.Popen(
        [sys.executable, str(CLUSTER), "--hosts", "2", "--slots", "1", "--prefix", CLUSTER_PREFIX,
         "--", "sleep", "300"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        first = proc.stdout.readline()  # printed once the sshds answer
        assert first.startswith("[cluster] 2 hosts"), first
        deadline = time.monotonic() + 30  # until both ranks' sleeps run in their hosts
        while sum(len(subprocess.run(["ip", "netns", "pids", f"{CLUSTER_PREFIX}-h{i}"],
                                     capture_output=True, text=True).stdout.split()) > 1
                  for i in (1, 2)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, out
    assert "cluster removed" in out, out


def test_refuses_leftover_state_it_did_not_create():
    ns = f"{CLUSTER_PREFIX}-h1"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        r = subprocess.run([sys.executable, str(CLUSTER), "--prefix", CLUSTER_PREFIX, "--", "true"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2
        assert f"namespace {ns}" in r.stderr and "--cleanup" in r.stderr, r.stderr
        assert cluster.leftovers(CLUSTER_PREFIX) == [f"namespace {ns}"]  # untouched
        r = subprocess.run([sys.executable, str(CLUSTER), "--prefix", CLUSTER_PREFIX, "--cleanup"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and ns in r.stdout, r.stdout + r.stderr
        assert not cluster.leftovers(CLUSTER_PREFIX)
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_refuses_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(cluster.ClusterError, match="needs root"):
        cluster.Cluster.requirements()


@pytest.mark.parametrize("kwargs, match", [
    (dict(hosts=0), "--hosts"), (dict(slots=0), "--slots"), (dict(prefix="a b"), "--prefix")])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(cluster.ClusterError, match=match):
        cluster.Cluster(**kwargs)
