"""Each sender's spread on the wire (``scheme_options["spread"]``, Adam's default under
shared moments; docs/recipe.md, "The senders' variance"), piece by piece in one process:

* the one-byte code of a spread, and the float16 share of a noise ratio (SparDL, ExDyna);
* the spread a rank's memory computes per sent element (its gradient's variance over the
  steps the element waited, over the value squared), through an undone step, a
  checkpoint and a loss scale's change;
* the decode's noise ratio ``P · mean_r(σ_r²) / (Σ_r v_r)²`` against one written from the
  records in float64, for every part mode, wire dtype, both decode paths, with and
  without the waits beside it; the gradients and the waits' shares bit for bit those of
  the same part without spreads;
* the shared Adam step given the noise: its second moment takes the senders' variance
  over P at the arrival's gain, the rest of the step as without.

``tests/test_moments.py`` runs the whole of it on Horovod workers against a reference.
"""
import pytest
import torch

from ssfusion_hvd.core import sparse_part
from ssfusion_hvd.core.buffers import SelectionResult, SparsePart, fresh_table, unpack
from ssfusion_hvd.core.wire import (SPREAD_MAX, SPREAD_MIN, code_spreads, noise_ratio,
                                   noise_shares, share_max, spread_codes)
from ssfusion_hvd.moments import SHARE_ROWS, SharedMoments
from ssfusion_hvd.sparsify import ResidualMemory, make_sparsifier

BETAS = (0.8, 0.95)
ADAM = ("adam", {"betas": BETAS, "eps": 1e-8})
SHAPES = [torch.Size([30, 20]), torch.Size([1]), torch.Size([5, 7]), torch.Size([200])]
KS = [24, 1, 6, 10]
OFFSET = 3  # a dense part's values before the sparse part


def test_spread_codes_are_within_7_percent_zero_below_and_saturate_above():
    s = torch.logspace(-9, 8, 20001, dtype=torch.float64)
    back = code_spreads()[spread_codes(s).long()]
    inside = s >= SPREAD_MIN
    assert float(((back - s) / s)[inside & (s <= SPREAD_MAX)].abs().max()) < 0.072
    codes = spread_codes(s)
    assert bool((codes[1:].long() >= codes[:-1].long()).all())  # monotone
    assert int(codes[s > 2 * SPREAD_MAX].min()) == 255  # saturates
    edge = torch.tensor([0.0, SPREAD_MIN / 4, float("nan"), -1.0])
    assert spread_codes(edge).tolist() == [0, 0, 0, 0]  # nothing to add
    assert code_spreads()[0] == 0


def test_noise_shares_carry_the_summed_variance_in_16_bits_whatever_the_wait():
    """Each rank's share ``scale² σ_r² / against`` in float16, ``against`` the value's rate
    per step squared: the shares' float16 sum, turned back by ``noise_ratio``, is the
    summed variance within float16's rounding plus P·2^-23 of the rate squared, for
    elements that waited 1 to 10^5 steps (a value = wait · rate), 2 to 1024 ranks and a
    loss scale of 1 or 2^16 on the wire; against the value squared (the first form) a
    long wait's share fell below float16's normals. 0 where ``against`` is 0, NaN or
    negative variances."""
    torch.manual_seed(0)
    n = 4000
    for nranks in (2, 8, 1024):
        for wait in (1, 1000, 100_000):
            for loss_scale in (1.0, 2.0 ** 16):
                rate = torch.randn(n, dtype=torch.float64) * 1e-3 * loss_scale
                value = rate * wait  # the synchronized sum of ``wait`` steps
                rel = torch.logspace(-4, 1, n, dtype=torch.float64)  # summed noise / rate²
                var_r = rel * rate.square() * nranks  # so that scale²·P·var_r = rel·rate²
                against = (value.float() / wait).square()
                shares = noise_shares(var_r.float(), against, 1.0 / nranks, nranks)
                assert shares.dtype == torch.float16
                summed = (shares.float() * nranks).half()  # P equal shares: one exact multiply
                got = noise_ratio(summed, against, value.float()).double() * value.square()
                want = rel * rate.square()
                # float16's rounding of a share and of the sum (2^-11 each), and its
                # subnormals (steps of 2^-24 per share): at most P·2^-24 of the rate²
                bound = 2 ** -9 * want + nranks * 2 ** -23 * rate.square()
                assert bool(((got - want).abs() <= bound).all()), (nranks, wait, loss_scale)
                # against the value squared the same shares are rel / (P·wait²): tiny
                if wait >= 1000 and nranks >= 8:
                    old = (rel / nranks / wait ** 2).float().half()
                    assert bool((old.float() < 2 ** -14).all())  # subnormal or 0: bits lost
    # a zero ``against``, NaN, a negative variance: no noise; noise far above it saturates
    edge = noise_shares(torch.tensor([1.0, float("nan"), -1.0, 1e30, 1e-1]),
                        torch.tensor([0.0, 1.0, 1.0, 1.0, 1e-6]), 1.0, nranks=4)
    assert edge.tolist() == [0.0, 0.0, 0.0, share_max(4), share_max(4)]
    back = noise_ratio(torch.tensor([1.0, 2.0, float("inf")]).half(), torch.ones(3),
                       torch.tensor([0.0, 1e-30, 1.0]))
    assert back.tolist() == [0.0, 0.0, 0.0]  # a value of 0, or one whose square underflows


