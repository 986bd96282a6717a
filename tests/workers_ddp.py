"""Workers for tests/test_ddp.py, run on gloo process groups by tests/ddprun.py: DDP with
the ssfusion_hvd.ddp hook; each records its own gradients (from a copy of the model outside
DDP) and the synchronized ones, step by step, with the buckets the hook met."""
import copy

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import ssfusion_hvd.ddp


def _model():
    """Three linear layers with tanh between them (not ReLU: a dead unit's gradient is
    exactly zero, which the shared moments read as "not arrived", docs/recipe.md §1, so
    the dense-limit test would not be the optimizer's step exactly where AdamW folds no
    weight decay into the gradient)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                               torch.nn.Tanh(), torch.nn.Linear(32, 10))


def _batch(rank: int, step: int, device="cpu"):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(8, 20, generator=g).to(device),
            torch.randint(0, 10, (8,), generator=g).to(device))


def _steps(ddp, ref, hook, rank, steps, out, no_sync=False, device="cpu"):
    """Gradients of ``steps`` steps (no optimizer: the weights stay, so ``ref`` computes
    this rank's own gradients of the same batches); with ``no_sync`` each step first
    accumulates one extra batch under ``ddp.no_sync()``. Recorded on the CPU."""
    for step in steps:
        ddp.zero_grad()
        ref.zero_grad()
        if no_sync:
            x, y = _batch(rank + 100, step, device)
            with ddp.no_sync():
                F.cross_entropy(ddp(x), y).backward()
            F.cross_entropy(ref(x), y).backward()
        x, y = _batch(rank, step, device)
        F.cross_entropy(ddp(x), y).backward()
        F.cross_entropy(ref(x), y).backward()
        out["local"].append({n: p.grad.to("cpu", copy=True) for n, p in ref.named_parameters()})
        out["synced"].append({n: p.grad.to("cpu", copy=True) for n, p in ddp.module.named_parameters()})
        out["buckets"].append(hook.bucket_names() if hook is not None else None)


def record(rank, world, scheme, density, steps=4, bucket_cap_mb=0.004, no_sync=False,
           as_view=False, warmup=0, device="cpu", piece_bytes=None):
    """``device="cuda"``: every rank on GPU 0 (gloo: ranks sharing one GPU; NCCL: one rank).
    ``piece_bytes``: allgather records larger than this in pieces (the hook's threshold)."""
    if piece_bytes is not None:
        ssfusion_hvd.ddp.ALLGATHER_PIECE_BYTES = piece_bytes
    model = _model().to(device)
    ref = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=as_view)
    hook = ssfusion_hvd.ddp.register(ddp, scheme=scheme, density=density,
                                     density_warmup_steps=warmup)
    out = {"local": [], "synced": [], "buckets": []}
    _steps(ddp, ref, hook, rank, range(steps), out, no_sync, device)
    out["pieces"] = max((b.pieces for _, b in hook._buckets.values()), default=1)
    return out


def plan_for(model, scheme, density, world, dense=()):
    """``make_plan`` on a slow link (two or more buckets), with the tensors ``dense`` then
    sent dense by allreduce, as Eq. 2 leaves small tensors dense on a real model's plan (on
    this small model it leaves none), and each bucket's first tensor's k doubled, as
    compensation raises the others' (so the reference must read the plan's ks)."""
    import dataclasses

    from ssfusion_hvd.plan import ALLREDUCE, CostModel, Group, default_backward_times

    sizes = [p.numel() for p in model.parameters()][::-1]
    fit = {"topk": {"cpu": (2e-5, 3e-10), "gpu": (2e-5, 3e-10)}}
    cost = CostModel.from_network(1e7, 50e-6, world, default_backward_times(sizes), sparsify=fit)
    plan = ssfusion_hvd.ddp.make_plan(model, cost, scheme, density)
    if len(plan.groups) < 2 and len(plan.sizes) > 2:  # (ssfusion's accuracy rule: one group)
        plan = dataclasses.replace(plan, groups=[Group(0, 2), Group(2, len(plan.sizes))])
    sparse, k, coll = list(plan.sparse), list(plan.k), list(plan.collective)
    for i, n in enumerate(plan.names):
        if n in dense:
            sparse[i], k[i], coll[i] = False, plan.sizes[i], ALLREDUCE
    for g in plan.groups:
        first = next((i for i in g.indices() if sparse[i]), None)
        if first is not None:
            k[first] = min(plan.sizes[first], 2 * k[first])
    return dataclasses.replace(plan, sparse=sparse, k=k, collective=coll)


def planned(rank, world, scheme, density, steps=4, dense=(), warmup=0):
    """``record`` with a plan: DDP built with ``ddp_kwargs(plan)``, the hook given it."""
    model = _model()
    ref = copy.deepcopy(model)
    plan = plan_for(model, scheme, density, world, dense)
    ddp = DDP(model, **ssfusion_hvd.ddp.ddp_kwargs(plan))
    hook = ssfusion_hvd.ddp.register(ddp, scheme=scheme, density=density,
                                     density_warmup_steps=warmup, plan=plan)
    out = {"local": [], "synced": [], "buckets": [], "bytes": []}
    for step in range(steps):
        _steps(ddp, ref, hook, rank, [step], out)
        out["bytes"].append(hook.bytes_sent)
    out["plan"] = {n: (s, k) for n, s, k in zip(plan.names, plan.sparse, plan.k)}
    out["groups"] = [tuple(plan.names[g.start:g.end]) for g in plan.groups]
    return out


def disagree(rank, world):
    """Rank 1 registers another density than rank 0, then a plan only rank 0 has: each
    raises on every rank; then one collective that completes only if no rank hangs."""
    ddp = DDP(_model())
    errors = []
    for kw in ({"density": 0.1 if rank == 0 else 0.2},
               {"plan": plan_for(_model(), "ssfusion", 0.01, world) if rank == 0 else None}):
        try:
            ssfusion_hvd.ddp.register(ddp, **kw)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    bad = {}
    plan = plan_for(_model(), "ssfusion", 0.01, world)
    for label, kw in {"scheme": {"scheme": "per_tensor", "density": 0.01},
                      "density": {"density": 0.02}, "not a plan": {"plan": "plan.json"},
                      "world": {"plan": plan_for(_model(), "ssfusion", 0.01, world + 1)},
                      "model": {"plan": plan_for(torch.nn.Linear(3, 3), "ssfusion", 0.01, world)}
                      }.items():
        kw = {"density": 0.01, "plan": plan, **kw}
        try:
            ssfusion_hvd.ddp.register(ddp, **kw)
            bad[label] = None
        except ValueError as e:
            bad[label] = str(e)
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    return {"errors": errors, "bad": bad, "sum": float(t)}


def resume(rank, world, scheme, density, steps=5, split=3, bucket_cap_mb=0.004, dense=None):
    """The synchronized gradients of ``steps`` steps, run through, and run as ``split``
    steps, a checkpoint of the hook, and the rest on a new DDP model and hook that load it.
    ``dense``: under a plan that sends these tensors dense (DDP built with its buckets)."""
    plan = None if dense is None else plan_for(_model(), scheme, density, world, dense)
    kw = ssfusion_hvd.ddp.ddp_kwargs(plan) if plan else {"bucket_cap_mb": bucket_cap_mb}
    through = {"local": [], "synced": [], "buckets": []}
    model = _model()
    ddp = DDP(model, **kw)
    hook = ssfusion_hvd.ddp.register(ddp, scheme=scheme, density=density, density_warmup_steps=0,
                                     plan=plan)
    _steps(ddp, copy.deepcopy(model), hook, rank, range(steps), through)
    resumed = {"local": [], "synced": [], "buckets": []}
    model = _model()
    ddp = DDP(model, **kw)
    hook = ssfusion_hvd.ddp.register(ddp, scheme=scheme, density=density, density_warmup_steps=0,
                                     plan=plan)
    _steps(ddp, copy.deepcopy(model), hook, rank, range(split), resumed)
    saved = copy.deepcopy(hook.state_dict())
    model = _model()
    ddp = DDP(model, **kw)
    hook = ssfusion_hvd.ddp.register(ddp, scheme=scheme, density=density, density_warmup_steps=0,
                                     plan=plan)
    hook.load_state_dict(saved)
    _steps(ddp, copy.deepcopy(model), hook, rank, range(split, steps), resumed)
    return {"through": through["synced"], "resumed": resumed["synced"]}


def bad_input(rank, world):
    """Each bad argument's error on this rank, then one collective that completes only if
    every rank got here (nothing before it ran a collective on a subset of the ranks)."""
    ddp = DDP(_model())
    errors = {}
    for kw in ({"scheme": "nope"}, {"density": 0.0}, {"density": 1.5}, {"sparsifier": "x"},
               {"density_warmup_steps": -1}, {"density_warmup_steps": "fast"},
               {"scheme": "ssfusion", "sparsifier": "randomk"},
               {"momentum_correction": True}, {"optimizer": "sgd"},
               {"optimizer": torch.optim.SGD(_model().parameters(), lr=0.1)},
               {"optimizer": torch.optim.SGD(ddp.parameters(), lr=0.1), "momentum_correction": True},
               {"grad_scaler": torch.amp.GradScaler("cpu")}, {"grad_scaler": 2.0}):
        label = str({k: v if isinstance(v, (str, int, float)) else type(v).__name__
                     for k, v in kw.items()})  # (the same on every rank)
        try:
            ssfusion_hvd.ddp.register(ddp, **kw)
            errors[label] = None
        except ValueError as e:
            errors[label] = str(e)
    try:
        ssfusion_hvd.ddp.register(_model())
    except ValueError as e:
        errors["not ddp"] = str(e)
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    return {"errors": errors, "sum": float(t)}


def _optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2, weight_decay=1e-2)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=1e-2)


