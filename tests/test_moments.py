"""Shared moments (``moments="shared"``, ``ssfusion_hvd/moments.py``) on real Horovod
workers.

* The dense limit: at density 1 on 4 ranks, each rank with its own noisy batches, the
  run equals ``torch.optim.SGD`` / ``Adam`` / ``AdamW`` stepping one model on the
  averaged gradient, for a whole-gradient scheme (ZEN) and a planned one.
* The sparse regime: at density 0.05 every step equals a reference written element by
  element from the recorded inputs (the synchronized gradient, the optimizer's state and
  the ages before the step): every element takes the optimizer's step with a zero
  gradient, and one that arrived after ``a`` steps also gets the gradient part of ``a``
  steps of ``S / a``. With each sender's wait on the wire (``waits``), the reference
  replays every rank's own burst from its recorded residual, gradient and wait. With
  each sender's spread on the wire (``spread``, Adam's default), the reference adds the
  senders' variance over P to Adam's second moment, each rank's computed from its
  recorded sum of squares, gradient, residual and wait. Every rank ends every step
  bit-identical, state included.
"""
import math

import numpy as np
import pytest
import torch

from hvdrun import run_workers
import workers_moments

pytestmark = pytest.mark.multiworker

LIMIT = {
    "zen_adam": dict(scheme="zen", optimizer="adam", density=1.0),
    "zen_adamw": dict(scheme="zen", optimizer="adamw", density=1.0),
    "zen_sgd_nesterov": dict(scheme="zen", optimizer="sgd", density=1.0, nesterov=True),
    "planned_adam": dict(scheme="ssfusion_oi", optimizer="adam", density=1.0, plan="all_sparse"),
    "planned_adam_waits": dict(scheme="ssfusion_oi", optimizer="adam", density=1.0,
                               plan="all_sparse", waits=True),
    "planned_sgd": dict(scheme="ssfusion_oi", optimizer="sgd", density=1.0, plan="all_sparse",
                        waits=False),
    "planned_sgd_waits": dict(scheme="ssfusion_oi", optimizer="sgd", density=1.0,
                              plan="all_sparse", waits=True),
    "planned_sgd_auto": dict(scheme="ssfusion_oi", optimizer="sgd", density=1.0,
                             plan="all_sparse"),
}
SPARSE = {
    # Adam's default, waits="auto", carries none on 2 ranks; spread="auto" carries the spreads
    "planned_adam": dict(scheme="ssfusion_oi", optimizer="adam", density=0.05, plan="all_sparse",
                         steps=8),
    "planned_adam_nospread": dict(scheme="ssfusion_oi", optimizer="adam", density=0.05,
                                  plan="all_sparse", steps=8, spread=False),
    "planned_adam_waits": dict(scheme="ssfusion_oi", optimizer="adam", density=0.05,
                               plan="all_sparse", steps=8, waits=True),
    # (12 steps: by the gain, 8 had no element that two senders sent after different waits)
    "per_tensor_adamw_waits": dict(scheme="per_tensor", optimizer="adamw", density=0.05,
                                   steps=12, density_warmup=3, waits=True),
    "planned_sgd_damp": dict(scheme="ssfusion_oi", optimizer="sgd_damp", density=0.05,
                             plan="all_sparse", steps=8, waits=False),
    # the default, waits="auto", carries no waits on 2 ranks: the union's age, exactly
    "planned_sgd_auto": dict(scheme="ssfusion_oi", optimizer="sgd", density=0.05,
                             plan="all_sparse", steps=8),
    "zen_sgd_nesterov": dict(scheme="zen", optimizer="sgd", density=0.05, nesterov=True, steps=8),
    "per_tensor_adamw": dict(scheme="per_tensor", optimizer="adamw", density=0.05, steps=8,
                             density_warmup=3),
    "planned_sgd_waits": dict(scheme="ssfusion_oi", optimizer="sgd", density=0.05,
                              plan="all_sparse", steps=8, waits=True),
    "multi_tensor_sgd_waits": dict(scheme="multi_tensor", optimizer="sgd_damp", density=0.05,
                                   steps=8, waits=True, density_warmup=3),
    # the group budget (floors, the rest shared), selected by the gain (the default)
    "planned_adam_group": dict(scheme="ssfusion_oi", optimizer="adam", density=0.05,
                               plan="all_sparse", steps=8, group_floor=0.0),
    "planned_adam_group_step": dict(scheme="ssfusion_oi", optimizer="adam", density=0.05,
                                    plan="all_sparse", steps=8, group_floor=0.0,
                                    select_by="step"),
    "planned_adam_magnitude": dict(scheme="ssfusion_oi", optimizer="adam", density=0.05,
                                   plan="all_sparse", steps=8, select_by="magnitude"),
    # ZEN's one top-k over the whole gradient, by the gain (its default) and not
    "zen_adam": dict(scheme="zen", optimizer="adam", density=0.05, steps=8),
    "zen_adam_magnitude": dict(scheme="zen", optimizer="adam", density=0.05, steps=8,
                               select_by="magnitude"),
    # ExDyna: every rank sends every selected element; the variances follow the values'
    # allreduce as float16 shares (against Adam's second moment) in a second one
    "exdyna_adam": dict(scheme="exdyna", optimizer="adam", density=0.05, steps=8),
    # SparDL: merged partial sums; each rank's variance since the last delivery, summed
    "spardl_adam": dict(scheme="spardl", optimizer="adam", density=0.05, steps=8),
}


