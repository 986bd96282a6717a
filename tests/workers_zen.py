"""Worker functions for tests/test_zen.py (run on every Horovod rank).

``run_all`` runs every case of one launch (one launch per world size keeps the suite fast):
recorded runs of ``scheme="zen"`` (local gradients by autograd.grad, residuals and sparsifier
state before each step, synchronized gradients, stats), a checkpoint restart, a short
training run whose loss must fall, and non-finite gradients from one rank. The test rebuilds
the synchronized gradient from the recorded inputs alone.
"""
import copy

import torch
import torch.nn as nn

import ssfusion_hvd
import workers_schemes
from workers_schemes import DTYPES, OPS, _batch, _model, _train_steps

# this worker process also runs bfloat16 (Horovod's allgather has no bfloat16: ZEN sends bytes)
DTYPES.setdefault("bfloat16", torch.bfloat16)



def _opt(model, sparsifier="topk", density=0.05, op="average", predivide=1.0, momentum=0.0,
         lr=0.05, warmup=None, **kw):
    # warmup: the recipe's density warm-up (None: the product default)
    if warmup is not None:
        kw["density_warmup_steps"] = warmup
    return ssfusion_hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
        named_parameters=model.named_parameters(), scheme="zen", sparsifier=sparsifier,
        density=density, op=OPS[op], gradient_predivide_factor=predivide, **kw)


def _scheme_state(opt):
    state = opt.state_dict()["ssfusion"]["state"]
    return ({k: v.clone() for k, v in state["residuals"].items()}, state["sparsifier"])


def record(steps=4, op="average", predivide=1.0, dtype="float32", sparsifier="topk",
           density=0.05):
    model = _model(dtype)
    # a short density warm-up: the recorded steps cover its stages and the target
    opt = _opt(model, sparsifier, density, op, predivide, warmup=2)
    named = sorted(model.named_parameters())  # the scheme's canonical (name-sorted) order
    names, params = [n for n, _ in named], [p for _, p in named]
    loss_fn = nn.CrossEntropyLoss()
    out = []
    for step in range(steps):
        opt.zero_grad()
        residual, sparsifier_state = _scheme_state(opt)
        x, y = _batch(step, 0, dtype)
        grads = torch.autograd.grad(loss_fn(model(x).float(), y), params, allow_unused=True)
        local = {n: (None if g is None else g.detach().clone()) for n, g in zip(names, grads)}
        loss_fn(model(x).float(), y).backward()
        opt.synchronize()
        synced = {n: p.grad.detach().clone() for n, p in zip(names, params)}
        with opt.skip_synchronize():
            opt.step()
        out.append({"residual": residual, "sparsifier": sparsifier_state, "local": local,
                    "synced": synced, "stats": opt.stats()})
    return {"steps": out, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "names": names}


def checkpoint(save_at=3, total=6):
    """Uninterrupted run vs. a new model+optimizer restored at ``save_at`` (same launch)."""
    model = _model("float32")
    opt = _opt(model, momentum=0.9)
    _train_steps(model, opt, range(save_at))
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "opt": copy.deepcopy(opt.state_dict())}  # momentum buffers are live tensors
    _train_steps(model, opt, range(save_at, total))
    torch.manual_seed(99)
    other = type(model)()  # different weights: everything must come from the checkpoint
    opt2 = _opt(other, momentum=0.9)
    other.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    _train_steps(other, opt2, range(save_at, total))
    return {"straight": {n: p.detach().clone() for n, p in model.named_parameters()},
            "resumed": {n: p.detach().clone() for n, p in other.named_parameters()},
            "had_residuals": bool(saved["opt"]["ssfusion"]["state"]["residuals"])}


def train(steps=60, density=0.05, **recipe):
    """Loss on this rank's fixed data before and after training with scheme='zen'."""
    model = _model("float32")
    opt = _opt(model, density=density, lr=0.1, momentum=0.9, **recipe)
    loss_fn = nn.CrossEntropyLoss()
    data = [_batch(b, 0, "float32") for b in range(4)]

    def full_loss():
        with torch.no_grad():
            return sum(float(loss_fn(model(x), y)) for x, y in data) / len(data)

    before = full_loss()
    for step in range(steps):
        opt.zero_grad()
        x, y = data[step % len(data)]
        loss_fn(model(x), y).backward()
        opt.step()
    return {"before": before, "after": full_loss(), "stats": opt.stats()}


def nonfinite():
    """Rank 1 poisons a.weight and c.bias at step 3 (``workers_schemes.nonfinite``)."""
    return workers_schemes.nonfinite("zen")


def run_all(cases):
    """Every case of this launch, in order (each builds its own model and optimizer)."""
    out = {}
    for name, (func, kwargs) in cases.items():
        out[name] = globals()[func](**kwargs)
    return out