def dense_limit(rank, world, kind, scheme="per_tensor", steps=6, dense=None):
    """Parameters after ``steps`` optimizer steps: DDP's own average with the optimizer,
    and the hook at density 1 with the optimizer's side of the recipe (shared moments),
    which there is exactly the optimizer on the averaged gradient. ``dense``: with a plan
    that sends these tensors dense (the optimizer's own step moves them, decay included)."""
    out = {}
    for label in ("ddp", "hook"):
        model = _model()
        plan = None if dense is None else plan_for(model, scheme, 1.0, world, dense)
        ddp = DDP(model, **(ssfusion_hvd.ddp.ddp_kwargs(plan) if plan else {"bucket_cap_mb": 0.004}))
        opt = _optimizer(kind, model.parameters())
        if label == "hook":
            hook = ssfusion_hvd.ddp.register(ddp, scheme=scheme, density=1.0, optimizer=opt,
                                             density_warmup_steps=0, plan=plan)
            assert hook.recipe.shared is not None and hook.recipe.corrects()
        for step in range(steps):
            x, y = _batch(rank, step)
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        out[label] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out



def scaler_steps(rank, world, steps, poison=None, scheme="ssfusion", dense=None):
    """SGD with momentum under a GradScaler whose scale grows every other step: the
    parameters and this rank's residuals after ``steps``. ``poison``: the step whose loss
    is infinite on rank 1 (GradScaler skips it on every rank). ``dense``: under a plan
    that sends these tensors dense."""
    model = _model()
    plan = None if dense is None else plan_for(model, scheme, 0.1, world, dense)
    ddp = DDP(model, **(ssfusion_hvd.ddp.ddp_kwargs(plan) if plan else {"bucket_cap_mb": 0.004}))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    hook = ssfusion_hvd.ddp.register(ddp, scheme=scheme, density=0.1, optimizer=opt,
                                     grad_scaler=scaler, density_warmup_steps=0, plan=plan)
    scales = []
    for step in steps:
        x, y = _batch(rank, step)
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        if step == poison and rank == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
    ddp.zero_grad()
    x, y = _batch(rank, 99)  # one more step's first bucket: a skipped last step is undone
    scaler.scale(F.cross_entropy(ddp(x), y)).backward()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "residuals": hook.state_dict()["residuals"], "scales": scales}


