"""The group budget (ops.group_ef_topk, SparsePart mode "group"): a fusion buffer's k
shared by magnitude, each tensor keeping its floor. The native CPU kernel and the torch
composition bit for bit against a brute-force reference (tests/test_schemes.group_select)
on every dtype combination, input kind, floor and k; the residual and DGC's velocity after
the step; ResidualMemory and SparsePart on top of it."""
import math

import pytest
import torch

from ssfusion_hvd import ops
from ssfusion_hvd.core.buffers import SparsePart
from ssfusion_hvd.sparsify import ResidualMemory, make_sparsifier
from ssfusion_hvd.rules import AdamRule, GradientRule, MomentumRule
from test_ops_feedback import FEEDBACK_DTYPES, KINDS, _bits, _inputs
from test_schemes import group_select

# segment sizes: tiny ones, empty ones, and sizes that take the filtered top-k
LAYOUTS = [[5], [3, 0, 7, 1], [300, 40, 1000], [20_000, 5, 70_001, 256], [1, 1, 1, 1, 1]]


def _case(sizes, share, extra, seed):
    """(offsets, floors, k): floors max(1, ceil(share·k_i)) of k_i = ceil(0.02·n_i) (0 for
    an empty segment), k their k's plus ``extra`` of the room left."""
    ks = [min(n, max(1, math.ceil(0.02 * n))) if n else 0 for n in sizes]
    floors = [min(k, max(1, math.ceil(share * k))) if k else 0 for k in ks]
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    k = sum(ks) + int(extra * (offsets[-1] - sum(ks)))
    return offsets, floors, k


def _expected(acc, sizes, floors, k, wire):
    """What the op must return and leave in the residual: brute force, then the wire error."""
    values, idx = group_select(acc.float(), sizes, k, floors)
    idx = idx.long()
    values = acc[idx]
    left = acc.clone()  # an exact wire leaves zeros (NaN included), else the rounding error
    left[idx] = 0 if wire == acc.dtype else (values.float() - values.to(wire).float()).to(acc.dtype)
    return values, idx, left


