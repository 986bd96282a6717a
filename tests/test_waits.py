"""Each sender's wait on the wire (``scheme_options={"waits": True}``, docs/design.md,
"Each sender's wait"), piece by piece in one process:

* the one-byte code of a wait;
* the wait a rank's memory counts per element, through a skipped step and a checkpoint;
* the decode's shares ``Σ_r v_r·w(a_r) / Σ_r v_r`` (SGD: w = ψ at μ; Adam: ψ at β1 and
  1/a) against ones written from the records in float64, for every part mode, wire dtype
  and both decode paths, the gradients bit for bit those of the same part without waits;
* the shared moments' SGD and Adam steps given those shares against a replay of every
  sender's burst one step at a time.

``tests/test_moments.py`` runs the whole of it on Horovod workers.
"""
import pytest
import torch

from ssfusion_hvd.core import sparse_part
from ssfusion_hvd.core.buffers import SelectionResult, SparsePart, fresh_table, unpack
from ssfusion_hvd.core.wire import WAIT_EXACT, WAIT_MAX, code_waits, wait_codes
from ssfusion_hvd.moments import SHARE_ROWS, SharedMoments, fresh_share, share_table
from ssfusion_hvd.sparsify import ResidualMemory, make_sparsifier

MU = 0.9
BETAS = (0.8, 0.95)
RULES = {"sgd": ("momentum", {"momentum": MU}), "adam": ("adam", {"betas": BETAS, "eps": 1e-8})}
SHAPES = [torch.Size([30, 20]), torch.Size([1]), torch.Size([5, 7]), torch.Size([200])]
KS = [24, 1, 6, 10]
OFFSET = 3  # a dense part's values before the sparse part


def test_wait_codes_are_exact_to_16_then_within_2_percent():
    waits = torch.arange(1, 3 * WAIT_MAX)
    codes = wait_codes(waits)
    back = code_waits()[codes.long()]
    exact = waits <= WAIT_EXACT
    assert torch.equal(back[exact], waits[exact].double())
    inside = waits <= WAIT_MAX
    assert float(((back - waits) / waits)[inside].abs().max()) < 0.02
    assert torch.equal(codes[~inside], torch.full_like(codes[~inside], 255))  # saturates
    assert bool((codes[1:].long() >= codes[:-1].long()).all())  # monotone


def test_sent_waits_count_each_elements_steps_through_undo_and_checkpoint():
    mem = ResidualMemory()
    mem.register("g0.s", ["a", "b"], [torch.Size([4]), torch.Size([2])])
    grad = torch.zeros(6)

    def send(idx):
        mem.select_topk("g0.s", grad, 0)  # creates the residual; which k does not matter
        return mem.sent_waits("g0.s", torch.tensor(idx)).tolist()

    assert send([0, 5]) == [1, 1]  # first step: one step of gradient each
    assert send([0]) == [1]
    assert send([1, 5]) == [3, 2]  # 1 never sent: 3 steps; 5 last sent at step 1
    mem.checkpoint()
    assert send([1, 2]) == [1, 4]
    mem.restore()  # the step never happened: the same answer again
    assert send([1, 2]) == [1, 4]
    saved = mem.named_state()
    # steps since each element's last send, after 4 steps
    assert saved["waits"]["a"].tolist() == [2, 0, 0, 4] and saved["waits"]["b"].tolist() == [4, 1]
    fresh = ResidualMemory()
    fresh.register("g0.s", ["a", "b"], [torch.Size([4]), torch.Size([2])])
    fresh.load_named_state(saved, torch.device("cpu"))
    fresh.select_topk("g0.s", grad, 0)
    assert fresh.sent_waits("g0.s", torch.tensor([0, 3, 4, 5])).tolist() == [3, 5, 5, 2]
    # residuals dropped (e.g. another rank's plan adopted): the waits go with them
    fresh.load_named_state({"residuals": {}}, torch.device("cpu"))
    fresh.select_topk("g0.s", grad, 0)
    assert fresh.sent_waits("g0.s", torch.tensor([0])).tolist() == [1]


def _part(mode, dtype, acc, waits, family="sgd"):
    part = _new_part(mode, dtype, acc, SHARE_ROWS[family] if waits else 0)
    if waits:  # the rule in force (the engine sets it)
        part.fresh = fresh_table(*RULES[family], "cpu")
    return part


def _new_part(mode, dtype, acc, waits):
    dev = torch.device("cpu")
    if mode == "buffer":
        return SparsePart("g0.s", range(len(SHAPES)), SHAPES, [sum(KS)], "buffer",
                          [make_sparsifier("topk")], OFFSET, dtype, dev, acc_dtype=acc, waits=waits)
    sps = [make_sparsifier("topk" if mode != "per_tensor" else "dgc", **(
        {} if mode != "per_tensor" else {"seed": 3})) for _ in SHAPES]
    floors = [1] * len(SHAPES) if mode == "group" else None
    return SparsePart("g0.s", range(len(SHAPES)), SHAPES, KS, mode, sps, OFFSET, dtype, dev,
                      acc_dtype=acc, floors=floors, waits=waits)


