"""Worker functions for tests/test_schemes.py (run on every Horovod rank).

Each run records, per step and per rank, what the reference needs: the local gradients
(after backward, before synchronization), the residuals before the step, the synchronized
gradients and the plan in use. The test rebuilds the synchronized gradient from these alone.
"""
import os

import horovod.torch as hvd
import torch
import torch.nn as nn

import ssfusion_hvd
from ssfusion_hvd.plan import CostModel

OPS = {"average": hvd.Average, "sum": hvd.Sum}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Net(nn.Module):
    """Tensors of several sizes (so plans differ by scheme) and a layer that never runs."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 64)
        self.b = nn.Linear(64, 32)
        self.c = nn.Linear(32, 3)
        self.unused = nn.Linear(5, 5)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.relu(self.a(x)))))


def _model(dtype):
    torch.manual_seed(1234)  # identical initial weights on every rank
    return Net().to(DTYPES[dtype])


def _batch(step, micro, dtype):
    # differs per rank: the MPI world rank where one exists (sub-communicator jobs must not
    # see the same data as their sibling job), else Horovod's rank
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", hvd.rank()))
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(16, 12, generator=g).to(DTYPES[dtype]), torch.randint(0, 3, (16,), generator=g)


def profile(sparsifier, element_size=4, gbit=10.0, latency=5e-5):
    """A fixed cost model (a ``gbit`` Gbit/s ring, ``latency`` s per hop) so no probing
    happens in tests."""
    fit = {"gpu": (20e-6, 1e-10), "cpu": (40e-6, 2e-10)}
    return CostModel.from_network(gbit * 1e9, latency, hvd.size(), backward_s=[],
                                  sparsify={sparsifier: fit}, element_size=element_size)


def _residuals(opt):
    state = opt.state_dict()["ssfusion"]["state"]
    return {k: v.detach().cpu().clone() for k, v in state.get("residuals", {}).items()}


def _cpu(tensors):
    """A record's tensors on the host (a GPU run's records are checked anywhere)."""
    return {n: None if t is None else t.detach().cpu().clone() for n, t in tensors.items()}


def record(scheme, steps=4, passes=1, op="average", predivide=1.0, dtype="float32",
           sparsifier="topk", density=0.05, warmup=2, plan=None, gbit=10.0, latency=5e-5,
           scheme_options=None, device="cpu"):
    """Runs ``steps`` steps of ``scheme`` and records what the reference needs (module
    docstring); ``device="cuda"``: model and batches on this rank's GPU (local rank modulo
    the GPUs there; the records are returned on the host)."""
    if device == "cuda":
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    model = _model(dtype).to(device)
    opt = ssfusion_hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
        scheme=scheme, sparsifier=sparsifier, density=density, backward_passes_per_step=passes,
        op=OPS[op], gradient_predivide_factor=predivide, warmup_steps=warmup,
        profile=profile(sparsifier, torch.empty(0, dtype=DTYPES[dtype]).element_size(), gbit,
                        latency),
        plan=plan, log_plan=False, scheme_options=scheme_options)
    names = [n for n, _ in model.named_parameters()]
    loss_fn = nn.CrossEntropyLoss()
    steps_out = []
    for step in range(steps):
        opt.zero_grad()
        residual = _residuals(opt)
        plan_before = None if opt.plan is None else opt.plan.to_json()
        # local gradients by autograd.grad (no .grad accumulation, no hooks): cloning p.grad
        # after backward would race with the in-place allreduce of the dense warm-up
        params = list(model.parameters())
        local = dict.fromkeys(names)
        for micro in range(passes):
            x, y = (t.to(device) for t in _batch(step, micro, dtype))
            grads = torch.autograd.grad(loss_fn(model(x).float(), y), params, allow_unused=True)
            for n, g in zip(names, grads):
                if g is not None:
                    local[n] = g if local[n] is None else local[n] + g
        for micro in range(passes):
            x, y = (t.to(device) for t in _batch(step, micro, dtype))
            loss_fn(model(x).float(), y).backward()
        opt.synchronize()
        synced = _cpu({n: p.grad for n, p in zip(names, model.parameters())
                       if p.grad is not None})
        with opt.skip_synchronize():
            opt.step()
        steps_out.append({"plan": plan_before, "residual": residual, "local": _cpu(local),
                          "synced": synced, "stats": opt.stats()})
    return {"steps": steps_out, "params": _cpu(dict(model.named_parameters())),
            "size": hvd.size()}


def mixed_plan(density=0.05, group_floor=0.25):
    """A plan using every part kind: allreduce part, dense allgather part, inline selection
    of two tensors (under the group budget with floors of ``group_floor``, or segmented
    with None), offloaded selection, and a multi-tensor fusion buffer."""
    from ssfusion_hvd.plan import Group, Plan
    from ssfusion_hvd.plan.cost import nominal_k
    names = ["c.bias", "c.weight", "b.bias", "b.weight", "a.bias", "a.weight",
             "unused.bias", "unused.weight"]
    sizes = [3, 96, 32, 2048, 64, 768, 5, 25]
    groups = [Group(0, 4), Group(4, 6, buffer_k=nominal_k(832, density)), Group(6, 8)]
    sparse = [False, True, True, True, True, True, False, True]
    k = [3, nominal_k(96, density), nominal_k(32, density), nominal_k(2048, density), None, None,
         5, 2]
    coll = ["allreduce", "allgather", "allgather", "allgather", "allgather", "allgather",
            "allgather", "allgather"]
    offload = [False, False, False, True, False, False, False, True]
    return Plan("ssfusion_oi", names, sizes, groups, sparse, k, coll, offload, density, "topk",
                group_floor=group_floor)


def record_all(schemes, forced=True, min_k=False, **kwargs):
    """One launch, many schemes: each gets its own model and optimizer; ``forced`` adds a
    run of ssfusion_oi on :func:`mixed_plan` (every part kind, from the first step) and one
    on it with per-tensor k (``forced_segmented``), ``min_k`` one of ssfusion_oi planned
    with the small-tensor rule (``min_k`` 32) and one with per-tensor k (``floor`` None)."""
    out = {s: record(s, **kwargs) for s in schemes}
    density = kwargs.get("density", 0.05)
    if forced:
        out["forced"] = record("ssfusion_oi", plan=mixed_plan(density), **kwargs)
        out["forced_segmented"] = record("ssfusion_oi", plan=mixed_plan(density, None), **kwargs)
    if min_k:
        out["min_k"] = record("ssfusion_oi", scheme_options={"min_k": 32}, **kwargs)
        out["floor_none"] = record("ssfusion_oi", scheme_options={"floor": None}, **kwargs)
    return out


def auto_runs(links, **kwargs):
    """scheme="auto" planned on a cost model of each ``(Gbit/s, latency s)`` of ``links``."""
    return {i: record("auto", gbit=g, latency=lat, **kwargs) for i, (g, lat) in enumerate(links)}


def _train_steps(model, opt, steps, dtype="float32"):
    loss_fn = nn.CrossEntropyLoss()
    for step in steps:
        opt.zero_grad()
        x, y = _batch(step, 0, dtype)
        loss_fn(model(x).float(), y).backward()
        opt.step()


def _checkpoint_opt(model, scheme, sparsifier):
    return ssfusion_hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(), scheme=scheme, sparsifier=sparsifier,
        density=0.05, warmup_steps=2, profile=profile(sparsifier), log_plan=False)


def checkpoint_run(scheme, sparsifier, ckpt_dir, save_at=4, total=8):
    """Uninterrupted run that also saves (model, optimizer) on every rank at ``save_at``."""
    model = _model("float32")
    opt = _checkpoint_opt(model, scheme, sparsifier)
    _train_steps(model, opt, range(save_at))
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
               os.path.join(ckpt_dir, f"rank{hvd.rank()}.pt"))
    _train_steps(model, opt, range(save_at, total))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def checkpoint_resume(scheme, sparsifier, ckpt_dir, save_at=4, total=8):
    """A new job: restores every rank's checkpoint and runs the remaining steps."""
    torch.manual_seed(99)  # different initial weights: everything must come from the file
    model = Net()
    opt = _checkpoint_opt(model, scheme, sparsifier)
    state = torch.load(os.path.join(ckpt_dir, f"rank{hvd.rank()}.pt"), weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    assert opt.plan is not None and opt.plan.to_json() == state["opt"]["ssfusion"]["state"]["plan"]
    _train_steps(model, opt, range(save_at, total))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def nonfinite(scheme):
    """Rank 1 puts NaN and Inf into two gradient elements at step 3: every rank's synchronized
    gradient must carry them and stats() must count them. No optimizer step is taken (the
    parameters stay finite, so later steps show what error feedback still holds)."""
    model = _model("float32")
    kw = dict(plan=mixed_plan()) if scheme == "forced" else dict(warmup_steps=2,
                                                                 profile=profile("topk"))
    opt = ssfusion_hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
        scheme="ssfusion_oi" if scheme == "forced" else scheme, density=0.05, log_plan=False,
        **kw)
    state = {"step": 0}

    def poison(g):
        if hvd.rank() == 1 and state["step"] == 3:
            g = g.clone()
            g.view(-1)[0] = float("nan")
            g.view(-1)[1] = float("inf")
        return g

    for name in ("a.weight", "c.bias"):
        dict(model.named_parameters())[name].register_hook(poison)
    out = []
    loss_fn = nn.CrossEntropyLoss()
    for step in range(5):
        state["step"] = step
        opt.zero_grad()
        x, y = _batch(step, 0, "float32")
        loss_fn(model(x), y).backward()
        opt.synchronize()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        out.append({"grads": grads, "stats": opt.stats()})
    return out


def dtype_errors(schemes):
    """The error each scheme raises at construction for a bfloat16 model (None: accepted)."""
    out = {}
    for scheme in schemes:
        model = _model("float32").to(torch.bfloat16)
        try:
            ssfusion_hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),
                named_parameters=model.named_parameters(), scheme=scheme, log_plan=False)
            out[scheme] = None
        except ValueError as e:
            out[scheme] = str(e)
    return out
