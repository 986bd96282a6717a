"""Workers for tests/test_horovod_patterns.py: Horovod's everyday usage patterns, run on
every Horovod rank through tests/_worker.py.

The resume pattern is the one of Horovod's ``examples/pytorch/pytorch_imagenet_resnet50.py``:
every rank builds the model and the optimizer; rank 0 alone loads the checkpoint; then
``hvd.broadcast_parameters`` and ``hvd.broadcast_optimizer_state`` from rank 0.
"""
import dataclasses
import os

import horovod.torch as hvd
from horovod.common.exceptions import HorovodInternalError
import torch

import ssfusion_hvd
from workers_schemes import Net, _train_steps, profile

SPARSE_KW = dict(density=0.05, warmup_steps=2, density_warmup_steps=3, log_plan=False)


def _profile():
    """The tests' fixed cost model with backward times for Net's 8 tensors too, so the plan
    does not depend on how fast this run's backward pass happened to be."""
    model = profile("topk")
    model.backward_s = (1e-4,) * 8
    return model


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


def _wrap(model, kind, scheme, rank_variant=False, moments=None, options=None):
    kw = {} if scheme == "dense" else dict(SPARSE_KW, profile=_profile())
    if moments is not None:
        kw["moments"] = moments
    if options is not None:
        kw["scheme_options"] = options
    return ssfusion_hvd.DistributedOptimizer(
        _optimizer(kind, model.parameters(), rank_variant),
        named_parameters=model.named_parameters(), scheme=scheme, **kw)


def _torch_state(opt):
    """The wrapped optimizer's live state (what Horovod broadcasts into), by parameter
    position: torch's own ``state_dict``, not ours, which first writes each rank's local
    rule buffers into the entries of the tensors it sparsifies (those differ per rank by
    design once a rank keeps its own)."""
    sd = torch.optim.Optimizer.state_dict(opt)
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


def resume(scheme, optimizer, ckpt_dir, own=False, save_at=6, total=10, strip_rank1=False,
           moments=None, options=None):
    """Trains ``total`` steps straight, saving at ``save_at`` (rank 0: model and optimizer;
    every rank: its own optimizer state). Then a new model and optimizer (other initial
    weights and per-rank hyper-parameters) resume Horovod's way: rank 0 loads (``own``:
    every rank loads its own optimizer state), broadcast_parameters,
    broadcast_optimizer_state, and the remaining steps. ``strip_rank1``: rank 1 loads rank
    0's optimizer checkpoint with every per-rank store removed instead of nothing."""
    torch.manual_seed(1234)
    model = Net()
    opt = _wrap(model, optimizer, scheme, moments=moments, options=options)
    _train_steps(model, opt, range(save_at))
    path = os.path.join(ckpt_dir, f"{scheme}-{optimizer}-{moments}-rank{hvd.rank()}.pt")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    saved_own = _own_state(opt)
    _train_steps(model, opt, range(save_at, total))
    straight = _params(model)
    straight_plan = None if opt.plan is None else opt.plan.to_json()
    hvd.barrier()

    torch.manual_seed(99 + hvd.rank())  # other initial weights on every rank
    model = Net()
    opt = _wrap(model, optimizer, scheme, rank_variant=True, moments=moments, options=options)
    if hvd.rank() == 0 or own or strip_rank1:
        ckpt = torch.load(path if own else os.path.join(ckpt_dir, f"{scheme}-{optimizer}-{moments}-rank0.pt"),
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
    _train_steps(model, opt, range(save_at, save_at + 1))
    own_after_adopt = _own_state(opt)
    _train_steps(model, opt, range(save_at + 1, total))
    return {"straight": straight, "resumed": _params(model), "after_broadcast": after_broadcast,
            "plan": None if opt.plan is None else opt.plan.to_json(), "straight_plan": straight_plan,
            "saved_own": saved_own, "own_after_adopt": own_after_adopt,
            "recipe": (opt.recipe.kind, opt.recipe.hparams),
            "ages": opt.state_dict()["ssfusion"].get("ages")}


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
        _train_steps(model, opt, range(steps))
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
    kw = {} if scheme == "dense" else dict(SPARSE_KW, profile=None if probe else _profile())
    opt = ssfusion_hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(), scheme=scheme, process_set=mine, **kw)
    _train_steps(model, opt, range(steps))
    out = {"params": _params(model), "stats": opt.stats(),
           "plan": None if opt.plan is None else opt.plan.to_json()}
    hvd.barrier()
    for ps in sets:
        hvd.remove_process_set(ps)
    return out


