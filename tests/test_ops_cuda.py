"""CUDA kernels against the CPU native kernels: bit-identical results for every op.

Skipped entirely without a GPU or when the extension was built without CUDA kernels
(``build_info()['cuda_kernels']``). Both sides run ``backend="native"``; the CPU side is
itself held to the pure-torch reference by tests/test_ops.py.

Caveat (scatter-add results only): where a sum is NaN, the NaN's payload bits may differ
between CPU and GPU (x86 propagates an input NaN's payload, the GPU writes a canonical
NaN), so those compares accept any NaN where the other side has a NaN, and require every
other element to match bit for bit. Selections copy values and never do arithmetic, so they
are compared bit for bit, NaNs included.
"""
import math
import os

import pytest
import torch

from ssfusion_hvd import ops
from ssfusion_hvd.plan.models import model_tensors
from test_ops import (DELIVER_KINDS, DELIVER_SIZES, deliver, deliver_records,
                      nonfinite_records)
from test_ops import _data as _base_data

if not torch.cuda.is_available() or not ops.build_info().get("cuda_kernels", False):
    # one skip for the module, not one per parametrized case
    pytest.skip("needs a CUDA device and an extension built with CUDA kernels",
                allow_module_level=True)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEV = "cuda"


def _data(n, dtype, kind, seed):
    """test_ops's inputs, plus "special": NaN, +-Inf, +-0 and subnormals among normals."""
    if kind != "special":
        return _base_data(n, dtype, kind, seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g).to(dtype)
    if n == 0:
        return x
    pos = torch.randint(0, n, (max(1, n // 50),), generator=g)
    tiny = {torch.float32: 1e-40, torch.float16: 6e-8, torch.bfloat16: 1e-39}[dtype]
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0,
                             tiny, -tiny]).to(dtype)  # tiny: a subnormal of dtype
    x[pos] = specials[torch.arange(pos.numel()) % specials.numel()]
    return x


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _same(a, b):
    """(values, indices) pairs equal bit for bit, dtypes included; a may be on the GPU."""
    assert a[0].dtype == b[0].dtype and a[1].dtype == b[1].dtype
    assert a[0].numel() == b[0].numel()
    assert torch.equal(a[1].cpu(), b[1])
    if a[0].numel():
        assert torch.equal(_bits(a[0].cpu()), _bits(b[0]))


def _same_sum(a, b):
    """Scatter-add results: bit for bit, except any NaN matches any NaN (module docstring)."""
    a = a.cpu()
    assert a.dtype == b.dtype and a.shape == b.shape
    na, nb = torch.isnan(a), torch.isnan(b)
    assert torch.equal(na, nb)
    assert torch.equal(_bits(a[~na]), _bits(b[~nb]))


def _both(x):
    return x, x.to(DEV)


def resnet50_sizes(width_div=1):
    """ResNet-50's 161 gradient sizes (ssfusion_hvd.plan.models); width_div > 1 shrinks
    each (about width_div^2 for the convolutions) to keep CPU reference runs short."""
    sizes = [n for _, n in model_tensors("resnet50")]
    return sizes if width_div == 1 else [max(1, n // width_div**2) for n in sizes]


# ------------------------------------------------------------------------------- top-k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 2, 7, 100, 2047, 2048, 2049, 16384, 16385, 65539, 300_001])
@pytest.mark.parametrize("kind", ["normal", "ties", "scaled", "special"])
def test_topk_cuda_equals_cpu(n, dtype, kind):
    c, g = _both(_data(n, dtype, kind, seed=n + 3))
    for k in sorted({0, 1, max(1, n // 1000), max(1, n // 100), n // 2, max(0, n - 1), n}):
        if k <= n:
            _same(ops.topk(g, k, backend="native"), ops.topk(c, k, backend="native"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["normal", "ties", "special"])
def test_topk_cuda_large(dtype, kind):
    n = 10**7
    c, g = _both(_data(n, dtype, kind, seed=11))
    for k in (n // 1000, n // 100):
        _same(ops.topk(g, k, backend="native"), ops.topk(c, k, backend="native"))


def test_topk_cuda_noncontiguous_and_all_equal():
    x = torch.randn(640, 33)[:, ::2]
    assert not x.is_contiguous()
    _same(ops.topk(x.to(DEV)[:, :], 500, backend="native"), ops.topk(x, 500, backend="native"))
    g = torch.randn(640, 33, device=DEV)[:, ::2]  # non-contiguous on the device itself
    _same(ops.topk(g, 77, backend="native"), ops.topk(g.cpu(), 77, backend="native"))
    ones = torch.ones(5000)
    _same(ops.topk(ones.to(DEV), 1234, backend="native"), ops.topk(ones, 1234, backend="native"))


def test_topk_cuda_on_side_stream():
    x = _data(500_000, torch.float32, "scaled", 5)
    ref = ops.topk(x, 5000, backend="native")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g = x.to(DEV, non_blocking=False)
        got = ops.topk(g, 5000, backend="native")
    s.synchronize()
    _same(got, ref)


# ------------------------------------------------------------------------------- segmented


def _segments(sizes, density, seed, gap=0, extra_cases=True):
    """offsets with `gap` unused elements between segments, ks = ceil(density * len) with a
    few k == 0 and k == len segments mixed in."""
    g = torch.Generator().manual_seed(seed)
    offs, ks, pos = [], [], gap
    for i, m in enumerate(sizes):
        offs.append(pos)
        k = min(m, max(1, math.ceil(density * m))) if m else 0
        if extra_cases and i % 17 == 5:
            k = 0
        elif extra_cases and i % 23 == 7:
            k = m
        elif extra_cases and i % 13 == 3 and m:
            k = int(torch.randint(0, m + 1, (1,), generator=g))
        ks.append(k)
        pos += m + gap
    offs.append(pos - gap)
    return torch.tensor(offs, dtype=torch.int64), torch.tensor(ks, dtype=torch.int64), pos


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["normal", "ties", "scaled", "special"])
def test_segmented_topk_cuda_model_sizes(dtype, kind):
    sizes = resnet50_sizes(width_div=4)  # 161 tensors, model-like spread of sizes
    assert len(sizes) >= 100
    for density, gap in ((0.01, 0), (0.001, 3)):
        off, ks, total = _segments(sizes, density, seed=len(sizes), gap=gap)
        c, g = _both(_data(total, dtype, kind, seed=17))
        got = ops.segmented_topk(g, off, ks, backend="native")
        _same(got, ops.segmented_topk(c, off, ks, backend="native"))


def test_segmented_topk_cuda_full_resnet50():
    sizes = resnet50_sizes()
    off, ks, total = _segments(sizes, 0.01, seed=1, extra_cases=False)
    c, g = _both(_data(total, torch.float32, "scaled", seed=2))
    _same(ops.segmented_topk(g, off, ks, backend="native"),
          ops.segmented_topk(c, off, ks, backend="native"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_segmented_topk_cuda_edge_cases(dtype):
    x = _data(50_000, dtype, "ties", seed=3)
    c, g = _both(x)
    cases = [
        ([0], []),                                  # no segments
        ([0, 0], [0]),                              # one empty segment
        ([0, 1], [1]),                              # one element
        ([5, 5, 9, 9, 40_000], [0, 2, 0, 39_991]),  # empty and k == len segments, offset != 0
        ([0, 50_000], [0]),                         # k == 0 everywhere
        ([0, 50_000], [50_000]),                    # everything
        ([0, 2048, 4096, 4097, 50_000], [7, 2048, 1, 4000]),  # tile-sized segments
        ([0, 20_000, 20_001, 50_000], [19_999, 1, 1]),
    ]
    for off, ks in cases:
        off_t = torch.tensor(off, dtype=torch.int64)
        ks_t = torch.tensor(ks, dtype=torch.int64)
        _same(ops.segmented_topk(g, off_t, ks_t, backend="native"),
              ops.segmented_topk(c, off_t, ks_t, backend="native"))


def test_segmented_topk_cuda_many_tiny_segments_and_lists():
    sizes = [int(s) for s in torch.randint(0, 40, (3000,), generator=torch.Generator().manual_seed(4))]
    off, ks, total = _segments(sizes, 0.3, seed=5)
    c, g = _both(_data(total, torch.float16, "ties", seed=6))
    _same(ops.segmented_topk(g, off, ks, backend="native"),
          ops.segmented_topk(c, off, ks, backend="native"))
    # python lists and int32 tensors are accepted as offsets/ks as well
    _same(ops.segmented_topk(g, off.tolist(), ks.int(), backend="native"),
          ops.segmented_topk(c, off, ks, backend="native"))


def test_segmented_topk_cuda_back_to_back_calls():
    # The plan goes through a pinned host buffer: many calls queued without a sync in
    # between must each see their own offsets.
    x = _data(200_000, torch.float32, "normal", seed=8)
    g = x.to(DEV)
    plans = []
    for r in range(20):
        sizes = [int(s) for s in torch.randint(1, 2000, (100,), generator=torch.Generator().manual_seed(r))]
        off, ks, total = _segments(sizes, 0.01 * (1 + r % 3), seed=r)
        plans.append((off, ks))
    got = [ops.segmented_topk(g, off, ks, backend="native") for off, ks in plans]
    for (off, ks), res in zip(plans, got):
        _same(res, ops.segmented_topk(x, off, ks, backend="native"))


def test_segmented_topk_cuda_noncontiguous():
    x = torch.randn(1000, 6)[:, ::2]
    off = torch.tensor([0, 1000, 2500, 3000])
    ks = torch.tensor([10, 1, 499])
    _same(ops.segmented_topk(x.to(DEV), off, ks, backend="native"),
          ops.segmented_topk(x, off, ks, backend="native"))


def test_segmented_topk_cuda_rejects_bad_segments():
    g = torch.randn(10, device=DEV)
    with pytest.raises((ValueError, RuntimeError), match="out of range"):
        ops.segmented_topk(g, [0, 5, 10], [6, 1], backend="native")
    with pytest.raises((ValueError, RuntimeError)):
        ops.segmented_topk(g, [0, 11], [1], backend="native")
    with pytest.raises((ValueError, RuntimeError)):
        ops.segmented_topk(g, [0, 10], [1, 1], backend="native")


# ------------------------------------------------------------------------------- sampled


def _same_float(a, b):
    assert (math.isinf(a) and a == b) or a == b, (a, b)


SAMPLE_SEEDS = (0, 1, 2**64 - 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["normal", "ties", "scaled", "special"])
def test_sampled_threshold_cuda_equals_cpu(dtype, kind):
    """The same seeded stratified positions (csrc/sampling.h) and the same estimate."""
    for n in (1, 2, 17, 1000, 65537, 1_000_003):
        c, g = _both(_data(n, dtype, kind, seed=n))
        for k in sorted({1, max(1, n // 1000), max(1, n // 100), n // 2 or 1, n}):
            for samples in (1, 7, 1000, n, n + 5, 10**6):
                for seed in SAMPLE_SEEDS:
                    _same_float(ops.sampled_threshold(g, k, samples, seed, backend="native"),
                                ops.sampled_threshold(c, k, samples, seed, backend="native"))


def test_sampled_threshold_cuda_reads_the_mirrored_positions():
    """|x[i]| = i + 1: over k = 1..n the estimates are exactly the sampled magnitudes."""
    n, samples = 300, 23
    x = torch.arange(1, n + 1, dtype=torch.float32).to(DEV)
    for seed in SAMPLE_SEEDS:
        got = {ops.sampled_threshold(x, k, samples, seed, backend="native")
               for k in range(1, n + 1)}
        assert got == {float(p + 1) for p in ops.sample_positions(n, samples, seed).tolist()}


def test_sampled_threshold_cuda_large_and_noncontiguous():
    x = _data(10**7, torch.float32, "scaled", seed=9)
    c, g = _both(x)
    for k, samples in ((10**4, 10**4), (10**5, 10**5), (10**5, 123_457)):
        for seed in SAMPLE_SEEDS:
            _same_float(ops.sampled_threshold(g, k, samples, seed, backend="native"),
                        ops.sampled_threshold(c, k, samples, seed, backend="native"))
    nc = torch.randn(300, 40)[:, ::3]
    _same_float(ops.sampled_threshold(nc.to(DEV), 50, 500, 7, backend="native"),
                ops.sampled_threshold(nc, 50, 500, 7, backend="native"))


def test_sampled_threshold_cuda_nan_is_inf():
    x = torch.tensor([0.5, float("nan"), 2.0, -3.0])
    assert ops.sampled_threshold(x.to(DEV), 1, 4, backend="native") == float("inf")
    assert ops.sampled_threshold(x.to(DEV), 2, 4, backend="native") == 3.0


# ------------------------------------------------------------------------------- threshold


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 1000, 2049, 300_001, 10**7])
def test_threshold_cuda_equals_cpu(n, dtype):
    c, g = _both(_data(n, dtype, "special" if n < 10**7 else "scaled", seed=7))
    for thr in [0.0, -1.0, 1e-3, 0.5, 2.0, 1e9, float("inf"), 1e-45, 6e-8]:
        got = ops.threshold_select(g, thr, backend="native")
        _same(got, ops.threshold_select(c, thr, backend="native"))
        assert ops.threshold_count(g, thr, backend="native") == \
            ops.threshold_count(c, thr, backend="native") == got[1].numel()


def test_threshold_cuda_noncontiguous_and_ties():
    x = _data(40_000, torch.bfloat16, "ties", seed=1).view(200, 200)[:, ::2]
    for thr in (0.0, 1.0, 2.0, 3.0, 3.5):
        _same(ops.threshold_select(x.to(DEV), thr, backend="native"),
              ops.threshold_select(x, thr, backend="native"))


# ------------------------------------------------------------------------------- codec


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("k", [0, 1, 5, 1000])
@pytest.mark.parametrize("offset", [0, 3])
def test_pack_cuda_equals_cpu(dtype, idx_dtype, k, offset):
    x = _data(5000, dtype, "special", seed=k)
    v, i = ops.topk(x, k, backend="native")
    i = i.to(idx_dtype)
    size = offset + ops.record_numel(k, dtype, idx_dtype) + 11
    a = torch.full((size,), 9.0, dtype=dtype)
    b = a.to(DEV)
    end_a = ops.pack(v, i, a, offset, backend="native")
    end_b = ops.pack(v.to(DEV), i.to(DEV), b, offset, backend="native")
    assert end_a == end_b
    assert torch.equal(_bits(b.cpu()), _bits(a))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n,k", [(1, 0), (1, 1), (10, 1000), (50_000, 20_000), (10**6, 10**6)])
def test_scatter_add_cuda_equals_cpu(dtype, idx_dtype, n, k):
    g = torch.Generator().manual_seed(n + k)
    dense = _data(n, dtype, "normal", seed=n)
    values = _data(k, dtype, "special", seed=k)
    indices = torch.randint(0, n, (k,), generator=g).to(idx_dtype)  # duplicates included
    a, b = dense.clone(), dense.to(DEV)
    ops.scatter_add(a, values, indices, backend="native")
    ops.scatter_add(b, values.to(DEV), indices.to(DEV), backend="native")
    _same_sum(b, a)


def test_scatter_add_cuda_duplicates_add_in_order():
    # float16 rounding after every add makes the order visible
    vals = torch.tensor([2048.0, 1.0, 1.0, 1.0, -2048.0], dtype=torch.float16)
    idx = torch.tensor([3, 3, 3, 3, 3], dtype=torch.int32)
    a = torch.zeros(4, dtype=torch.float16)
    b = a.to(DEV)
    ops.scatter_add(a, vals, idx, backend="native")
    ops.scatter_add(b, vals.to(DEV), idx.to(DEV), backend="native")
    _same_sum(b, a)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("nchunks", [1, 2, 5])
@pytest.mark.parametrize("off", [0, 3])
def test_scatter_add_chunks_cuda_equals_cpu(dtype, idx_dtype, nchunks, off):
    n, k = 20_000, 700
    g = torch.Generator().manual_seed(nchunks)
    chunk_len = off + ops.record_numel(k, dtype, idx_dtype) + 6
    gathered = torch.zeros(nchunks * chunk_len, dtype=dtype)
    for p in range(nchunks):  # each rank's own top-k: indices overlap across chunks
        x = torch.randn(n, generator=g).to(dtype)
        x[p * 7] = float("inf") if p % 2 else float("nan")
        v, i = ops.topk(x, k, backend="native")
        ops.pack(v, i.to(idx_dtype), gathered[p * chunk_len:(p + 1) * chunk_len], off,
                 backend="native")
    dense = _data(n, dtype, "normal", seed=3)
    a, b = dense.clone(), dense.to(DEV)
    ops.scatter_add_chunks(a, gathered, nchunks, off, k, idx_dtype, backend="native")
    ops.scatter_add_chunks(b, gathered.to(DEV), nchunks, off, k, idx_dtype, backend="native")
    _same_sum(b, a)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_widening_decode_cuda_equals_cpu(dtype, idx_dtype):
    n, k, nchunks, off = 20_000, 700, 3, 3
    g = torch.Generator().manual_seed(11)
    chunk_len = off + ops.record_numel(k, dtype, idx_dtype) + 6
    gathered = torch.zeros(nchunks * chunk_len, dtype=dtype)
    for p in range(nchunks):
        v, i = ops.topk(torch.randn(n, generator=g).to(dtype), k, backend="native")
        ops.pack(v, i.to(idx_dtype), gathered[p * chunk_len:(p + 1) * chunk_len], off,
                 backend="native")
    dense = _data(n, torch.float32, "normal", seed=5)
    a, b = dense.clone(), dense.to(DEV)
    ops.scatter_add_chunks(a, gathered, nchunks, off, k, idx_dtype, backend="native")
    ops.scatter_add_chunks(b, gathered.to(DEV), nchunks, off, k, idx_dtype, backend="native")
    assert torch.equal(b.cpu(), a)


@pytest.mark.parametrize("dtype,acc", DELIVER_KINDS)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("nchunks", [1, 2, 5])
@pytest.mark.parametrize("scale", [1.0, 0.2])
def test_deliver_chunks_cuda_equals_cpu(dtype, acc, idx_dtype, nchunks, scale):
    """Overlapping chunks, sink entries, empty tensors (test_ops.deliver_records); out is
    all zero afterwards on both (checked by test_ops.deliver)."""
    sizes, k, off = DELIVER_SIZES, 700, 3
    gathered, _, out_numel = deliver_records(sizes, k, nchunks, dtype, idx_dtype, off, seed=nchunks)
    args = (gathered, nchunks, off, k, idx_dtype, out_numel, acc, sizes, dtype, scale, "native")
    a, ca = deliver(*args)
    b, cb = deliver(*args, device=DEV)
    for x, y in zip(b, a):
        _same_sum(x, y)
    assert ca == cb == 0


@pytest.mark.parametrize("dtype,acc", DELIVER_KINDS)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_deliver_chunks_cuda_counts_nonfinite_like_cpu(dtype, acc, idx_dtype, scale):
    gathered, sizes, k, nchunks = nonfinite_records(dtype, idx_dtype)
    args = (gathered, nchunks, 0, k, idx_dtype, sum(sizes) + k, acc, sizes, dtype, scale, "native")
    a, ca = deliver(*args, fill=0.0)
    b, cb = deliver(*args, fill=0.0, device=DEV)
    for x, y in zip(b, a):
        _same_sum(x, y)
    assert ca == cb >= 3


def test_deliver_chunks_cuda_many_tensors_large():
    """ResNet-50's 161 tensor sizes at half width: the binary search over many
    bounds, chunks of 250k entries."""
    sizes = resnet50_sizes(width_div=2)
    numel, k, nchunks = sum(sizes), 250_000, 4
    gathered, _, out_numel = deliver_records(sizes, k, nchunks, torch.float16, torch.int32, 0, 9)
    args = (gathered, nchunks, 0, k, torch.int32, out_numel, torch.float32, sizes, torch.float16,
            0.25, "native")
    a, ca = deliver(*args)
    b, cb = deliver(*args, device=DEV)
    for x, y in zip(b, a):
        _same_sum(x, y)
    assert ca == cb == 0 and numel > k


# ------------------------------------------------------------------------------- huge


@pytest.mark.skipif(os.environ.get("SSF_TEST_HUGE") != "1",
                    reason="set SSF_TEST_HUGE=1 (needs ~10 GB host and device memory)")
def test_int64_indices_beyond_2_31():
    n = 2**31 + 4099
    x = torch.zeros(n, dtype=torch.float16)
    pos = torch.tensor([5, 2**31 - 1, 2**31, n - 1])
    x[pos] = torch.tensor([1.0, -2.0, 3.0, float("nan")], dtype=torch.float16)
    g = x.to(DEV)
    got = ops.topk(g, 4, backend="native")
    assert got[1].dtype == torch.int64 and got[1].cpu().tolist() == pos.tolist()
    seg = ops.segmented_topk(g, [0, 2**31, n], [2, 2], backend="native")
    assert seg[1].dtype == torch.int64 and seg[1].cpu().tolist() == pos.tolist()
    sel = ops.threshold_select(g, 0.5, backend="native")
    assert sel[1].cpu().tolist() == pos.tolist()


# ------------------------------------------------------------------ fused error feedback


@pytest.mark.parametrize("gdt,rdt,wdt", [(torch.float32, torch.float32, torch.float32),
                                         (torch.float16, torch.float32, torch.float16),
                                         (torch.bfloat16, torch.float32, torch.bfloat16),
                                         (torch.float32, torch.float32, torch.bfloat16),
                                         (torch.float16, torch.float16, torch.float16),
                                         (torch.bfloat16, torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("kind", ["normal", "ties", "special"])
def test_ef_topk_cuda_equals_cpu(gdt, rdt, wdt, kind):
    """ef_topk and segmented_ef_topk: selections and updated residuals (NaN payloads aside,
    as for scatter-add: the sum is arithmetic). A float32 residual runs the fused kernel
    (the sum formed in the first radix pass), k = 0 and k = n its accumulate-only paths,
    n <= 2^14 the accumulate then the one-block top-k (16,384: four of its chunks)."""
    for n, k in [(0, 0), (100, 0), (100, 100), (1000, 10), (16_384, 164), (300_001, 3_000),
                 (2_000_003, 20_001)]:
        grad = _data(n, gdt, kind, seed=n)
        res = (torch.randn(n, generator=torch.Generator().manual_seed(k)) * 0.3).to(rdt)
        r_cpu, r_gpu = res.clone(), res.to(DEV)
        want = ops.ef_topk(grad, r_cpu, k, wdt, backend="native")
        got = ops.ef_topk(grad.to(DEV), r_gpu, k, wdt, backend="native")
        assert torch.equal(got[1].cpu(), want[1])
        _same_nan(got[0].cpu(), want[0])
        _same_nan(r_gpu.cpu(), r_cpu)
        if gdt == rdt:  # DGC's velocity step (the velocity has the residual's dtype)
            u = torch.randn(n, generator=torch.Generator().manual_seed(n + 1)).to(rdt)
            u_cpu, u_gpu = u.clone(), u.to(DEV)
            want = ops.ef_topk(grad, r_cpu, k, wdt, velocity=u_cpu, momentum=0.9,
                               mask_velocity=True, backend="native")
            got = ops.ef_topk(grad.to(DEV), r_gpu, k, wdt, velocity=u_gpu, momentum=0.9,
                              mask_velocity=True, backend="native")
            assert torch.equal(got[1].cpu(), want[1])
            _same_nan(got[0].cpu(), want[0])
            _same_nan(r_gpu.cpu(), r_cpu)
            _same_nan(u_gpu.cpu(), u_cpu)
    sizes = [5, 0, 70_000, 3, 1_000_000]
    off = torch.tensor([0] + sizes).cumsum(0)
    ks = [1, 0, 700, 3, 10_000]
    grad = _data(int(off[-1]), gdt, kind, seed=1)
    res = torch.zeros(int(off[-1]), dtype=rdt)
    r_gpu = res.to(DEV)
    want = ops.segmented_ef_topk(grad, res, off, ks, wdt, backend="native")
    got = ops.segmented_ef_topk(grad.to(DEV), r_gpu, off, ks, wdt, backend="native")
    assert torch.equal(got[1].cpu(), want[1])
    _same_nan(got[0].cpu(), want[0])
    _same_nan(r_gpu.cpu(), res)
    if gdt == rdt:
        u = torch.randn(int(off[-1]), generator=torch.Generator().manual_seed(2)).to(rdt)
        u_cpu, u_gpu = u.clone(), u.to(DEV)
        want = ops.segmented_ef_topk(grad, res, off, ks, wdt, velocity=u_cpu, momentum=0.5,
                                     mask_velocity=True, backend="native")
        got = ops.segmented_ef_topk(grad.to(DEV), r_gpu, off, ks, wdt, velocity=u_gpu,
                                    momentum=0.5, mask_velocity=True, backend="native")
        assert torch.equal(got[1].cpu(), want[1])
        _same_nan(got[0].cpu(), want[0])
        _same_nan(r_gpu.cpu(), res)
        _same_nan(u_gpu.cpu(), u_cpu)


def _same_nan(a, b):
    """Bit for bit where not NaN; NaN where the other is NaN."""
    assert a.dtype == b.dtype and torch.equal(torch.isnan(a), torch.isnan(b))
    keep = ~torch.isnan(b)
    assert torch.equal(_bits(a[keep]), _bits(b[keep]))


# ------------------------------------------------------- selection by Adam's pending step


@pytest.mark.parametrize("sizes", [[70_001], [16, 15, 17], [0, 5, 0, 3000, 1],
                                   [(i * 37) % 500 for i in range(70)]])  # > one launch's batch
@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("root", [False, True])
def test_step_key_cuda_equals_cpu(sizes, backend, root):
    """ops.ef_step_key and ops.step_denominator on CUDA (the kernel, and the torch
    composition the dispatcher falls back to) against the CPU kernel, itself held to a
    numpy brute force by tests/test_ops_group.py: residual, key and denominator bit for bit
    (NaN where v or the sum is NaN)."""
    from test_ops_group import _step_key_case
    grads, vs, b2s, residual = _step_key_case(sizes, sum(sizes))
    r_cpu, key_cpu, den_cpu = residual.clone(), torch.empty_like(residual), torch.empty_like(residual)
    ops.ef_step_key(grads, r_cpu, vs, b2s, 1e-8, key_cpu, root=root, backend="native")
    ops.step_denominator(vs, b2s, 1e-8, den_cpu, root=root, backend="native")
    r_gpu, key_gpu = residual.to(DEV), torch.empty_like(residual, device=DEV)
    den_gpu = torch.empty_like(residual, device=DEV)
    g_gpu, v_gpu = [x.to(DEV) for x in grads], [v.to(DEV) for v in vs]
    assert ops.ef_step_key(g_gpu, r_gpu, v_gpu, b2s, 1e-8, key_gpu, root=root,
                           backend=backend) is key_gpu
    assert ops.step_denominator(v_gpu, b2s, 1e-8, den_gpu, root=root, backend=backend) is den_gpu
    _same_nan(r_gpu.cpu(), r_cpu)
    _same_nan(key_gpu.cpu(), key_cpu)
    _same_nan(den_gpu.cpu(), den_cpu)


def test_step_key_cuda_rejects_bad_arguments_before_writing():
    from test_ops_group import _step_key_case
    grads, vs, b2s, residual = _step_key_case([300, 40, 1000], 7)
    g, v, r = [x.to(DEV) for x in grads], [x.to(DEV) for x in vs], residual.to(DEV)
    key, before = torch.empty_like(r), r.clone()
    with pytest.raises((ValueError, RuntimeError), match="one of each per tensor"):
        ops.ef_step_key(g, r, v[:2], b2s, 1e-8, key, backend="native")
    with pytest.raises((ValueError, RuntimeError), match="the key must be|tile both"):
        ops.ef_step_key(g, r, v, b2s, 1e-8, key[:10], backend="native")
    with pytest.raises(RuntimeError, match="tile both|device"):
        ops.step_denominator(v, b2s, 1e-8, torch.empty(r.numel()), backend="native")
    assert torch.equal(r, before)
