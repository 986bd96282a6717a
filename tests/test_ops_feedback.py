"""The filtered top-k path and the fused error-feedback selection (ops.ef_topk,
ops.segmented_ef_topk): native kernels bit for bit against the torch fallback and against
the unfused ``residual + grad -> topk -> residual update`` in torch; ResidualMemory's fused
path against its three-call path, for every local rule."""
import os
from pathlib import Path
import subprocess
import sys

import pytest
import torch

from ssfusion_hvd import ops
from ssfusion_hvd.sparsify import ResidualMemory
from ssfusion_hvd.rules import AdamRule, GradientRule, MomentumRule

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _bits(t):
    """Raw bits, NaNs made canonical: a NaN's payload after arithmetic depends on how each
    implementation widened the 16-bit NaN, not on anything the selection decides."""
    t = t.contiguous().clone()
    t[torch.isnan(t)] = float("nan")
    return t.view(torch.uint8)


def _same(a, b):
    assert a[0].dtype == b[0].dtype and a[1].dtype == b[1].dtype
    assert torch.equal(a[1], b[1])
    assert torch.equal(_bits(a[0]), _bits(b[0]))


def _inputs(n, kind, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(n, generator=g)
    if kind == "ties":
        return torch.randint(-3, 4, (n,), generator=g).float()
    if kind == "zeros":  # the k-th magnitude is 0: every element is a candidate
        x = torch.zeros(n)
        x[torch.randperm(n, generator=g)[: n // 500]] = 1.0
        return x
    if kind == "clustered":  # all large values inside one small region: one chunk overflows
        x = torch.randn(n, generator=g) * 1e-3
        lo = n // 3
        x[lo:lo + n // 50] = torch.randn(n // 50, generator=g) * 10  # (empty when n < 50)
        return x
    if kind == "nonfinite":
        x = torch.randn(n, generator=g)
        special = torch.tensor([float("nan"), float("inf"), -float("inf"), float("nan"), 0.0,
                                -0.0, 1e-40])[:n]
        x[torch.randperm(n, generator=g)[:special.numel()]] = special
        return x
    raise ValueError(kind)


KINDS = ["normal", "ties", "zeros", "clustered", "nonfinite"]
# from 256 elements up, k <= n / 16 takes the sampled filter; up to 4096 elements the
# others are resolved whole (bisection over every key), larger ones by the radix select
FILTER_CASES = [(300, 3), (1_000, 10), (4_000, 2_000), (5_000, 1), (20_000, 1), (20_000, 13),
                (65_539, 65), (300_001, 3_000), (300_001, 300), (1_000_003, 10_001),
                (1_000_003, 1_001), (300_001, 30_000)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_filtered_topk_equals_torch(kind, dtype):
    for n, k in FILTER_CASES:
        x = _inputs(n, kind, seed=n + k).to(dtype)
        _same(ops.topk(x, k, backend="native"), ops.topk(x, k, backend="torch"))


def _reference(grad, residual, k, wire, offsets=None, ks=None):
    """The unfused composition in torch: residual + grad -> top-k -> residual update."""
    acc = residual.clone().view(-1)
    acc += grad.reshape(-1).to(acc.dtype)
    if offsets is None:
        v, i = ops.topk(acc, k, backend="torch")
    else:
        v, i = ops.segmented_topk(acc, offsets, ks, backend="torch")
    if wire == acc.dtype:
        acc[i.long()] = 0
    else:
        acc[i.long()] = v - v.to(wire).to(acc.dtype)
    return (v, i), acc


# (gradient dtype, residual dtype, wire dtype): float32 accumulation takes any gradient
FEEDBACK_DTYPES = [(torch.float32, torch.float32, torch.float32),
                   (torch.float16, torch.float32, torch.float16),
                   (torch.bfloat16, torch.float32, torch.bfloat16),
                   (torch.float32, torch.float32, torch.float16),
                   (torch.float16, torch.float16, torch.float16),
                   (torch.bfloat16, torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("gdt,rdt,wdt", FEEDBACK_DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_ef_topk_equals_unfused_torch(gdt, rdt, wdt, kind):
    cases = [(0, 0), (1, 1), (5, 0), (100, 7), (4_097, 4_097)] + FILTER_CASES[:6]
    for n, k in cases:
        grad = _inputs(n, kind, seed=n).to(gdt)
        residual = (torch.randn(n, generator=torch.Generator().manual_seed(k)) * 0.5).to(rdt)
        want, want_res = _reference(grad, residual, k, wdt)
        for backend in ("native", "torch"):
            r = residual.clone()
            got = ops.ef_topk(grad, r, k, wdt, backend=backend)
            _same(got, want)
            assert torch.equal(_bits(r), _bits(want_res)), (backend, n, k)


@pytest.mark.parametrize("gdt,rdt,wdt", FEEDBACK_DTYPES[:3] + FEEDBACK_DTYPES[4:5])
def test_segmented_ef_topk_equals_unfused_torch(gdt, rdt, wdt):
    g = torch.Generator().manual_seed(3)
    sizes = [1, 64, 0, 4_096, 3, 37_000, 128, 1_200_000, 7, 300] * 3
    off = torch.tensor([5] + sizes).cumsum(0)  # elements before the first segment and ...
    n = int(off[-1]) + 11                      # ... after the last: accumulated only
    grad = (torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 2, (n,), generator=g)).to(gdt)
    grad[::997] = 0.5  # ties
    grad[12_345] = float("nan")
    residual = (torch.randn(n, generator=g) * 0.1).to(rdt)
    ks = torch.tensor([min(s, max(1, s // 100)) if s else 0 for s in sizes])
    ks[3] = sizes[3]  # a whole segment
    ks[9] = 0          # a segment that sends nothing
    want, want_res = _reference(grad, residual, None, wdt, off, ks)
    for backend in ("native", "torch"):
        r = residual.clone()
        got = ops.segmented_ef_topk(grad, r, off, ks, wdt, backend=backend)
        _same(got, want)
        assert torch.equal(_bits(r), _bits(want_res)), backend


def _velocity_reference(grad, residual, velocity, m, k, wire, mask, offsets=None, ks=None):
    """The composition the velocity ops fuse: velocity.mul_(m).add_(grad), error feedback of
    the velocity, its sent entries cleared when masking."""
    u = velocity.clone()
    u.mul_(m).add_(grad)
    got, acc = _reference(u, residual, k, wire, offsets, ks)
    if mask:
        u[got[1].long()] = 0
    return got, acc, u


VELOCITY_DTYPES = [(torch.float32, torch.float32), (torch.float32, torch.float16),
                   (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("dt,wdt", VELOCITY_DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_ef_topk_with_velocity_equals_torch(dt, wdt, kind):
    """DGC's momentum step inside the fused op: selections, residual and velocity as torch's
    mul_, add_, error feedback and index_fill_ make them (product and sum rounded apart)."""
    cases = [(0, 0), (100, 0), (100, 100), (1_000, 10), (20_000, 13), (300_001, 3_000),
             (1_000_003, 10_001), (300_001, 30_000)]
    for n, k in cases:
        grad = _inputs(n, kind, seed=n + k).to(dt)
        g = torch.Generator().manual_seed(k)
        residual = (torch.randn(n, generator=g) * 0.5).to(dt)
        velocity = torch.randn(n, generator=g).to(dt)
        for mask in (False, True):
            want, want_res, want_u = _velocity_reference(grad, residual, velocity, 0.9, k, wdt, mask)
            for backend in ("native", "torch"):
                r, u = residual.clone(), velocity.clone()
                got = ops.ef_topk(grad, r, k, wdt, velocity=u, momentum=0.9, mask_velocity=mask,
                                  backend=backend)
                _same(got, want)
                assert torch.equal(_bits(r), _bits(want_res)), (backend, n, k, mask)
                assert torch.equal(_bits(u), _bits(want_u)), (backend, n, k, mask)


@pytest.mark.parametrize("dt,wdt", VELOCITY_DTYPES)
def test_segmented_ef_topk_with_velocity_equals_torch(dt, wdt):
    g = torch.Generator().manual_seed(5)
    sizes = [1, 64, 0, 4_096, 3, 37_000, 128, 1_200_000, 7, 300]
    off = torch.tensor([5] + sizes).cumsum(0)  # elements outside the segments: stepped, kept
    n = int(off[-1]) + 11
    grad = (torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 2, (n,), generator=g)).to(dt)
    grad[12_345] = float("nan")
    residual = (torch.randn(n, generator=g) * 0.1).to(dt)
    velocity = torch.randn(n, generator=g).to(dt)
    ks = torch.tensor([min(s, max(1, s // 100)) if s else 0 for s in sizes])
    ks[3] = sizes[3]
    for mask in (False, True):
        want, want_res, want_u = _velocity_reference(grad, residual, velocity, 0.5, None, wdt,
                                                     mask, off, ks)
        for backend in ("native", "torch"):
            r, u = residual.clone(), velocity.clone()
            got = ops.segmented_ef_topk(grad, r, off, ks, wdt, velocity=u, momentum=0.5,
                                        mask_velocity=mask, backend=backend)
            _same(got, want)
            assert torch.equal(_bits(r), _bits(want_res)), (backend, mask)
            assert torch.equal(_bits(u), _bits(want_u)), (backend, mask)


def test_ef_topk_rejects_bad_velocity_before_anything_moves():
    for backend in ("native", "torch"):
        r2 = torch.zeros(20)
        r, u = r2[:10], torch.ones(10)  # a velocity r2[5:15] overlaps half of this residual
        bad = [(dict(velocity=torch.ones(10, dtype=torch.float16)), "one dtype"),
               (dict(velocity=torch.ones(9)), "must match|elements"),
               (dict(velocity=torch.ones(20)[::2]), "contiguous"),
               (dict(velocity=r), "share"),
               (dict(velocity=r2[5:15]), "share")]
        for kw, msg in bad:
            with pytest.raises((TypeError, ValueError, RuntimeError), match=msg):
                ops.ef_topk(torch.randn(10), r, 2, velocity=kw["velocity"], momentum=0.9,
                            backend=backend)
            assert torch.equal(r, torch.zeros(10)) and torch.equal(u, torch.ones(10))


def test_ef_topk_rejects_bad_input():
    for backend in ("native", "torch"):
        with pytest.raises((TypeError, RuntimeError), match="same dtype"):
            ops.ef_topk(torch.randn(10), torch.zeros(10, dtype=torch.float16), 1, backend=backend)
        with pytest.raises((ValueError, RuntimeError), match="elements|must match"):
            ops.ef_topk(torch.randn(10), torch.zeros(9), 1, backend=backend)
        with pytest.raises((ValueError, RuntimeError), match="out of range"):
            ops.ef_topk(torch.randn(10), torch.zeros(10), 11, backend=backend)
    with pytest.raises(ValueError, match="contiguous"):
        ops.ef_topk(torch.randn(10), torch.zeros(20)[::2], 1)
    with pytest.raises(ValueError, match="offsets"):
        ops.segmented_ef_topk(torch.randn(10), torch.zeros(10), [0, 10], [1, 1])


def test_baseline_isa_filter_equals_torch():
    """The SSE2 filter and resolve loops (what a CPU without AVX-512 runs), on this machine too."""
    code = (
        "import torch\nfrom ssfusion_hvd import ops\n"
        "for n, k in [(20_000, 13), (300_001, 3_000), (1_000_003, 10_001)]:\n"
        "    for dt in (torch.float32, torch.float16, torch.bfloat16):\n"
        "        g = torch.Generator().manual_seed(n)\n"
        "        x = torch.randn(n, generator=g).to(dt)\n"
        "        x[n // 3: n // 3 + n // 50] *= 100\n"
        "        a, b = ops.topk(x, k), ops.topk(x, k, backend='torch')\n"
        "        assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0]), (n, k, dt)\n"
        "        r0 = torch.randn(n, generator=g)\n"
        "        r1, r2 = r0.clone(), r0.clone()\n"
        "        a = ops.ef_topk(x, r1, k, dt)\n"
        "        b = ops.ef_topk(x, r2, k, dt, backend='torch')\n"
        "        assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0]) and torch.equal(r1, r2)\n"
        "        pieces = list(x.split([n // 7, 5, n - n // 7 - 5 - n // 3, n // 3]))\n"
        "        r1 = r0.clone()\n"
        "        a = ops.ef_topk(pieces, r1, k, dt)\n"
        "        assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0]) and torch.equal(r1, r2)\n"
        "from test_ops import tied_at_kth\n"
        "for n in (100_003, 300_001):\n"
        "    x = tied_at_kth(n, n // 100, 37, seed=n)\n"
        "    a, b = ops.topk(x, n // 100), ops.topk(x, n // 100, backend='torch')\n"
        "    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0]), n\n"
        "print('baseline ok')\n")
    env = dict(os.environ, SSF_CPU_ISA="baseline")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "baseline ok" in out.stdout, out.stderr[-3000:]


# ------------------------------------------------------------------ ResidualMemory


def _rules():
    return [GradientRule(), MomentumRule(0.9), MomentumRule(0.9, nesterov=True, masking=True),
            MomentumRule(0.5, dampening=0.1, masking=False), AdamRule(),
            MomentumRule(0.9, masking=False)]


@pytest.mark.parametrize("ri", range(6))
@pytest.mark.parametrize("gdt,acc", [(torch.float32, None), (torch.float16, torch.float32),
                                     (torch.bfloat16, None)])
def test_memory_select_topk_equals_compensate_topk_update(ri, gdt, acc):
    """Three steps of the fused path and of compensate + topk + update: same selections,
    residuals and rule state (velocity, Adam moments, step counts)."""
    fused, plain = ResidualMemory(_rules()[ri], acc), ResidualMemory(_rules()[ri], acc)
    fused.rule.density = plain.rule.density = 0.01
    sizes = [3_000, 40_000, 17]
    off = torch.tensor([0] + sizes).cumsum(0)
    ks = [30, 400, 1]
    g = torch.Generator().manual_seed(ri)
    for step in range(3):
        grad = torch.randn(int(off[-1]), generator=g).to(gdt)
        grad[::101] = -0.0  # signed zeros survive the first step as they do in compensate()
        for key in ("whole", "segments"):
            if key == "whole":
                got = fused.select_topk(key, grad, 500, wire_dtype=gdt)
                a = plain.compensate(key, grad)
                want = ops.topk(a, 500)
            else:
                got = fused.select_topk(key, grad, offsets=off, ks=ks, wire_dtype=gdt)
                a = plain.compensate(key, grad)
                want = ops.segmented_topk(a, off, ks)
            plain.update(key, a, want[1], gdt)
            _same(got, want)
            assert torch.equal(_bits(fused.residuals[key]), _bits(plain.residuals[key])), (step, key)
            for b in fused.rule.buffers:
                assert torch.equal(_bits(fused.rule.state[key][b]),
                                   _bits(plain.rule.state[key][b])), (step, b)
            assert fused.rule.steps.get(key) == plain.rule.steps.get(key)


def test_memory_fused_velocity_from_a_loaded_checkpoint():
    """A velocity loaded from a checkpoint takes the fused path on the first step after it:
    the same selections and state as the unfused path from the same checkpoint."""
    names, shapes = ["a", "b"], [torch.Size([3_000]), torch.Size([40_000])]
    first = ResidualMemory(MomentumRule(0.9))
    first.register("k", names, shapes)
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(43_000, generator=g) for _ in range(4)]
    for grad in grads[:2]:
        first.select_topk("k", grad, 430)
    saved = first.named_state()
    fused, plain = ResidualMemory(MomentumRule(0.9)), ResidualMemory(MomentumRule(0.9))
    for mem in (fused, plain):
        mem.register("k", names, shapes)
        mem.load_named_state(saved, torch.device("cpu"))
        mem.rule.density = 0.01
    assert fused.rule.fused_velocity("k", grads[2]) is not None  # the path under test
    for grad in grads[2:]:
        got = fused.select_topk("k", grad, 430)
        a = plain.compensate("k", grad)
        want = ops.topk(a, 430)
        plain.update("k", a, want[1])
        _same(got, want)
        assert torch.equal(_bits(fused.residuals["k"]), _bits(plain.residuals["k"]))
        assert torch.equal(_bits(fused.rule.state["k"]["momentum_buffer"]),
                           _bits(plain.rule.state["k"]["momentum_buffer"]))
        assert fused.rule.steps["k"] == plain.rule.steps["k"]


def test_memory_fused_velocity_counts_a_step_only_when_the_kernel_ran():
    mem = ResidualMemory(MomentumRule(0.9))
    offsets, ks = [0, 50, 100], [5, 5]
    mem.select_topk("s", torch.randn(100), offsets=offsets, ks=ks)
    mem.select_topk("s", torch.randn(100), offsets=offsets, ks=ks)  # fused from here on
    u = mem.rule.state["s"]["momentum_buffer"].clone()
    for bad in (dict(offsets=[0, 60, 50], ks=[5, 5]),  # offsets decrease
                dict(offsets=offsets, ks=ks, wire_dtype=torch.float64)):
        with pytest.raises((ValueError, TypeError, RuntimeError)):
            mem.select_topk("s", torch.randn(100), **bad)
        assert torch.equal(mem.rule.state["s"]["momentum_buffer"], u)
        assert mem.rule.steps["s"] == 2


def test_memory_select_topk_checks_before_the_rule_moves():
    """A bad call raises before the rule's velocity or step count changes."""
    mem = ResidualMemory(MomentumRule(0.9))
    mem.select_topk("a", torch.randn(100), 5)
    u = mem.rule.state["a"]["momentum_buffer"].clone()
    for bad in (lambda: mem.select_topk("a", torch.randn(100), 101),
                lambda: mem.select_topk("a", torch.randn(100)),
                lambda: mem.select_topk("a", torch.randn(99), 5)):
        with pytest.raises(ValueError):
            bad()
        assert torch.equal(mem.rule.state["a"]["momentum_buffer"], u)
        assert mem.rule.steps["a"] == 1


def _segments_of(sizes):
    off = [0]
    for n in sizes:
        off.append(off[-1] + n)
    return off


def _list_call(grads, r, off, ks, k, wire, **kw):
    """The list form under test: one k over the tensors back to back (ops.ef_topk) when k
    is given, else one top-k per tensor (ops.segmented_ef_topk)."""
    if k is None:
        return ops.segmented_ef_topk(grads, r, off, ks, wire, **kw)
    return ops.ef_topk(grads, r, k, wire, **kw)


# one k over a list of tensors: the sample finds its positions' tensors, the filter runs
# across tensor bounds inside a thread's chunk; k = 0, small shares, a share too large to
# filter (radix select on the formed sums), the whole input
LIST_KS = [None, 0, 1, 1_162, 20_000, 116_226]


@pytest.mark.parametrize("gdt,rdt", [(torch.float32, torch.float32), (torch.float16, torch.float32),
                                     (torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
@pytest.mark.parametrize("velocity", [False, True])
@pytest.mark.parametrize("k", LIST_KS)
def test_ef_topk_of_tensors_equals_the_concatenation(gdt, rdt, velocity, k):
    """The gradient as a list of tensors (read where they lie), one top-k per tensor
    (segmented_ef_topk) or one over all (ef_topk): values, indices, residual and velocity
    bit for bit those of the op on the concatenation, native and torch; a non-contiguous
    tensor, an empty one and tensors shorter than a vector block too."""
    if velocity and gdt != rdt:
        return  # a velocity has the residual's dtype, as the gradient
    sizes = [300, 5_000, 17, 40_000, 1, 0, 70_000, 5, 3, 900]
    off, ks = _segments_of(sizes), [max(1, n // 100) if n else 0 for n in sizes]
    g = torch.Generator().manual_seed(len(sizes))
    grads = [_inputs(n, kind, seed=n).to(gdt) for n, kind in zip(sizes, KINDS + KINDS)]
    grads[3] = torch.randn(100, 400, generator=g).to(gdt).t()  # 40,000, not contiguous
    r0 = torch.randn(off[-1], generator=g).to(rdt)
    v0 = torch.randn(off[-1], generator=g).to(rdt)
    for backend in ("native", "torch"):
        r, rc = r0.clone(), r0.clone()
        kw, kwc = {}, {}
        if velocity:
            kw = dict(velocity=v0.clone(), momentum=0.9, mask_velocity=True)
            kwc = dict(velocity=v0.clone(), momentum=0.9, mask_velocity=True)
        got = _list_call(grads, r, off, ks, k, gdt, backend=backend, **kw)
        want = _list_call(torch.cat([x.reshape(-1) for x in grads]), rc, off, ks, k, gdt,
                          backend="torch", **kwc)
        _same(got, want)
        assert torch.equal(_bits(r), _bits(rc)), backend
        if velocity:
            assert torch.equal(_bits(kw["velocity"]), _bits(kwc["velocity"])), backend


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pieces", [7, 300])
def test_ef_topk_of_many_tensors_equals_torch(kind, pieces):
    """One k over many tensors of uneven sizes (the filtered path, candidates from every
    thread's chunk crossing tensor bounds), against the unfused torch composition, on
    every input kind (ties, every element a candidate, one region overflowing its chunk's
    buffer, NaN/Inf)."""
    n = 300_001
    g = torch.Generator().manual_seed(pieces)
    cuts = sorted(torch.randint(0, n, (pieces - 1,), generator=g).tolist())
    x = _inputs(n, kind, seed=pieces)
    grads = [x[lo:hi] for lo, hi in zip([0] + cuts, cuts + [n])]
    r0 = torch.randn(n, generator=g) * 0.1
    for k in (1, 300, 3_000):
        r, rc = r0.clone(), r0.clone()
        got = ops.ef_topk(grads, r, k, backend="native")
        rc.add_(x)
        want = ops.topk(rc, k, backend="torch")
        rc[want[1].long()] = 0
        _same(got, want)
        assert torch.equal(_bits(r), _bits(rc)), k


def test_ef_topk_of_tensors_rejects_bad_lists():
    r = torch.zeros(30)
    good = [torch.randn(10), torch.randn(20)]
    bad = [([torch.randn(10)], [0, 10, 30], [1, 1], "segments"),  # one tensor, two segments
           ([torch.randn(10), torch.randn(19)], [0, 10, 30], [1, 1], "tile"),
           (good, [0, 10, 29], [1, 1], "tile"),  # do not reach the residual's end
           ([torch.randn(10), torch.randn(20, dtype=torch.float16)], [0, 10, 30], [1, 1], "one dtype"),
           (good, [0, 10, 30], [1, 21], "out of range"),
           ([torch.randn(10), torch.zeros(20, dtype=torch.int32)], [0, 10, 30], [1, 1], "dtype")]
    one_k = [([], "segments"), ([torch.randn(10), torch.randn(19)], "tile"),
             ([torch.randn(10), torch.randn(21)], "tile"),
             ([torch.randn(10), torch.randn(20, dtype=torch.float16)], "one dtype"),
             ([torch.randn(10), torch.zeros(20, dtype=torch.int32)], "dtype")]
    for backend in ("native", "torch"):
        for grads, off, ks, msg in bad:
            with pytest.raises((TypeError, ValueError, RuntimeError), match=msg):
                ops.segmented_ef_topk(grads, r, off, ks, backend=backend)
            assert torch.equal(r, torch.zeros(30))
        for grads, msg in one_k + [(good, "out of range")]:
            with pytest.raises((TypeError, ValueError, RuntimeError), match=msg):
                ops.ef_topk(grads, r, 31 if grads is good else 1, backend=backend)
            assert torch.equal(r, torch.zeros(30))
        with pytest.raises((TypeError, ValueError, RuntimeError), match="share"):
            ops.segmented_ef_topk(good, r, [0, 10, 30], [1, 1], velocity=r, momentum=0.9,
                                  backend=backend)


@pytest.mark.parametrize("ri", range(6))
@pytest.mark.parametrize("gdt,acc", [(torch.float32, None), (torch.float16, torch.float32),
                                     (torch.bfloat16, None)])
@pytest.mark.parametrize("segmented", [True, False])
def test_memory_select_topk_tensors_equals_the_staged_path(ri, gdt, acc, segmented):
    """Four steps of select_topk_tensors (gradients where they lie, where it applies) and of
    select_topk on their concatenation, per tensor or one k over all: same selections,
    residuals and rule state. It applies from the second step (the first creates the
    residual), for the rules the kernel takes inside (plain error feedback; momentum
    without dampening or Nesterov, of the accumulation dtype), and otherwise returns None
    having changed nothing."""
    direct, staged = ResidualMemory(_rules()[ri], acc), ResidualMemory(_rules()[ri], acc)
    direct.rule.density = staged.rule.density = 0.01
    sizes = [3_000, 40_000, 17]
    how = dict(offsets=torch.tensor(_segments_of(sizes)), ks=[30, 400, 1]) if segmented \
        else dict(k=430)
    g = torch.Generator().manual_seed(ri)
    rule = _rules()[ri]
    takes = isinstance(rule, GradientRule) or (
        isinstance(rule, MomentumRule) and not rule.dampening and not rule.nesterov
        and (acc is None or gdt == acc))
    for step in range(4):
        grads = [torch.randn(n, generator=g).to(gdt) for n in sizes]
        flat = torch.cat(grads)
        got = direct.select_topk_tensors("k", grads, wire_dtype=gdt, **how)
        assert (got is not None) == (takes and step > 0), step
        if got is None:
            got = direct.select_topk("k", flat, wire_dtype=gdt, **how)
        want = staged.select_topk("k", flat, wire_dtype=gdt, **how)
        _same(got, want)
        assert torch.equal(_bits(direct.residuals["k"]), _bits(staged.residuals["k"])), step
        for b in direct.rule.buffers:
            assert torch.equal(_bits(direct.rule.state["k"][b]), _bits(staged.rule.state["k"][b]))
        assert direct.rule.steps.get("k") == staged.rule.steps.get("k"), step


@pytest.mark.parametrize("segmented", [True, False])
def test_memory_select_topk_tensors_declines_what_it_cannot_take(segmented):
    """None, with nothing changed, for float64 gradients (the staged path then raises its
    own error) and for tensors of mixed dtypes."""
    mem = ResidualMemory(GradientRule(), torch.float32)
    how = dict(offsets=[0, 10, 30], ks=[1, 2]) if segmented else dict(k=3)
    mem.select_topk("k", torch.randn(30), **how)
    r = mem.residuals["k"].clone()
    for grads in ([torch.randn(10, dtype=torch.float64), torch.randn(20, dtype=torch.float64)],
                  [torch.randn(10), torch.randn(20, dtype=torch.float16)]):
        assert mem.select_topk_tensors("k", grads, **how) is None
        assert torch.equal(mem.residuals["k"], r)
