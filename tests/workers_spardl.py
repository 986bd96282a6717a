"""Worker functions for tests/test_spardl.py (run on every Horovod rank).

``run_all`` runs every case of one launch. First it builds an optimizer whose team count
does not divide the number of workers: every rank must raise ValueError (and the launch go
on). Then for each team count ``d`` (``scheme_options={"teams": d}``) it records a few
steps with Average and with Sum (local gradients by autograd.grad, residuals and B-SAG
state before the step, the synchronized gradients, stats), checks a
state_dict/load_state_dict round trip, and trains the tiny model of
tests/workers_schemes.py.
"""
import io

import horovod.torch as hvd
import torch
import torch.nn as nn

import ssfusion_hvd
from workers_schemes import OPS, _batch, _model


def _state(opt):
    return opt.state_dict()["ssfusion"]["state"]


def _optimizer(model, teams, op="average", predivide=1.0, density=0.05, lr=0.05, momentum=0.0,
               warmup=100, optimizer="sgd", select_by=None):
    inner = (torch.optim.Adam(model.parameters(), lr=0.01) if optimizer == "adam" else
             torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum))
    return ssfusion_hvd.DistributedOptimizer(
        inner,
        named_parameters=model.named_parameters(), scheme="spardl", density=density,
        op=OPS[op], gradient_predivide_factor=predivide, density_warmup_steps=warmup,
        scheme_options={"teams": teams} if select_by is None else
        {"teams": teams, "select_by": select_by})


def bad_teams(teams):
    """The ValueError of a team count that does not divide the number of workers."""
    try:
        _optimizer(_model("float32"), teams)
    except ValueError as exc:
        return str(exc)
    return None


def record(teams, steps=4, op="average", predivide=1.0, dtype="float32", density=0.05,
           optimizer="sgd", select_by=None):
    """``optimizer="adam"``: shared moments (the default), so from the second step every
    selection is by the pending step; each step also records Adam's state before it."""
    model = _model(dtype)
    # a short density warm-up: the recorded steps cross its stages (new layouts)
    opt = _optimizer(model, teams, op, predivide, density, warmup=2, optimizer=optimizer,
                     select_by=select_by)
    names = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    params = dict(model.named_parameters())
    loss_fn = nn.CrossEntropyLoss()
    out = []
    for step in range(steps):
        opt.zero_grad()
        state = _state(opt)
        adam = {n: (float(opt.state[params[n]]["step"]),
                    opt.state[params[n]]["exp_avg_sq"].detach().clone())
                for n in names if "exp_avg_sq" in opt.state.get(params[n], {})}
        x, y = _batch(step, 0, dtype)
        grads = torch.autograd.grad(loss_fn(model(x).float(), y), [params[n] for n in names],
                                    allow_unused=True)
        local = {n: (torch.zeros_like(params[n]) if g is None else g.detach().clone())
                 for n, g in zip(names, grads)}
        loss_fn(model(x).float(), y).backward()
        opt.synchronize()
        synced = {n: params[n].grad.detach().clone() for n in names}
        with opt.skip_synchronize():
            opt.step()
        out.append({"residual": {k: v.clone() for k, v in state["residuals"].items()},
                    "adam": adam,
                    "bsag": state["bsag"], "local": local, "synced": synced,
                    "stats": opt.stats()})
    final = _state(opt)
    return {"names": names, "steps": out, "final_residual": final["residuals"],
            "final_bsag": final["bsag"], "teams": teams, "op": op, "density": density,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _train(model, opt, steps, dtype="float32"):
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    for step in steps:
        opt.zero_grad()
        x, y = _batch(step % 2, 0, dtype)  # two fixed batches per rank
        loss = loss_fn(model(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(hvd.allreduce(loss.detach(), name="spardl.test.loss").item())
    return losses


def checkpoint(teams, save_at=3, total=7):
    """Saves (model, optimizer) at ``save_at``, runs on; then a fresh model and optimizer
    load the saved state and run the same steps: parameters must match bit for bit."""
    model = _model("float32")
    opt = _optimizer(model, teams, momentum=0.9)
    _train(model, opt, range(save_at))
    file = _through_file({"model": model.state_dict(), "opt": opt.state_dict()})
    saved = _state(opt)
    _train(model, opt, range(save_at, total))
    first = {n: p.detach().clone() for n, p in model.named_parameters()}

    torch.manual_seed(99 + hvd.rank())  # different weights: everything must come from the file
    model2 = type(model)()
    opt2 = _optimizer(model2, teams, momentum=0.9)
    for obj, key in ((model2, "model"), (opt2, "opt")):
        obj.load_state_dict(file[key])
    loaded = _state(opt2)
    _train(model2, opt2, range(save_at, total))
    second = {n: p.detach().clone() for n, p in model2.named_parameters()}
    return {"saved": saved, "loaded": loaded, "first": first, "second": second}


def _through_file(obj):
    """``obj`` saved with torch.save and loaded back (copies, as a checkpoint file holds)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def train(teams, op="average", steps=30, lr=1.0, density=0.1):
    model = _model("float32")
    opt = _optimizer(model, teams, op, density=density,
                     lr=lr if op == "average" else lr / hvd.size())
    losses = _train(model, opt, range(steps))
    return {"losses": losses, "stats": opt.stats(),
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def run_all(teams, steps=4, train_steps=30):
    out = {"bad_teams": bad_teams(hvd.size() + 1)}
    for d in teams:
        out[("record", d, "average")] = record(d, steps=steps)
        out[("record", d, "sum")] = record(d, steps=steps, op="sum")
        out[("record", d, "adam")] = record(d, steps=steps, optimizer="adam")
        out[("checkpoint", d)] = checkpoint(d)
        out[("train", d, "average")] = train(d, steps=train_steps)
        out[("train", d, "sum")] = train(d, "sum", steps=train_steps)
    # by the step, at a density where the gain's key would select otherwise
    out["adam_step"] = record(max(teams), steps=8, optimizer="adam", select_by="step",
                              density=0.2)
    if 1 in teams:  # other dtypes and the predivide factor, plain SRS
        out[("record", 1, "predivide")] = record(1, steps=3, predivide=2.0)
        out[("record", 1, "float16")] = record(1, steps=3, dtype="float16")
    return out