def _records(part, nranks, seed):
    """Every rank's selection (distinct positions, a few records short of capacity so
    they pad into the sink, values that cancel somewhere across ranks) and its waits."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(nranks):
        k = part.capacity - r % 2
        idx = torch.randperm(part.numel, generator=g)[:k].sort().values
        idx[0] = 7  # every rank sends position 7 ...
        idx = idx.unique()
        vals = torch.randn(idx.numel(), generator=g).to(part.dtype)
        vals[0] = [1.5, -1.5, 0.0][min(r, 2)]  # ... and it sums to exactly 0
        waits = torch.randint(1, 40, (idx.numel(),), generator=g, dtype=torch.int32)
        waits[1] = 300 + r  # beyond the exact codes
        out.append((vals, idx.to(part.idx_dtype), waits))
    return out


def _decode(part, records, monkeypatch, direct, postscale=0.5):
    monkeypatch.setattr(sparse_part, "DIRECT_MAX_SHARE", 1.0 if direct else 0.0)
    record_len = OFFSET + part.length
    sends = []
    for vals, idx, waits in records:
        send = torch.full((record_len,), 2.0, dtype=part.dtype)
        part.pack(SelectionResult(vals, idx, waits=waits if part.waits else None), send, 1.0)
        sends.append(send)
    grads = [torch.full(s, -9.0, dtype=part.dtype) for s in SHAPES]
    unpack(part, torch.cat(sends), len(records), record_len, grads, postscale)
    return grads


def _expected_share(part, records, family="sgd"):
    """The weighted shares in float64 over the sums as the decode's output holds them (in
    its accumulation dtype: the gradient they are shares of)."""
    rows = SHARE_ROWS[family]
    num = torch.zeros(rows, part.numel, dtype=torch.float64)
    den = torch.zeros(part.numel, dtype=part.acc_dtype)
    for vals, idx, waits in records:
        a = code_waits()[wait_codes(waits).long()]
        weights = [fresh_share(MU, a)] if family == "sgd" else [fresh_share(BETAS[0], a), 1 / a]
        for row, w in enumerate(weights):
            num[row].index_add_(0, idx.long(), vals.double() * w)
        den.index_add_(0, idx.long(), vals.to(part.acc_dtype))
    den = den.double()
    touched = torch.zeros(part.numel, dtype=torch.bool)
    for _, idx, _ in records:
        touched[idx.long()] = True
    return torch.where(den != 0, num / den, torch.zeros_like(num)), touched, den


@pytest.mark.parametrize("mode", ["segmented", "group", "buffer", "per_tensor"])
@pytest.mark.parametrize("dtype,acc", [(torch.float32, None), (torch.bfloat16, torch.float32),
                                       (torch.float16, None)])
@pytest.mark.parametrize("nranks", [1, 3])
@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("family", ["sgd", "adam"])
def test_decode_share_is_the_weighted_fresh_share_of_the_senders(mode, dtype, acc, nranks,
                                                                 direct, family, monkeypatch):
    part = _part(mode, dtype, acc, waits=True, family=family)
    plain = _part(mode, dtype, acc, waits=False)
    assert part.waits and part.length > plain.length
    for step in range(2):  # the second decode must not see the first one's positions
        records = _records(part, nranks, seed=100 * step + nranks)
        grads = _decode(part, records, monkeypatch, direct)
        for g, ref in zip(grads, _decode(plain, records, monkeypatch, direct)):
            assert torch.equal(g.view(torch.uint8), ref.view(torch.uint8))  # same gradients
        want, touched, den = _expected_share(part, records, family)
        got = part.share[:, :part.numel].double()
        assert got.shape[0] == SHARE_ROWS[family]
        # where the records sum to exactly 0 (position 7 on 2 ranks) the share is 0;
        # where they nearly cancel the ratio is ill-conditioned in float32 sums
        well = touched & (den.abs() > 1e-3)
        torch.testing.assert_close(got[:, well], want[:, well], rtol=2e-5, atol=1e-6)
        if nranks > 1:
            assert den[7] == 0 and not got[:, 7].any()
        assert bool(torch.isfinite(part.share).all())
    if nranks == 1 and mode == "segmented":  # one rank: the weights of its own wait, exactly
        vals, idx, waits = records[0]
        a = code_waits()[wait_codes(waits).long()]
        nz = vals != 0
        torch.testing.assert_close(part.share[:, idx.long()][:, nz].double(),
                                   share_table(*RULES[family], a)[:, nz], rtol=1e-6, atol=0)


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("family", ["sgd", "adam"])
def test_a_non_finite_decode_leaves_every_share_finite(direct, family, monkeypatch):
    """A step whose records hold NaN and Inf is skipped (GradScaler), but its positions
    keep their shares until a record touches them again, and there a share multiplies a
    zero gradient: it must be finite, or 0·NaN would reach the moments."""
    part = _part("segmented", torch.float32, None, waits=True, family=family)
    records = _records(part, 3, seed=7)
    records[0][0][2] = float("nan")
    records[1][0][3] = float("inf")
    _decode(part, records, monkeypatch, direct)
    assert bool(torch.isfinite(part.share).all())
    p = torch.nn.Parameter(torch.ones(part.numel))
    opt = (torch.optim.SGD([p], lr=0.1, momentum=MU) if family == "sgd"
           else torch.optim.Adam([p], lr=0.1, betas=BETAS))
    p.grad = torch.zeros(part.numel)  # the next step: nothing arrived anywhere
    SharedMoments(*RULES[family]).step(opt, opt.param_groups[0], [p],
                                       {p: part.share[:, :part.numel]})
    for t in opt.state[p].values():
        assert bool(torch.isfinite(torch.as_tensor(t)).all())
    assert torch.equal(p.detach(), torch.ones(part.numel))


@pytest.mark.parametrize("direct", [True, False])
def test_a_part_without_momentum_decodes_its_waits_unread(direct, monkeypatch):
    """SGD without momentum (or before a broadcast gives it one): no table, no share, and
    the gradients are those of a part without waits. Found by 4 workers under the default
    waits="auto" with plain SGD."""
    part = _new_part("segmented", torch.float32, None, waits=True)
    plain = _new_part("segmented", torch.float32, None, waits=False)
    assert part.waits and part.fresh is None
    records = _records(part, 3, seed=11)
    for g, ref in zip(_decode(part, records, monkeypatch, direct),
                      _decode(plain, records, monkeypatch, direct)):
        assert torch.equal(g, ref)
    assert not bool(part.share.any())


def test_random_k_parts_carry_no_waits():
    """Shared indices: every rank sends the same elements, the union's age is exact."""
    part = SparsePart("g0.s", [0], [torch.Size([50])], [5], "per_tensor",
                      [make_sparsifier("randomk", seed=1)], 0, torch.float32,
                      torch.device("cpu"), waits=True)
    assert part.shared_indices and not part.waits