def _torch_optimizer(group, params):
    hp = {k: v for k, v in group.items() if k not in ("foreach", "fused", "differentiable",
                                                       "capturable", "initial_lr")}
    if "momentum" in hp:
        return torch.optim.SGD(params, **hp)
    cls = torch.optim.AdamW if hp.pop("decoupled_weight_decay", False) else torch.optim.Adam
    return cls(params, **hp)


@pytest.fixture(scope="module")
def limit_runs():
    return run_workers(workers_moments.record_all, np=4, timeout=300, cases=LIMIT)


@pytest.mark.parametrize("name", sorted(LIMIT))
def test_dense_limit_is_the_optimizer_on_the_averaged_gradient(limit_runs, name):
    ranks = [r[name] for r in limit_runs]
    assert ranks[0]["moments"] == "shared"
    names, group = ranks[0]["names"], ranks[0]["group"]
    first = ranks[0]["steps"][0]["before"]
    params = [first[n].clone().requires_grad_(True) for n in names]
    ref = _torch_optimizer(group, params)
    sparse_steps = 0
    for s, st0 in enumerate(ranks[0]["steps"]):
        sparse_steps += bool(st0["sparse"])
        for p, n in zip(params, names):
            # P noisy gradients, averaged (weight decay is the optimizer's, as in torch)
            p.grad = sum(r["steps"][s]["local"][n] for r in ranks) / len(ranks)
        ref.step()
        for r in ranks:
            for p, n in zip(params, names):
                torch.testing.assert_close(r["steps"][s]["after"][n], p.detach(), rtol=1e-5,
                                           atol=1e-6, msg=lambda m: f"{name} step {s} {n}: {m}")
    assert sparse_steps == len(ranks[0]["steps"]), "every step must go through the sparse path"


def _carried_waits(run) -> bool:
    """Whether a run's wire carried its senders' waits."""
    return run["carried"]["waits"]


def test_waits_auto_carries_them_from_three_ranks(limit_runs, sparse_runs):
    on_4 = {name: _carried_waits(limit_runs[0][name]) for name in LIMIT if "planned" in name}
    assert on_4 == {"planned_sgd": False, "planned_sgd_waits": True, "planned_sgd_auto": True,
                    "planned_adam": True, "planned_adam_waits": True}
    assert not _carried_waits(sparse_runs[0]["planned_sgd_auto"])  # 2 ranks
    assert not _carried_waits(sparse_runs[0]["planned_adam"])
    assert _carried_waits(sparse_runs[0]["planned_sgd_waits"])
    assert _carried_waits(sparse_runs[0]["planned_adam_waits"])


def test_spread_auto_carries_them_under_adam(limit_runs, sparse_runs):
    carried = {name: run["carried"]["spread"] for name, run in sparse_runs[0].items()}
    assert carried == {name: "adam" in name and "nospread" not in name for name in carried}
    assert limit_runs[0]["planned_adam"]["carried"]["spread"]


def _reference(kind, group, w, S, age, state, sparse, noise=None):
    """One step of the shared moments for one tensor, element by element: every element
    takes the optimizer's step with a zero gradient (its moments decay and move it); one
    that arrived after ``a`` steps also gets the gradient part of ``a`` steps of
    ``g = S / a``, replayed one step at a time."""
    S = S.double()
    age = (age.double() if age is not None else torch.zeros_like(S)) + 1
    if kind == "adam":
        w, new = _adam_reference(group, w.double(), [(S, age)], state, age, noise)
    else:
        w, new = _momentum_reference(group, w.double(), [(S, age)], state)
    age[S != 0] = 0
    return w, new, age


