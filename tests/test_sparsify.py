"""Sparsifiers hold their documented density tolerance; error feedback loses nothing."""
import pytest
import torch

from ssfusion_hvd import ops
from ssfusion_hvd.sparsify import SPARSIFIERS, ResidualMemory, make_sparsifier
from ssfusion_hvd.rules import AdamRule, MomentumRule


def _inputs(kind, n, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(n, generator=g)
    if kind == "laplace":
        u = (torch.rand(n, generator=g) - 0.5).clamp(-0.4999, 0.4999)
        return -u.sign() * torch.log1p(-2 * u.abs())
    if kind == "model":  # layers with fixed scales spanning 5 decades, like real gradients
        sizes = [64, 4096, 37_000, 128, 250_000, 512, 100_000, 10]
        scales = 10 ** torch.linspace(-5, 0, len(sizes))[torch.tensor([3, 0, 5, 7, 1, 6, 2, 4])]
        return torch.cat([torch.randn(s, generator=g) * c for s, c in zip(sizes, scales.tolist())])
    raise ValueError(kind)


@pytest.mark.parametrize("name", sorted(SPARSIFIERS))
@pytest.mark.parametrize("kind", ["gaussian", "laplace", "model"])
@pytest.mark.parametrize("density", [0.01, 0.001])
def test_density_within_documented_tolerance(name, kind, density):
    lo, hi = SPARSIFIERS[name].tolerance
    sp = make_sparsifier(name)
    for it in range(6):  # a stationary stream: fresh draws of the same distribution
        x = _inputs(kind, 400_000 if kind != "model" else 0, seed=100 * it + 1)
        k = max(1, round(density * x.numel()))
        v, i = sp.select(x, k)
        assert v.shape == i.shape and i.dtype == torch.int32
        assert i.numel() <= sp.capacity(k)
        assert bool((i[1:] > i[:-1]).all()), "indices must be ascending and distinct"
        assert torch.equal(v, x[i.long()]), "values are the input's, with sign"
        if name == "threshold" and it == 0:
            continue  # first call: no threshold yet (exact k); tolerance applies after
        assert lo * k <= i.numel() <= hi * k, (name, kind, it, i.numel(), k)


@pytest.mark.parametrize("name", ["topk", "redsync", "dgc", "gaussiank", "sidco"])
def test_selection_is_the_largest(name):
    """Magnitude-based methods return a set of the largest magnitudes (their own count)."""
    x = _inputs("laplace", 50_000, seed=3)
    v, i = make_sparsifier(name).select(x, 500)
    ref_v, ref_i = ops.topk(x, i.numel())
    assert torch.equal(i, ref_i)


def test_randomk_indices_shared_across_ranks_and_steps_differ():
    a, b = make_sparsifier("randomk", seed=7), make_sparsifier("randomk", seed=7)
    x, y = torch.randn(1000), torch.randn(1000)  # different data on the two "ranks"
    i1, i2 = a.select(x, 50)[1], b.select(y, 50)[1]
    assert torch.equal(i1, i2)
    assert not torch.equal(a.select(x, 50)[1], i1)  # next step draws afresh
    assert SPARSIFIERS["randomk"].shared_indices


def test_threshold_scaling_follows_algorithm_5():
    sp = make_sparsifier("threshold", beta=1.2, gamma=0.1)
    assert sp.scale_factor(2.0) == pytest.approx(1.1)
    assert sp.scale_factor(0.5) == pytest.approx(0.9)
    assert sp.scale_factor(1.1) == pytest.approx(1.025)
    assert sp.scale_factor(0.9) == pytest.approx(0.975)
    assert sp.scale_factor(1.0) == 1.0


def test_threshold_tracks_density_on_stationary_stream():
    sp = make_sparsifier("threshold")
    counts = []
    for it in range(60):
        x = _inputs("laplace", 100_000, seed=it)
        counts.append(sp.select(x, 1000)[1].numel())
    mean_late = sum(counts[20:]) / len(counts[20:])
    assert 0.8 * 1000 <= mean_late <= 1.2 * 1000, counts


@pytest.mark.parametrize("name", sorted(SPARSIFIERS))
def test_state_roundtrip(name):
    a = make_sparsifier(name)
    x = torch.randn(10_000)
    a.select(x, 100)
    b = make_sparsifier(name)
    b.load_state_dict(a.state_dict())
    y = torch.randn(10_000)
    assert all(torch.equal(p, q) for p, q in zip(a.select(y, 100), b.select(y, 100)))


def test_dgc_samples_alike_across_ranks_and_steps_differ():
    """Two "ranks" with the same base seed sample the same positions at every step, whatever
    their data; consecutive steps sample different positions."""
    a, b = make_sparsifier("dgc", seed=7), make_sparsifier("dgc", seed=7)
    n, samples, seeds = 100_000, 2048, []
    for step in range(4):
        assert a.sample_seed() == b.sample_seed()
        seeds.append(a.sample_seed())
        a.select(torch.randn(n), 100)
        b.select(torch.randn(n) * 5, 100)
    assert a.calls == b.calls == 4
    assert len(set(seeds)) == 4
    pos = [ops.sample_positions(n, samples, s) for s in seeds]
    assert all(not torch.equal(p, q) for p, q in zip(pos, pos[1:]))
    assert make_sparsifier("dgc", seed=8).sample_seed() != seeds[0]  # the base seed counts


def test_dgc_state_roundtrip_reproduces_the_sample_sequence():
    """A resumed instance continues the call counter, so it draws the very samples (and
    selections) the original draws; a fresh one (counter 0) does not. A coarse sample
    (64 elements) and no overshoot make the selection depend on the sample: when the
    estimate lands above the k-th magnitude fewer than k elements are selected."""
    opts = dict(sample_fraction=0.0, min_samples=64, min_hits=0, overshoot=1.0, seed=3)
    xs = [torch.randn(50_000, generator=torch.Generator().manual_seed(s)) for s in range(8)]
    a = make_sparsifier("dgc", **opts)
    for x in xs[:3]:
        a.select(x, 500)
    state = a.state_dict()
    assert state == {"seed": 3, "calls": 3}
    b, fresh = make_sparsifier("dgc", **opts), make_sparsifier("dgc", **opts)
    b.load_state_dict(dict(state))
    ours, resumed, restarted = ([s.select(x, 500) for x in xs[3:]] for s in (a, b, fresh))
    for (v, i), (w, j) in zip(ours, resumed):
        assert torch.equal(i, j) and torch.equal(v, w)
    assert b.state_dict() == a.state_dict() == {"seed": 3, "calls": 8}
    assert len({i.numel() for _, i in ours}) > 1  # the counts follow the samples
    assert any(not torch.equal(i, j) for (_, i), (_, j) in zip(ours, restarted))
    fresh.load_state_dict({})  # a checkpoint from before DGC had state: counter from 0
    assert fresh.calls == 0 and fresh.seed == 3


@pytest.mark.parametrize("name", sorted(SPARSIFIERS))
def test_nonfinite_gradients_are_selected_not_dropped(name):
    x = torch.randn(20_000)
    x[123], x[4567], x[9999] = float("nan"), float("inf"), -float("inf")
    v, i = make_sparsifier(name).select(x, 200)
    if not SPARSIFIERS[name].shared_indices:  # random-k picks positions blindly by design
        assert {123, 4567, 9999} <= set(i.tolist())
    assert torch.equal(v.isnan(), x[i.long()].isnan())


def test_bad_requests():
    with pytest.raises(ValueError, match="unknown sparsifier"):
        make_sparsifier("nope")
    for name in SPARSIFIERS:
        with pytest.raises(ValueError, match="cannot select"):
            make_sparsifier(name).select(torch.randn(10), 11)


# ------------------------------------------------------------------ error feedback


def _dense(values, indices, n, dtype):
    out = torch.zeros(n, dtype=dtype)
    out[indices.long()] = values
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["topk", "dgc", "randomk", "threshold"])
def test_error_feedback_is_exact(dtype, name):
    """sent + new residual == gradient + old residual, bit for bit, every step."""
    mem, sp = ResidualMemory(), make_sparsifier(name)
    old = torch.zeros(5000, dtype=dtype)
    for step in range(5):
        grad = torch.randn(5000, generator=torch.Generator().manual_seed(step)).to(dtype)
        expected = grad + old  # the same single rounding
        acc = mem.compensate("w", grad)
        v, i = sp.select(acc, 50)
        sent = _dense(v, i, 5000, dtype)
        mem.update("w", acc, i)
        new = mem.residuals["w"]
        assert torch.equal((sent + new).view(torch.uint8), expected.view(torch.uint8))
        assert torch.equal(new[i.long()], torch.zeros(i.numel(), dtype=dtype))
        old = new.clone()


