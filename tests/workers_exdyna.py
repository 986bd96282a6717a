"""Worker functions for tests/test_exdyna.py (run on every Horovod rank).

``record`` drives ``DistributedOptimizer(scheme="exdyna")`` and keeps, per step and rank,
what the reference needs: the scheme's state before the step (threshold, partitions,
iteration, residuals), the local gradients, the indices this rank selected, the
synchronized gradients and ``stats()``. Two models: :class:`Synthetic`, whose gradient is
exactly a fixed random vector plus per-rank noise (a stationary stream, for the density
test), and the tiny ``Net`` of tests/workers_schemes.py (real gradients, an unused layer).
"""
import copy
import io

import horovod.torch as hvd
import torch
import torch.nn as nn

import ssfusion_hvd
from workers_schemes import DTYPES, OPS, Net, _batch, _train_steps

SHAPES = {"w0": (30, 40), "w1": (40,), "w2": (25, 36), "w3": (17,), "w4": (8, 8)}  # 2221 elements


class Synthetic(nn.Module):
    """``loss = sum_p <p, c_p>``: the gradient of p is c_p exactly, whatever p is."""

    def __init__(self):
        super().__init__()
        for n, s in SHAPES.items():
            setattr(self, n, nn.Parameter(torch.zeros(s)))
        g = torch.Generator().manual_seed(7)  # the same fixed part on every rank
        # skewed: w0 (the first partition at P=2) carries larger gradients, so Algorithm 3
        # has something to balance
        self.fixed = {n: torch.randn(s, generator=g) * (3.0 if n == "w0" else 1.0)
                      for n, s in SHAPES.items()}

    def stream(self, step):
        g = torch.Generator().manual_seed(100_000 * (hvd.rank() + 1) + step)
        return {n: f + 2.0 * torch.randn(f.shape, generator=g) for n, f in self.fixed.items()}

    def loss(self, c):
        return sum((getattr(self, n) * c[n]).sum() for n in SHAPES)


def _scheme_state(opt):
    state = opt.state_dict()["ssfusion"]["state"]
    return {"exdyna": copy.deepcopy(state["exdyna"]),
            "residuals": {k: v.clone() for k, v in state["residuals"].items()}}


def _optimizer(model, density, op="average", predivide=1.0, lr=0.01, momentum=0.0, warmup=0,
               optimizer="sgd", select_by=None):
    # density warm-up off unless asked: the stream cases measure Algorithm 5's tracking
    inner = (torch.optim.Adam(model.parameters(), lr=0.01) if optimizer == "adam" else
             torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum))
    return ssfusion_hvd.DistributedOptimizer(
        inner,
        named_parameters=model.named_parameters(), scheme="exdyna", density=density,
        op=OPS[op], gradient_predivide_factor=predivide, density_warmup_steps=warmup,
        scheme_options={} if select_by is None else {"select_by": select_by})


def record(model_kind="synthetic", steps=5, density=0.05, op="average", predivide=1.0,
           dtype="float32", optimizer="sgd", warmup=None, select_by=None):
    """``optimizer="adam"``: shared moments, so from Adam's first step on the threshold is
    on the key (``select_by``: the gain by default, or the step); each step also records
    Adam's state before it."""
    if model_kind == "synthetic":
        model = Synthetic()
    else:
        torch.manual_seed(1234)
        model = Net().to(DTYPES[dtype])
    # the net cases run the density warm-up through two of its stages (steps 0, 1), then d
    if warmup is None:
        warmup = 0 if model_kind == "synthetic" else 2
    opt = _optimizer(model, density, op, predivide, warmup=warmup, optimizer=optimizer,
                     select_by=select_by)
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    loss_fn = nn.CrossEntropyLoss()
    out = []
    for step in range(steps):
        opt.zero_grad()
        before = _scheme_state(opt)
        before["adam"] = {n: (float(opt.state[p]["step"]), opt.state[p]["exp_avg_sq"].clone())
                          for n, p in zip(names, params) if "exp_avg_sq" in opt.state.get(p, {})}
        if model_kind == "synthetic":
            c = model.stream(step)
            local = {n: c[n].clone() for n in names}
            model.loss(c).backward()
        else:
            x, y = _batch(step, 0, dtype)
            grads = torch.autograd.grad(loss_fn(model(x).float(), y), params, allow_unused=True)
            local = {n: g for n, g in zip(names, grads)}
            loss_fn(model(x).float(), y).backward()
        opt.synchronize()
        synced = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        selected = opt._scheme.selected.clone()
        with opt.skip_synchronize():
            opt.step()
        out.append({"state": before, "local": local, "selected": selected, "synced": synced,
                    "stats": opt.stats()})
    return {"steps": out, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "size": hvd.size(), "rank": hvd.rank()}


def density_run(steps=120, density=0.05, momentum=0.9):
    """The stationary stream under the default recipe (momentum correction with SGD's
    momentum, the density warm-up): per step the phase, the density in force and the
    elements sent."""
    model = Synthetic()
    opt = ssfusion_hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=momentum),
        named_parameters=model.named_parameters(), scheme="exdyna", density=density)
    out = []
    for step in range(steps):
        opt.zero_grad()
        model.loss(model.stream(step)).backward()
        opt.step()
        st = opt.stats()
        out.append({k: st[k] for k in ("phase", "density_target", "elements_sent", "elements",
                                        "demand")})
    return {"steps": out, "recipe": opt.recipe.kind}