@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 10, 64, 257, 2048])
def test_saturated_shares_sum_to_a_finite_float16_in_any_order(nranks):
    """P shares at the clamp, summed in float16 one by one (a ring's hops) or pairwise (a
    tree's), stay finite: a clamp at 65504 / P did not (3 ranks: 21840 each, rounded up;
    10 ranks one by one: the partial sums round up to inf)."""
    top = noise_shares(torch.tensor([1e30]), torch.tensor([1.0]), 1.0, nranks)
    assert float(top) == share_max(nranks) > 0.9 * 65504 / nranks / (1 + 2 ** -11) ** nranks
    ring = torch.zeros(1, dtype=torch.float16)
    for _ in range(nranks):
        ring = (ring.float() + top.float()).half()
    tree = top.repeat(nranks)
    while tree.numel() > 1:
        tree = torch.cat([tree, torch.zeros(tree.numel() % 2, dtype=torch.float16)])
        tree = (tree[0::2].float() + tree[1::2].float()).half()
    assert bool(torch.isfinite(ring).all()) and bool(torch.isfinite(tree).all())


def test_sent_spreads_are_each_elements_variance_over_its_wait():
    """Per element, the gradients since this rank last sent it, replayed: the spread of a
    sent element is their variance over their sum squared; undone steps, a checkpoint and
    a loss scale's change keep that."""
    g = torch.Generator().manual_seed(3)
    names, shapes = ["a", "b"], [torch.Size([8]), torch.Size([4])]
    mem = ResidualMemory()
    mem.register("g0.s", names, shapes)
    history = [[] for _ in range(12)]  # per element, its gradients since its last send

    def step(k=3, scale=1.0):
        grads = [torch.randn(s, generator=g) * scale for s in shapes]
        flat = torch.cat([x.reshape(-1) for x in grads])
        mem.add_squares("g0.s", grads)
        values, idx = mem.select_topk("g0.s", flat, k)
        waits = mem.sent_waits("g0.s", idx)
        return flat, values, idx, waits, mem.sent_spreads("g0.s", idx, values, waits)

    def check(flat, values, idx, waits, spreads, scale=1.0):
        for e, x in enumerate(flat.tolist()):
            history[e].append(x / scale)
        for j, e in enumerate(idx.tolist()):
            h = torch.tensor(history[e], dtype=torch.float64)
            assert int(waits[j]) == len(h)
            want = (h.var(unbiased=False) / h.sum() ** 2) if len(h) > 1 else 0.0
            assert abs(float(values[j]) / scale - float(h.sum())) < 1e-5
            torch.testing.assert_close(float(spreads[j]), float(want), rtol=1e-4, atol=1e-6)
            history[e] = []

    for _ in range(4):
        check(*step())
    mem.checkpoint()
    step()  # undone: as if it never happened
    mem.restore()
    check(*step())
    saved = mem.named_state()
    assert set(saved["squares"]) == set(names)
    fresh = ResidualMemory()
    fresh.register("g0.s", names, shapes)
    fresh.load_named_state(saved, torch.device("cpu"))
    mem = fresh
    check(*step())
    mem.rescale(8.0)  # a loss scale: every gradient so far 8 times what it was
    for _ in range(3):
        check(*step(scale=8.0), scale=8.0)