def _adam_reference(group, w, sources, state, age, noise=None):
    """Adam's step for one tensor, element by element, from ``sources`` (as
    :func:`_momentum_reference`'s): each burst replayed as ``a_r`` steps of ``S_r / a_r``
    in the first moment (the last step's part stays in it, the earlier ones moved the
    parameter: over this step's denominator); the second moment takes the summed rate
    ``Σ_r S_r / a_r`` as ``age`` steps of it (the union's age, which is one source's
    ``a_r`` without waits: then this is ``a`` steps of ``g = S / a`` exactly), and
    ``noise`` (the senders' variance over P, :func:`_noise`) at the same gain."""
    b1, b2 = group["betas"]
    lr = group["lr"]
    if group.get("decoupled_weight_decay"):
        w = w * (1 - lr * group["weight_decay"])
    m = state.get("exp_avg", torch.zeros_like(w)).double().clone() * b1
    v = state.get("exp_avg_sq", torch.zeros_like(w)).double().clone() * b2
    t = float(state.get("step", 0)) + 1
    rate, skipped, hit = torch.zeros_like(w), torch.zeros_like(w), torch.zeros_like(w, dtype=torch.bool)
    for S_r, a_r in sources:
        S_r, a_r = S_r.double(), a_r.double()
        mine = S_r != 0
        g = torch.where(mine, S_r / a_r, torch.zeros_like(S_r))
        gm = torch.zeros_like(S_r)  # what g added to m after j of the a steps
        for j in range(int(a_r[mine].max()) if bool(mine.any()) else 0):
            live = mine & (a_r > j)
            skipped += torch.where(live, gm, torch.zeros_like(gm))
            gm = torch.where(live, b1 * gm + (1 - b1) * g, gm)
        m += gm
        rate += g
        hit |= mine
    hit &= sum(S_r.double() for S_r, _ in sources) != 0  # an exact zero sum: none arrived
    extra = rate * rate if noise is None else rate * rate + noise
    v += torch.where(hit, (1 - b2 ** age.double()) * extra, torch.zeros_like(v))
    upd = ((m + skipped) / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + group["eps"])
    return w - lr * upd, {"exp_avg": m, "exp_avg_sq": v, "step": t}


def _momentum_reference(group, w, sources, state):
    """SGD's step for one tensor, element by element, from ``sources``: per sender, what
    it added to the average and the steps it waited, ``(S_r, a_r)`` (the union's age is
    one source: the sum and its age). Each burst is replayed as ``a_r`` steps of
    ``S_r / a_r``, on top of this step's decay of the velocity; the replays add up."""
    mu, damp = group["momentum"], group["dampening"]
    tail = state.get("momentum_buffer", torch.zeros_like(w)).double().clone() * mu
    moved, added, total = tail.clone(), torch.zeros_like(tail), torch.zeros_like(tail)
    for S_r, a_r in sources:
        S_r, a_r = S_r.double(), a_r.double()
        hit = S_r != 0
        g = torch.where(hit, S_r / a_r, torch.zeros_like(S_r))
        gu = torch.zeros_like(S_r)  # what g added to the velocity after j of the a steps
        for j in range(int(a_r[hit].max()) if bool(hit.any()) else 0):
            live = hit & (a_r > j)
            gu = torch.where(live, mu * gu + (1 - damp) * g, gu)
            moved += torch.where(live, gu, torch.zeros_like(gu))
        added += gu
        total += S_r
    if group["nesterov"]:  # each of the a steps moves by g + mu·u_j
        moved = mu * moved + total
    return w - group["lr"] * moved, {"momentum_buffer": tail + added}


def _senders(ranks, s, n, group):
    """Per rank, what it added to the average of tensor ``n`` at step ``s`` and the steps
    it waited for it: its error-compensated gradient (residual, own gradient, coupled
    weight decay) where it sent (its wait is 0 after the step), over P."""
    out = []
    coupled = 0.0 if group.get("decoupled_weight_decay") else group["weight_decay"]
    for r in ranks:
        st, nxt = r["steps"][s], r["steps"][s + 1]
        local = st["local"][n] + coupled * st["before"][n]
        acc = st["residuals"].get(n, torch.zeros_like(local)) + local
        sent = nxt["waits"][n] == 0
        waited = st["waits"].get(n, torch.zeros_like(local, dtype=torch.int32)) + 1
        out.append((torch.where(sent, acc, torch.zeros_like(acc)) / len(ranks), waited))
    return out