def test_momentum_correction_masks_velocity():
    mem = ResidualMemory(MomentumRule(0.9, masking=True))
    g = torch.tensor([1.0, 2.0, 3.0, 4.0])
    acc = mem.compensate("w", g)  # u = g, acc = u
    assert torch.equal(acc, g)
    mem.update("w", acc, torch.tensor([3], dtype=torch.int32))
    assert mem.rule.state["w"]["momentum_buffer"].tolist() == [1.0, 2.0, 3.0, 0.0]
    acc = mem.compensate("w", g)  # u = 0.9 u + g; acc = residual + u
    u = torch.tensor([1.9, 3.8, 5.7, 4.0])
    assert torch.allclose(mem.rule.state["w"]["momentum_buffer"], u)
    assert torch.allclose(acc, torch.tensor([1.0, 2.0, 3.0, 0.0]) + u)


@pytest.mark.parametrize("nesterov,dampening", [(False, 0.0), (True, 0.0), (False, 0.1)])
def test_momentum_rule_at_full_density_is_sgd_momentum(nesterov, dampening):
    """Sending everything every step, the corrected update equals torch.optim.SGD's
    momentum update step for step (masking only matters for what stays behind)."""
    torch.manual_seed(0)
    w_ref = torch.randn(50, requires_grad=True)
    w = w_ref.detach().clone()
    ref = torch.optim.SGD([w_ref], lr=0.1, momentum=0.9, dampening=dampening, nesterov=nesterov)
    rule = MomentumRule(0.9, dampening=dampening, nesterov=nesterov)
    rule.mask = lambda key, idx: None  # full density: factor masking is a no-op by design
    mem = ResidualMemory(rule)
    for step in range(6):
        g = torch.randn(50)
        w_ref.grad = g.clone()
        ref.step()
        acc = mem.compensate("w", g)
        w -= 0.1 * acc  # everything is sent (update() then takes acc over as the residual)
        mem.update("w", acc, torch.arange(50))
        assert not mem.residuals["w"].any()
        torch.testing.assert_close(w, w_ref.detach(), rtol=1e-6, atol=1e-6)