def _part(mode, dtype, acc, waits, spread):
    dev = torch.device("cpu")
    rows = SHARE_ROWS["adam"] if waits else 0
    if mode == "buffer":
        part = SparsePart("g0.s", range(len(SHAPES)), SHAPES, [sum(KS)], "buffer",
                          [make_sparsifier("topk")], OFFSET, dtype, dev, acc_dtype=acc,
                          waits=rows, spread=spread)
    else:
        sps = [make_sparsifier("topk" if mode != "per_tensor" else "dgc",
                               **({} if mode != "per_tensor" else {"seed": 3})) for _ in SHAPES]
        part = SparsePart("g0.s", range(len(SHAPES)), SHAPES, KS, mode, sps, OFFSET, dtype, dev,
                          acc_dtype=acc, floors=[1] * len(SHAPES) if mode == "group" else None,
                          waits=rows, spread=spread)
    if waits:
        part.fresh = fresh_table(*ADAM, "cpu")
    return part


def _records(part, nranks, seed):
    """Every rank's selection (some short of capacity: they pad into the sink; position 7
    sent by every rank and summing to exactly 0 on two or more), waits and spreads (some
    0, some past the codes' range)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(nranks):
        k = part.capacity - r % 2
        idx = torch.randperm(part.numel, generator=g)[:k]
        if not bool((idx == 7).any()):
            idx[0] = 7
        vals = torch.randn(idx.numel(), generator=g).to(part.dtype)
        vals[idx == 7] = [1.5, -1.5, 0.0][min(r, 2)]
        waits = torch.randint(1, 40, (idx.numel(),), generator=g, dtype=torch.int32)
        spreads = torch.rand(idx.numel(), generator=g) * 10 ** torch.randint(-12, 8, (idx.numel(),),
                                                                            generator=g)
        spreads[1] = 0.0
        out.append((vals, idx.to(part.idx_dtype), waits, spreads))
    return out


def _decode(part, records, monkeypatch, direct):
    monkeypatch.setattr(sparse_part, "DIRECT_MAX_SHARE", 1.0 if direct else 0.0)
    record_len = OFFSET + part.length
    sends = []
    for vals, idx, waits, spreads in records:
        send = torch.full((record_len,), 2.0, dtype=part.dtype)
        part.pack(SelectionResult(vals, idx, waits=waits if part.waits else None,
                                  spreads=spreads if part.spread else None), send, 1.0)
        sends.append(send)
    grads = [torch.full(s, -9.0, dtype=part.dtype) for s in SHAPES]
    unpack(part, torch.cat(sends), len(records), record_len, grads, 0.5)
    return grads


def _expected_noise(part, records):
    """``P · mean_r(spread_r · v_r²) / (Σ_r v_r)²`` in float64 over the senders at each
    position, the sum as the decode's output holds it (its accumulation dtype)."""
    var = torch.zeros(part.numel, dtype=torch.float64)
    count = torch.zeros(part.numel, dtype=torch.float64)
    den = torch.zeros(part.numel, dtype=part.acc_dtype)
    for vals, idx, _, spreads in records:
        s = code_spreads()[spread_codes(spreads).long()]
        var.index_add_(0, idx.long(), s * vals.double() ** 2)
        count.index_add_(0, idx.long(), torch.ones(idx.numel(), dtype=torch.float64))
        den.index_add_(0, idx.long(), vals.to(part.acc_dtype))
    den = den.double()
    want = len(records) * var / count.clamp(min=1) / den ** 2
    return torch.where((den != 0) & (count > 0), want, torch.zeros_like(want)), count > 0, den


@pytest.mark.parametrize("mode", ["segmented", "group", "buffer", "per_tensor"])
@pytest.mark.parametrize("dtype,acc", [(torch.float32, None), (torch.bfloat16, torch.float32),
                                       (torch.float16, None)])
