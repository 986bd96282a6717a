"""Workers for tests/test_precision.py: mixed precision the way users train, on every
Horovod rank (through tests/_worker.py).

Every case trains ``Net`` for a few steps with one scheme and returns, per run, the
parameters, the wrapped optimizer's state, our own state (residuals, the local rule's
buffers) and the stats of every step, so the test can compare a run with its reference
bit for bit and the ranks with each other.
"""
import contextlib

import horovod.torch as hvd
import torch
from torch import nn

import ssfusion_hvd
from workers_horovod import SPARSE_KW, _profile
from workers_schemes import Net, _batch

INIT_SCALE = 2.0 ** 10


def _state(opt, model):
    sd = opt.state_dict()
    torch_state = {f"{pid}.{k}": (v.cpu().clone() if torch.is_tensor(v) else v)
                   for pid, st in sd["state"].items() for k, v in st.items()}
    ours = sd["ssfusion"]["state"]
    own = {f"{store}.{n}": t.cpu().clone() for store in ("residuals", "momentum_buffer", "exp_avg",
                                                   "exp_avg_sq")
           for n, t in (ours.get(store) or {}).items()}
    for key in ("iteration",):
        if key in ours:
            own[key] = ours[key]
    return {"params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
            "torch": torch_state, "own": own}


#: the schemes that sparsify their first step: they are told the scaler up front
WHOLE = ("zen", "exdyna", "spardl")


def _opt(model, scheme, kind, scaler=None):
    torch.manual_seed(0)
    if kind == "sgd":
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    else:
        inner = torch.optim.Adam(model.parameters(), lr=2e-3, weight_decay=1e-4)
    kw = {} if scheme == "dense" else dict(SPARSE_KW, profile=_profile())
    if scheme in WHOLE:
        kw["grad_scaler"] = scaler
    return ssfusion_hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                             scheme=scheme, **kw)


def _run(scheme, kind, steps, *, autocast=None, scaler=None, pattern="long", overflow=(),
         skip=(), halve_after=(), clip=None, device="cpu", model_dtype=None):
    """One run of ``steps`` steps. ``autocast``: None, "float16" or "bfloat16" (CPU
    autocast on the float32 model). ``scaler``: a GradScaler's init scale, growth interval
    (None: no scaler). ``overflow``: steps whose loss on rank 1 is infinite. ``skip``: steps
    left out altogether (a reference's), and ``halve_after``: steps after which the
    reference halves its scale as the overflow run's scaler does. ``device``: "cpu" or
    "cuda" (rank r on GPU r modulo the GPUs there are)."""
    if device == "cuda":
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    torch.manual_seed(1234)
    model = Net().to(device)
    if model_dtype is not None:  # the float32 reference starts from the rounded weights
        model = model.to(torch.bfloat16)
        if model_dtype == "float32_rounded":
            model = model.float()
    gs = None
    if scaler is not None:
        init, interval = scaler
        gs = torch.amp.GradScaler(device, init_scale=init, growth_interval=interval)
    opt = _opt(model, scheme, kind, gs)
    loss_fn = nn.CrossEntropyLoss()
    stats, scales = [], []
    for step in range(steps):
        if step in skip:
            if step in halve_after and gs is not None:
                gs.update(new_scale=gs.get_scale() / 2)
            continue
        opt.zero_grad()
        x, y = (t.to(device) for t in _batch(step, 0, "float32"))
        if model_dtype == "bfloat16":
            x = x.to(torch.bfloat16)
        ctx = (torch.autocast(device, dtype=getattr(torch, autocast)) if autocast
               else contextlib.nullcontext())
        with ctx:
            loss = loss_fn(model(x).float(), y)
        if step in overflow and hvd.rank() == 1:
            loss = loss * float("inf")
        if gs is None:
            loss.backward()
            if clip:
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        else:
            gs.scale(loss).backward()
            if pattern == "long":  # Horovod's documented AMP pattern
                opt.synchronize()
                gs.unscale_(opt)
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                with opt.skip_synchronize():
                    gs.step(opt)
            else:  # the short one: step() synchronizes
                gs.step(opt)
            gs.update()
            scales.append(gs.get_scale())
        stats.append(opt.stats())
    return dict(_state(opt, model), stats=stats, scales=scales)