def _noise(ranks, s, n, group, pulled=False, coded=True):
    """What the senders' variance adds to Adam's second moment of tensor ``n`` at step
    ``s`` (before the gain): per rank that sent an element, its gradient's variance over
    the steps it waited (its recorded sum of squares plus this step's gradient squared,
    its sum ``acc`` and wait ``w``: ``Σg²/w − (acc/w)²``) as the wire carries it (a ratio
    to ``acc²``, one byte); their mean over the senders, times P, over the arrived sum
    squared, is the noise ratio ``R`` (in float32 as the decode computes it, the sums in
    rank order), and ``R`` times the synchronized gradient squared is the term (in
    gradient units the senders' mean variance over P). ``pulled``: ``R`` travels as one
    byte too (ZEN's owner to every rank); ``coded=False``: every rank sends its variance
    as a float16 share against :func:`_against` (ExDyna's second allreduce), the term the
    float16 sum of the shares times it."""
    from ssfusion_hvd.core.wire import code_spreads, spread_codes
    table = code_spreads().float()
    coupled = 0.0 if group.get("decoupled_weight_decay") else group["weight_decay"]
    variances, count, total = [], 0, 0
    for r in ranks:
        st, nxt = r["steps"][s], r["steps"][s + 1]
        g = st["local"][n] + coupled * st["before"][n]  # what the memory saw
        acc = st["residuals"].get(n, torch.zeros_like(g)) + g
        sent = (nxt["waits"][n] == 0) & (acc != 0)
        w = (st["waits"].get(n, torch.zeros_like(g, dtype=torch.int32)) + 1).float()
        q = st["squares"].get(n, torch.zeros_like(g)) + g * g
        spread = (q / (w * (acc * acc)) - 1 / (w * w)).clamp(min=0)
        if coded:
            spread = table[spread_codes(torch.where(sent, spread, 0.0)).long()]
        variances.append(torch.where(sent, spread * acc.square(), 0.0))
        count = count + sent.float()
        total = total + torch.where(sent, acc, 0.0)
    if not coded:  # every rank sent (count is P): float16 shares of the summed variance
        synced = ranks[0]["steps"][s]["synced"][n]
        against = _against(ranks[0]["steps"][s]["ages"].get(n), synced)
        c2 = float(len(ranks)) ** -2  # (the average's scale, squared: variances are acc²)
        summed = sum(_float16_share(c2 * v, against) for v in variances).half().double()
        return torch.where((total != 0) & (synced != 0), summed * against, 0.0)
    ratio = sum(variances) / count * float(len(ranks)) / total.square()
    ratio = torch.where((count > 0) & (total != 0) & torch.isfinite(ratio), ratio, 0.0)
    ratio = code_spreads()[spread_codes(ratio).long()] if pulled else ratio.double()
    return ratio * ranks[0]["steps"][s]["synced"][n].double() ** 2


def _window_noise(ranks, s, n, group):
    """SparDL's term: per rank, its gradient's variance over the steps since the element
    was last delivered (its recorded sums of gradients and squares plus this step's, and
    that wait: ``Σg²/w − (Σg/w)²``) times the average's scale squared (1/P²), over the
    delivered value squared (the same everywhere) as a float16 share, the shares summed in
    float16, times the value squared, where the element is delivered."""
    coupled = 0.0 if group.get("decoupled_weight_decay") else group["weight_decay"]
    variances = []
    for r in ranks:
        st, nxt = r["steps"][s], r["steps"][s + 1]
        g = st["local"][n] + coupled * st["before"][n]
        w = (st["waits"].get(n, torch.zeros_like(g, dtype=torch.int32)) + 1).double()
        q = st["squares"].get(n, torch.zeros_like(g)).double() + g.double() ** 2
        m = (st["sums"].get(n, torch.zeros_like(g)).double() + g.double()) / w
        variances.append((q / w - m * m).clamp(min=0) / len(ranks) ** 2)
    delivered = ranks[0]["steps"][s + 1]["waits"][n] == 0
    value = ranks[0]["steps"][s]["synced"][n]
    against = _against(ranks[0]["steps"][s]["ages"].get(n), value)
    summed = sum(_float16_share(v, against) for v in variances).half().double()
    return torch.where(delivered & (value != 0), summed * against, 0.0)