@pytest.mark.parametrize("nranks", [1, 3])
@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("waits", [False, True])
def test_decode_noise_is_the_senders_mean_variance_over_p(mode, dtype, acc, nranks, direct,
                                                          waits, monkeypatch):
    part = _part(mode, dtype, acc, waits, spread=True)
    plain = _part(mode, dtype, acc, waits, spread=False)
    assert part.spread and part.length > plain.length
    for step in range(2):  # the second decode must not see the first one's positions
        records = _records(part, nranks, seed=100 * step + nranks)
        grads = _decode(part, records, monkeypatch, direct)
        for g, ref in zip(grads, _decode(plain, records, monkeypatch, direct)):
            assert torch.equal(g.view(torch.uint8), ref.view(torch.uint8))  # same gradients
        if waits:  # and the same shares: the spreads' bytes come after the waits'
            assert torch.equal(part.share, plain.share)
        want, touched, den = _expected_noise(part, records)
        got = part.noise[0, :part.numel].double()
        well = touched & (den.abs() > 1e-3)  # (a near-cancelling sum: ill-conditioned)
        torch.testing.assert_close(got[well], want[well], rtol=2e-5, atol=1e-12)
        assert bool(got[well & (want > 0)].gt(0).all())
        if nranks > 1:
            assert den[7] == 0 and got[7] == 0
        assert bool(torch.isfinite(part.noise).all())
        for view, (lo, hi) in zip(part.noise_views, zip(part.bounds, part.bounds[1:])):
            assert torch.equal(view.reshape(-1), part.noise[0, lo:hi])


def test_a_non_finite_decode_leaves_the_noise_finite(monkeypatch):
    """A skipped step's records hold NaN/Inf: its positions keep their noise until touched
    again, and there it multiplies a zero gradient, so it must stay finite."""
    part = _part("segmented", torch.float32, None, waits=False, spread=True)
    records = _records(part, 3, seed=7)
    records[0][0][2] = float("nan")
    records[1][0][3] = float("inf")
    _decode(part, records, monkeypatch, direct=True)
    assert bool(torch.isfinite(part.noise).all())


def test_random_k_parts_carry_no_spread():
    part = SparsePart("g0.s", [0], [torch.Size([50])], [5], "per_tensor",
                      [make_sparsifier("randomk", seed=1)], 0, torch.float32,
                      torch.device("cpu"), spread=True)
    assert part.shared_indices and not part.spread


def _adam(n, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(n, generator=g))
    opt = torch.optim.Adam([p], lr=0.01, betas=BETAS)
    opt.state[p].update(exp_avg=torch.randn(n, generator=g), exp_avg_sq=torch.rand(n, generator=g),
                        step=torch.tensor(4.0))
    p.grad = torch.randn(n, generator=g)
    p.grad[:5] = 0  # nothing arrived there
    moments = SharedMoments(*ADAM)
    moments.ages[p] = torch.randint(0, 6, (n,), generator=g).float()
    return p, opt, moments


