"""Decode of a group's allgather parts (core/buffers.py) against the decode it replaced,
written here from torch primitives: zero the whole output, add every rank's record, scale
the whole output, copy it into the gradients. The sparse decode now touches the gradients
once and its output only where the records point, so what one step leaves in the output
must never reach the next."""
import math

import pytest
import torch

from ssfusion_hvd import ops
from ssfusion_hvd.core import sparse_part
from ssfusion_hvd.core.buffers import (DensePart, SelectionResult, SparsePart, nonfinite_count,
                                       unpack)
from ssfusion_hvd.sparsify import make_sparsifier


@pytest.fixture(autouse=True)
def direct_decode(monkeypatch):
    """These parts are dense enough (~4 % per rank) that the decode would take the full
    path; the tests below are about the direct one, so it is allowed at any density."""
    monkeypatch.setattr(sparse_part, "DIRECT_MAX_SHARE", 1.0)

SHAPES = [torch.Size([40, 25]), torch.Size([0]), torch.Size([]), torch.Size([7, 3, 5]),
          torch.Size([300])]
KS = [30, 0, 1, 12, 9]
KINDS = [(torch.float32, None), (torch.float16, torch.float32), (torch.bfloat16, torch.float32),
         (torch.float16, None), (torch.bfloat16, None)]  # (gradient dtype, accumulation dtype)
OFFSET = 6  # a dense part's values before the sparse part's record


def _part(dtype, acc, sparsifier="topk", buffer=False):
    """A part of SHAPES: per tensor (segmented for top-k), or with buffer=True one k over
    the whole buffer (multi_tensor's mode)."""
    if buffer:
        return SparsePart("g0.s", range(len(SHAPES)), SHAPES, [sum(KS)], "buffer",
                          [make_sparsifier(sparsifier)], OFFSET, dtype, torch.device("cpu"),
                          acc_dtype=acc)
    sps = [make_sparsifier(sparsifier) for _ in SHAPES]
    mode = "segmented" if sparsifier == "topk" else "per_tensor"
    return SparsePart("g0.s", range(len(SHAPES)), SHAPES, KS, mode, sps, OFFSET, dtype,
                      torch.device("cpu"), acc_dtype=acc)


def _selection(part, g, short):
    """One rank's selection: k distinct positions per tensor (the first `short` entries of
    the last tensor left out, so the record is padded into the sink), random values."""
    vals, idxs = [], []
    for t, (lo, hi) in enumerate(zip(part.bounds, part.bounds[1:])):
        k = part.ks[t] - (short if t == len(SHAPES) - 1 else 0)
        idxs.append(lo + torch.randperm(hi - lo, generator=g)[:k].sort().values)
        vals.append(torch.randn(k, generator=g) * 3)
    return (torch.cat(vals).to(part.dtype),
            torch.cat(idxs).to(part.idx_dtype))


def _gather(part, nranks, seed, nan_at=None):
    """Every rank packs its own selection; returns (gathered, record_len). ``nan_at``:
    (rank, entry) whose value is NaN."""
    g = torch.Generator().manual_seed(seed)
    record_len = OFFSET + part.length
    sends = []
    for r in range(nranks):
        v, i = _selection(part, g, short=r % 3)
        if nan_at is not None and nan_at[0] == r:
            v[nan_at[1]] = float("nan")
        send = torch.full((record_len,), 5.0, dtype=part.dtype)  # the dense part's values
        part.pack(SelectionResult(v, i), send, 1.0)
        sends.append(send)
    return torch.cat(sends), record_len