def _eval_loss(model, batches=4):
    """Mean loss over the training batches of every rank (the global objective)."""
    loss_fn = nn.CrossEntropyLoss()
    with torch.no_grad():
        local = sum(float(loss_fn(model(x), y)) for x, y in
                    (_batch(s, 0, "float32") for s in range(batches))) / batches
    return float(hvd.allreduce(torch.tensor([local], dtype=torch.float64), op=hvd.Average,
                               name="exdyna.eval"))


def train(op="average", steps=40, density=0.1, lr=0.5, scheme="exdyna"):
    """The tiny Net trained by ``scheme``: global loss before and after (the same 4
    batches per rank again and again, labels random: the net memorizes them)."""
    torch.manual_seed(1234)
    model = Net()
    opt = ssfusion_hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr), named_parameters=model.named_parameters(),
        scheme=scheme, density=density, op=OPS[op])
    loss_fn = nn.CrossEntropyLoss()
    before = _eval_loss(model)
    for step in range(steps):
        opt.zero_grad()
        x, y = _batch(step % 4, 0, "float32")
        loss_fn(model(x), y).backward()
        opt.step()
    after = _eval_loss(model)
    return {"before": before, "after": after, "stats": opt.stats(),
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def checkpoint(save_at=5, total=10):
    """Saves (model, optimizer) at ``save_at``, runs on; a new model and optimizer (other
    initial weights) load the checkpoint and run the same steps: bit-identical parameters,
    and the restored scheme state equals the saved one."""
    torch.manual_seed(1234)
    model = Net()
    opt = _optimizer(model, 0.05, lr=0.05, momentum=0.9)
    _train_steps(model, opt, range(save_at))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    saved = _scheme_state(opt)
    _train_steps(model, opt, range(save_at, total))
    torch.manual_seed(99)
    model2 = Net()
    opt2 = _optimizer(model2, 0.05, lr=0.05, momentum=0.9)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    restored = _scheme_state(opt2)
    _train_steps(model2, opt2, range(save_at, total))
    return {"saved": saved, "restored": restored,
            "uninterrupted": {n: p.detach().clone() for n, p in model.named_parameters()},
            "resumed": {n: p.detach().clone() for n, p in model2.named_parameters()}}


def nonfinite(steps=7, poison_at=2):
    """Rank 1 puts NaN into one element of a.weight at step ``poison_at``; no optimizer
    step is taken (the parameters stay finite). Returns the synchronized a.weight[0, 0]
    and stats() per step."""
    torch.manual_seed(1234)
    model = Net()
    opt = _optimizer(model, 0.05)
    state = {"step": 0}

    def poison(g):
        if hvd.rank() == 1 and state["step"] == poison_at:
            g = g.clone()
            g.view(-1)[0] = float("nan")
        return g

    model.a.weight.register_hook(poison)
    loss_fn = nn.CrossEntropyLoss()
    out = []
    for step in range(steps):
        state["step"] = step
        opt.zero_grad()
        x, y = _batch(step, 0, "float32")
        loss_fn(model(x), y).backward()
        opt.synchronize()
        out.append({"value": float(model.a.weight.grad.view(-1)[0]), "stats": opt.stats()})
    return out


def keyed_disagreement(steps=3):
    """Adam, shared moments: after two steps rank 1 loses its optimizer state (as a
    checkpoint loaded on rank 0 only, without hvd.broadcast_optimizer_state, leaves the
    others): its threshold would be on the magnitude, rank 0's on the pending step, and
    only one of them would calibrate (an allgather more). Every rank must raise
    RanksDisagree before any collective of that step; returns its message."""
    from ssfusion_hvd.agreement import RanksDisagree

    torch.manual_seed(1234)
    model = Net()
    opt = _optimizer(model, 0.05, optimizer="adam")
    loss_fn = nn.CrossEntropyLoss()
    for step in range(steps):
        if step == 2 and hvd.rank() == 1:
            opt.state.clear()
        opt.zero_grad()
        x, y = _batch(step, 0, "float32")
        loss_fn(model(x), y).backward()
        try:
            opt.step()
        except RanksDisagree as exc:
            return {"step": step, "error": str(exc)}
    return {"step": None, "error": None}


def all_cases(long_steps=50):
    """Everything test_exdyna.py checks, in one launch."""
    return {
        "stream": record("synthetic", steps=long_steps, density=0.05),
        "density_momentum": density_run(),
        "stream_predivide": record("synthetic", steps=4, density=0.02, predivide=2.0),
        "stream_sum": record("synthetic", steps=4, density=0.05, op="sum"),
        "net": record("net", steps=5, density=0.05),
        "net_sum": record("net", steps=5, density=0.05, op="sum"),
        "net_fp16": record("net", steps=4, density=0.05, dtype="float16"),
        # a density warm-up of 8 steps (4 stages of 2), Adam's state from step 1: every
        # warm-up step calibrates (on the key from step 1, also within a stage), the final
        # density at step 8, a threshold from step 9
        "net_adam": record("net", steps=11, density=0.05, optimizer="adam", warmup=8),
        "net_adam_step": record("net", steps=11, density=0.05, optimizer="adam", warmup=8,
                                select_by="step"),
        "train_average": train("average"),
        "train_sum": train("sum", lr=0.1),
        "dense_average": train("average", scheme="dense"),
        "dense_sum": train("sum", lr=0.1, scheme="dense"),
        "checkpoint": checkpoint(),
        "nonfinite": nonfinite(),
        "keyed_disagreement": keyed_disagreement(),  # last: it leaves an optimizer raising
    }
