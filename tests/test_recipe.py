"""The training recipe (``ssfusion_hvd/recipe.py``) on real Horovod workers, against a
reference that applies it by hand to the recorded inputs.

Per step and rank the reference takes the local gradient, the parameters and the
recorded state (residuals and the local rule's buffers, or the wrapped optimizer's state
they were seeded from), computes the rule's local update (DGC momentum correction with
weight decay folded in, or the local Adam update), selects with the plan in force at the
density of the warm-up's stage, sums over ranks and compares with the synchronized
gradient; then it checks the masking of the rule's momentum, the parameter update
(``w -= lr · update`` for sparsified tensors, the wrapped optimizer's own step for the
others) and that every rank ends bit-identical.
"""
import math

import pytest
import torch

from hvdrun import run_workers
import workers_recipe
from ssfusion_hvd.plan import Group, Plan
from ssfusion_hvd.plan.cost import nominal_k
from ssfusion_hvd.recipe import Recipe, resolve_recipe, warmup_length
from test_schemes import reference_step

CASES = {
    # live plans after 2 dense profiling steps: the rules continue the optimizer's state
    # (momentum buffer; Adam's moments and step), which the optimizer then no longer holds
    "per_tensor_sgd": dict(scheme="per_tensor", optimizer="sgd", steps=7),
    "per_tensor_adam": dict(scheme="per_tensor", optimizer="adam", steps=7),
    # every part kind from step 0 (dense AR, dense AG, segmented, offloaded, buffer)
    "forced_sgd_nesterov": dict(scheme="ssfusion_oi", forced=True, optimizer="sgd", nesterov=True),
    "forced_sgd_dampening_masked": dict(scheme="ssfusion_oi", forced=True, optimizer="sgd_damp",
                                        masking=True),
    "forced_adam": dict(scheme="ssfusion_oi", forced=True, optimizer="adam"),
    "multi_tensor_adamw": dict(scheme="multi_tensor", optimizer="adamw", warmup=1),
    "zen_sgd": dict(scheme="zen", optimizer="sgd"),
    "zen_adam_unmasked": dict(scheme="zen", optimizer="adam", masking=False),
}


@pytest.fixture(scope="module")
def runs():
    return run_workers(workers_recipe.record_all, np=2, timeout=400, cases=CASES)


def _local_update(kind, group, masking, n, g, w, state, own):
    """The rule's local update of tensor ``n`` and its buffers after the step."""
    g = g.float()
    decoupled = group.get("decoupled_weight_decay", False)
    if group["weight_decay"] and not decoupled:
        g = g + group["weight_decay"] * w

    def buf(b):
        if state.get(b, {}).get(n) is not None:
            return state[b][n].float()
        if own.get(n, {}).get(b) is not None:  # continues the wrapped optimizer's state
            return own[n][b].float()
        return None

    if kind == "momentum":
        m, damp = group["momentum"], group["dampening"]
        u = buf("momentum_buffer")
        u = g.clone() if u is None else u.mul(m).add(g, alpha=1 - damp)
        upd = g.add(u, alpha=m) if group["nesterov"] else u
        return upd, {"momentum_buffer": u}
    b1, b2 = group["betas"]
    m, v = buf("exp_avg"), buf("exp_avg_sq")
    m = torch.zeros_like(g) if m is None else m
    v = torch.zeros_like(g) if v is None else v
    t = state.get("steps", {}).get(n)
    if t is None:
        t = int(float(own.get(n, {}).get("step", 0)))
    t += 1
    m = m.mul(b1).add(g, alpha=1 - b1)
    v = v.mul(b2).addcmul(g, g, value=1 - b2)
    # the same operations as AdamRule: Adam's first step makes every |update| ~1, so the
    # selection depends on the last bit
    denom = v.sqrt() / math.sqrt(1 - b2 ** t) + group["eps"]
    upd = (m / denom) / (1 - b1 ** t)
    return upd, {"exp_avg": m, "exp_avg_sq": v}