if __name__ == "__main__":
    # under torchrun (tests/test_ddp.py): the process group from torchrun's environment
    import os
    import sys

    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = record(rank, world, scheme="ssfusion", density=0.1)
    torch.save(result, os.path.join(sys.argv[1], f"rank{rank}.pt"))
    dist.barrier()  # (see tests/ddprun.py)
    dist.destroy_process_group()


def measured(rank, world, density=0.1):
    """``measure_cost`` on this job (each rank its own batch), the plan made from it, and
    one step of DDP with the plan's buckets and the hook: what every rank got."""
    model = _model()
    x, y = _batch(rank, 0)
    cost = ssfusion_hvd.ddp.measure_cost(model, lambda: F.cross_entropy(model(x), y).backward(),
                                         density=density)
    grads_left = [p.grad for p in model.parameters() if p.grad is not None]
    plan = ssfusion_hvd.ddp.make_plan(model, cost, "ssfusion", density)
    ddp = DDP(model, **ssfusion_hvd.ddp.ddp_kwargs(plan))
    hook = ssfusion_hvd.ddp.register(ddp, density=density, plan=plan, density_warmup_steps=0)
    out = {"local": [], "synced": [], "buckets": []}
    _steps(ddp, copy.deepcopy(model), hook, rank, range(2), out)
    return {"cost": cost.to_json(), "plan": plan.to_json(), "grads_left": len(grads_left),
            "synced": out["synced"]}