def test_adam_rule_is_adam_on_one_rank_at_full_density_without_masking():
    """What holds: one rank, every element sent, masking off. It does not hold on P ranks
    (each rank's update is preconditioned by its own second moment, noise included:
    0.52x Adam's norm at P = 4, ``scripts/recipe_ablation.py --adam-limit 4``) nor with the
    default masking, which clears the first moment wherever an element is sent
    (docs/recipe.md, section 1)."""
    torch.manual_seed(0)
    w_ref = torch.randn(40, requires_grad=True)
    w = w_ref.detach().clone()
    ref = torch.optim.Adam([w_ref], lr=0.01, betas=(0.8, 0.99), eps=1e-6)
    rule = AdamRule((0.8, 0.99), 1e-6)
    rule.mask = lambda key, idx: None
    mem = ResidualMemory(rule)
    for step in range(6):
        g = torch.randn(40)
        w_ref.grad = g.clone()
        ref.step()
        acc = mem.compensate("w", g)
        w -= 0.01 * acc
        mem.update("w", acc, torch.arange(40))
        torch.testing.assert_close(w, w_ref.detach(), rtol=1e-5, atol=1e-6)
    assert mem.rule.steps["w"] == 6


def test_adam_rule_masks_first_moment_only():
    mem = ResidualMemory(AdamRule(masking=True))
    acc = mem.compensate("w", torch.tensor([1.0, -2.0, 3.0]))
    mem.update("w", acc, torch.tensor([1]))
    st = mem.rule.state["w"]
    assert st["exp_avg"][1] == 0 and st["exp_avg"][0] != 0
    assert bool((st["exp_avg_sq"] > 0).all())


