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


def resume(rank, world, scheme, density, steps=5, split=3, bucket_cap_mb=0.004):
    """The synchronized gradients of ``steps`` steps, run through, and run as ``split``
    steps, a checkpoint of the hook, and the rest on a new DDP model and hook that load it."""
    through = {"local": [], "synced": [], "buckets": []}
    model = _model()
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    hook = ssfusion_hvd.ddp.register(ddp, scheme=scheme, density=density, density_warmup_steps=0)
    _steps(ddp, copy.deepcopy(model), hook, rank, range(steps), through)
    resumed = {"local": [], "synced": [], "buckets": []}
    model = _model()
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    hook = ssfusion_hvd.ddp.register(ddp, scheme=scheme, density=density, density_warmup_steps=0)
    _steps(ddp, copy.deepcopy(model), hook, rank, range(split), resumed)
    saved = copy.deepcopy(hook.state_dict())
    model = _model()
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    hook = ssfusion_hvd.ddp.register(ddp, scheme=scheme, density=density, density_warmup_steps=0)
    hook.load_state_dict(saved)
    _steps(ddp, copy.deepcopy(model), hook, rank, range(split, steps), resumed)
    return {"through": through["synced"], "resumed": resumed["synced"]}


def bad_input(rank, world):
    """Each bad argument's error on this rank, then one collective that completes only if
    every rank got here (nothing before it ran a collective on a subset of the ranks)."""
    ddp = DDP(_model())
    errors = {}
    for kw in ({"scheme": "nope"}, {"density": 0.0}, {"density": 1.5}, {"sparsifier": "x"},
               {"density_warmup_steps": -1}, {"scheme": "ssfusion", "sparsifier": "randomk"},
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


def dense_limit(rank, world, kind, scheme="per_tensor", steps=6):
    """Parameters after ``steps`` optimizer steps: DDP's own average with the optimizer,
    and the hook at density 1 with the optimizer's side of the recipe (shared moments),
    which there is exactly the optimizer on the averaged gradient."""
    out = {}
    for label in ("ddp", "hook"):
        model = _model()
        ddp = DDP(model, bucket_cap_mb=0.004)
        opt = _optimizer(kind, model.parameters())
        if label == "hook":
            hook = ssfusion_hvd.ddp.register(ddp, scheme=scheme, density=1.0, optimizer=opt,
                                             density_warmup_steps=0)
            assert hook.recipe.shared is not None and hook.recipe.corrects()
        for step in range(steps):
            x, y = _batch(rank, step)
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        out[label] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out



def scaler_steps(rank, world, steps, poison=None, scheme="ssfusion"):
    """SGD with momentum under a GradScaler whose scale grows every other step: the
    parameters and this rank's residuals after ``steps``. ``poison``: the step whose loss
    is infinite on rank 1 (GradScaler skips it on every rank)."""
    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    hook = ssfusion_hvd.ddp.register(ddp, scheme=scheme, density=0.1, optimizer=opt,
                                     grad_scaler=scaler, density_warmup_steps=0)
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
