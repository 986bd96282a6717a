"""The CPU kernels fork onto ATen's intra-op threads, and their results do not depend on
how many threads ran them.

``at::parallel_for`` is a header template: with torch's OpenMP backend it forks only when
the extension itself is compiled with OpenMP. Built without it, every kernel ran on one
thread while the docs said otherwise, and none of the chunked loops had ever run
concurrently. These tests pin both: the build forks, and every kernel gives the same bits
at 1, 2 and 3 threads (chunks are fixed by the input size, never by the thread count;
races would show as differences or as failures across repeated runs)."""
import pytest
import torch

from ssfusion_hvd import ops

pytestmark = pytest.mark.skipif(not ops.have_extension(), reason="needs the native extension")

THREADS = [1, 2, 3]


@pytest.fixture
def threads():
    """Runs the body under each thread count in turn; restores the caller's count."""
    before = torch.get_num_threads()

    def run(fn):
        outs = []
        for t in THREADS:
            torch.set_num_threads(t)
            outs.append(fn())
        torch.set_num_threads(before)
        return outs

    yield run
    torch.set_num_threads(before)


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8) if t.is_floating_point() else t


def _assert_same(outs):
    first = outs[0]
    for o in outs[1:]:
        assert len(o) == len(first)
        for a, b in zip(first, o):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(_bits(a), _bits(b))


def test_kernels_fork_when_torch_uses_openmp():
    if "OpenMP" not in torch.__config__.parallel_info().split("parallel backend:")[1].splitlines()[0]:
        pytest.skip("torch's intra-op pool is not OpenMP")
    from ssfusion_hvd import _C
    assert ops.build_info()["openmp"], ops.build_info()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert _C.cpu_parallel_threads(64) == 2
        torch.set_num_threads(1)
        assert _C.cpu_parallel_threads(64) == 1
    finally:
        torch.set_num_threads(before)


def _gradient(n, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.linspace(0.1, 3.0, n)  # a trend across chunks
    x[::997] *= 40  # clusters of large values, some chunks far fuller than others
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(300_000, 3_000), (300_000, 40_000), (70_000, 70), (5_000, 50)])
def test_topk_same_at_every_thread_count(threads, n, k, dtype):
    x = _gradient(n, n + k, dtype)
    outs = threads(lambda: ops.topk(x, k, backend="native"))
    _assert_same(outs)
    _assert_same([outs[0], ops.topk(x, k, backend="torch")])


def test_segmented_topk_same_at_every_thread_count(threads):
    sizes = [1_200_000, 3, 40_000, 0, 17_000, 250_000] + [900] * 40 + [20_000] * 10
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    ks = [max(0, s // 100) for s in sizes]
    flat = _gradient(offsets[-1], 11)
    outs = threads(lambda: ops.segmented_topk(flat, offsets, ks, backend="native"))
    _assert_same(outs)
    _assert_same([outs[0], ops.segmented_topk(flat, offsets, ks, backend="torch")])


@pytest.mark.parametrize("wire", [None, torch.bfloat16])
def test_fused_feedback_same_at_every_thread_count(threads, wire):
    n, k = 400_000, 4_000
    grad = _gradient(n, 5)
    start = _gradient(n, 6) * 0.1

    def run():
        r = start.clone()
        v, i = ops.ef_topk(grad, r, k, wire, backend="native")
        return v, i, r

    outs = threads(run)
    _assert_same(outs)
    r = start.clone()
    v, i = ops.ef_topk(grad, r, k, wire, backend="torch")
    _assert_same([outs[0], (v, i, r)])

    offsets, ks = [0, 150_000, 150_100, 400_000], [1_500, 0, 2_500]

    def run_segmented():
        r = start.clone()
        v, i = ops.segmented_ef_topk(grad, r, offsets, ks, wire, backend="native")
        return v, i, r

    _assert_same(threads(run_segmented))


def test_threshold_select_same_at_every_thread_count(threads):
    x = _gradient(500_000, 8)
    outs = threads(lambda: ops.threshold_select(x, 2.5, backend="native"))
    _assert_same(outs)
    assert [ops.threshold_count(x, 2.5, backend="native") for _ in THREADS] == [outs[0][0].numel()] * 3


def test_sampled_threshold_same_at_every_thread_count(threads):
    x = _gradient(600_000, 9)
    outs = threads(lambda: (torch.tensor([ops.sampled_threshold(x, 6_000, 20_000, seed=3,
                                                                backend="native")]),))
    _assert_same(outs)


def test_decode_same_at_every_thread_count(threads):
    n, k, nchunks, off = 300_000, 6_000, 4, 2
    chunk_len = off + ops.record_numel(k, torch.float32) + 3
    gathered = torch.zeros(nchunks * chunk_len)
    for p in range(nchunks):  # overlapping records, as from each rank's own top-k
        v, i = ops.topk(_gradient(n, 20 + p), k)
        ops.pack(v, i, gathered[p * chunk_len:(p + 1) * chunk_len], off)
    sizes = [100_000, 0, 150_000, 50_000]

    def run():
        dense = torch.zeros(n)
        ops.scatter_add_chunks(dense, gathered, nchunks, off, k, backend="native")
        summed = dense.clone()
        ts = [torch.zeros(s) for s in sizes]
        bad = ops.deliver_chunks(dense, ts, gathered, nchunks, off, k, scale=0.25,
                                 backend="native")
        return (summed, dense, *ts, bad)

    outs = threads(run)
    _assert_same(outs)
    assert not outs[0][1].any()  # the decode leaves the sums buffer zero again


def test_hash_partition_same_at_every_thread_count(threads):
    g = torch.Generator().manual_seed(4)
    idx = torch.randperm(2_000_000, generator=g)[:300_000].to(torch.int32)
    outs = threads(lambda: ops.hash_partition(idx, 4, seed=99, backend="native"))
    _assert_same(outs)
    _assert_same([outs[0], ops.hash_partition(idx, 4, seed=99, backend="torch")])