def _opt(model, scheme, torch_opt=None, **extra):
    kw = {} if scheme == "dense" else dict(SPARSE_KW, profile=_profile())
    kw.update(extra)
    named = kw.pop("named", model.named_parameters())
    return ssfusion_hvd.DistributedOptimizer(
        torch_opt or torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=named, scheme=scheme, **kw)


class TwoHeads(torch.nn.Module):
    """Rank 0 uses head ``a``, the others head ``b``: a parameter without a gradient on
    some ranks (Horovod's "different outputs" case)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(12, 16)
        self.a = torch.nn.Linear(16, 3)
        self.b = torch.nn.Linear(16, 3)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.a(h) if hvd.rank() == 0 else self.b(h)


class Bag(torch.nn.Module):
    def __init__(self, sparse):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8, sparse=sparse)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, idx):
        return self.out(self.emb(idx).mean(1))


def behaviours(scheme, steps=7):
    """Horovod's optimizer behaviours, each on its own model; returns per behaviour the
    final parameters (identical on every rank when synchronization worked) and what was
    observed."""
    import warnings

    loss_fn = torch.nn.CrossEntropyLoss()
    out = {}

    def batch(step):
        g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
        return torch.randn(16, 12, generator=g), torch.randint(0, 3, (16,), generator=g)

    # synchronize(), clip, step() inside skip_synchronize(): no warning; and step() after
    # synchronize() without skip_synchronize(): Horovod's warning every step, no hang
    for label, skip in (("clip", True), ("no_skip", False)):
        torch.manual_seed(1)
        model = Net()
        opt = _opt(model, scheme)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for s in range(steps):
                opt.zero_grad()
                x, y = batch(s)
                loss_fn(model(x), y).backward()
                opt.synchronize()
                if skip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                    with opt.skip_synchronize():
                        opt.step()
                else:
                    opt.step()
        out[label] = {"params": _params(model), "warnings": [
            str(w.message) for w in caught if "skip_synchronize" in str(w.message)]}

    # a parameter without gradient on some ranks
    torch.manual_seed(2)
    model = TwoHeads()
    opt = _opt(model, scheme)
    for s in range(steps):
        opt.zero_grad()
        x, y = batch(s)
        loss_fn(model(x), y).backward()
        opt.step()
    out["different_outputs"] = {"params": _params(model)}

    # requires_grad switched per step: two optimizers, GAN style
    torch.manual_seed(3)
    gen, disc = torch.nn.Linear(4, 12), torch.nn.Linear(12, 1)
    opt_g = _opt(gen, scheme, torch.optim.SGD(gen.parameters(), lr=0.05, momentum=0.9),
                 named=[("g." + n, p) for n, p in gen.named_parameters()])
    opt_d = _opt(disc, scheme, torch.optim.SGD(disc.parameters(), lr=0.05, momentum=0.9),
                 named=[("d." + n, p) for n, p in disc.named_parameters()])
    bce = torch.nn.BCEWithLogitsLoss()
    for s in range(steps):
        g = torch.Generator().manual_seed(1000 * hvd.rank() + s)
        z, real = torch.randn(8, 4, generator=g), torch.randn(8, 12, generator=g)
        for p in gen.parameters():
            p.requires_grad_(False)
        opt_d.zero_grad()
        (bce(disc(real), torch.ones(8, 1)) + bce(disc(gen(z)), torch.zeros(8, 1))).backward()
        opt_d.step()
        for p in gen.parameters():
            p.requires_grad_(True)
        for p in disc.parameters():
            p.requires_grad_(False)
        opt_g.zero_grad()
        bce(disc(gen(z)), torch.ones(8, 1)).backward()
        opt_g.step()
        for p in disc.parameters():
            p.requires_grad_(True)
    out["gan"] = {"params": {**{"g." + n: p.detach().clone() for n, p in gen.named_parameters()},
                             **{"d." + n: p.detach().clone() for n, p in disc.named_parameters()}}}

    # no named_parameters
    torch.manual_seed(4)
    model = Net()
    opt = _opt(model, scheme, named=None)
    _train_steps(model, opt, range(steps))
    out["unnamed"] = {"params": _params(model)}

    # duplicate and missing names: ValueError on every rank, before any collective
    errors = {}
    for case in ("duplicate", "missing"):
        model = Net()
        named = list(model.named_parameters())
        named = named[:1] + named[:-1] if case == "duplicate" else named[1:]
        try:
            _opt(model, scheme, named=named)
            errors[case] = None
        except ValueError as exc:
            errors[case] = str(exc)
    out["names"] = errors

    # hyper-parameters replaced after construction: rank 0 loads a state dict whose weight
    # decay is 0 and broadcasts it (torch's load_state_dict and the broadcast replace the
    # param-group dicts); steps on zero gradients must then leave the weights where they
    # are on every rank (a stale group would fold the old decay into the sparse updates)
    torch.manual_seed(6)
    model = Net()
    opt = _opt(model, scheme, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9,
                                              weight_decay=0.1))
    if hvd.rank() == 0:
        state = opt.state_dict()
        for g in state["param_groups"]:
            g["weight_decay"] = 0.0
        opt.load_state_dict(state)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    before = _params(model)
    for s in range(steps):
        opt.zero_grad()
        x, y = batch(s)
        (0.0 * loss_fn(model(x), y)).backward()
        opt.step()
    out["fresh_groups"] = {"params": _params(model), "moved": max(
        float((p - before[n]).abs().max()) for n, p in _params(model).items()),
        "weight_decay": [g["weight_decay"] for g in opt.param_groups]}

    # sparse embeddings, with and without sparse_as_dense
    for sad in (False, True):
        torch.manual_seed(5)
        model = Bag(sparse=True)
        opt = _opt(model, scheme, torch.optim.SGD(model.parameters(), lr=0.1), sparse_as_dense=sad)
        for s in range(steps):
            g = torch.Generator().manual_seed(1000 * hvd.rank() + s)
            idx, y = torch.randint(0, 50, (8, 5), generator=g), torch.randint(0, 3, (8,), generator=g)
            opt.zero_grad()
            loss_fn(model(idx), y).backward()
            opt.step()
        out[f"sparse_embedding_{'as_dense' if sad else 'sparse'}"] = {"params": _params(model)}
    hvd.barrier()
    return out


def load_on_rank0_only(scheme, ckpt_dir, save_at=6):
    """Rank 0 loads a checkpoint and nobody calls hvd.broadcast_optimizer_state: the ranks
    are at different points of the scheme. Returns the error each rank raised (or None)."""
    torch.manual_seed(1234)
    model = Net()
    opt = _wrap(model, "sgd", scheme)
    _train_steps(model, opt, range(save_at))
    path = os.path.join(ckpt_dir, f"alone-{scheme}.pt")
    if hvd.rank() == 0:
        torch.save(opt.state_dict(), path)
    hvd.barrier()
    torch.manual_seed(1234)
    model = Net()
    opt = _wrap(model, "sgd", scheme)
    if hvd.rank() == 0:
        opt.load_state_dict(torch.load(path, weights_only=False))
    try:
        _train_steps(model, opt, range(save_at, save_at + 3))
    except RuntimeError as exc:
        return str(exc)
    return None


def stage_plans_differ(scheme, steps=5):
    """The ranks agree on the plan but rank 1 scales it to the warm-up's stages
    differently (one more element of one tensor, as another release of
    ``Plan.at_density`` might): every rank raises the same RanksDisagree at the first
    sparse step instead of decoding records laid out for another k; then a collective
    both ranks run (nobody was left waiting). Returns the error each rank raised."""
    from ssfusion_hvd.plan.plan import Plan

    real = Plan.at_density
    if hvd.rank() == 1:
        def at_density(self, density):
            at = real(self, density)
            i = next((i for i, (sp, k, n) in enumerate(zip(at.sparse, at.k, at.sizes))
                      if sp and k is not None and k < n), None)
            if at is self or i is None:  # (the test then finds no error: it fails, not hangs)
                return at
            return dataclasses.replace(at, k=[k + 1 if j == i else k for j, k in enumerate(at.k)])
        Plan.at_density = at_density
    torch.manual_seed(1234)
    model = Net()
    opt = _wrap(model, "sgd", scheme)
    error = None
    try:
        _train_steps(model, opt, range(steps))
    except RuntimeError as exc:
        error = str(exc)
    finally:
        Plan.at_density = real
    hvd.allreduce(torch.ones(1), name="after_stage_plans_differ", op=hvd.Sum)
    return error


def resume_cases(scheme, optimizers, ckpt_dir, owns=(False,), moments=None, options=None):
    """:func:`resume` for each torch optimizer and each ``own``, in one job."""
    return {(kind, own): resume(scheme, kind, ckpt_dir, own=own, moments=moments, options=options)
            for kind in optimizers for own in owns}


def scheme_mismatch():
    """Rank 0 runs ssfusion_oi, rank 1 per_tensor: the same ValueError on both ranks when
    the optimizer is built (its first collective compares the setups), so the later
    hvd.broadcast_optimizer_state and steps never run on mismatched schemes; then a
    collective both ranks run (nobody was left waiting)."""
    torch.manual_seed(1234)
    model = Net()
    try:
        _wrap(model, "sgd", "ssfusion_oi" if hvd.rank() == 0 else "per_tensor")
        error = None
    except ValueError as exc:
        error = str(exc)
    hvd.allreduce(torch.ones(1), name="after_scheme_mismatch", op=hvd.Sum)
    return error


def uneven_join(scheme, steps=(5, 3)):
    """Horovod's pattern for ranks with uneven data: rank r trains ``steps[r]`` steps, then
    calls hvd.join(). A sparse scheme's step on the rank still stepping raises (its records
    travel by allgather, which Horovod refuses with joined ranks) and leaves the parameters
    as they were, and its residuals and momentum (``own_kept``); that rank then joins too.
    Returns the error, what join() returned, the parameters and an allreduce run by both
    afterwards (nobody was left waiting)."""
    torch.manual_seed(1234)
    model = Net()
    opt = _wrap(model, "sgd", scheme)
    error = own_kept = None
    for step in range(steps[hvd.rank()]):
        own = _own_state(opt)
        try:
            _train_steps(model, opt, [step])
        except RuntimeError as exc:
            error = str(exc)
            after = _own_state(opt)
            own_kept = all(torch.equal(own[store][n], after[store][n])
                           for store in own for n in own[store]) and all(
                               set(own[s]) == set(after[s]) for s in own)
            break
    out = {"error": error, "params": _params(model), "join_error": None, "own_kept": own_kept}
    try:
        out["last"] = int(hvd.join())
        out["after"] = float(hvd.allreduce(torch.ones(1), name="after_uneven_join", op=hvd.Sum))
    except HorovodInternalError as exc:  # Horovod's own failure after the join (see the test)
        out["join_error"] = str(exc)
    return out


def own_collectives(scheme, agreement, steps=6):
    """Counts, per step, the collectives the optimizer makes itself (its transport: the
    step's agreement and the ranks' non-finite flags) besides the scheme's, with the
    agreement on or off (``_agreement``: the measuring runs' switch). Returns the counts
    and the parameters after ``steps`` steps."""
    torch.manual_seed(1234)
    model = Net()
    opt = _wrap(model, "sgd", scheme)
    opt._agreement.enabled = agreement
    counts = []
    transport = opt._transport
    made = transport.allreduce

    def counted(*args, **kwargs):
        counts[-1] += 1
        return made(*args, **kwargs)

    transport.allreduce = counted
    for step in range(steps):
        counts.append(0)
        _train_steps(model, opt, [step])
    return {"counts": counts, "params": _params(model)}


def outside_the_set(schemes, steps=6):
    """Horovod's own shape (its ``test_optimizer_process_sets``): for each scheme, one
    optimizer built on every rank with the even ranks' process set. The odd ranks are
    outside it: they make no collective and step on their own gradients, as a plain torch
    optimizer does. Per scheme: the parameters and, beside them, those of a plain SGD
    that saw the same batches. Needs HOROVOD_DYNAMIC_PROCESS_SETS=1."""
    import copy
    from workers_schemes import _batch

    even = hvd.add_process_set([r for r in range(hvd.size()) if r % 2 == 0])
    loss_fn = torch.nn.CrossEntropyLoss()
    out = {"included": even.included()}
    for scheme in schemes:
        torch.manual_seed(1234)
        model = Net()
        twin = copy.deepcopy(model)
        sgd = dict(lr=0.05, momentum=0.9, weight_decay=1e-4)
        plain = torch.optim.SGD(twin.parameters(), **sgd)
        opt = _opt(model, scheme, torch.optim.SGD(model.parameters(), **sgd), process_set=even)
        for step in range(steps):
            x, y = _batch(step, 0, "float32")
            for m, o in ((model, opt), (twin, plain)):
                o.zero_grad()
                loss_fn(m(x), y).backward()
                o.step()
        out[scheme] = {"params": _params(model), "plain": _params(twin), "stats": opt.stats(),
                       "state": opt.state_dict()}
    hvd.barrier()
    hvd.remove_process_set(even)
    return out


def _wrap_step(opt, wrappers, compiled):
    """``opt.step`` behind ``wrappers`` plain wrappers (loggers, framework hooks), then
    optionally ``torch.compile`` (the eager backend: dynamo's frame evaluation without a
    compiler toolchain)."""
    for _ in range(wrappers):
        inner = opt.step

        def step(*args, _inner=inner, **kwargs):
            return _inner(*args, **kwargs)
        opt.step = step
    if compiled:
        opt.step = torch.compile(opt.step, backend="eager")


def wrapped_resume(scheme, cases, ckpt_dir, save_at=4, total=8):
    """The rank-0 resume pattern with ``opt.step`` wrapped: an LR scheduler (which wraps
    it itself), then ``wrappers`` more and optionally ``torch.compile``; the broadcast by
    ``hvd.broadcast_optimizer_state`` or, ``explicit``, ``ssfusion_hvd``'s. Per case
    (``(wrappers, compiled, explicit)``): the straight run's parameters and the resumed."""
    loss_fn = torch.nn.CrossEntropyLoss()
    from workers_schemes import _batch

    def build():
        model = Net()
        opt = _opt(model, scheme, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9,
                                                   weight_decay=1e-4))
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)

    def train(model, opt, sched, steps):
        for step in steps:
            opt.zero_grad()
            x, y = _batch(step, 0, "float32")
            loss_fn(model(x), y).backward()
            opt.step()
            sched.step()

    out = {}
    for wrappers, compiled, explicit in cases:
        torch.manual_seed(1234)
        model, opt, sched = build()
        train(model, opt, sched, range(save_at))
        path = os.path.join(ckpt_dir, f"wrapped-{scheme}-{hvd.rank()}.pt")
        if hvd.rank() == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()}, path)
        train(model, opt, sched, range(save_at, total))
        straight = _params(model)
        hvd.barrier()

        torch.manual_seed(99 + hvd.rank())  # other initial weights on every rank
        model, opt, sched = build()
        _wrap_step(opt, wrappers, compiled)
        if hvd.rank() == 0:
            ckpt = torch.load(path, weights_only=False)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
            sched.load_state_dict(ckpt["sched"])
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        (ssfusion_hvd.broadcast_optimizer_state if explicit else hvd.broadcast_optimizer_state)(
            opt, root_rank=0)
        sched.load_state_dict(hvd.broadcast_object(sched.state_dict(), root_rank=0))
        after_broadcast = _params(model)
        train(model, opt, sched, range(save_at, total))
        out[(wrappers, compiled, explicit)] = {
            "straight": straight, "after_broadcast": after_broadcast, "resumed": _params(model)}
        hvd.barrier()
    return out


