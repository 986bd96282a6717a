"""Worker functions for tests/test_recipe.py (run on every Horovod rank).

Each run records, per step and per rank, everything a reference needs to rebuild the
step with the training recipe applied: the parameters, the scheme's state (residuals and
the local rule's buffers per parameter name) and the wrapped optimizer's own state before
the step, the local gradients, the synchronized gradients, the plan and the density in
force, and the parameters after ``step()``.
"""
import horovod.torch as hvd
import torch
import torch.nn as nn

import ssfusion_hvd
from workers_schemes import _batch, _model, _train_steps, mixed_plan, profile

OPTIMIZERS = {
    "sgd": lambda ps, wd, nesterov: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=wd,
                                                     nesterov=nesterov),
    "sgd_damp": lambda ps, wd, nesterov: torch.optim.SGD(ps, lr=0.05, momentum=0.8, dampening=0.1,
                                                          weight_decay=wd),
    "adam": lambda ps, wd, nesterov: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.95), weight_decay=wd),
    "adamw": lambda ps, wd, nesterov: torch.optim.AdamW(ps, lr=0.01, weight_decay=wd),
}


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


def record(scheme, optimizer="sgd", steps=6, warmup=2, forced=False, density=0.05, wd=1e-3,
           nesterov=False, masking="auto", density_warmup=3, dtype="float32"):
    """(the local rules: ``moments="local"``; tests/test_moments.py covers the shared ones)"""
    model = _model(dtype)
    named = sorted(model.named_parameters())
    names = [n for n, _ in named]
    params = [p for _, p in named]
    name_of = {p: n for n, p in named}
    inner = OPTIMIZERS[optimizer](model.parameters(), wd, nesterov)
    opt = ssfusion_hvd.DistributedOptimizer(
        inner, named_parameters=model.named_parameters(), scheme=scheme, density=density,
        warmup_steps=warmup, profile=profile("topk"), plan=mixed_plan(density) if forced else None,
        log_plan=False, density_warmup_steps=density_warmup, momentum_masking=masking,
        moments="local")
    loss_fn = nn.CrossEntropyLoss()
    out = []
    for step in range(steps):
        opt.zero_grad()
        state = _clone(opt.state_dict()["ssfusion"]["state"])
        own = {name_of[p]: _clone(dict(s)) for p, s in opt.state.items()}
        before = {n: p.detach().clone() for n, p in named}
        plan = None if opt.plan is None else opt.plan.to_json()
        x, y = _batch(step, 0, dtype)
        grads = torch.autograd.grad(loss_fn(model(x).float(), y), params, allow_unused=True)
        local = {n: (None if g is None else g.detach().clone()) for n, g in zip(names, grads)}
        loss_fn(model(x).float(), y).backward()
        opt.synchronize()
        synced = {n: p.grad.detach().clone() for n, p in named if p.grad is not None}
        with opt.skip_synchronize():
            opt.step()
        out.append({"plan": plan, "state": state, "own": own, "before": before, "local": local,
                    "synced": synced, "stats": opt.stats(),
                    "after": {n: p.detach().clone() for n, p in named}})
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {"steps": out, "names": names, "group": groups[0],
            "recipe": opt.recipe.kind, "masking": opt.recipe.hparams.get("masking")}


def record_all(cases):
    return {name: record(**kw) for name, kw in cases.items()}


def checkpoint(scheme, optimizer, ckpt, moments, save_at=4, total=8):
    """Uninterrupted run saving every rank's (model, optimizer) at ``save_at``, then a new
    model and optimizer resumed from that file: the parameters must match bit for bit."""
    import os

    def build(seed):
        model = _model("float32")
        if seed is not None:
            torch.manual_seed(seed)
            model = type(model)()
        opt = ssfusion_hvd.DistributedOptimizer(
            OPTIMIZERS[optimizer](model.parameters(), 1e-3, False),
            named_parameters=model.named_parameters(), scheme=scheme, density=0.05,
            warmup_steps=2, profile=profile("topk"), log_plan=False, density_warmup_steps=6,
            moments=moments)
        return model, opt

    model, opt = build(None)
    _train_steps(model, opt, range(save_at))
    path = os.path.join(ckpt, f"{scheme}-{optimizer}-{moments}-rank{hvd.rank()}.pt")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    _train_steps(model, opt, range(save_at, total))
    first = {n: p.detach().clone() for n, p in model.named_parameters()}
    model2, opt2 = build(99 + hvd.rank())  # other weights: everything must come from the file
    state = torch.load(path, weights_only=False)
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    _train_steps(model2, opt2, range(save_at, total))
    second = {n: p.detach().clone() for n, p in model2.named_parameters()}
    saved = state["opt"]["ssfusion"]["state"]
    return {"first": first, "second": second, "rule": saved.get("rule"),
            "buffers": sorted(k for k in ("momentum_buffer", "exp_avg") if saved.get(k)),
            "ages": sorted(state["opt"]["ssfusion"].get("ages") or ())}


def checkpoint_all(cases, ckpt):
    return {f"{s}-{o}-{m}": checkpoint(s, o, ckpt, m) for s, o, m in cases}
