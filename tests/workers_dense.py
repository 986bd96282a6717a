"""Worker functions for tests/test_optimizer_dense.py (run on every Horovod rank)."""
import copy

import horovod.torch as hvd
import torch
import torch.nn as nn

import ssfusion_hvd

OPS = {"average": hvd.Average, "sum": hvd.Sum}


def _model():
    torch.manual_seed(1234)  # identical initial weights on every rank
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def _batch(step, micro):
    g = torch.Generator().manual_seed(1000 * hvd.rank() + 10 * step + micro)  # differs per rank
    return torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)


def _train(model, opt, steps, passes):
    loss_fn = nn.CrossEntropyLoss()
    for step in range(steps):
        opt.zero_grad()
        for micro in range(passes):
            x, y = _batch(step, micro)
            loss_fn(model(x), y).backward()
        opt.step()


def equivalence(steps=20, passes=1, op="average", predivide=1.0, groups=None):
    """Trains the same model with ours (scheme=dense) and with hvd.DistributedOptimizer."""
    ours_model = _model()
    ref_model = copy.deepcopy(ours_model)
    initial = [p.detach().clone() for p in ours_model.parameters()]
    kw = dict(backward_passes_per_step=passes, op=OPS[op], gradient_predivide_factor=predivide,
              groups=groups)
    ours = ssfusion_hvd.DistributedOptimizer(
        torch.optim.SGD(ours_model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=ours_model.named_parameters(), scheme="dense", **kw)
    ref = hvd.DistributedOptimizer(
        torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=ref_model.named_parameters(), **kw)
    _train(ours_model, ours, steps, passes)
    _train(ref_model, ref, steps, passes)
    return {"ours": [p.detach().clone() for p in ours_model.parameters()],
            "ref": [p.detach().clone() for p in ref_model.parameters()],
            "initial": initial}


def bad_inputs():
    """Every bad argument must raise ValueError locally, before any collective."""
    model = _model()
    cases = {
        "scheme": dict(scheme="no-such-scheme"),
        "sparsifier": dict(sparsifier="no-such-sparsifier"),
        "density0": dict(density=0.0),
        "density_big": dict(density=1.5),
        "density_nan": dict(density=float("nan")),
        "density_str": dict(density="0.1"),
        "passes": dict(backward_passes_per_step=0),
        "duplicate": dict(named_parameters=[("w", p) for p in model.parameters()]),
        "missing": dict(named_parameters=list(model.named_parameters())[:-1]),
        "predivide": dict(op=hvd.Sum, gradient_predivide_factor=2.0),
        # the sparse schemes' training recipe (ssfusion_hvd/recipe.py)
        "warmup_negative": dict(scheme="ssfusion_oi", density_warmup_steps=-1),
        "warmup_float": dict(scheme="ssfusion_oi", density_warmup_steps=2.5),
        "warmup_str": dict(scheme="ssfusion_oi", density_warmup_steps="fast"),
        "correction_value": dict(scheme="per_tensor", momentum_correction="yes"),
        "correction_no_momentum": dict(scheme="per_tensor", momentum_correction=True),
        "correction_rmsprop": dict(scheme="zen", momentum_correction=True,
                                   optimizer=torch.optim.RMSprop(model.parameters(), lr=0.1,
                                                                 momentum=0.9)),
        "correction_amsgrad": dict(scheme="exdyna", momentum_correction=True,
                                   optimizer=torch.optim.Adam(model.parameters(), amsgrad=True)),
        "correction_groups": dict(scheme="spardl", momentum_correction=True, optimizer=torch.optim.SGD(
            [{"params": list(model.parameters())[:2], "momentum": 0.9},
             {"params": list(model.parameters())[2:], "momentum": 0.5}],
            lr=0.1)),
        "fp32": dict(scheme="ssfusion", fp32_accumulation="yes"),
        "masking": dict(scheme="per_tensor", momentum_masking="sometimes"),
    }
    messages = {}
    for name, kw in cases.items():
        kw.setdefault("named_parameters", model.named_parameters())
        opt = kw.pop("optimizer", None) or torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            ssfusion_hvd.DistributedOptimizer(opt, **kw)
        except ValueError as exc:
            messages[name] = str(exc)
    # a collective after the errors: would mismatch or hang if any case had submitted one
    total = hvd.allreduce(torch.ones(1), name="after_bad_inputs", op=hvd.Sum)
    return {"messages": messages, "total": float(total)}
