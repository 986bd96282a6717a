"""Native kernels (ssfusion_hvd._C) against the pure-torch fallback: identical results."""
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ssfusion_hvd import ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 2, 7, 100, 1000, 4097, 65536 + 3, 300_001]


def _data(n, dtype, kind, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        x = torch.randn(n, generator=g)
    elif kind == "ties":  # few distinct magnitudes, both signs: heavy ties everywhere
        x = torch.randint(-3, 4, (n,), generator=g).float()
    elif kind == "scaled":  # per-layer scale differences, like real gradients
        x = torch.randn(n, generator=g) * torch.logspace(-6, 2, n)[torch.randperm(n, generator=g)]
    else:
        raise ValueError(kind)
    return x.to(dtype)


def _same(a, b):
    """Bitwise equality of (values, indices) pairs."""
    assert a[1].dtype == b[1].dtype and a[0].dtype == b[0].dtype
    assert torch.equal(a[1], b[1])
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) if a[0].numel() else True


def test_extension_built():
    assert ops.have_extension(), ops.build_info()


def test_cuda_sources_compiled_when_nvcc_present():
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    assert ops.build_info()["cuda_sources_compiled"], ops.build_info()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", ["normal", "ties", "scaled"])
def test_topk_native_equals_torch(n, dtype, kind):
    x = _data(n, dtype, kind, seed=n)
    for k in sorted({0, 1, max(1, n // 100), max(1, n // 10), n // 2, n}):
        _same(ops.topk(x, k, backend="native"), ops.topk(x, k, backend="torch"))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 3000), st.sampled_from(DTYPES), st.data())
def test_topk_random(n, dtype, data):
    seed = data.draw(st.integers(0, 2**31 - 1))
    x = _data(n, dtype, data.draw(st.sampled_from(["normal", "ties", "scaled"])), seed)
    k = data.draw(st.integers(0, n))
    got = ops.topk(x, k, backend="native")
    _same(got, ops.topk(x, k, backend="torch"))
    # definition check, independent of both implementations: the k largest keys, lowest
    # indices among ties, ascending indices
    key = ops.magnitude_key(x).long()
    order = sorted(range(n), key=lambda i: (-int(key[i]), i))[:k]
    assert got[1].tolist() == sorted(order)


def test_topk_ties_go_to_lower_index_and_keep_sign():
    x = torch.tensor([1.0, -3.0, 2.0, 3.0, -2.0, 2.0])
    v, i = ops.topk(x, 4)
    assert i.tolist() == [1, 2, 3, 4] and v.tolist() == [-3.0, 2.0, 3.0, -2.0]


def test_topk_nan_inf_are_selected_first():
    x = torch.tensor([0.5, float("nan"), -float("inf"), 7.0, 1e30])
    for backend in ("native", "torch"):
        v, i = ops.topk(x, 2, backend=backend)
        assert i.tolist() == [1, 2]
        assert torch.isnan(v[0]) and v[1] == -float("inf")


def test_topk_noncontiguous_and_shapes():
    x = torch.randn(64, 33)[:, ::2]
    assert not x.is_contiguous()
    _same(ops.topk(x, 50, backend="native"), ops.topk(x.contiguous(), 50, backend="torch"))


def test_topk_rejects_bad_input():
    with pytest.raises(ValueError, match="out of range"):
        ops.topk(torch.randn(10), 11)
    with pytest.raises(TypeError, match="unsupported dtype"):
        ops.topk(torch.arange(10), 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 1000, 300_001])