def overflow_cases(schemes, kinds=("sgd",), patterns=("long", "short"), steps=9,
                   overflow=(0, 3, 6), device="cpu"):
    """Float16 autocast and GradScaler; rank 1's loss overflows at ``overflow`` steps
    (the first is a planned scheme's warm-up step, the second its first sparse step,
    where the local rule takes over the optimizer's state, the third later). The
    reference leaves those steps out and halves its scale where the scaler halved it."""
    out = {}
    for scheme in schemes:
        for kind in kinds:
            for pattern in patterns:
                run = _run(scheme, kind, steps, autocast="float16",
                           scaler=(INIT_SCALE, 1000), pattern=pattern, overflow=overflow,
                           clip=5.0, device=device)
                first = min(overflow)
                ref_init = INIT_SCALE / 2 if first == 0 else INIT_SCALE
                ref = _run(scheme, kind, steps, autocast="float16", scaler=(ref_init, 1000),
                           pattern=pattern, skip=overflow,
                           halve_after=[s for s in overflow if s != 0], clip=5.0,
                           device=device)
                out[(scheme, kind, pattern)] = {"run": run, "ref": ref}
    return out


def scale_change_cases(schemes, kinds=("sgd", "adam"), steps=8):
    """Float32 model; a GradScaler whose scale doubles every second step against the
    same run without loss scaling."""
    out = {}
    for scheme in schemes:
        for kind in kinds:
            run = _run(scheme, kind, steps, scaler=(2.0 ** 8, 2), pattern="short")
            ref = _run(scheme, kind, steps)
            out[(scheme, kind)] = {"run": run, "ref": ref}
    return out


def autocast_cases(schemes, dtype="bfloat16", steps=8, device="cpu"):
    """Autocast on the float32 model (bfloat16 without a scaler); the same job's float32
    run beside it."""
    out = {}
    for scheme in schemes:
        out[scheme] = {"run": _run(scheme, "sgd", steps, autocast=dtype, device=device),
                       "ref": _run(scheme, "sgd", steps, device=device)}
    return out


def bf16_model_cases(schemes, steps=8, device="cpu"):
    """A model held in bfloat16 (SGD, momentum correction) against the float32 run from the
    same, rounded, weights."""
    out = {}
    for scheme in schemes:
        out[scheme] = {"run": _run(scheme, "sgd", steps, device=device, model_dtype="bfloat16"),
                       "ref": _run(scheme, "sgd", steps, device=device,
                                   model_dtype="float32_rounded")}
    return out


def float64_errors(schemes):
    """A float64 model with every sparse scheme: the error each rank gets, with the first
    collective (the model check) replaced by one that fails loudly, so an error raised
    after it would show; then one allreduce, which only completes if every rank is here."""
    import ssfusion_hvd.consistency as optimizer_module  # (what the optimizer calls first)

    def no_collective(*args, **kwargs):
        raise AssertionError("a collective ran before the argument check")

    out = {}
    real = optimizer_module.check_same_model
    optimizer_module.check_same_model = no_collective
    try:
        for scheme in schemes:
            model = Net().double()
            try:
                ssfusion_hvd.DistributedOptimizer(
                    torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                    named_parameters=model.named_parameters(), scheme=scheme, log_plan=False)
                out[scheme] = None
            except ValueError as e:
                out[scheme] = str(e)
    finally:
        optimizer_module.check_same_model = real
    out["_after"] = hvd.allreduce(torch.ones(1), name="float64.after", op=hvd.Sum).item()
    return out