def portable(optimizer, ckpt_dir, scheme="zen", first=4, then=4):
    """A checkpoint of ours loads anywhere. Every rank trains on the same batches at
    density 1 (every element sent, no masking: the local rules are then exactly the torch
    optimizer, and the ranks' average is each rank's own gradient), so a run that goes on
    under a plain torch optimizer, Horovod's optimizer or ours with another scheme must
    land where the uninterrupted run does. Per continuation: the parameters after
    ``first`` + ``then`` steps, and the uninterrupted run's."""
    import copy

    loss_fn = torch.nn.CrossEntropyLoss()

    def batches(steps):
        for step in steps:
            g = torch.Generator().manual_seed(500 + step)  # the same on every rank
            yield torch.randn(16, 12, generator=g), torch.randint(0, 3, (16,), generator=g)

    def make(params):
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
        return torch.optim.Adam(params, lr=1e-2, weight_decay=1e-3)

    def ours(model, which):
        return ssfusion_hvd.DistributedOptimizer(
            make(model.parameters()), named_parameters=model.named_parameters(), scheme=which,
            density=1.0, density_warmup_steps=0, momentum_masking=False, log_plan=False)

    def train(model, opt, steps):
        for x, y in batches(steps):
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()

    def net():  # every tensor gets a gradient (a plain torch optimizer skips the others)
        torch.manual_seed(1234)
        return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

    model = net()
    opt = ours(model, scheme)
    train(model, opt, range(first))
    path = os.path.join(ckpt_dir, f"portable-{optimizer}-{hvd.rank()}.pt")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    train(model, opt, range(first, first + then))
    out = {"straight": _params(model)}
    ckpt = torch.load(path, weights_only=False)
    out["torch_state"] = {k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in st.items()}
                          for k, st in ckpt["opt"]["state"].items()}
    for name in ("torch", "horovod", "dense", "spardl"):
        model = net()
        model.load_state_dict(ckpt["model"])
        if name == "torch":
            opt = make(model.parameters())
        elif name == "horovod":
            opt = hvd.DistributedOptimizer(make(model.parameters()),
                                           named_parameters=model.named_parameters())
        else:
            opt = ours(model, name)
        opt.load_state_dict(copy.deepcopy(ckpt["opt"]))
        train(model, opt, range(first, first + then))
        out[name] = _params(model)
    return out


