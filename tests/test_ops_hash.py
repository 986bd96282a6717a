"""ZEN's hierarchical hashing (ops.hash_partition, ops.hash_owner): the native kernel against
the pure-torch fallback bit for bit, both against a plain sequential reading of Algorithm 1,
and the invariants the scheme relies on (every index in exactly one partition, nothing lost).
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ssfusion_hvd import ops

I64_EDGES = [0, 1, 2**31 - 1, 2**31, 2**32 + 5, 2**40 + 3, 2**62, 2**63 - 1, -1, -(2**63)]


def _indices(m, dtype, kind, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "sorted":  # what a sparsifier returns: distinct, ascending
        hi = max(4 * m, 16) if dtype == torch.int32 else 2**40
        x = torch.randint(0, hi, (m,), generator=g, dtype=torch.int64).unique()
        return x[torch.randperm(x.numel(), generator=g)].sort().values.to(dtype)
    if kind == "duplicates":  # heavy collisions: few distinct values, repeated
        return torch.randint(0, 5, (m,), generator=g).to(dtype)
    if kind == "random":
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, (m,), generator=g, dtype=torch.int64).to(dtype)
    raise ValueError(kind)


def _same(a, b):
    for x, y in zip(a, b):
        assert x.dtype == y.dtype == torch.int64
        assert torch.equal(x, y)


def _sequential(indices, nparts, seed, table_size, rounds):
    """Algorithm 1 read literally, one index at a time per round (slow; small inputs only)."""
    keys = indices.long()
    part = ops.hash_owner(indices, nparts, seed, backend="torch").long().tolist()
    slot = [ops._hash_to(keys, ops.hash_seed(seed, r), table_size).tolist()
            for r in range(1, rounds + 1)]
    tables = [[None] * table_size for _ in range(nparts)]
    pending = list(range(indices.numel()))
    for r in range(rounds):
        keep = []
        for j in pending:  # ascending j: the first to find a free slot is the lowest
            t = tables[part[j]]
            if t[slot[r][j]] is None:
                t[slot[r][j]] = j
            else:
                keep.append(j)
        pending = keep
    order, counts, overflow = [], [], []
    for p in range(nparts):
        serial = [j for j in pending if part[j] == p]
        placed = [j for j in tables[p] if j is not None]
        order += placed + serial
        counts.append(len(placed) + len(serial))
        overflow.append(len(serial))
    return (torch.tensor(order, dtype=torch.int64), torch.tensor(counts, dtype=torch.int64),
            torch.tensor(overflow, dtype=torch.int64))


def _check_invariants(indices, nparts, seed, result):
    order, counts, overflow = result
    m = indices.numel()
    # every position exactly once: nothing lost, nothing duplicated
    assert torch.equal(order.sort().values, torch.arange(m))
    assert int(counts.sum()) == m and counts.numel() == nparts
    assert bool((overflow >= 0).all()) and bool((overflow <= counts).all())
    # every index in the partition h_0 gives it (the same on every rank for one seed)
    owner = ops.hash_owner(indices, nparts, seed)
    assert torch.equal(counts, torch.bincount(owner.long(), minlength=nparts))
    bounds = [0] + torch.cumsum(counts, 0).tolist()
    for p in range(nparts):
        assert bool((owner[order[bounds[p]:bounds[p + 1]]] == p).all())


def test_extension_has_hash_ops():
    assert ops.have_extension()
    assert ops._C is not None and hasattr(ops._C, "hash_partition_cpu")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("m", [0, 1, 2, 100, 4097, 100_000])
@pytest.mark.parametrize("nparts", [1, 2, 3, 4, 7, 64])
@pytest.mark.parametrize("kind", ["sorted", "duplicates", "random"])
def test_hash_partition_native_equals_torch(m, nparts, dtype, kind):
    idx = _indices(m, dtype, kind, seed=m + nparts)
    for rounds, table_size in [(3, None), (0, None), (1, 1), (4, 3), (2, 4 * (m // nparts) + 7)]:
        got = ops.hash_partition(idx, nparts, 12345, table_size=table_size, rounds=rounds,
                                 backend="native")
        _same(got, ops.hash_partition(idx, nparts, 12345, table_size=table_size, rounds=rounds,
                                      backend="torch"))
        _check_invariants(idx, nparts, 12345, got)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 400), st.integers(1, 9), st.integers(0, 5), st.integers(1, 40),
       st.sampled_from([torch.int32, torch.int64]),
       st.sampled_from(["sorted", "duplicates", "random"]), st.integers(0, 2**64 - 1))
def test_hash_partition_matches_algorithm_1(m, nparts, rounds, table_size, dtype, kind, seed):
    idx = _indices(m, dtype, kind, seed % 1000)
    want = _sequential(idx, nparts, seed, table_size, rounds)
    for backend in ("native", "torch"):
        _same(ops.hash_partition(idx, nparts, seed, table_size=table_size, rounds=rounds,
                                 backend=backend), want)


def test_int64_edge_values():
    idx = torch.tensor(I64_EDGES * 3, dtype=torch.int64)
    for nparts in (1, 2, 5, 1000):
        for backend in ("native", "torch"):
            r = ops.hash_partition(idx, nparts, 7, table_size=2, rounds=2, backend=backend)
            _check_invariants(idx, nparts, 7, r)
        _same(ops.hash_partition(idx, nparts, 7, table_size=2, rounds=2, backend="native"),
              ops.hash_partition(idx, nparts, 7, table_size=2, rounds=2, backend="torch"))
        assert torch.equal(ops.hash_owner(idx, nparts, 7, backend="native"),
                           ops.hash_owner(idx, nparts, 7, backend="torch"))
    # int32 and int64 spellings of one index hash alike
    small = torch.tensor([0, 5, 2**31 - 1, -7], dtype=torch.int32)
    _same(ops.hash_partition(small, 4, 1), ops.hash_partition(small.long(), 4, 1))


def test_heavy_collisions_lose_nothing():
    idx = torch.arange(10_000, dtype=torch.int32)
    order, counts, overflow = ops.hash_partition(idx, 4, 3, table_size=1, rounds=3)
    assert int(counts.sum()) == 10_000
    assert torch.equal(overflow, counts - 1)  # one slot each, the rest in serial memory
    # the serial memory keeps input order; the one slot went to the lowest position
    bounds = [0] + torch.cumsum(counts, 0).tolist()
    for p in range(4):
        part = order[bounds[p]:bounds[p + 1]]
        assert bool((part[1:] > part[:-1]).all())
    dup = torch.full((1000,), 42, dtype=torch.int64)  # one index a thousand times
    order, counts, overflow = ops.hash_partition(dup, 3, 3, table_size=1)
    assert torch.equal(order, torch.arange(1000)) and int(counts.max()) == 1000
    assert int(overflow.sum()) == 999
    # with room, each round's hash function places one more copy (the lowest pending one)
    order, counts, overflow = ops.hash_partition(dup, 3, 3, rounds=3)
    placed = 1000 - int(overflow.sum())
    assert 1 <= placed <= 3 and sorted(order[:placed].tolist()) == list(range(placed))
    assert torch.equal(order[placed:], torch.arange(placed, 1000))


def test_rounds_zero_is_all_serial_in_input_order():
    idx = _indices(5000, torch.int64, "sorted", 1)
    order, counts, overflow = ops.hash_partition(idx, 5, 9, rounds=0)
    assert torch.equal(overflow, counts)
    owner = ops.hash_owner(idx, 5, 9).long()
    assert torch.equal(order, torch.sort(owner, stable=True).indices)


def test_result_independent_of_thread_count():
    idx = _indices(300_000, torch.int32, "sorted", 3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.hash_partition(idx, 3, 5)
        torch.set_num_threads(max(2, threads))
        many = ops.hash_partition(idx, 3, 5)
    finally:
        torch.set_num_threads(threads)
    _same(one, many)


def test_seed_and_defaults():
    idx = _indices(20_000, torch.int32, "sorted", 4)
    a, b = ops.hash_owner(idx, 4, 1), ops.hash_owner(idx, 4, 2)
    assert not torch.equal(a, b) and torch.equal(a, ops.hash_owner(idx, 4, 1))
    assert torch.equal(ops.hash_owner(idx, 4, -1), ops.hash_owner(idx, 4, 2**64 - 1))
    assert ops.default_table_size(20_000, 4) == 10_000 and ops.default_table_size(0, 4) == 1
    # a universal hash balances a dense range and a sparse sorted set alike (Theorem 2)
    for x in (torch.arange(100_000), idx):
        counts = ops.hash_partition(x, 8, 1)[1]
        assert float(counts.max()) * 8 / x.numel() < 1.05


def test_bad_arguments_rejected():
    idx = torch.arange(10, dtype=torch.int32)
    for bad in (dict(nparts=0), dict(nparts=2**31), dict(rounds=-1), dict(rounds=65),
                dict(table_size=0)):
        kw = dict(nparts=2, rounds=3, table_size=None) | bad
        nparts = kw.pop("nparts")
        for backend in ("native", "torch"):
            with pytest.raises((ValueError, RuntimeError)):
                ops.hash_partition(idx, nparts, 0, backend=backend, **kw)
    for backend in ("native", "torch"):
        with pytest.raises(TypeError):
            ops.hash_partition(idx.float(), 2, 0, backend=backend)
        with pytest.raises(TypeError):
            ops.hash_partition(idx.view(2, 5), 2, 0, backend=backend)
        with pytest.raises(TypeError):
            ops.hash_owner(idx.to(torch.int16), 2, 0, backend=backend)
    with pytest.raises(RuntimeError):  # the kernel checks on its own too
        ops._C.hash_partition_cpu(idx, 0, 0, 4, 3)


@pytest.mark.skipif(not torch.cuda.is_available()
                    or not ops.build_info().get("cuda_kernels", False), reason="needs a CUDA device and an extension built with CUDA kernels")
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("kind", ["sorted", "duplicates", "random"])
def test_hash_cuda_equals_cpu(dtype, kind):
    for m in (0, 1, 1000, 300_001):
        idx = _indices(m, dtype, kind, m)
        for nparts, rounds, table_size in [(4, 3, None), (3, 0, None), (7, 2, 1), (64, 4, 5)]:
            cpu = ops.hash_partition(idx, nparts, 99, table_size=table_size, rounds=rounds)
            gpu = ops.hash_partition(idx.cuda(), nparts, 99, table_size=table_size,
                                     rounds=rounds, backend="native")
            _same(cpu, [t.cpu() for t in gpu])
        assert torch.equal(ops.hash_owner(idx, 5, 99),
                           ops.hash_owner(idx.cuda(), 5, 99, backend="native").cpu())