def adam_selection(rank, world, select_by, steps=5, density=0.1):
    """The hook with Adam (shared moments) at ``density``: per step this rank's residuals,
    parameters, own gradient and Adam state before the step, its residuals after, and the
    buckets (what tests/test_ddp.py rebuilds each rank's selection from)."""
    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.004)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-2)
    hook = ssfusion_hvd.ddp.register(ddp, scheme="ssfusion", density=density, optimizer=opt,
                                     density_warmup_steps=0, select_by=select_by)
    named = dict(model.named_parameters())
    out = []
    for step in range(steps):
        x, y = _batch(rank, step)
        opt.zero_grad()
        before = {"residuals": {n: r.clone() for n, r in hook.state_dict()["residuals"].items()},
                  "params": {n: p.detach().clone() for n, p in named.items()},
                  "state": {n: {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                for k, v in opt.state[p].items()} for n, p in named.items()}}
        grads = torch.autograd.grad(F.cross_entropy(model(x), y), list(named.values()))
        before["local"] = {n: g.detach().clone() for n, g in zip(named, grads)}
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        before["after"] = {n: r.clone() for n, r in hook.state_dict()["residuals"].items()}
        before["buckets"] = hook.bucket_names()
        out.append(before)
    return {"steps": out, "group": {k: v for k, v in opt.param_groups[0].items() if k != "params"}}


def resume_adam(rank, world, scheme, density, bucket_cap_mb, steps=6, split=3):
    """Adam under the hook (shared moments, each sender's spread on the wire): the
    parameters after each of ``steps`` steps run through, and run as ``split`` steps, a
    checkpoint (model, optimizer, hook), and the rest on a new model, DDP, optimizer and
    hook that load it."""
    def build():
        model = _model()
        ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
        opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
        hook = ssfusion_hvd.ddp.register(ddp, scheme=scheme, density=density,
                                         density_warmup_steps=0, optimizer=opt)
        return ddp, opt, hook

    def train(ddp, opt, span, out):
        for step in span:
            opt.zero_grad()
            x, y = _batch(rank, step)
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            out.append({n: p.detach().clone() for n, p in ddp.module.named_parameters()})

    through, resumed = [], []
    ddp, opt, hook = build()
    train(ddp, opt, range(steps), through)
    ddp, opt, hook = build()
    train(ddp, opt, range(split), resumed)
    saved = copy.deepcopy({"model": ddp.module.state_dict(), "opt": opt.state_dict(),
                           "hook": hook.state_dict()})
    ddp, opt, hook = build()
    ddp.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    hook.load_state_dict(saved["hook"])
    train(ddp, opt, range(split, steps), resumed)
    return {"through": through, "resumed": resumed, "spread": hook.spread,
            "squares": {n: float(t.abs().sum()) for n, t in saved["hook"]["squares"].items()},
            "waits": {n: int(t.max()) for n, t in saved["hook"]["waits"].items()},
            "noise": sum(float(r.abs().sum()) for r in hook.noise.values())}