def _reference(part, gathered, nranks, record_len, postscale):
    """The previous decode, from torch primitives: zeroed output, records added rank by
    rank (index_add_: distinct positions within a record), all of it scaled, then cast
    into fresh gradients."""
    out = torch.zeros(part.numel + part.capacity, dtype=part.acc_dtype)
    for r in range(nranks):
        start = r * record_len + OFFSET
        if part.shared_indices:
            v, i = gathered[start:start + part.capacity], part._sent_indices
        else:
            v, i = ops.unpack(gathered, start, part.capacity, part.idx_dtype)
        out.index_add_(0, i.long(), v.to(part.acc_dtype))
    if postscale != 1.0:
        out.mul_(postscale)
    return [out[lo:hi].view(s).to(part.dtype)
            for lo, hi, s in zip(part.bounds, part.bounds[1:], SHAPES)]


def _grads(dtype, contiguous=True):
    """Stale gradients (the decode must overwrite every element)."""
    if contiguous:
        return [torch.full(s, -9.0, dtype=dtype) for s in SHAPES]
    # 2-D and 3-D gradients in a transposed layout: same shapes, not contiguous
    return [torch.full(s[::-1], -9.0, dtype=dtype).permute(*reversed(range(len(s))))
            if len(s) > 1 else torch.full(s, -9.0, dtype=dtype) for s in SHAPES]


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _assert_same(grads, ref):
    for g, r in zip(grads, ref):
        assert g.shape == r.shape and g.dtype == r.dtype
        nan = torch.isnan(r)
        assert torch.equal(torch.isnan(g), nan)  # NaN payloads aside (ops.deliver_chunks)
        assert torch.equal(_bits(g[~nan]), _bits(r[~nan]))


@pytest.mark.parametrize("dtype,acc", KINDS)
@pytest.mark.parametrize("nranks", [1, 2, 4])
@pytest.mark.parametrize("postscale", [1.0, 0.25])
def test_sparse_decode_twice_equals_the_full_decode(dtype, acc, nranks, postscale):
    """Two consecutive decodes with different records: each equals the full decode of its
    own records, bit for bit (nothing of step 1 leaks into step 2), into the same gradient
    tensors, and leaves the output all zero."""
    part = _part(dtype, acc)
    assert not part.shared_indices and part.capacity == sum(KS)
    grads = _grads(dtype)
    ptrs = [g.data_ptr() for g in grads]
    for step in range(2):
        gathered, record_len = _gather(part, nranks, seed=10 * step + nranks)
        for g in grads:
            g.fill_(-9.0)  # stale values everywhere
        count = unpack(part, gathered, nranks, record_len, grads, postscale)
        _assert_same(grads, _reference(part, gathered, nranks, record_len, postscale))
        assert [g.data_ptr() for g in grads] == ptrs  # written in place
        assert int(_bits(part.out).count_nonzero()) == 0  # +0.0 everywhere, sink included
        assert nonfinite_count(count) == 0 and count.dim() == 0


@pytest.mark.parametrize("dtype,acc", KINDS)
def test_sparse_decode_counts_nonfinite(dtype, acc):
    part = _part(dtype, acc)
    gathered, record_len = _gather(part, 3, seed=1, nan_at=(1, 4))
    grads = _grads(dtype)
    decoded = unpack(part, gathered, 3, record_len, grads, 1 / 3)
    _assert_same(grads, _reference(part, gathered, 3, record_len, 1 / 3))
    assert nonfinite_count(decoded) == 1
    assert sum(int(torch.isnan(g).sum()) for g in grads) == 1


@pytest.mark.parametrize("dtype,acc", KINDS[:3])
def test_sparse_decode_of_non_contiguous_gradients_takes_the_full_path(dtype, acc):
    """Gradients the native op cannot write (transposed layouts) are decoded by the full
    path; a direct decode after it still starts from an all-zero output."""
    part = _part(dtype, acc)
    for step, contiguous in enumerate([False, True, False, True]):
        gathered, record_len = _gather(part, 2, seed=step)
        grads = _grads(dtype, contiguous)
        assert all(g.is_contiguous() for g in grads) == contiguous
        decoded = unpack(part, gathered, 2, record_len, grads, 0.5)
        _assert_same(grads, _reference(part, gathered, 2, record_len, 0.5))
        assert decoded.is_floating_point() != contiguous  # full path: the scaled output
        assert nonfinite_count(decoded) == 0


