"""The same checks under Horovod's MPI controller (``horovodrun --mpi``) and with an mpi4py
communicator handed to ``hvd.init(comm=...)``, as Horovod documents for jobs that already
use MPI. Skipped, with the reason, where Horovod was built without MPI (scripts/install.sh
installs OpenMPI when it can and says so when it cannot)."""
import pytest
import torch

from hvdrun import mpi_built, run_workers
import workers_dense
import workers_schemes
from test_optimizer_dense import _check
from test_schemes import check_run

pytestmark = [pytest.mark.multiworker,
              pytest.mark.skipif(not mpi_built(), reason="Horovod built without MPI "
                                 "(scripts/install.sh could not install OpenMPI)")]


def test_dense_matches_horovod_under_mpi():
    _check(run_workers(workers_dense.equivalence, np=2, steps=10, controller="mpi"), 2)


def test_sparse_scheme_matches_reference_under_mpi():
    results = run_workers(workers_schemes.record_all, np=2, timeout=300, controller="mpi",
                          schemes=["ssfusion_oi"], steps=5, warmup=2)
    for scheme in ("ssfusion_oi", "forced"):  # live plan after a warm-up; every part kind
        runs = [r[scheme] for r in results]
        assert check_run(runs) == (5 if scheme == "forced" else 3), scheme


def _have_mpi4py() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


needs_mpi4py = pytest.mark.skipif(not _have_mpi4py(), reason="mpi4py not installed")


@needs_mpi4py
def test_mpi4py_world_communicator():
    """hvd.init(comm=MPI.COMM_WORLD): our optimizer on it, sparse and dense."""
    results = run_workers(workers_schemes.record_all, np=2, timeout=300, controller="mpi",
                          mpi_comm="world", schemes=["dense", "multi_tensor"], steps=4,
                          warmup=2, forced=False)
    assert [r["multi_tensor"]["size"] for r in results] == [2, 2]
    assert check_run([r["multi_tensor"] for r in results]) == 2
    assert check_run([r["dense"] for r in results]) == 0  # dense: every step checked as warm-up


@needs_mpi4py
def test_mpi4py_split_sub_communicators():
    """Four MPI ranks split into two communicators (even, odd world ranks) of two, one
    Horovod job on each: every sub-job synchronizes within its own communicator only."""
    results = run_workers(workers_schemes.record_all, np=4, timeout=400, controller="mpi",
                          mpi_comm="split", schemes=["ssfusion_oi"], steps=4, warmup=2,
                          forced=False)
    assert [r["ssfusion_oi"]["size"] for r in results] == [2, 2, 2, 2]
    # batches are seeded by the world rank, so the sub-jobs see different data; each
    # synchronized gradient must be its own pair's average (a sum over all four, or over
    # the wrong pair, fails the reference)
    for members in ([0, 2], [1, 3]):
        assert check_run([results[w]["ssfusion_oi"] for w in members]) == 2
    synced = [results[w]["ssfusion_oi"]["steps"][0]["synced"] for w in (0, 1)]
    assert any(not torch.equal(synced[0][n], synced[1][n]) for n in synced[0])