def _against(age, value):
    """What a rank's variance is measured against on the wire (``wire.noise_shares``, the
    schemes' ``_noise_against``): the value's rate per step squared, ``(value / a)²`` in
    float32, ``a`` the shared moments' age before the step plus one (1 before their
    first step)."""
    rate = value.float()
    if age is not None:
        rate = rate / (age.float() + 1.0)
    return rate.square().double()


def _float16_share(variance, against):
    """One rank's share as it travels (``wire.noise_shares``, its own reference):
    ``variance / against`` rounded to float16, 0 where ``against`` is 0, and clamped so
    that 2 ranks' shares cannot overflow (these runs have 2 ranks)."""
    from ssfusion_hvd.core.wire import share_max
    share = variance.double() / against.double()
    share = torch.where((against > 0) & torch.isfinite(share), share, 0.0)
    return share.clamp(0, share_max(2)).half().double()


@pytest.fixture(scope="module")
def sparse_runs():
    return run_workers(workers_moments.record_all, np=2, timeout=300, cases=SPARSE)


@pytest.mark.parametrize("name", sorted(SPARSE))
def test_sparse_steps_match_the_elementwise_reference(sparse_runs, name):
    ranks = [r[name] for r in sparse_runs]
    names, group, kind = ranks[0]["names"], ranks[0]["group"], ranks[0]["kind"]
    steps = ranks[0]["steps"]
    late_arrivals = mixed_waits = noisy = 0
    for s, st0 in enumerate(steps):
        for r in ranks[1:]:  # every rank: the same sum, parameters, state and ages
            st = r["steps"][s]
            for n in names:
                assert torch.equal(st["synced"][n], st0["synced"][n]), (name, s, n)
                assert torch.equal(st["after"][n], st0["after"][n]), (name, s, n)
                for b, t in st0["own"].get(n, {}).items():
                    assert torch.equal(torch.as_tensor(st["own"][n][b]), torch.as_tensor(t)), (name, s, n, b)
            assert st["ages"].keys() == st0["ages"].keys()
            for n, a in st0["ages"].items():
                assert torch.equal(st["ages"][n], a), (name, s, n)
        if s + 1 == len(steps):
            break
        nxt = steps[s + 1]
        for n in st0["sparse"]:
            noise = (None if not ranks[0]["carried"]["spread"] else
                     _window_noise(ranks, s, n, group) if name.startswith("spardl") else
                     _noise(ranks, s, n, group, pulled=name.startswith("zen"),
                            coded=not name.startswith("exdyna")))
            noisy += 0 if noise is None else int((noise > 0).sum())
            if "waits" in name:  # each sender's own burst
                senders = _senders(ranks, s, n, group)
                if kind == "adam":  # (its second moment's gain: the union's age)
                    age = st0["ages"].get(n)
                    age = (age.double() if age is not None else torch.zeros_like(senders[0][0])) + 1
                    w, state = _adam_reference(group, st0["before"][n].double(), senders,
                                               st0["own"].get(n, {}), age, noise)
                else:
                    w, state = _momentum_reference(group, st0["before"][n].double(), senders,
                                                   st0["own"].get(n, {}))
                late_arrivals += sum(int(((S != 0) & (a > 1)).sum()) for S, a in senders)
                # the senders' waits differ where the union's age would have been wrong
                differ = (senders[0][1] != senders[1][1]) & (senders[0][0] != 0) & (senders[1][0] != 0)
                mixed_waits += int(differ.sum())
            else:
                age = st0["ages"].get(n)
                w, state, age_after = _reference(kind, group, st0["before"][n], st0["synced"][n],
                                                 age, st0["own"].get(n, {}), st0["sparse"], noise)
                late_arrivals += int(((age_after == 0) & ((age if age is not None else 0) > 0)).sum())
                torch.testing.assert_close(nxt["ages"][n].double(), age_after, rtol=0, atol=0)
            torch.testing.assert_close(st0["after"][n].double(), w, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name} step {s} {n}: {m}")
            for b, t in state.items():
                got = nxt["own"][n][b]
                torch.testing.assert_close(torch.as_tensor(got).double(), torch.as_tensor(t, dtype=torch.float64),
                                           rtol=1e-5, atol=1e-7, msg=lambda m: f"{name} step {s} {n} {b}: {m}")
    assert sum(bool(st["sparse"]) for st in steps) >= 4, name
    assert late_arrivals > 0, f"{name}: no element arrived after waiting (the ages were not exercised)"
    assert "waits" not in name or mixed_waits > 0, f"{name}: no element two senders sent after different waits"
    assert noisy > 0 or not ranks[0]["carried"]["spread"], f"{name}: no sender's spread was above 0"




