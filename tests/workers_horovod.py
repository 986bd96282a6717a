"""Workers for tests/test_horovod_patterns.py: Horovod's everyday usage patterns, run on
every Horovod rank through tests/_worker.py.

The resume pattern is the one of Horovod's ``examples/pytorch/pytorch_imagenet_resnet50.py``:
every rank builds the model and the optimizer; rank 0 alone loads the checkpoint; then
``hvd.broadcast_parameters`` and ``hvd.broadcast_optimizer_state`` from rank 0.
"""
import os

import horovod.torch as hvd
import torch
import torch.nn as nn

import ssfusion_hvd
from workers_schemes import Net, _batch, profile

SPARSE_KW = dict(density=0.05, warmup_steps=2, density_warmup_steps=3, log_plan=False)


def _optimizer(kind, params, rank_variant=False):
    """The torch optimizer ``kind``; with ``rank_variant`` the hyper-parameters differ per
    rank (a broadcast must replace them with rank 0's)."""
    r = hvd.rank() if rank_variant else 0
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05 + 0.01 * r, momentum=0.9 - 0.2 * r,
                               weight_decay=1e-4)
    if kind == "adam":
        return torch.optim.Adam(params, lr=2e-3 + 1e-3 * r, betas=(0.9 - 0.1 * r, 0.999))
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=2e-3 + 1e-3 * r, weight_decay=0.01 + 0.01 * r)
    return getattr(torch.optim, kind)(params, lr=0.01 + 0.01 * r)


def _wrap(model, kind, scheme, rank_variant=False):
    kw = {} if scheme == "dense" else dict(SPARSE_KW, profile=profile("topk"))
    return ssfusion_hvd.DistributedOptimizer(
        _optimizer(kind, model.parameters(), rank_variant),
        named_parameters=model.named_parameters(), scheme=scheme, **kw)


def _steps(model, opt, steps):
    loss_fn = nn.CrossEntropyLoss()
    for step in steps:
        opt.zero_grad()
        x, y = _batch(step, 0, "float32")
        loss_fn(model(x), y).backward()
        opt.step()


def _torch_state(opt):
    """The wrapped optimizer's state (what Horovod broadcasts), by parameter position."""
    sd = opt.state_dict()
    state = {f"{pid}.{k}": (v.clone() if torch.is_tensor(v) else v)
             for pid, st in sd["state"].items() for k, v in st.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    return state, groups


def _own_state(opt):
    ours = opt.state_dict()["ssfusion"]["state"]
    return {store: {n: t.clone() for n, t in ours.get(store, {}).items()}
            for store in ("residuals", "momentum_buffer", "exp_avg", "exp_avg_sq")}


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def resume(scheme, optimizer, ckpt_dir, own=False, save_at=6, total=10, strip_rank1=False):
    """Trains ``total`` steps straight, saving at ``save_at`` (rank 0: model and optimizer;
    every rank: its own optimizer state). Then a new model and optimizer (other initial
    weights and per-rank hyper-parameters) resume Horovod's way: rank 0 loads (``own``:
    every rank loads its own optimizer state), broadcast_parameters,
    broadcast_optimizer_state, and the remaining steps. ``strip_rank1``: rank 1 loads rank
    0's optimizer checkpoint with every per-rank store removed instead of nothing."""
    torch.manual_seed(1234)
    model = Net()
    opt = _wrap(model, optimizer, scheme)
    _steps(model, opt, range(save_at))
    path = os.path.join(ckpt_dir, f"{scheme}-{optimizer}-rank{hvd.rank()}.pt")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    saved_own = _own_state(opt)
    _steps(model, opt, range(save_at, total))
    straight = _params(model)
    straight_plan = None if opt.plan is None else opt.plan.to_json()
    hvd.barrier()

    torch.manual_seed(99 + hvd.rank())  # other initial weights on every rank
    model = Net()
    opt = _wrap(model, optimizer, scheme, rank_variant=True)
    if hvd.rank() == 0 or own or strip_rank1:
        ckpt = torch.load(path if own else os.path.join(ckpt_dir, f"{scheme}-{optimizer}-rank0.pt"),
                          weights_only=False)
        if hvd.rank() == 0:
            model.load_state_dict(ckpt["model"])
        elif strip_rank1:
            ours = ckpt["opt"]["ssfusion"]["state"]
            for store in ("residuals", "momentum_buffer", "exp_avg", "exp_avg_sq", "steps"):
                ours.pop(store, None)
        opt.load_state_dict(ckpt["opt"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    after_broadcast = _torch_state(opt)
    _steps(model, opt, range(save_at, save_at + 1))
    own_after_adopt = _own_state(opt)
    _steps(model, opt, range(save_at + 1, total))
    return {"straight": straight, "resumed": _params(model), "after_broadcast": after_broadcast,
            "plan": None if opt.plan is None else opt.plan.to_json(), "straight_plan": straight_plan,
            "saved_own": saved_own, "own_after_adopt": own_after_adopt,
            "recipe": (opt.recipe.kind, opt.recipe.hparams)}


def fresh_broadcast(scheme, optimizers, steps=5):
    """The fresh-start pattern for each optimizer: per-rank hyper-parameters and initial
    weights, broadcast_parameters + broadcast_optimizer_state, then training."""
    out = {}
    for kind in optimizers:
        torch.manual_seed(7 + hvd.rank())
        model = Net()
        opt = _wrap(model, kind, scheme, rank_variant=True)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        state, groups = _torch_state(opt)
        _steps(model, opt, range(steps))
        out[kind] = {"state": state, "groups": groups, "params": _params(model),
                     "final_state": _torch_state(opt)[0]}
    return out


def process_sets(scheme, layout, steps=8, probe=False):
    """Disjoint process sets used at once (``layout``: their ranks, covering the job; as
    in Horovod's own optimizer tests): each rank's optimizer synchronizes within its set
    only. Needs HOROVOD_DYNAMIC_PROCESS_SETS=1."""
    sets = [hvd.add_process_set(ranks) for ranks in layout]
    mine = next(ps for ps, ranks in zip(sets, layout) if hvd.rank() in ranks)
    torch.manual_seed(1234)
    model = Net()
    kw = {} if scheme == "dense" else dict(SPARSE_KW, profile=None if probe else profile("topk"))
    opt = ssfusion_hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(), scheme=scheme, process_set=mine, **kw)
    _steps(model, opt, range(steps))
    out = {"params": _params(model), "stats": opt.stats(),
           "plan": None if opt.plan is None else opt.plan.to_json()}
    hvd.barrier()
    for ps in sets:
        hvd.remove_process_set(ps)
    return out