@pytest.mark.parametrize("gdt,rdt,wdt", FEEDBACK_DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_group_ef_topk_equals_brute_force(gdt, rdt, wdt, kind):
    for li, sizes in enumerate(LAYOUTS):
        for share, extra in ((0.0, 0.0), (0.25, 0.0), (1.0, 0.0), (0.0, 0.01), (0.5, 1.0)):
            offsets, floors, k = _case(sizes, share, extra, li)
            n = offsets[-1]
            grad = _inputs(n, kind, seed=n + li)
            # one NaN at most: the order of two NaNs is that of their payloads, which
            # widening a 16-bit NaN may set either way (ops.py: NaN above +Inf)
            grad[grad.isnan().nonzero().flatten()[1:]] = float("inf")
            grad = grad.to(gdt)
            res0 = _inputs(n, "normal", seed=n + 7).to(rdt) * 0.5
            acc = res0 + grad.to(rdt)
            want_v, want_i, want_res = _expected(acc, sizes, floors, k, wdt)
            for backend in ("native", "torch"):
                for listed in (False, True):
                    r = res0.clone()
                    g = list(grad.split(sizes)) if listed else grad
                    v, i = ops.group_ef_topk(g, r, offsets, floors, k, wdt, backend=backend)
                    assert torch.equal(i.long(), want_i), (sizes, share, extra, backend, listed)
                    assert torch.equal(_bits(v), _bits(want_v)), (sizes, backend, listed)
                    assert torch.equal(_bits(r), _bits(want_res)), (sizes, backend, listed)
                    # no tensor with a floor goes missing
                    per = torch.bucketize(i.long(), torch.tensor(offsets[1:-1]), right=True)
                    for s, f in enumerate(floors):
                        assert int((per == s).sum()) >= f


@pytest.mark.parametrize("dt", [torch.float32, torch.float16])
@pytest.mark.parametrize("mask", [False, True])
def test_group_ef_topk_with_velocity(dt, mask):
    """DGC's velocity step inside the op: u = m·u + g accumulated, its sent entries cleared
    when masking, floors and the rest alike."""
    sizes = [3000, 17, 900]
    offsets, floors, k = _case(sizes, 0.25, 0.0, 0)
    n = offsets[-1]
    grad = _inputs(n, "normal", seed=1).to(dt)
    u0 = _inputs(n, "normal", seed=2).to(dt)
    res0 = _inputs(n, "normal", seed=3).to(dt)
    u_want = u0.clone().mul_(0.9).add_(grad)
    acc = res0.clone().add_(u_want)
    want_v, want_i, want_res = _expected(acc, sizes, floors, k, dt)
    if mask:
        u_want[want_i] = 0
    for backend in ("native", "torch"):
        u, r = u0.clone(), res0.clone()
        v, i = ops.group_ef_topk(list(grad.split(sizes)), r, offsets, floors, k, dt,
                                 velocity=u, momentum=0.9, mask_velocity=mask, backend=backend)
        assert torch.equal(i.long(), want_i) and torch.equal(v, want_v), backend
        assert torch.equal(r, want_res) and torch.equal(u, u_want), backend


def test_group_ef_topk_rejects_bad_input_before_anything_moves():
    offsets, floors = [0, 10, 30], [2, 3]
    for k, fl in ((4, floors), (31, floors), (5, [11, 0]), (5, [-1, 3])):
        for backend in ("native", "torch"):
            r = torch.ones(30)
            with pytest.raises((ValueError, RuntimeError)):
                ops.group_ef_topk(torch.ones(30), r, offsets, fl, k, backend=backend)
            assert torch.equal(r, torch.ones(30)), (k, fl, backend)


@pytest.mark.parametrize("rule", [GradientRule, lambda: MomentumRule(0.9, masking=True),
                                  lambda: MomentumRule(0.9, nesterov=True), AdamRule])
def test_memory_group_selection_equals_compensate_select_update(rule):
    """ResidualMemory.select_topk with floors and a budget (the fused path, in place and on a
    staged copy) leaves what compensate + the brute-force selection + update leave."""
    sizes = [700, 40, 5000]
    offsets, floors, k = _case(sizes, 0.1, 0.0, 0)
    n = offsets[-1]
    fused, plain = ResidualMemory(rule()), ResidualMemory(rule())
    for step in range(4):
        grad = _inputs(n, "normal", seed=10 + step)
        acc = plain.compensate("g", grad)
        _, idx = group_select(acc, sizes, k, floors)
        want = acc[idx.long()].clone()
        plain.update("g", acc, idx)
        if step % 2 and fused.residuals:  # the in-place path of SparsePart.select_grads
            got = fused.select_topk_tensors("g", list(grad.split(sizes)), k, offsets=offsets,
                                            ks=floors)
            if got is None:  # a rule the kernel cannot take: the staged path
                got = fused.select_topk("g", grad, k, offsets=offsets, ks=floors)
        else:
            got = fused.select_topk("g", grad, k, offsets=offsets, ks=floors)
        assert torch.equal(got[1].long(), idx.long()) and torch.equal(got[0], want), step
        assert torch.equal(fused.residuals["g"], plain.residuals["g"]), step
        for b in fused.rule.buffers:
            assert torch.equal(fused.rule.state["g"][b], plain.rule.state["g"][b]), (step, b)


def test_sparse_part_group_mode():
    """A group part selects the budget (its tensors' k summed) with each tensor at or
    above its floor, reading the gradients in place or staged alike, and reports no
    tensor missing."""
    shapes = [torch.Size([40, 50]), torch.Size([7]), torch.Size([3000])]
    ks = [20, 1, 30]
    floors = [2, 1, 3]

    def part():
        return SparsePart("g0.s", [0, 1, 2], shapes, ks, "group",
                          [make_sparsifier("topk") for _ in ks], 0, torch.float32,
                          torch.device("cpu"), floors=floors)

    a, b = part(), part()
    assert a.capacity == sum(ks)
    ma, mb = ResidualMemory(MomentumRule(0.9)), ResidualMemory(MomentumRule(0.9))
    for step in range(3):
        grads = [_inputs(math.prod(s), "normal", seed=20 + 3 * step + j).view(s)
                 for j, s in enumerate(shapes)]
        ra = a.select_grads(ma, grads)
        b.stage_grads(grads)
        rb = b.select(mb)
        assert torch.equal(ra.indices, rb.indices) and torch.equal(ra.values, rb.values)
        assert ra.values.numel() == sum(ks) and a.missing(ra) == 0
        per = torch.bucketize(ra.indices.long(), torch.tensor(a.bounds[1:-1]), right=True)
        assert all(int((per == s).sum()) >= f for s, f in enumerate(floors))
    with pytest.raises(ValueError):
        SparsePart("x", [0], [torch.Size([5])], [2], "group", [make_sparsifier("topk")], 0,
                   torch.float32, torch.device("cpu"), floors=[3])


@pytest.mark.parametrize("sizes", LAYOUTS)
@pytest.mark.parametrize("share,extra", [(0.0, 0.0), (0.5, 0.01), (1.0, 0.0), (0.0, 0.2)])
def test_keyed_topk_equals_brute_force(sizes, share, extra):
    """ops.keyed_topk, the group budget (and one k, and per-segment ks) over any
    non-negative key, as SparsePart selects the shared Adam rule's pending steps: the same
    positions as the brute force on that key; a key with ties (many equal values and
    zeros) takes the lower index."""
    offsets, floors, k = _case(sizes, share, extra, 0)
    n = offsets[-1]
    g = torch.Generator().manual_seed(n + int(100 * share))
    key = torch.rand(n, generator=g)
    key[torch.randint(0, max(n, 1), (n // 3,), generator=g)] = 0.5  # ties
    key[::5] = 0.0
    got = ops.keyed_topk(key, k, offsets, floors)
    _, want = group_select(key, sizes, k, floors)
    assert got.tolist() == want.tolist()
    ks = [min(s, max(1, math.ceil(0.02 * s))) if s else 0 for s in sizes]
    seg = ops.keyed_topk(key, None, offsets, ks)
    _, ref = ops.segmented_topk(key, offsets, ks, backend="torch")
    assert seg.tolist() == ref.tolist()
    whole = ops.keyed_topk(key, min(k, n))
    assert whole.tolist() == ops.topk(key, min(k, n), backend="torch")[1].tolist()


def _step_key_case(sizes, seed):
    """Per tensor a gradient, Adam's v (some zeros, one NaN and an Inf gradient where the
    layout has room) and a bias correction; a residual with a -0.0 and signed values."""
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, generator=g) for n in sizes]
    vs = [torch.rand(n, generator=g) * 10.0 ** torch.randint(-8, 0, (1,), generator=g).item()
          for n in sizes]
    for s, n in enumerate(sizes):
        if n > 3:
            vs[s][:2] = 0.0
            vs[s][2] = float("nan") if s % 2 else vs[s][2]
            grads[s][3] = float("inf") if s % 3 == 0 else grads[s][3]
    b2s = [math.sqrt(1 - 0.999 ** t) for t in range(1, len(sizes) + 1)]
    residual = torch.randn(sum(sizes), generator=g)
    if residual.numel():
        residual[0] = -0.0
    return grads, vs, b2s, residual


@pytest.mark.parametrize("root", [False, True])
@pytest.mark.parametrize("sizes", LAYOUTS + [[70_001], [16, 15, 17]])
@pytest.mark.parametrize("isa", ["native", "baseline"])
def test_step_key_is_the_rules_denominator(sizes, isa, root, monkeypatch):
    """ops.ef_step_key: the residual's sum and |sum| / (sqrt(v) / bias2_sqrt + eps) per
    element, with ``root`` |sum| / sqrt(sqrt(v) / bias2_sqrt + eps) (the gain's key; and
    ops.step_denominator: the denominator alone), against a numpy brute force (float32,
    each operation rounded once, numpy's correctly rounded square root), bit for bit, NaN
    where v or the sum is: the native kernel (its AVX-512 loop, and the SSE2 one with
    SSF_CPU_ISA=baseline) and the torch composition alike."""
    np = pytest.importorskip("numpy")
    if isa == "baseline":
        monkeypatch.setenv("SSF_CPU_ISA", "baseline")
    grads, vs, b2s, residual = _step_key_case(sizes, sum(sizes))
    eps = 1e-8
    acc = residual.numpy() + np.concatenate([x.numpy() for x in grads])
    den = np.concatenate([np.sqrt(v.numpy()) / np.float32(b) for v, b in zip(vs, b2s)])
    den_want = den + np.float32(eps)
    if root:
        den_want = np.sqrt(den_want)
    want = np.abs(acc) / den_want
    backends = ["torch"] + (["native"] if ops.has_native("ef_step_key", residual) else [])
    for backend in backends:
        r, key = residual.clone(), torch.empty_like(residual)
        out = ops.ef_step_key(grads, r, vs, b2s, eps, key, root=root, backend=backend)
        assert out is key
        assert _bits(r).tolist() == _bits(torch.from_numpy(acc)).tolist(), backend
        assert _bits(key).tolist() == _bits(torch.from_numpy(want)).tolist(), backend
        # the denominator alone (SparDL, ExDyna), rounded alike
        den = torch.empty_like(residual)
        assert ops.step_denominator(vs, b2s, eps, den, root=root, backend=backend) is den
        assert _bits(den).tolist() == _bits(torch.from_numpy(den_want)).tolist(), backend


def test_step_key_takes_what_the_native_kernel_does_not():
    """The torch composition where the kernel does not apply: 0-d bias corrections (a
    device-held step) and 16-bit gradients give the float32 ones' result; bad arguments
    raise before anything is written."""
    grads, vs, b2s, residual = _step_key_case([300, 40, 1000], 7)
    want_r, want = residual.clone(), torch.empty_like(residual)
    ops.ef_step_key(grads, want_r, vs, b2s, 1e-8, want)
    r, key = residual.clone(), torch.empty_like(residual)
    ops.ef_step_key(grads, r, vs, [torch.tensor(b) for b in b2s], 1e-8, key)
    assert torch.equal(_bits(key), _bits(want)) and torch.equal(_bits(r), _bits(want_r))
    half = [x.to(torch.bfloat16) for x in grads]
    r, key = residual.clone(), torch.empty_like(residual)
    ops.ef_step_key(half, r, vs, b2s, 1e-8, key)
    r2 = residual.clone().add_(torch.cat(half).float())
    assert torch.equal(_bits(r), _bits(r2))
    before = residual.clone()
    with pytest.raises(ValueError, match="one of each per tensor"):
        ops.ef_step_key(grads, residual, vs[:2], b2s, 1e-8, key)
    with pytest.raises(ValueError, match="one element count"):
        ops.ef_step_key(grads, residual, [vs[1], vs[0], vs[2]], b2s, 1e-8, key)
    with pytest.raises(ValueError, match="the key must be"):
        ops.ef_step_key(grads, residual, vs, b2s, 1e-8, key[:10])
    assert torch.equal(residual, before)


@pytest.mark.parametrize("root", [False, True])
@pytest.mark.parametrize("mode", ["group", "segmented", "buffer"])
def test_sparse_part_selects_by_step_natively_and_in_torch_alike(mode, root, monkeypatch):
    """SparsePart's selection by the pending step or gain (gradients read where they lie,
    with the native key; staged, with the torch one) over three steps: the same values,
    indices and residuals, and the indices are the brute-force top of |acc| / denominator
    (the gain: its square root) under the part's budget."""
    from ssfusion_hvd.kernels import dispatch
    from ssfusion_hvd.recipe import StepScales

    np = pytest.importorskip("numpy")
    sizes = [300, 40, 1000, 7]
    shapes = [torch.Size([n]) for n in sizes]
    ks = [max(1, n // 20) for n in sizes]
    floors = [1] * len(ks) if mode == "group" else None
    pmode = "group" if mode == "group" else mode
    runs = []
    for native in (True, False):
        if not native:
            monkeypatch.setitem(dispatch._NATIVE, ("ef_step_key", "cpu"), None)
        kk = ks if mode != "buffer" else [sum(ks)]
        part = SparsePart("g", list(range(len(sizes))), shapes, kk, pmode,
                          [make_sparsifier("topk") for _ in kk], 0, torch.float32,
                          torch.device("cpu"), floors=floors)
        grads, vs, b2s, _ = _step_key_case(sizes, 3)
        vs = [v.nan_to_num(0.5) for v in vs]
        part.step_scales = lambda: StepScales(vs, b2s, 1e-8, root)
        memory, got = ResidualMemory(), []
        for step in range(3):
            gs = [x * (step + 1) for x in grads]
            before = memory.residuals.get("g")
            before = torch.zeros(sum(sizes)) if before is None else before.clone()
            res = part.select_grads(memory, gs) if native else (part.stage_grads(gs) or part.select(memory))
            acc = before + torch.cat(gs)
            den = np.concatenate([np.sqrt(v.numpy()) / np.float32(b) for v, b in zip(vs, b2s)])
            den = den + np.float32(1e-8)
            key = torch.from_numpy(np.abs(acc.numpy()) / (np.sqrt(den) if root else den))
            if mode == "group":
                want = group_select(key, sizes, sum(ks), floors)[1]
            elif mode == "segmented":
                want = ops.segmented_topk(key, part._offsets, torch.tensor(ks), backend="torch")[1]
            else:
                want = ops.topk(key, sum(ks), backend="torch")[1]
            assert res.indices.tolist() == want.tolist()
            assert torch.equal(res.values, acc[want.long()])
            got.append((res.values, res.indices, memory.residuals["g"].clone()))
        runs.append(got)
    for (v1, i1, r1), (v2, i2, r2) in zip(*runs):
        assert torch.equal(i1, i2) and torch.equal(_bits(v1), _bits(v2)) and torch.equal(_bits(r1), _bits(r2))