@pytest.mark.parametrize("name", ["planned_adam", "planned_adam_group", "planned_adam_group_step",
                                  "planned_adam_magnitude", "zen_adam", "zen_adam_magnitude"])
def test_adam_selects_the_largest_pending_gains(sparse_runs, name):
    """Under Adam with shared moments each rank sends, by default, the elements whose
    pending sum times the step it would take is largest, acc² / (sqrt(v-hat) + eps) (the
    first-order decrease of the loss; ranked as |acc| / sqrt(sqrt(v-hat) + eps)), from the
    optimizer's state before the step (per tensor, under the group budget: floors, then
    the rest by that key, or ZEN's one k over the whole gradient); ``select_by="step"``
    those whose step is largest, |acc| / (sqrt(v-hat) + eps); ``"magnitude"`` the largest
    |acc|. Each rank's sent set (where its residual was zeroed) equals that reference, and
    the key chooses differently from the magnitude on these steps and, under the group
    budget, the gain from the step (so the check tells all three apart)."""
    from ssfusion_hvd.plan.cost import nominal_k
    from test_schemes import group_select

    mode = ("magnitude" if name.endswith("_magnitude") else
            "step" if name.endswith("_step") else "gain")
    by_step = mode != "magnitude"
    runs = [r[name] for r in sparse_runs]
    names, group = runs[0]["names"], runs[0]["group"]
    b2, eps = group["betas"][1], group["eps"]
    coupled = 0.0 if group.get("decoupled_weight_decay") else group["weight_decay"]
    checked = differ = other = 0
    for run in runs:
        steps = run["steps"]
        for s in range(len(steps) - 1):
            st, nxt = steps[s], steps[s + 1]
            if not st["sparse"]:
                continue
            # (before Adam's first step there is no state: magnitude, for the whole part)
            stateful = by_step and all("exp_avg_sq" in st["own"].get(n, {}) for n in names)
            accs, keys, others = [], [], []
            for n in names:
                local = st["local"][n] + coupled * st["before"][n]
                acc = (st["residuals"].get(n, torch.zeros_like(local)) + local).reshape(-1)
                accs.append(acc)
                if stateful:
                    own = st["own"][n]
                    v = own["exp_avg_sq"].reshape(-1).float()
                    # the rule's denominator, sqrt(v) / sqrt(1 - b2^t) + eps, the square root
                    # correctly rounded (numpy's; torch's CPU one is not)
                    b2s = math.sqrt(1.0 - b2 ** max(float(own["step"]), 1.0))
                    denom = torch.from_numpy(np.sqrt(v.numpy())) / b2s + eps
                    root = torch.from_numpy(np.sqrt(denom.numpy()))  # the gain's
                    step, gain = (acc / denom).abs(), (acc / root).abs()
                    keys.append(gain if mode == "gain" else step)
                    others.append(step if mode == "gain" else gain)
                else:
                    keys.append(acc.abs())
                    others.append(acc.abs())
            sizes = [a.numel() for a in accs]
            ks = [nominal_k(n, 0.05) for n in sizes]
            k = sum(ks)
            # the group budget's floors (share 0: one element each), or each tensor its k
            floors = [1] * len(ks) if "group" in name else ks
            if name.startswith("zen"):  # one k over the whole gradient, no floor
                k, floors = nominal_k(sum(sizes), 0.05), [0] * len(ks)
            acc = torch.cat(accs)
            want = set(group_select(torch.cat(keys), sizes, k, floors)[1].tolist())
            differ += want != set(group_select(acc, sizes, k, floors)[1].tolist())
            other += want != set(group_select(torch.cat(others), sizes, k, floors)[1].tolist())
            sent = torch.cat([nxt["residuals"][n].reshape(-1) for n in names]) == 0
            got = set((sent & (acc != 0)).nonzero().flatten().tolist())
            assert got == {j for j in want if acc[j] != 0}, (name, s)
            checked += 1
    assert checked >= 8, name
    assert (differ > 0) == by_step, (name, differ)
    # under the group budget the gain and the step choose differently here (per tensor, and
    # ZEN's one k, their orders agreed on these steps)
    if "group" in name:
        assert (other > 0) == by_step, (name, other)
