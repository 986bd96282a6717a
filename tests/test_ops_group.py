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