@pytest.mark.parametrize("with_shares", [False, True])
def test_adam_step_adds_the_noise_to_the_second_moment(with_shares):
    """v ← (as without) + (1 − β2^a)·R·S²; the first moment, the ages and everything else
    as without; R = 0 is the step without noise; SGD reads none."""
    n = 40
    g = torch.Generator().manual_seed(1)
    noise = torch.rand(n, generator=g) * 3
    shares = torch.rand(2, n, generator=g) + 0.1 if with_shares else None

    def run(r):
        p, opt, moments = _adam(n, seed=2)
        age = moments.ages[p] + 1
        moments.step(opt, opt.param_groups[0], [p], {p: shares} if with_shares else {},
                     None if r is None else {p: r})
        return p, opt.state[p], moments.ages[p], age

    p0, st0, ages0, age = run(None)
    p1, st1, ages1, _ = run(noise)
    pz, stz, _, _ = run(torch.zeros(n))
    S = _adam(n, seed=2)[0].grad
    extra = (1 - BETAS[1] ** age.double()) * noise.double() * S.double() ** 2
    torch.testing.assert_close(st1["exp_avg_sq"].double(), st0["exp_avg_sq"].double() + extra,
                               rtol=1e-6, atol=1e-9)
    # (without shares the step without noise takes the native pass: the same to rounding)
    torch.testing.assert_close(st1["exp_avg"], st0["exp_avg"], rtol=1e-6, atol=1e-9)
    assert torch.equal(ages1, ages0)
    assert bool((st1["exp_avg_sq"][:5] == st0["exp_avg_sq"][:5]).all())  # nothing arrived
    moved0, moved1 = (p0 - _adam(n, 2)[0]).abs(), (p1 - _adam(n, 2)[0]).abs()
    assert bool((moved1[5:] < moved0[5:]).all())  # a larger v, a smaller step
    torch.testing.assert_close(pz.detach(), p0.detach(), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(stz["exp_avg_sq"], st0["exp_avg_sq"], rtol=1e-6, atol=1e-9)

    q = torch.nn.Parameter(torch.ones(n))
    sgd = torch.optim.SGD([q], lr=0.1, momentum=0.9)
    q.grad = torch.ones(n)
    SharedMoments("momentum", {"momentum": 0.9}).step(sgd, sgd.param_groups[0], [q], {},
                                                      {q: noise})
    r = torch.nn.Parameter(torch.ones(n))
    sgd2 = torch.optim.SGD([r], lr=0.1, momentum=0.9)
    r.grad = torch.ones(n)
    SharedMoments("momentum", {"momentum": 0.9}).step(sgd2, sgd2.param_groups[0], [r], {})
    assert torch.equal(q.detach(), r.detach())


def test_whole_gradient_schemes_measure_shares_against_the_rate_per_step():
    """SparDL's and ExDyna's ``_noise_against``: at the given flat elements the
    synchronized value over the steps it waited, squared, ``(value / (age + 1))²``, by
    the shared moments' ages (the same on every rank); the value squared before they
    have any."""
    from types import SimpleNamespace

    from ssfusion_hvd.core.layout import FlatLayout
    from ssfusion_hvd.schemes.whole import WholeGradientScheme

    ages = [torch.tensor([0.0, 3.0, 1.0, 0.0, 9.0, 2.0]), torch.full((2, 3), 4.0)]
    recipe = SimpleNamespace(arrival_ages=lambda params: ages)
    stub = SimpleNamespace(config=SimpleNamespace(recipe=recipe), _trainable=[0, 1], _den=None,
                           flat=FlatLayout([torch.Size([6]), torch.Size([2, 3])]))
    idx = torch.tensor([0, 1, 4, 7, 11])
    values = torch.tensor([1e-3, -2e-3, 3e-3, 4e-3, -5e-3])
    got = WholeGradientScheme._noise_against(stub, idx, values)
    waited = torch.tensor([1.0, 4.0, 10.0, 5.0, 5.0])
    torch.testing.assert_close(got, (values / waited).square(), rtol=1e-6, atol=0)
    recipe.arrival_ages = lambda params: None  # before the shared moments' first step
    assert torch.equal(WholeGradientScheme._noise_against(stub, idx, values), values.square())


def test_arrival_ages_read_a_tensor_without_one_as_zero():
    """``Recipe.arrival_ages``: the shared moments' ages per tensor; a tensor without one
    yet reads 0 (what its first step gives it), so the others keep theirs; None without
    shared moments or before any tensor has an age."""
    from types import SimpleNamespace

    from ssfusion_hvd.recipe import Recipe

    p, q = torch.zeros(3), torch.zeros(2, 2)
    aged = torch.tensor([1.0, 0.0, 7.0])
    recipe = SimpleNamespace(shared=SimpleNamespace(ages={p: aged}))
    got = Recipe.arrival_ages(recipe, [p, q])
    assert got[0] is aged and torch.equal(got[1], torch.zeros(2, 2))
    assert Recipe.arrival_ages(SimpleNamespace(shared=SimpleNamespace(ages={})), [p, q]) is None
    assert Recipe.arrival_ages(SimpleNamespace(shared=None), [p, q]) is None