@pytest.mark.parametrize("damp,nesterov", [(0.0, False), (0.3, False), (0.0, True)])
def test_step_with_shares_replays_every_senders_burst(damp, nesterov):
    """Rank r sends v_r after waiting a_r steps: a_r steps of v_r / a_r in its velocity,
    replayed one at a time in float64, summed over the ranks and averaged; the shared
    moments' one step given S = mean v_r and the share of the waits must land there."""
    g = torch.Generator().manual_seed(5)
    n, nranks = 64, 4
    v = torch.randn(nranks, n, generator=g)
    a = torch.randint(1, 30, (nranks, n), generator=g).double()
    v[:, :8] = 0  # nothing arrived at the first 8 elements
    v[1:, 8:16] = 0  # one sender only
    w0 = torch.randn(n, generator=g)
    u0 = torch.randn(n, generator=g)
    S = v.sum(0) / nranks
    share = torch.where(S != 0, (v.double() * fresh_share(MU, a)).sum(0) / (v.double().sum(0)),
                        torch.zeros(n, dtype=torch.float64))

    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([p], lr=0.1, momentum=MU, dampening=damp, nesterov=nesterov)
    opt.state[p]["momentum_buffer"] = u0.clone()
    p.grad = S.clone()
    moments = SharedMoments("momentum", {"momentum": MU, "dampening": damp, "nesterov": nesterov})
    moments.step(opt, opt.param_groups[0], [p], {p: share.float()[None]})

    # the replay: this step decays the velocity and moves by it; each sender's burst adds
    # what its a_r steps of (1 − d)·v_r/(a_r·P) did to the velocity and the parameter
    tail = u0.double() * MU
    moved = tail.clone()
    added = torch.zeros(n, dtype=torch.float64)
    for r in range(nranks):
        gr = (1 - damp) * v[r].double() / (a[r] * nranks)
        gu = torch.zeros(n, dtype=torch.float64)
        for j in range(int(a[r].max())):
            live = (a[r] > j) & (v[r] != 0)
            gu = torch.where(live, MU * gu + gr, gu)
            moved += torch.where(live, gu, torch.zeros_like(gu))
        added += gu
    if nesterov:  # each step moves by g + μ·u_j
        moved = MU * moved + S.double()
    torch.testing.assert_close(p.detach().double(), w0.double() - 0.1 * moved, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state[p]["momentum_buffer"].double(), tail + added,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_step_with_shares_replays_every_senders_burst(decoupled):
    """Adam: rank r's v_r after a_r steps is a_r steps of v_r/(a_r·P) in the first moment,
    replayed one at a time in float64 (the part still in m, and the rest that moved the
    parameter in the steps skipped); the second moment takes the summed rate
    Σ_r v_r/(a_r·P) over the union's age. The shared moments' one step given S = mean v_r
    and the decode's two shares must land there, the union's age advanced as without."""
    g = torch.Generator().manual_seed(6)
    n, nranks = 64, 3
    b1, b2 = BETAS
    v = torch.randn(nranks, n, generator=g)
    a = torch.randint(1, 30, (nranks, n), generator=g).double()
    v[:, :8] = 0  # nothing arrived at the first 8 elements
    v[1:, 8:16] = 0  # one sender only
    union = torch.randint(0, 5, (n,), generator=g).float()  # ages before this step
    w0, m0 = torch.randn(n, generator=g), torch.randn(n, generator=g)
    v0 = torch.rand(n, generator=g)
    S = v.sum(0) / nranks
    table = share_table(*RULES["adam"], a.reshape(-1)).view(2, nranks, n)
    shares = torch.where(S != 0, (v.double() * table).sum(1) / v.double().sum(0),
                         torch.zeros(2, n, dtype=torch.float64))

    p = torch.nn.Parameter(w0.clone())
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([p], lr=0.01, betas=BETAS, weight_decay=0.0)
    opt.state[p].update(exp_avg=m0.clone(), exp_avg_sq=v0.clone(), step=torch.tensor(4.0))
    p.grad = S.clone()
    moments = SharedMoments("adam", {"betas": BETAS, "eps": 1e-8})
    moments.ages[p] = union.clone()
    moments.step(opt, opt.param_groups[0], [p], {p: shares.float()})

    # the replay: each sender's a_r steps of its rate; what they added to m, step by step,
    # either is still in m (the last step's) or moved the parameter in a skipped step
    m = m0.double() * b1
    extra = torch.zeros(n, dtype=torch.float64)
    rate = torch.zeros(n, dtype=torch.float64)
    for r in range(nranks):
        gr = v[r].double() / (a[r] * nranks)
        rate += gr
        gm = torch.zeros(n, dtype=torch.float64)
        for j in range(int(a[r].max())):
            live = (a[r] > j) & (v[r] != 0)
            extra += torch.where(live, gm, torch.zeros_like(gm))  # moved a skipped step
            gm = torch.where(live, b1 * gm + (1 - b1) * gr, gm)
        m += gm  # the last step's stays in m
    age = union.double() + 1
    v1 = v0.double() * b2 + torch.where(S != 0, (1 - b2 ** age) * rate ** 2, torch.zeros(n, dtype=torch.float64))
    t = 5
    # this step's first moment and the skipped steps' contributions, over this step's
    # denominator (the rule's catch-up)
    num = m + extra
    upd = (num / (1 - b1 ** t)) / ((v1 / (1 - b2 ** t)).sqrt() + 1e-8)
    torch.testing.assert_close(opt.state[p]["exp_avg"].double(), m, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state[p]["exp_avg_sq"].double(), v1, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(p.detach().double(), w0.double() - 0.01 * upd, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(moments.ages[p], torch.where(S != 0, torch.zeros(n), union + 1))


@pytest.mark.parametrize("family", ["sgd", "adam"])
def test_a_step_mixing_tensors_with_and_without_shares_steps_each_as_alone(family):
    """One step over tensors some of whose wires carried waits (a share each) and some
    not (the union's age): each lands where a step of it alone lands."""
    kind, hp = RULES[family]
    g = torch.Generator().manual_seed(9)

    def setup():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(n)))
              for n in (10, 7)]
        opt = (torch.optim.SGD(ps, lr=0.1, momentum=MU) if family == "sgd"
               else torch.optim.Adam(ps, lr=0.01, betas=BETAS))
        moments = SharedMoments(kind, hp)
        for p in ps:
            p.grad = torch.randn(p.numel(), generator=torch.Generator().manual_seed(p.numel() + 1))
            moments.ages[p] = torch.full((p.numel(),), 3.0)
        return ps, opt, moments

    share = torch.rand(SHARE_ROWS[family], 10, generator=g)
    ps, opt, moments = setup()
    moments.step(opt, opt.param_groups[0], ps, {ps[0]: share})
    both = [p.detach().clone() for p in ps]
    ps, opt, moments = setup()
    moments.step(opt, opt.param_groups[0], [ps[0]], {ps[0]: share})
    moments.step(opt, opt.param_groups[0], [ps[1]], {})
    for p, want in zip(ps, both):
        assert torch.equal(p.detach(), want)