def other_size_save(schemes, ckpt_dir, kind="sgd"):
    """Trains 6 steps on every rank, then rank 0 saves its model and optimizer state."""
    for scheme in schemes:
        torch.manual_seed(0)
        model = Net()
        opt = _wrap(model, kind, scheme)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        _train_steps(model, opt, range(6))
        if hvd.rank() == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
                       os.path.join(ckpt_dir, f"{scheme}.pt"))
    return None


def other_size_load(schemes, ckpt_dir, kind="sgd"):
    """A job of another size resumes from rank 0's checkpoint (Horovod's resume pattern):
    per scheme, whether rank 0 was warned, the optimizer state against the checkpoint's
    torch entries after the broadcast, and the parameters after 6 more steps."""
    import warnings

    out = {}
    for scheme in schemes:
        torch.manual_seed(1)
        model = Net()
        opt = _wrap(model, kind, scheme)
        ckpt = torch.load(os.path.join(ckpt_dir, f"{scheme}.pt"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if hvd.rank() == 0:
                model.load_state_dict(ckpt["model"])
                opt.load_state_dict(ckpt["opt"])
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        loaded = {k: {b: v.clone() for b, v in st.items() if torch.is_tensor(v)}
                  for k, st in ckpt["opt"]["state"].items()}
        live = {k: {b: v.clone() for b, v in st.items() if torch.is_tensor(v)}
                for k, st in opt.state_dict()["state"].items()}
        _train_steps(model, opt, range(6, 12))
        out[scheme] = {"warned": [str(w.message) for w in caught if "ranks" in str(w.message)],
                       "loaded": loaded, "live": live, "params": _params(model)}
    return out
