"""Worker functions for tests/test_moments.py (run on every Horovod rank).

Shared moments (``moments="shared"``): every rank records, per step, the parameters, the
wrapped optimizer's state, the ages, its residuals, waits and sums of squares before the
step (what its sent entries' spreads are computed from), its own
gradient on its own batch, the synchronized gradient, the names of the tensors sparsified, and the
parameters after ``step()``.
"""
import horovod.torch as hvd
import torch
import torch.nn as nn

import ssfusion_hvd
from workers_recipe import OPTIMIZERS, _clone
from workers_schemes import profile


class TanhNet(nn.Module):
    """No exact zeros in its gradients (tanh, no unused layer): at density 1 every element
    of every synchronized gradient arrives."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 40)
        self.b = nn.Linear(40, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def record(scheme, optimizer, density, steps=6, density_warmup=0, plan=None, wd=1e-3,
           nesterov=False, waits=None, select_by=None, group_floor=None, spread=None):
    torch.manual_seed(7)  # identical initial weights on every rank
    model = TanhNet()
    named = sorted(model.named_parameters())
    name_of = {p: n for n, p in named}
    inner = OPTIMIZERS[optimizer](model.parameters(), wd, nesterov)
    if plan == "all_sparse":  # every tensor sparsified from step 0, one segmented group
        from ssfusion_hvd.plan import Group, Plan
        from ssfusion_hvd.plan.cost import nominal_k
        names = [n for n, _ in named]
        sizes = [p.numel() for _, p in named]
        plan = Plan("ssfusion_oi", names, sizes, [Group(0, len(names))], [True] * len(names),
                    [nominal_k(s, density) for s in sizes], ["allgather"] * len(names),
                    [False] * len(names), density, group_floor=group_floor)
    opt = ssfusion_hvd.DistributedOptimizer(
        inner, named_parameters=model.named_parameters(), scheme=scheme, density=density,
        warmup_steps=2, profile=profile("topk"), plan=plan, log_plan=False,
        density_warmup_steps=density_warmup, moments="shared",
        scheme_options={k: v for k, v in (("waits", waits), ("select_by", select_by),
                                          ("spread", spread)) if v is not None} or None)
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * hvd.rank() + step)  # noisy: a batch per rank
        x, y = torch.randn(16, 12, generator=g), torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        ours = opt.state_dict()["ssfusion"]
        ages = _clone(ours.get("ages", {}))
        # this rank's residuals, each element's wait since it last sent it and its sum of
        # squared gradients over that wait
        mine = {k: _clone(ours["state"].get(k, {}))
                for k in ("residuals", "waits", "squares", "sums")}
        own = {name_of[p]: _clone(dict(s)) for p, s in opt.state.items()}
        before = {n: p.detach().clone() for n, p in named}
        # the gradient before the hooks: they fold coupled weight decay into p.grad
        grads = torch.autograd.grad(nn.functional.cross_entropy(model(x), y), [p for _, p in named])
        local = {n: g.detach().clone() for (n, _), g in zip(named, grads)}
        nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        synced = {n: p.grad.detach().clone() for n, p in named}
        sparse = sorted(name_of[p] for p in opt._scheme.sparse_params())
        with opt.skip_synchronize():
            opt.step()
        out.append({"ages": ages, "own": own, "before": before, "local": local, **mine,
                    "synced": synced, "sparse": sparse,
                    "after": {n: p.detach().clone() for n, p in named}})
    group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    engine = getattr(opt._scheme, "_engine", None)  # what the planned schemes' wire carried
    carried = {"waits": bool(engine and engine._waits),
               "spread": bool(engine._spread if engine else getattr(opt._scheme, "spread", False))}
    return {"steps": out, "names": [n for n, _ in named], "group": group,
            "moments": opt.recipe.moments, "kind": opt.recipe.kind, "carried": carried}


def record_all(cases):
    return {name: record(**kw) for name, kw in cases.items()}