@pytest.mark.parametrize("dtype,acc", KINDS[:3])
def test_random_k_decode_sums_values_at_own_indices(dtype, acc):
    """random-k parts send values only (shared indices): they keep the full path."""
    part = _part(dtype, acc, sparsifier="randomk")
    assert part.shared_indices
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        v, i = _selection(part, g, short=0)
        record_len = OFFSET + part.length
        gathered = torch.randn(2 * record_len, generator=g).to(dtype)
        for r in range(2):
            part.pack(SelectionResult(gathered[r * record_len + OFFSET:][:v.numel()].clone(), i),
                      gathered[r * record_len:(r + 1) * record_len], 1.0)
        grads = _grads(dtype)
        unpack(part, gathered, 2, record_len, grads, 0.5)
        _assert_same(grads, _reference(part, gathered, 2, record_len, 0.5))


@pytest.mark.parametrize("dtype,acc", KINDS[:3])
def test_dense_part_decode(dtype, acc):
    shapes = [torch.Size([3, 4]), torch.Size([5])]
    part = DensePart([0, 1], shapes, 2, dtype, torch.device("cpu"), acc)
    record_len = 2 + part.length + 3
    gathered = torch.randn(3 * record_len).to(dtype)
    grads = [torch.full(s, -9.0, dtype=dtype) for s in shapes]
    out = unpack(part, gathered, 3, record_len, grads, 1 / 3)
    chunks = gathered.view(3, record_len)[:, 2:2 + part.length]
    want = torch.sum(chunks, dim=0, dtype=acc or dtype).mul_(1 / 3)
    assert torch.equal(out, want)
    assert torch.equal(torch.cat([g.reshape(-1) for g in grads]), want.to(dtype))


@pytest.mark.parametrize("share,direct", [(0.0, False), (1.0, True)])
def test_decode_path_follows_the_touched_share(monkeypatch, share, direct):
    """Records touching more of the output than DIRECT_MAX_SHARE take the full path (the
    output scanned, returned as a float tensor), else the direct one (a 0-d count): the
    same gradients either way."""
    monkeypatch.setattr(sparse_part, "DIRECT_MAX_SHARE", share)
    part = _part(torch.float32, None)
    grads = _grads(torch.float32)
    gathered, record_len = _gather(part, 2, seed=5)
    decoded = unpack(part, gathered, 2, record_len, grads, 0.5)
    _assert_same(grads, _reference(part, gathered, 2, record_len, 0.5))
    assert (decoded.dim() == 0 and not decoded.is_floating_point()) == direct


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_nonfinite_count_is_exact_whatever_the_sum_does(dtype):
    """The count's shortcut (a finite sum means no NaN/Inf) never changes the answer: finite
    tensors whose sum overflows the dtype, or even float32, still count 0; each kind of
    non-finite value, alone and mixed (+Inf beside -Inf sums to NaN), is counted exactly."""
    big = torch.finfo(dtype).max
    cases = {
        "finite": (torch.linspace(-3, 3, 1001).to(dtype), 0),
        # overflows the dtype (and, from bfloat16 up, the float32 accumulator too)
        "sum overflows": (torch.full((64,), big, dtype=dtype), 0),
        "empty": (torch.zeros(0, dtype=dtype), 0),
    }
    for what, values in {"nan": [math.nan], "+inf": [math.inf], "-inf": [-math.inf],
                         "+inf and -inf": [math.inf, -math.inf],
                         "all three": [math.nan, math.inf, -math.inf, math.nan]}.items():
        x = torch.arange(257, dtype=torch.float32).to(dtype)
        x[torch.arange(len(values)) * 31 + 5] = torch.tensor(values, dtype=dtype)
        cases[what] = (x, len(values))
    for what, (x, expected) in cases.items():
        assert nonfinite_count(x) == expected == int((~torch.isfinite(x)).sum()), what