def _dense_step(group, kind, w, grad, own_state):
    """The wrapped optimizer's own step on one tensor, from its recorded state."""
    p = w.clone().requires_grad_(True)
    hp = {k: v for k, v in group.items() if k not in ("foreach", "fused", "differentiable",
                                                       "capturable", "initial_lr")}
    cls = torch.optim.SGD if "momentum" in hp else (
        torch.optim.AdamW if hp.get("decoupled_weight_decay") else torch.optim.Adam)
    hp.pop("decoupled_weight_decay", None)
    opt = cls([p], **hp)
    if own_state:
        opt.state[p] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in own_state.items()}
    p.grad = grad.clone()
    opt.step()
    return p.detach()


def _check_case(name, case, runs):
    ranks = [r[name] for r in runs]
    names, group = ranks[0]["names"], ranks[0]["group"]
    kind = ranks[0]["recipe"]
    assert kind == ("adam" if case["optimizer"].startswith("adam") else "momentum"), name
    recipe = Recipe(kind, 0.05, 3, True, {})
    planned = 0
    for s in range(len(ranks[0]["steps"])):
        steps = [r["steps"][s] for r in ranks]
        st0 = steps[0]
        for other in steps[1:]:  # identical decisions and results on every rank
            assert other["stats"]["density_target"] == st0["stats"]["density_target"]
            for n in names:
                assert torch.equal(other["after"][n], st0["after"][n]), (name, s, n)
        target = st0["stats"]["density_target"]
        if case["scheme"] == "zen":
            plan = Plan("zen", names, [st0["before"][n].numel() for n in names],
                        [Group(0, len(names), nominal_k(sum(st0["before"][n].numel() for n in names),
                                                        target))],
                        [True] * len(names), [None] * len(names), ["allgather"] * len(names),
                        [False] * len(names), target)
        elif st0["plan"] is None:  # dense profiling step: the wrapped optimizer does it all
            assert target == 1.0
            for n in names:
                if n in st0["synced"]:
                    want = _dense_step(group, kind, st0["before"][n], st0["synced"][n], st0["own"].get(n))
                    torch.testing.assert_close(st0["after"][n], want, rtol=1e-6, atol=1e-7)
            continue
        else:
            plan = Plan.from_json(st0["plan"]).at_density(target)
        # the density warm-up: 3 steps in 4 stages (steps 0, 1, 2), then the target
        assert target == pytest.approx(recipe.density_at(s)), (name, s)
        planned += 1
        sparse = {n for n, sp in zip(plan.names, plan.sparse) if sp}
        ref_ranks, buffers = [], []
        for st in steps:
            local, bufs = {}, {}
            for n in names:
                g = st["local"][n] if st["local"][n] is not None else torch.zeros_like(st["before"][n])
                if n in sparse:
                    local[n], bufs[n] = _local_update(kind, group, None, n, g, st["before"][n],
                                                      st["state"], st["own"])
                else:
                    local[n] = g
            ref_ranks.append({"local": local, "residual": st["state"].get("residuals", {}),
                              "synced": st["synced"]})
            buffers.append(bufs)
        sent = []
        want, new_res = reference_step(plan, ref_ranks, sent_out=sent)
        for n, t in want.items():
            torch.testing.assert_close(st0["synced"][n].reshape(-1).double(), t.double(),
                                       rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} step {s} {n}: {m}")
        # "auto" masking: SGD while the density is below 1 - momentum; Adam always
        auto = kind == "adam" or target < 1 - group.get("momentum", 0.0)
        masked = ranks[0]["masking"] is True or (ranks[0]["masking"] == "auto" and auto)
        if s + 1 < len(ranks[0]["steps"]):
            for r, run in enumerate(ranks):
                nxt = run["steps"][s + 1]["state"]
                for n in sparse:
                    torch.testing.assert_close(nxt["residuals"][n].reshape(-1), new_res[r][n],
                                               rtol=1e-5, atol=1e-6)
                    for b, t in buffers[r][n].items():
                        t = t.reshape(-1).clone()
                        if masked and b in ("momentum_buffer", "exp_avg"):
                            t[sent[r][n]] = 0
                        torch.testing.assert_close(nxt[b][n].reshape(-1), t, rtol=1e-5, atol=1e-6,
                                                   msg=lambda m: f"{name} step {s} {n} {b}: {m}")
                        if masked and b in ("momentum_buffer", "exp_avg"):
                            assert not nxt[b][n].reshape(-1)[sent[r][n]].any()
                    # the rule owns the state of sparsified tensors: the optimizer keeps
                    # zero placeholders (same structure on every rank, nothing stale)
                    placeholder = run["steps"][s + 1]["own"][n]
                    assert set(placeholder) == ({"momentum_buffer"} if kind == "momentum"
                                                else {"step", "exp_avg", "exp_avg_sq"}), placeholder
                    assert not any(v.any() for v in placeholder.values()), (name, s, n)
        lr = group["lr"]
        for n in names:
            w, synced = st0["before"][n], st0["synced"][n]
            if n in sparse:  # the synchronized update applied as is (AdamW: decay first)
                want_w = w * (1 - lr * group["weight_decay"]) if group.get("decoupled_weight_decay") else w
                want_w = want_w - lr * synced
            else:
                want_w = _dense_step(group, kind, w, synced, st0["own"].get(n))
            torch.testing.assert_close(st0["after"][n], want_w, rtol=1e-6, atol=1e-7,
                                       msg=lambda m: f"{name} step {s} {n}: {m}")
    return planned