def test_threshold_select_native_equals_torch(n, dtype):
    x = _data(n, dtype, "scaled", seed=7)
    if n:
        x[n // 2] = float("nan")
    for thr in [0.0, 1e-3, 0.5, 2.0, 1e9, -1.0]:
        got = ops.threshold_select(x, thr, backend="native")
        _same(got, ops.threshold_select(x, thr, backend="torch"))
        assert ops.threshold_count(x, thr, backend="native") == got[1].numel()
        assert ops.threshold_count(x, thr, backend="torch") == got[1].numel()
    if n:
        assert n // 2 in ops.threshold_select(x, 1e9)[1].tolist()  # NaN never dropped


def test_threshold_nan_threshold_rejected():
    with pytest.raises(ValueError, match="NaN"):
        ops.threshold_select(torch.randn(4), float("nan"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("k", [0, 1, 5, 1000])
def test_pack_native_equals_torch(dtype, idx_dtype, k):
    x = torch.randn(5000).to(dtype)
    v, i = ops.topk(x, k)
    i = i.to(idx_dtype)
    size = 3 + ops.record_numel(k, dtype, idx_dtype) + 11
    a, b = torch.full((size,), 9.0, dtype=dtype), torch.full((size,), 9.0, dtype=dtype)
    end_a = ops.pack(v, i, a, 3, backend="native")
    end_b = ops.pack(v, i, b, 3, backend="torch")
    assert end_a == end_b == 3 + ops.record_numel(k, dtype, idx_dtype)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert (a[end_a:] == 9).all() and (a[:3] == 9).all()  # nothing outside the record written
    v2, i2 = ops.unpack(a, 3, k, idx_dtype)
    assert torch.equal(v2, v) and torch.equal(i2, i)


def test_record_spans_match_native():
    from ssfusion_hvd import _C

    for dtype in DTYPES:
        for idt in (torch.int32, torch.int64):
            for k in (0, 1, 2, 3, 17):
                assert tuple(_C.record_spans(k, dtype, idt)) == ops.record_spans(k, dtype, idt)


def test_pack_overflow_rejected():
    v, i = ops.topk(torch.randn(100), 10)
    for backend in ("native", "torch"):
        with pytest.raises((ValueError, RuntimeError), match="does not fit"):
            ops.pack(v, i, torch.zeros(15), 0, backend=backend)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nchunks", [1, 2, 3, 5])
def test_scatter_add_chunks_native_equals_torch(dtype, nchunks):
    n, k, off = 20_000, 700, 4
    g = torch.Generator().manual_seed(nchunks)
    chunk_len = off + ops.record_numel(k, dtype) + 6
    gathered = torch.zeros(nchunks * chunk_len, dtype=dtype)
    expected = torch.zeros(n, dtype=torch.float64)
    for p in range(nchunks):  # each rank's own top-k: indices overlap across chunks
        x = torch.randn(n, generator=g).to(dtype)
        v, i = ops.topk(x, k)
        ops.pack(v, i, gathered[p * chunk_len:(p + 1) * chunk_len], off)
        expected.index_add_(0, i.long(), v.double())
    a = torch.zeros(n, dtype=dtype)
    b = torch.zeros(n, dtype=dtype)
    ops.scatter_add_chunks(a, gathered, nchunks, off, k, backend="native")
    ops.scatter_add_chunks(b, gathered, nchunks, off, k, backend="torch")
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    tol = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    assert torch.allclose(a.double(), expected, atol=tol * nchunks, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_widening_decode_sums_16_bit_records_in_float32(dtype):
    """fp32 accumulation of float16/bfloat16 records: every value converted exactly, then
    added in float32 in chunk order; native equals torch, bit for bit; float16 sums would
    round at every add."""
    n, k, nchunks = 5_000, 400, 4
    g = torch.Generator().manual_seed(7)
    chunk_len = ops.record_numel(k, dtype)
    gathered = torch.zeros(nchunks * chunk_len, dtype=dtype)
    want = torch.zeros(n, dtype=torch.float32)
    for p in range(nchunks):
        v, i = ops.topk(torch.randn(n, generator=g).to(dtype), k)
        ops.pack(v, i, gathered[p * chunk_len:(p + 1) * chunk_len], 0)
        want.index_add_(0, i.long(), v.float())  # float32 adds in chunk order
    a = torch.full((n,), 0.25)
    b = a.clone()
    ops.scatter_add_chunks(a, gathered, nchunks, 0, k, backend="native")
    ops.scatter_add_chunks(b, gathered, nchunks, 0, k, backend="torch")
    assert torch.equal(a, b) and torch.equal(a, want + 0.25)
    with pytest.raises((ValueError, RuntimeError), match="cannot sum"):
        ops.scatter_add_chunks(torch.zeros(n, dtype=torch.float16),
                               torch.zeros(chunk_len, dtype=torch.float32), 1, 0, 1)


def test_scatter_add_duplicates_add_in_order():
    for backend in ("native", "torch"):
        d = torch.zeros(4)
        ops.scatter_add(d, torch.tensor([1.0, 2.0, 4.0]), torch.tensor([3, 0, 3], dtype=torch.int32),
                        backend=backend)
        assert d.tolist() == [2.0, 0.0, 0.0, 5.0]
        with pytest.raises((IndexError, RuntimeError), match="out of range"):
            ops.scatter_add(d, torch.tensor([1.0]), torch.tensor([4]), backend=backend)


# ------------------------------------------------------------------ deliver_chunks

DELIVER_SIZES = [300, 0, 1, 2000, 0, 57]  # a part's tensors, empty ones included


def deliver_records(sizes, k, nchunks, dtype, idx_dtype, off=3, seed=0):
    """Gathered records as a sparse part's decode sees them: chunk p names k distinct
    positions of out (the tensors back to back, then a sink of k): mostly positions of the
    tensors, drawn independently per chunk (so chunks overlap), some chunks ending in zero
    padding at sink positions. Chunk 1 cancels chunk 0's first value (a +0 sum). Returns
    (gathered, chunk_len, out_numel)."""
    g = torch.Generator().manual_seed(seed)
    numel = sum(sizes)
    chunk_len = off + ops.record_numel(k, dtype, idx_dtype) + 5
    gathered = torch.zeros(nchunks * chunk_len, dtype=dtype)
    first = None
    for p in range(nchunks):
        pad = (p % 3) * (k // 4)
        live = torch.randperm(numel, generator=g)
        vals = torch.randn(k, generator=g) * 4
        if p == 0:
            first = (int(live[0]), float(vals[0].to(dtype)))
        elif p == 1:  # the same position, the opposite value
            live = torch.cat([torch.tensor([first[0]]), live[live != first[0]]])
            vals[0] = -first[1]
        idx = torch.cat([live[:k - pad], numel + torch.randperm(k, generator=g)[:pad]])
        vals[k - pad:] = 0
        ops.pack(vals.to(dtype), idx.to(idx_dtype), gathered[p * chunk_len:(p + 1) * chunk_len],
                 off)
    return gathered, chunk_len, numel + k


def _named(gathered, nchunks, off, k, idx_dtype, numel):
    """Mask of the tensors' positions any record names."""
    chunk_len = gathered.numel() // nchunks
    mask = torch.zeros(numel, dtype=torch.bool)
    for p in range(nchunks):
        i = ops.unpack(gathered, p * chunk_len + off, k, idx_dtype)[1].long()
        mask[i[i < numel]] = True
    return mask


def full_decode(gathered, nchunks, off, k, idx_dtype, out_numel, acc, sizes, dtype, scale):
    """The decode before deliver_chunks, from torch primitives: zero out, add the records
    chunk by chunk (index_add_, distinct indices per chunk), scale all of out, copy it."""
    chunk_len = gathered.numel() // nchunks if nchunks else 0
    out = torch.zeros(out_numel, dtype=acc)
    for p in range(nchunks):
        v, i = ops.unpack(gathered, p * chunk_len + off, k, idx_dtype)
        out.index_add_(0, i.long(), v.to(acc))
    if scale != 1.0:
        out.mul_(scale)
    ts = [torch.empty(n, dtype=dtype) for n in sizes]
    torch._foreach_copy_(ts, list(out[:sum(sizes)].split(sizes)))
    return ts


def deliver(gathered, nchunks, off, k, idx_dtype, out_numel, acc, sizes, dtype, scale, backend,
            fill=7.0, device="cpu"):
    """scatter_add_chunks then deliver_chunks into tensors filled with `fill`; checks that
    out is all (+)zero afterwards. Returns (tensors, count)."""
    out = torch.zeros(out_numel, dtype=acc, device=device)
    gathered = gathered.to(device)
    ops.scatter_add_chunks(out, gathered, nchunks, off, k, idx_dtype, backend=backend)
    ts = [torch.full((n,), fill, dtype=dtype, device=device) for n in sizes]
    count = ops.deliver_chunks(out, ts, gathered, nchunks, off, k, idx_dtype, scale,
                               backend=backend)
    assert count.dtype == torch.int64 and count.dim() == 0 and count.device == out.device
    assert int(out.view(torch.uint8).count_nonzero()) == 0  # +0.0 everywhere, sink included
    return ts, int(count)


def _bits_equal(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


DELIVER_KINDS = [(torch.float32, torch.float32), (torch.float16, torch.float32),
                 (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
                 (torch.bfloat16, torch.bfloat16)]  # (tensors' dtype, out's dtype)


@pytest.mark.parametrize("dtype,acc", DELIVER_KINDS)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("nchunks", [1, 2, 5])
@pytest.mark.parametrize("scale", [1.0, 0.2])
def test_deliver_chunks_native_equals_torch_and_the_full_decode(dtype, acc, idx_dtype, nchunks,
                                                                scale):
    sizes, k, off = DELIVER_SIZES, 700, 3
    gathered, _, out_numel = deliver_records(sizes, k, nchunks, dtype, idx_dtype, off, seed=nchunks)
    args = (gathered, nchunks, off, k, idx_dtype, out_numel, acc, sizes, dtype, scale)
    # into zeroed tensors, as a decode runs it: the full decode, bit for bit
    ref = torch.cat(full_decode(*args))
    a, ca = deliver(*args, "native", fill=0.0)
    b, cb = deliver(*args, "torch", fill=0.0)
    assert _bits_equal(torch.cat(a), ref) and _bits_equal(torch.cat(b), ref) and ca == cb == 0
    named = _named(gathered, nchunks, off, k, idx_dtype, sum(sizes))
    if nchunks > 1:  # chunks overlap partly; one position sums to +0
        assert k < named.sum() < nchunks * k
        assert int(((ref == 0) & named).sum()) >= 1
    # elements no record names are never written
    a, _ = deliver(*args, "native", fill=7.0)
    b, _ = deliver(*args, "torch", fill=7.0)
    assert all(_bits_equal(x, y) for x, y in zip(a, b))
    assert torch.cat(a)[~named].eq(7.0).all()


def nonfinite_records(dtype, idx_dtype=torch.int32):
    """Three chunks of 20 entries over tensors of [50, 0, 30] elements (and a sink of 20):
    NaN and Inf in the records, Inf + -Inf across chunks, and three copies of a value whose
    sum overflows 16-bit types (finite in a float32 out, until it is cast). Returns
    (gathered, sizes, k, nchunks)."""
    sizes, k, nchunks = [50, 0, 30], 20, 3
    big = {torch.float32: 3e38, torch.float16: 40000.0, torch.bfloat16: 3e38}[dtype]
    nan, inf = float("nan"), float("inf")
    chunk_len = ops.record_numel(k, dtype, idx_dtype)
    gathered = torch.zeros(nchunks * chunk_len, dtype=dtype)
    for p in range(nchunks):
        # positions 0-3 in every chunk, then 12 + 4j + p: chunk p's own
        idx = torch.cat([torch.arange(4), 12 + torch.arange(k - 4) * 4 + p])
        vals = torch.arange(1, k + 1, dtype=torch.float32)
        vals[:4] = torch.tensor([nan if p == 0 else 1.0,  # NaN + 1 + 1
                                 inf if p == 1 else 2.0,  # 2 + Inf + 2
                                 [inf, -inf, 0.0][p],  # Inf - Inf
                                 big])  # overflows the 16-bit types
        ops.pack(vals.to(dtype), idx.to(idx_dtype), gathered[p * chunk_len:(p + 1) * chunk_len], 0)
    return gathered, sizes, k, nchunks


@pytest.mark.parametrize("dtype,acc", DELIVER_KINDS)
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_deliver_chunks_counts_nonfinite_values_once(dtype, acc, scale):
    """Each non-finite delivered position counts once, whatever the chunks that name it
    (nonfinite_records; with float32 out and scale 0.5 the 16-bit overflow is finite)."""
    gathered, sizes, k, nchunks = nonfinite_records(dtype)
    args = (gathered, nchunks, 0, k, torch.int32, sum(sizes) + k, acc, sizes, dtype, scale)
    a, ca = deliver(*args, "native", fill=0.0)
    b, cb = deliver(*args, "torch", fill=0.0)
    ref = torch.cat(full_decode(*args))
    for got in (torch.cat(a), torch.cat(b)):  # NaN payloads aside (ops.deliver_chunks)
        assert torch.equal(torch.isnan(got), torch.isnan(ref))
        assert _bits_equal(got[~got.isnan()], ref[~ref.isnan()])
    assert ca == cb == int((~torch.isfinite(ref)).sum()) >= 3


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_deliver_chunks_empty_records_and_tensors(backend):
    dtype, idx_dtype = torch.float32, torch.int32
    out = torch.zeros(10)
    ts = [torch.full((3,), 7.0), torch.empty(0)]
    gathered = torch.zeros(2 * ops.record_numel(0, dtype, idx_dtype) + 2)
    assert int(ops.deliver_chunks(out, ts, gathered, 2, 0, 0, idx_dtype, 0.5, backend=backend)) == 0
    assert int(ops.deliver_chunks(out, ts, torch.zeros(0), 0, 0, 0, idx_dtype, 0.5,
                                  backend=backend)) == 0
    assert ts[0].tolist() == [7.0] * 3
    # no tensors at all: every position is sink, cleared and never delivered
    rec = ops.record_numel(2, dtype, idx_dtype)
    gathered = torch.zeros(rec)
    ops.pack(torch.tensor([1.0, 2.0]), torch.tensor([4, 9], dtype=idx_dtype), gathered, 0)
    out = torch.zeros(10)
    ops.scatter_add_chunks(out, gathered, 1, 0, 2, idx_dtype, backend=backend)
    count = ops.deliver_chunks(out, [], gathered, 1, 0, 2, idx_dtype, 1.0, backend=backend)
    assert int(count) == 0 and not out.any()


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("bad", [-1, 12])
def test_deliver_chunks_rejects_indices_out_of_range_before_writing(backend, bad):
    dtype, idx_dtype, k = torch.float32, torch.int32, 2
    rec = ops.record_numel(k, dtype, idx_dtype)
    gathered = torch.zeros(2 * rec)
    ops.pack(torch.tensor([1.0, 2.0]), torch.tensor([0, 5], dtype=idx_dtype), gathered, 0)
    ops.pack(torch.tensor([3.0, 4.0]), torch.tensor([1, bad], dtype=idx_dtype), gathered, rec)
    out = torch.arange(12.0)  # 8 positions of the tensors, 4 of sink
    ts = [torch.full((5,), 7.0), torch.full((3,), 7.0)]
    with pytest.raises((IndexError, RuntimeError), match="out of range"):
        ops.deliver_chunks(out, ts, gathered, 2, 0, k, idx_dtype, 1.0, backend=backend)
    assert torch.equal(out, torch.arange(12.0)) and all(t.eq(7.0).all() for t in ts)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_deliver_chunks_rejects_bad_tensors_and_scales(backend):
    gathered = torch.zeros(ops.record_numel(1, torch.float16), dtype=torch.float16)
    out = torch.zeros(8)
    for ts, what in (([torch.zeros(4)], "records' dtype"),  # float32, not the records' float16
                     ([torch.zeros(4, 2, dtype=torch.float16).t()], "contiguous"),
                     ([torch.zeros(5, dtype=torch.float16)] * 2, "hold 10")):
        with pytest.raises((ValueError, RuntimeError), match=what):
            ops.deliver_chunks(out, ts, gathered, 1, 0, 1, torch.int32, 1.0, backend=backend)
        if backend == "native":  # the extension's own checks (csrc/checks.h), which CUDA shares
            with pytest.raises(RuntimeError, match=what):
                ops._C.deliver_chunks_cpu(out, ts, gathered, 1, gathered.numel(), 0, 1,
                                          torch.int32, 1.0)
    for scale in (-0.5, float("inf"), float("nan")):  # a +0 sum must stay +0 when scaled
        with pytest.raises((ValueError, RuntimeError), match="finite and >= 0"):
            ops.deliver_chunks(out, [torch.zeros(4, dtype=torch.float16)], gathered, 1, 0, 1,
                               torch.int32, scale, backend=backend)
        if backend == "native":
            with pytest.raises(RuntimeError, match="finite and >= 0"):
                ops._C.deliver_chunks_cpu(out, [torch.zeros(4, dtype=torch.float16)], gathered,
                                          1, gathered.numel(), 0, 1, torch.int32, scale)
    with pytest.raises((ValueError, RuntimeError), match="cannot"):  # float16 out, float32 records
        ops.deliver_chunks(torch.zeros(8, dtype=torch.float16), [torch.zeros(2)],
                           torch.zeros(ops.record_numel(1, torch.float32)), 1, 0, 1, torch.int32,
                           1.0, backend=backend)


# ------------------------------------------------------------------ segmented top-k, DGC


def _segments(sizes):
    return torch.tensor([0] + list(sizes)).cumsum(0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_segmented_topk_native_equals_torch(dtype):
    g = torch.Generator().manual_seed(5)
    sizes = [1, 64, 0, 4096, 3, 37_000, 128, 2_000_000, 7, 300] * 12  # 120 tensors
    off = _segments(sizes)
    flat = (torch.randn(int(off[-1]), generator=g) * 10 ** torch.randint(-4, 2, (1,), generator=g)).to(dtype)
    flat[::997] = 0.5  # ties inside segments
    ks = torch.tensor([min(s, max(1, s // 100)) if s else 0 for s in sizes])
    ks[3] = sizes[3]  # a whole segment
    got = ops.segmented_topk(flat, off, ks, backend="native")
    _same(got, ops.segmented_topk(flat, off, ks, backend="torch"))
    # each segment equals a plain top-k of the slice, shifted by the segment start
    pos = 0
    for s in range(len(sizes)):
        v, i = ops.topk(flat[int(off[s]):int(off[s + 1])], int(ks[s]))
        assert torch.equal(got[1][pos:pos + int(ks[s])], i + int(off[s]))
        pos += int(ks[s])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 500), min_size=0, max_size=40), st.data())
def test_segmented_topk_random(sizes, data):
    off = _segments(sizes) if sizes else torch.tensor([0])
    flat = _data(int(off[-1]), torch.float32, data.draw(st.sampled_from(["normal", "ties"])),
                 data.draw(st.integers(0, 1000)))
    ks = [data.draw(st.integers(0, s)) for s in sizes]
    _same(ops.segmented_topk(flat, off, ks, backend="native"),
          ops.segmented_topk(flat, off, ks, backend="torch"))


def test_segmented_topk_rejects_bad_segments():
    with pytest.raises((ValueError, RuntimeError), match="out of range"):
        ops.segmented_topk(torch.randn(10), [0, 5, 10], [6, 1], backend="native")
    with pytest.raises(ValueError, match="offsets"):
        ops.segmented_topk(torch.randn(10), [0, 10], [1, 1])


SAMPLE_SEEDS = [0, 1, 0x444743, 2**64 - 1]


def _with_nonfinite(x):
    """x with NaN, +Inf and -Inf at a few fixed positions."""
    x = x.clone()
    n = x.numel()
    for i, v in enumerate([float("nan"), float("inf"), -float("inf")] * 3):
        x[(i * 7919 + 13) % n] = v
    return x


@pytest.mark.parametrize("dtype", DTYPES)
def test_sampled_threshold_native_equals_torch(dtype):
    for n in (1, 2, 7, 1000, 65536 + 3, 1_000_003):
        x = _with_nonfinite(_data(n, dtype, "scaled", n))
        for samples in (1, 7, 1000, 10_000, n, n + 5):
            for k in sorted({1, max(1, n // 1000), max(1, n // 100), n // 2 or 1, n}):
                for seed in SAMPLE_SEEDS:
                    a = ops.sampled_threshold(x, k, samples, seed, backend="native")
                    assert a == ops.sampled_threshold(x, k, samples, seed, backend="torch"), \
                        (n, samples, k, seed)
    x = _with_nonfinite(_data(1_000_003, dtype, "scaled", 11))
    # with every element sampled the estimate is the exact k-th magnitude, whatever the seed
    mag = x.float().abs().nan_to_num(nan=float("inf"), posinf=float("inf"))
    kth = float(mag.topk(777).values[-1])
    for seed in SAMPLE_SEEDS:
        assert ops.sampled_threshold(x, 777, x.numel(), seed) == kth


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_sampled_threshold_nan_and_inf_are_inf(backend):
    x = torch.tensor([0.5, -float("inf"), 2.0, -3.0])
    assert ops.sampled_threshold(x, 1, 4, backend=backend) == float("inf")
    assert ops.sampled_threshold(x, 2, 4, backend=backend) == 3.0
    x[2] = float("nan")
    assert ops.sampled_threshold(x, 2, 4, backend=backend) == float("inf")
    assert ops.sampled_threshold(x, 3, 4, backend=backend) == 3.0


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 6000), st.integers(0, 2**64 - 1),
       st.sampled_from(DTYPES), st.data())
def test_sampled_threshold_random(n, samples, seed, dtype, data):
    x = _data(n, dtype, data.draw(st.sampled_from(["normal", "ties", "scaled"])),
              data.draw(st.integers(0, 2**31 - 1)))
    if data.draw(st.booleans()):
        x = _with_nonfinite(x)
    k = data.draw(st.integers(1, n))
    assert ops.sampled_threshold(x, k, samples, seed, backend="native") == \
        ops.sampled_threshold(x, k, samples, seed, backend="torch")


_M64 = 2**64 - 1


def _fmix64_py(h):
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & _M64
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & _M64
    return h ^ (h >> 33)


def _positions_py(n, samples, seed):
    """csrc/sampling.h's sample positions with plain Python ints (unbounded, no int64 tricks)."""
    samples = max(1, min(samples, n))
    s = _fmix64_py((seed + 0x9E3779B97F4A7C15) & _M64)
    out = []
    for j in range(samples):
        lo, hi = j * n // samples, (j + 1) * n // samples
        out.append(lo + (_fmix64_py(j ^ s) >> 1) % (hi - lo))
    return out


def test_sample_positions_mirror_sampling_h():
    for n, samples in [(1, 1), (5, 9), (10, 10), (1000, 7), (4097, 64), (300_001, 2048),
                       (2**40 + 12345, 1000)]:  # also far beyond int32, no overflow
        for seed in SAMPLE_SEEDS + [-1]:
            pos = ops.sample_positions(n, samples, seed)
            assert pos.dtype == torch.int64
            assert pos.tolist() == _positions_py(n, samples, seed % 2**64), (n, samples, seed)


def test_sample_positions_one_per_stratum_and_seeded():
    n, samples = 100_000, 999  # strata of 100 or 101 elements
    pos = ops.sample_positions(n, samples, 5)
    j = torch.arange(samples)
    assert bool(((j * n // samples <= pos) & (pos < (j + 1) * n // samples)).all())
    assert torch.equal(pos, ops.sample_positions(n, samples, 5))  # same seed, same positions
    others = [ops.sample_positions(n, samples, seed) for seed in (0, 6, 2**64 - 1)]
    for other in others:  # another seed: positions agree only by chance (~1 in 100 per stratum)
        assert float((other == pos).float().mean()) < 0.05
    # the offsets inside the strata are spread over the whole width, not stuck at a phase
    off = torch.cat([pos, *others]) - torch.cat([j * n // samples] * 4)
    assert int(off.min()) <= 2 and int(off.max()) >= 98
    assert torch.equal(ops.sample_positions(n, n, 3), torch.arange(n))  # width 1: all


def _sampled_set(x, samples, seed):
    """The magnitudes a native sampled_threshold reads: over k = 1..n its rank
    ceil(k * samples / n) takes every value 1..samples, so the thresholds are all of them."""
    return {ops.sampled_threshold(x, k, samples, seed, backend="native")
            for k in range(1, x.numel() + 1)}


def test_native_kernel_samples_the_mirrored_positions():
    n, samples = 300, 23
    x = torch.arange(1, n + 1, dtype=torch.float32) * torch.tensor([1.0, -1.0]).repeat(n // 2)
    got = {seed: _sampled_set(x, samples, seed) for seed in (0, 1, 2**64 - 1)}
    for seed, mags in got.items():  # |x[i]| = i + 1 reveals the positions read
        assert mags == {float(p + 1) for p in _positions_py(n, samples, seed)}, seed
    assert got[0] != got[1] and got[0] != got[2**64 - 1]
    assert _sampled_set(x, samples, 1) == got[1]


def test_sampled_threshold_does_not_alias_with_rows():
    """A weight-shaped gradient whose large entries all sit in one column: a stride equal to
    the row length (the former fixed-stride sample, x[j * n // samples]) reads column 0 only
    and never sees them; the stratified random sample does."""
    rows, cols, col = 4096, 64, 37
    g = torch.Generator().manual_seed(0)
    x = torch.rand(rows, cols, generator=g)  # small: [0, 1)
    x[:, col] = 10 + torch.rand(rows, generator=g)  # large: [10, 11), 1/64 of the elements
    n, samples, k = x.numel(), rows, rows // 2
    true = float(ops.topk(x, k)[0].abs().min())  # about 10.5: the median large entry
    strided = torch.arange(samples) * n // samples
    assert bool((strided % cols == 0).all())  # the old positions: column 0, every row
    kk = -(-k * samples // n)  # 32: the sample rank that estimates the k-th of n
    assert float(x.flatten()[strided].topk(kk).values[-1]) < 1  # the old estimate: a small one
    # Tolerance. A sample holds L ~ Binomial(4096, 1/64) = 64 +- 8 large entries and the
    # estimate is their 32nd largest, about 11 - 32 / (L + 1): L's spread moves it by
    # 32 / 65^2 * 8 ~ 0.06 (one sd) and the order statistic's own spread is
    # sqrt(32 * 32) / 64^1.5 ~ 0.06, together ~0.085; 0.3 is 3.5 sd. The mean of 20 seeds
    # has sd ~0.02 (plus a bias of ~-0.01 from E[1 / (L + 1)]): within 0.08.
    est = [ops.sampled_threshold(x, k, samples, seed) for seed in range(20)]
    assert all(abs(e - true) <= 0.3 for e in est), (true, est)
    assert abs(sum(est) / len(est) - true) <= 0.08, (true, est)
    assert len(set(est)) > 10  # the seeds draw different samples


def test_large_tensor_ten_million():
    x = torch.randn(10_000_000, generator=torch.Generator().manual_seed(1))
    x[::1000] = 3.0  # heavy ties around the threshold region
    for k in (1, 100_000):
        _same(ops.topk(x, k, backend="native"), ops.topk(x, k, backend="torch"))
    _same(ops.threshold_select(x, 3.0, backend="native"), ops.threshold_select(x, 3.0, backend="torch"))


def tied_at_kth(n, k, ties, seed):
    """Normal values with ``ties`` positions (some in runs, some scattered) set to +-M, M the
    magnitude ranked k - ties // 4: the k-th largest key is M and only some of the tied
    positions are selected, the lowest ones. Sampled filtering applies (k small against n)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    m = x.abs().sort(descending=True).values[k - 1 - ties // 4]
    runs = torch.arange(ties // 2) + int(torch.randint(0, n - ties, (1,), generator=g))
    spread = torch.randperm(n, generator=g)[:ties - ties // 2]
    pos = torch.cat([runs, spread])
    x[pos] = m * torch.where(torch.rand(len(pos), generator=g) < 0.5, -1.0, 1.0)
    return x


@pytest.mark.parametrize("n", [100_003, 300_001, 1_000_003, 7_000_003])
def test_topk_ties_at_the_kth_key_when_filtering(n):
    """The filtered path's resolve: ties at the k-th key, in runs inside one block and
    scattered over chunks, go to the lower indices. Up to 1e6 the candidates are a few
    thousand (bisection, block emit); at 7e6 about 90k (the parallel radix select, each
    chunk emitting its own share of the ties)."""
    k = n // 100
    for ties in (2, 37, 200):
        x = tied_at_kth(n, k, ties, seed=ties)
        got = ops.topk(x, k, backend="native")
        _same(got, ops.topk(x, k, backend="torch"))
        key = ops.magnitude_key(x)
        kth = key.sort(descending=True).values[k - 1]
        tied = (key == kth).nonzero().flatten()
        taken = torch.isin(tied, got[1].long())
        assert 0 < int(taken.sum()) < len(tied)  # the boundary falls inside the ties
        assert bool(taken[:int(taken.sum())].all())  # the lowest of them


@pytest.mark.parametrize("n", [257, 1_003, 20_011])
def test_topk_small_inputs_filtered_with_ties(n):
    """From 256 elements up the sample and filter run (below 16384 the radix select ran
    before): a sample of one to a few runs, ties at the k-th key inside the candidates,
    k a fiftieth of n, and k = 1."""
    for k in (max(1, n // 50), 1):
        for ties in (2, 2 * k + 1):
            x = tied_at_kth(n, k, ties, seed=n + ties) if k > 1 else \
                torch.randn(n, generator=torch.Generator().manual_seed(n))
            got = ops.topk(x, k, backend="native")
            _same(got, ops.topk(x, k, backend="torch"))
            if k == 1:
                assert int(got[1]) == int(x.abs().argmax())
                continue
            key = ops.magnitude_key(x)
            kth = key.sort(descending=True).values[k - 1]
            tied = (key == kth).nonzero().flatten()
            taken = torch.isin(tied, got[1].long())
            assert 0 < int(taken.sum()) < len(tied)
            assert bool(taken[:int(taken.sum())].all())


@pytest.mark.parametrize("n", [100_003, 300_001, 1_000_003])
def test_topk_large_values_clustered_in_one_chunk(n):
    """A run of large values: one chunk holds far more candidates than its share (its
    buffer overflows and is collected again), the others few."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x[n // 3:n // 3 + n // 50] *= 100
    for k in (n // 100, n // 1000):
        _same(ops.topk(x, k, backend="native"), ops.topk(x, k, backend="torch"))