@pytest.mark.parametrize("dtype,acc", KINDS)
@pytest.mark.parametrize("rule", ["gradient", "momentum", "adam"])
@pytest.mark.parametrize("buffer", [False, True])
def test_select_grads_equals_staging_then_select(dtype, acc, rule, buffer):
    """A top-k part, segmented or one k over its buffer, selects from its gradients where
    they lie once its residual exists and the rule is taken inside the kernel (plain error
    feedback; momentum with the gradient in the accumulation dtype): its staging buffer is
    then never written (NaN left in it stays). Otherwise it stages. Either way the
    selections and the residual equal those of stage_grads + select over four steps."""
    from ssfusion_hvd.sparsify import ResidualMemory
    from ssfusion_hvd.rules import AdamRule, GradientRule, MomentumRule
    make_rule = {"gradient": GradientRule, "momentum": lambda: MomentumRule(0.9),
                 "adam": AdamRule}[rule]
    direct, staged = _part(dtype, acc, buffer=buffer), _part(dtype, acc, buffer=buffer)
    mem_d, mem_s = ResidualMemory(make_rule(), acc), ResidualMemory(make_rule(), acc)
    mem_d.rule.density = mem_s.rule.density = 0.01
    in_place = rule == "gradient" or (rule == "momentum" and (acc is None or acc == dtype))
    g = torch.Generator().manual_seed(7)
    for step in range(4):
        grads = [torch.randn(s, generator=g).to(dtype) for s in SHAPES]
        direct.stage.fill_(float("nan"))
        got = direct.select_grads(mem_d, grads)
        assert bool(direct.stage.isnan().all()) == (in_place and step > 0), step
        staged.stage_grads(grads)
        want = staged.select(mem_s)
        assert torch.equal(got.indices, want.indices) and got.per_tensor == want.per_tensor
        assert torch.equal(got.values.view(torch.uint8), want.values.view(torch.uint8))
        assert torch.equal(mem_d.residuals[direct.key].view(torch.uint8),
                           mem_s.residuals[staged.key].view(torch.uint8)), step


@pytest.mark.parametrize("lo,hi", [(0, 0), (0, 31), (3, 3), (3, 9), (5, 6), (6, 20), (11, 31),
                                   (30, 31), (31, 31)])
def test_flat_layout_window_tiles_exactly_the_laid_out_slice(lo, hi):
    from ssfusion_hvd.core.layout import FlatLayout
    shapes = [(2, 3), (0,), (5,), (4, 5)]  # 31 elements, an empty tensor among them
    layout = FlatLayout(shapes)
    tensors = [torch.randn(s) for s in shapes]
    tensors[3] = tensors[3].t().contiguous().t()  # a non-contiguous one: its piece is a copy
    pieces, which = layout.window(tensors, lo, hi)
    flat = layout.gather(tensors)
    assert torch.equal(torch.cat(pieces) if pieces else torch.empty(0), flat[lo:hi])
    assert all(p.numel() for p in pieces)  # no empty piece, not even of the empty tensor
    owners = layout.owner(torch.arange(lo, hi)).tolist()
    assert which == list(dict.fromkeys(owners))
    for piece, i in zip(pieces, which):  # a contiguous tensor's piece is a view, not a copy
        shared = piece.untyped_storage().data_ptr() == tensors[i].untyped_storage().data_ptr()
        assert shared == tensors[i].is_contiguous()


def test_flat_layout_window_outside_raises():
    from ssfusion_hvd.core.layout import FlatLayout
    layout = FlatLayout([(3,), (4,)])
    for lo, hi in ((-1, 2), (2, 1), (0, 8)):
        with pytest.raises(ValueError, match="outside"):
            layout.window([torch.zeros(3), torch.zeros(4)], lo, hi)