def test_fp32_accumulation_keeps_the_wire_rounding_in_the_residual():
    """float16 gradients, float32 memory: the residual holds what float16 could not send
    and what stayed behind; sent (as float16) + residual == residual + grad in float32."""
    mem = ResidualMemory(dtype=torch.float32)
    old = torch.zeros(3000)
    for step in range(4):
        g = (torch.randn(3000, generator=torch.Generator().manual_seed(step)) * 1e-4).half()
        acc = mem.compensate("w", g)
        assert acc.dtype == torch.float32
        want = old + g.float()
        assert torch.equal(acc, want)
        v, i = make_sparsifier("topk").select(acc, 30)
        sent = torch.zeros(3000)
        sent[i.long()] = v.half().float()
        mem.update("w", acc, i, torch.float16)
        new = mem.residuals["w"]
        torch.testing.assert_close(sent + new, want, rtol=0, atol=1e-12)
        old = new.clone()
    # a small gradient next to a large residual: lost in a float16 residual, kept in float32
    for dtype, expect in ((torch.float32, 1.0 + 5 * float(torch.tensor(1e-4).half())),
                          (None, 1.0)):
        mem2 = ResidualMemory(dtype=dtype)
        nothing = torch.tensor([], dtype=torch.int64)
        mem2.update("x", mem2.compensate("x", torch.ones(4).half()), nothing)
        for _ in range(5):
            mem2.update("x", mem2.compensate("x", torch.full((4,), 1e-4).half()), nothing)
        assert float(mem2.residuals["x"][0]) == pytest.approx(expect, rel=1e-6), dtype


def test_auto_masking_follows_the_density_in_force():
    """"auto": masking only while an element waits longer than the momentum's horizon."""
    rule = MomentumRule(0.9)
    mem = ResidualMemory(rule)
    for density, masked in ((0.25, False), (0.11, False), (0.05, True), (0.01, True)):
        rule.density = density
        acc = mem.compensate("w", torch.ones(4))
        mem.update("w", acc, torch.tensor([0]))
        assert (rule.state["w"]["momentum_buffer"][0] == 0) == masked, density
    assert not MomentumRule(0.9, masking=False).masks(0.9)
    adam = ResidualMemory(AdamRule(masking="auto"))  # Adam: "auto" masks at every density
    adam.rule.density = 0.25
    adam.update("w", adam.compensate("w", torch.ones(4)), torch.tensor([0]))
    assert adam.rule.state["w"]["exp_avg"][0] == 0


def test_memory_named_state_roundtrip_and_mismatch():
    mem = ResidualMemory(MomentumRule(0.5, masking=True))
    mem.register("g0", ["a", "b"], [(4,), (2, 3)])
    acc = mem.compensate("g0", torch.randn(10))
    mem.update("g0", acc, torch.tensor([1, 2]))
    state = mem.named_state()
    assert set(state["residuals"]) == {"a", "b"} and state["residuals"]["b"].shape == (2, 3)
    assert set(state["momentum_buffer"]) == {"a", "b"} and state["steps"] == {"a": 1, "b": 1}
    other = ResidualMemory(MomentumRule(0.5))
    other.register("x", ["a"], [(4,)])  # another grouping of the same tensors
    other.register("y", ["b"], [(6,)])
    other.load_named_state(state, torch.device("cpu"))
    assert torch.equal(other.residuals["x"], mem.residuals["g0"][:4])
    assert torch.equal(other.rule.state["y"]["momentum_buffer"],
                       mem.rule.state["g0"]["momentum_buffer"][4:])
    with pytest.raises(ValueError, match="residual"):
        other.compensate("x", torch.randn(11))
    partial = {"residuals": {"a": torch.zeros(4)}}
    third = ResidualMemory()
    third.register("g0", ["a", "b"], [(4,), (6,)])
    with pytest.raises(ValueError, match="no residuals for"):
        third.load_named_state(partial, torch.device("cpu"))
    with pytest.raises(ValueError, match="accumulates"):
        ResidualMemory().load_named_state(state, torch.device("cpu"))
    with pytest.raises(ValueError, match="momentum"):
        MomentumRule(1.0)