@pytest.mark.multiworker
@pytest.mark.parametrize("name", sorted(CASES))
def test_recipe_matches_reference(runs, name):
    case = CASES[name]
    planned = _check_case(name, case, runs)
    assert planned >= 3, (name, planned)


@pytest.mark.multiworker
def test_checkpoint_restart_is_bit_identical_with_the_recipe(tmp_path):
    cases = [("ssfusion_oi", "sgd", "local"), ("per_tensor", "adam", "local"),
             ("zen", "sgd", "local"), ("spardl", "adamw", "local"), ("exdyna", "sgd", "local"),
             ("ssfusion_oi", "adam", "shared"), ("spardl", "sgd", "shared"),
             ("exdyna", "adamw", "shared"), ("zen", "sgd", "shared")]
    results = run_workers(workers_recipe.checkpoint_all, np=2, timeout=400, cases=cases,
                          ckpt=str(tmp_path))
    for r in results:
        for scheme, optimizer, moments in cases:
            ck = r[f"{scheme}-{optimizer}-{moments}"]
            if moments == "local":
                assert ck["rule"] == ("adam" if optimizer.startswith("adam") else "momentum")
                assert ck["buffers"], (scheme, optimizer)  # the rule's state was in the checkpoint
            else:  # the state is torch's (in the checkpoint's optimizer entries); ours: the ages
                assert not ck["buffers"] and ck["ages"], (scheme, optimizer)
            for n, t in ck["first"].items():
                assert torch.equal(t, ck["second"][n]), (scheme, optimizer, moments, n)


@pytest.mark.parametrize("density,length,start", [
    (0.1, 50, 0.25), (0.01, 50, 0.25), (0.006, 50, 0.15), (0.005, 60, 0.125),
    (0.001, 300, 0.025), (1e-4, 3000, 0.0025)])
def test_auto_warm_up_length_and_stages(density, length, start):
    """``"auto"``: 50 steps from 0.25 down to density 0.01, as DGC's; below it four stages
    from 25 times the target, each 2.24x the next, over the steps in which the target
    sends 30 % of the model (docs/results.md §2b); an int is taken as is."""
    assert warmup_length(density) == length
    assert warmup_length(density, 7) == 7 and warmup_length(density, 0) == 0
    recipe = resolve_recipe(torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=0.1,
                                            momentum=0.9), "ssfusion_oi", density)
    assert recipe.warmup_steps == length
    stages = [recipe.density_at(t) for t in range(length + 2)]
    assert stages[0] == pytest.approx(start) and stages[length] == stages[-1] == density
    edges = [t for t in range(1, len(stages)) if stages[t] != stages[t - 1]]
    assert edges == [-(-length * s // 4) for s in (1, 2, 3, 4)], edges
    ratios = [stages[e - 1] / stages[e] for e in edges]
    assert ratios == pytest.approx([(start / density) ** 0.25] * 4)
    assert resolve_recipe(torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=0.1),
                          "dense", density).warmup_steps == 0
    for bad in ("fast", 2.5, -1, True, None):
        with pytest.raises(ValueError, match="density_warmup_steps"):
            warmup_length(density, bad)
    with pytest.raises(ValueError, match="density must be"):  # not a ZeroDivisionError
        warmup_length(0.0)

