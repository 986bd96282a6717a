#!/usr/bin/env python3
"""Ablation of the training recipe in one process (no Horovod): which part buys what.

    .venv/bin/python scripts/recipe_ablation.py                        # digits, 8 seeds; lm, 1 seed
    .venv/bin/python scripts/recipe_ablation.py --tasks digits --seeds 0,1 --variants dense,auto

P ranks are replayed in one process on one model (their parameters are identical in
data-parallel training): each rank computes its gradient on its own shard (the same
batches as ``examples/train.py``), then every tensor is sparsified on its own (per-tensor
top-k, ``ssfusion_hvd.ops.topk``) through the package's own error feedback and local
rules (``ssfusion_hvd.sparsify.memory``), the selections are averaged, and the update is
applied as ``step()`` applies it. Like the real job, every run starts with the zero-gradient
step of ``hvd.broadcast_optimizer_state`` and, for the sparse variants, the planned
schemes' dense profiling steps (``--profiling``), after which the rules take over the
optimizer's state. A replica, not the distributed engine: it isolates the
recipe from planning and transport, and runs the many seeds a decision needs on two cores.

Variants (``--variants``):

* ``dense``: the average gradient through the task's optimizer (SGD momentum / Adam);
* ``ef``: plain error feedback on gradients, the optimizer applied to the sparse average
  (the package before the recipe), no density warm-up;
* ``ef_warm``: the same with the density warm-up;
* ``auto`` / ``mask`` / ``nomask``: the recipe's local rule (momentum correction for
  SGD, local Adam moments for Adam) with ``momentum_masking`` "auto", True, False, and
  the density warm-up of ``--warmup`` steps (default: the package's);
* ``mask_density``: ``auto``, but Adam's first moment masked by SGD's density rule (only
  while the density in force is below ``1 - beta1``) instead of always;
* ``shared_v``: an Adam rule that is Adam in the dense limit on P ranks: each rank's own
  first moment (masked by SGD's density rule), and one second moment for all ranks, of the
  *averaged* gradient, refreshed every step (``--refresh 1``: a dense allreduce a step in
  a real job) or at intervals (``--refresh K``, with ``--refresh-dense W``: every step
  until step W, then gaps doubling up to K, as 0/1 Adam refreshes its variance), floored
  at what Adam's would hold had the other ranks sent zeros; ``shared_v_mask``: the same,
  masked always;
* ``frozen_v``: 1-bit Adam's shape: ``--freeze`` dense Adam steps, then the second moment
  frozen and the first moment compressed with error feedback (the density warm-up starts
  after the dense steps);
* ``ef_age`` / ``ef_age_lazy`` / ``ef_age_tail``: plain error feedback on gradients, and
  one optimizer state for all ranks moved by the sparse average, each element's burst
  taken as the steps it waited (``AgedAdam``, ``AgedMomentum``): every element moves every
  step by its held moments (``ef_age``, Adam only); or only when it arrives, by the steps
  it waited (``ef_age_lazy``, the package's ``moments="shared"`` until 2026-11-26); or
  every step by its decaying moments, as the optimizer moves it with a zero gradient, plus
  at an arrival the gradient part of the steps it waited (``ef_age_tail``, the package's
  ``moments="shared"`` now); ``ef_age_tail_q``: ``ef_age_tail`` whose Adam second
  moment also takes how spiky each rank's sum was (``w·Σg²/S²`` over the ``w`` steps it
  waited: 1 for a steady gradient, ``w`` for one step's), weighted over the ranks that
  sent it (measured and rejected, docs/recipe.md §1); ``ef_age_tail_var``: ``ef_age_tail``
  whose Adam second moment also takes the senders' variance, each rank's own gradient's
  within its wait (``Σg²/w - (S/w)²``, averaged over the senders, over P): Adam's ``v`` of
  the averaged gradient is ``mean² + σ²/P`` (docs/results/accuracy_lm.md); ``ef_age_rank``: ``ef_age_tail``
  with each rank's own wait: a rank's values are caught up as the steps since *it* last
  sent the element (the package's rule takes the steps since *any* rank did, which is
  all the receivers of an allreduced sum can know) (``rank_catch_up``); ``ef_age_rank_m``:
  the same, Adam's second moment as ``ef_age_tail`` has it;
* ``auto_min_k``: ``auto`` with the SSFusion planner's accuracy rule
  (``plan.keep_small_dense``): tensors whose top-k at ``--density`` would keep fewer than
  ``--min-k`` elements are averaged dense and stepped by the task's optimizer, as the
  engine steps a plan's dense tensors.

``--model`` (cnn, mlp, mlp_deep, gru) and ``--optimizer`` (sgd; adam at ``--adam-lr``) choose the
digits task's model and optimizer, as ``examples/train.py --task`` and ``--optimizer`` do.

Output: one line per run and a mean ± std table per task (``--json`` keeps the runs).

``--lm-lr`` sets the LM's Adam learning rate (2e-3 by default, the cell's).

``--adam-limit P`` instead measures the Adam rule in the dense limit (density 1: every
element sent every step) on P ranks with noisy gradients (signal 0.1, noise 1 per
element): the norm of the rule's averaged update against ``torch.optim.Adam``'s on the
averaged gradient, and their cosine, with masking off and with the default.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from ssfusion_hvd import ops
from ssfusion_hvd.examples.data import DigitsNet, load_digits_split, shard
from ssfusion_hvd.plan.cost import nominal_k
from ssfusion_hvd.recipe import DEFAULT_WARMUP_STEPS, Recipe, warmup_length  # noqa: E402
from ssfusion_hvd.rules import AdamRule, MomentumRule
from ssfusion_hvd.sparsify.memory import ResidualMemory

VARIANTS = ("dense", "ef", "ef_warm", "auto", "mask", "nomask", "mask_density", "auto_min_k",
            "shared_v", "frozen_v", "shared_v_mask", "ef_age", "ef_age_lazy", "ef_age_tail", "ef_age_tail_q",
            "ef_age_tail_var", "ef_age_rank", "ef_age_rank_m")


class AgedAdam:
    """Prototype: plain error feedback on gradients, and one Adam state for all ranks,
    updated from the synchronized sparse average. An element that arrives after ``a``
    steps in the residual carries about ``a`` steps' worth of gradient: its moments
    move as ``a`` steps of ``S / a`` would move them (``m <- b1^a m + (1 - b1^a) S/a``),
    so a burst is not mistaken for a large gradient. Every rank holds the same state (it
    is computed from what every rank received). At density 1 every age is 1 and this is
    torch.optim.Adam on the averaged gradient, on any number of ranks. ``lazy``: an
    element moves only when it arrives, by ``a`` steps of the new update; otherwise
    every element moves every step by its current ``m / sqrt(v)``."""

    def __init__(self, p, state, lr, betas=(0.9, 0.999), eps=1e-8, lazy=False, tail=False,
                 catch="full"):
        self.lr, (self.b1, self.b2), self.eps, self.lazy, self.tail = lr, betas, eps, lazy, tail
        # the tail rule's catch-up of the steps an arrival skipped (``--catch``): "full",
        # "sqrt" (its square root), "cap:N" (at most N steps), "none-until:T" (none before
        # step T): shapes of a bounded catch-up, measured and rejected (docs/results/accuracy_lm.md)
        self.catch = catch
        self.m = state["exp_avg"].clone()
        self.v = state["exp_avg_sq"].clone()
        self.t = int(float(state["step"]))
        self.age = torch.zeros_like(p)

    @torch.no_grad()
    def step(self, p, avg, burst=None, extra_v=None):
        self.t += 1
        self.age += 1
        arrived = avg != 0
        if self.tail:
            # the moments decay and move every element every step, as Adam does with a zero
            # gradient; an arrival adds the a steps of its mean gradient g = S / a
            b1, b2 = self.b1, self.b2
            g = torch.where(arrived, avg / self.age, torch.zeros_like(avg))
            d1, d2 = b1 ** self.age, b2 ** self.age
            self.m.mul_(b1).add_((1 - d1) * g)
            # burst: how spiky the arrived sums were (1: a steady gradient, a: one step's)
            self.v.mul_(b2).add_((1 - d2) * g * g * (1 if burst is None else burst))
            if extra_v is not None:  # ef_age_tail_var: the senders' within-wait variance / P
                self.v.add_((1 - d2) * torch.where(arrived, extra_v, torch.zeros_like(extra_v)))
            catch = self.age - (1 - d1) / (1 - b1)
            if self.catch == "sqrt":
                catch = catch.clamp(min=0).sqrt()
            elif self.catch.startswith("cap:"):
                catch = catch.clamp(max=float(self.catch[4:]))
            elif self.catch.startswith("none-until:") and self.t < int(self.catch[11:]):
                catch = torch.zeros_like(catch)
            num = self.m + g * catch
            update = (num / (1 - b1 ** self.t)) / (
                (self.v / (1 - b2 ** self.t)).sqrt() + self.eps)
            self.age[arrived] = 0
            p.add_(update, alpha=-self.lr)
            return
        a = self.age[arrived]
        g = avg[arrived] / a
        d1, d2 = self.b1 ** a, self.b2 ** a
        self.m[arrived] = d1 * self.m[arrived] + (1 - d1) * g
        self.v[arrived] = d2 * self.v[arrived] + (1 - d2) * g * g
        update = (self.m / (1 - self.b1 ** self.t)) / (
            (self.v / (1 - self.b2 ** self.t)).sqrt() + self.eps)
        if self.lazy:
            update = torch.where(arrived, update * self.age, torch.zeros_like(update))
        self.age[arrived] = 0
        p.add_(update, alpha=-self.lr)


class AgedMomentum:
    """SGD with momentum's counterpart of :class:`AgedAdam` (lazy): one velocity for all
    ranks; an element arriving after ``a`` steps with ``S`` moves by the sum of the ``a``
    velocities that ``a`` steps of gradient ``S / a`` would have produced, and its
    velocity becomes the last of them. At density 1 this is torch.optim.SGD."""

    def __init__(self, p, state, lr, momentum=0.9, tail=False):
        self.lr, self.mu, self.tail = lr, momentum, tail
        self.u = state["momentum_buffer"].clone()
        self.age = torch.zeros_like(p)

    @torch.no_grad()
    def step(self, p, avg):
        self.age += 1
        arrived = avg != 0
        mu = self.mu
        if self.tail:
            # the velocity decays and moves every element every step, as dense SGD does with
            # a zero gradient; an arrival adds the a steps of its mean gradient
            self.u.mul_(mu)
            a = self.age[arrived]
            g = avg[arrived] / a
            ma = mu ** a
            geo = mu * (1 - ma) / (1 - mu)
            update = self.u.clone()
            update[arrived] += g / (1 - mu) * (a - geo)
            self.u[arrived] += g * (1 - ma) / (1 - mu)
            self.age[arrived] = 0
            p.add_(update, alpha=-self.lr)
            return
        a, u0 = self.age[arrived], self.u[arrived]
        g = avg[arrived] / a
        ma = mu ** a
        geo = mu * (1 - ma) / (1 - mu)  # sum_{j=1..a} mu^j
        moved = u0 * geo + g / (1 - mu) * (a - geo)
        self.u[arrived] = ma * u0 + g * (1 - ma) / (1 - mu)
        self.age[arrived] = 0
        update = torch.zeros_like(p)
        update[arrived] = moved
        p.add_(update, alpha=-self.lr)


def rank_catch_up(rule, p, picks, ranks: int, union_v: bool = False) -> None:
    """``ef_age_rank``: the tail rule with each rank's own wait. ``picks``: per rank, the
    (indices, values) it sent this step; each rank's values are spread over the steps since
    *that rank* last sent the element (``rule.ages[r]``), not since anyone did, and caught
    up as that many steps of their mean. SGD: velocity and movement gain the gradient part
    of those steps; Adam: the first moment likewise, the second moment the squared mean
    rate of all contributions over the union's wait (its tail rule); ``union_v``
    (``ef_age_rank_m``): Adam's second moment as the tail rule has it, the sum over the
    union's wait, ``(1 − β2^a)·(S/a)²``."""
    if not hasattr(rule, "ages"):
        rule.ages = [torch.zeros(p.numel()) for _ in range(ranks)]
    for a in rule.ages:
        a += 1
    flat = p.data.view(-1)
    if isinstance(rule, AgedMomentum):
        mu = rule.mu
        u = rule.u.view(-1)
        u.mul_(mu)
        update = u.clone()
        for r, (idx, vals) in enumerate(picks):
            a = rule.ages[r][idx]
            c = vals / (ranks * a)
            ma = mu ** a
            update.index_add_(0, idx, c / (1 - mu) * (a - mu * (1 - ma) / (1 - mu)))
            u.index_add_(0, idx, c * (1 - ma) / (1 - mu))
            rule.ages[r][idx] = 0
        flat.add_(update, alpha=-rule.lr)
        return
    b1, b2 = rule.b1, rule.b2
    rule.t += 1
    rule.age += 1
    m, v = rule.m.view(-1), rule.v.view(-1)
    rate = torch.zeros_like(m)   # the contributions' mean gradient per step
    extra = torch.zeros_like(m)  # the gradient part of the first moment over the waits
    m.mul_(b1)
    for r, (idx, vals) in enumerate(picks):
        a = rule.ages[r][idx]
        g = vals / (ranks * a)
        rate.index_add_(0, idx, g)
        m.index_add_(0, idx, (1 - b1 ** a) * g)
        extra.index_add_(0, idx, g * (a - (1 - b1 ** a) / (1 - b1)))
        rule.ages[r][idx] = 0
    arrived = rate != 0
    age = rule.age.view(-1)
    if union_v:
        total = torch.zeros_like(m)
        for idx, vals in picks:
            total.index_add_(0, idx, vals / ranks)
        rate = total / age
    v.mul_(b2).add_(torch.where(arrived, (1 - b2 ** age) * rate * rate, torch.zeros_like(rate)))
    age[arrived] = 0
    update = ((m + extra) / (1 - b1 ** rule.t)) / ((v / (1 - b2 ** rule.t)).sqrt() + rule.eps)
    flat.add_(update, alpha=-rule.lr)


class SharedVarianceAdam(AdamRule):
    """Prototype: local first moment, the second moment shared by every rank (``shared``:
    key -> [v, steps]); masking by SGD's density rule."""

    buffers = ("exp_avg",)

    def __init__(self, shared, ranks, **kw):
        super().__init__(**kw)
        self.shared, self.ranks = shared, ranks

    def apply(self, key, g):
        st = self._buffers(key, g)
        if "exp_avg" not in st:
            st["exp_avg"] = torch.zeros_like(g)
        m = st["exp_avg"]
        t = self.steps.get(key, 0) + 1
        self.steps[key] = t
        m.mul_(self.beta1).add_(g, alpha=1.0 - self.beta1)
        v, tv = self.shared[key][:2]
        # floor: what Adam's v would hold had the other ranks' gradients been zero here
        v = torch.maximum(v, g.square().mul_((1.0 - self.beta2) / self.ranks ** 2))
        denom = v.sqrt_().div_((1.0 - self.beta2 ** max(tv, 1)) ** 0.5).add_(self.eps)
        return torch.div(m, denom).div_(1.0 - self.beta1 ** t)

    def mask(self, key, idx):
        m = self.state.get(key, {}).get("exp_avg")
        if m is not None and self.masks(self.beta1):
            m.index_fill_(0, idx, 0)


class DensityMaskedAdam(AdamRule):
    """The ``mask_density`` variant: Adam's first moment masked by SGD's density rule."""

    def mask(self, key, idx):
        m = self.state.get(key, {}).get("exp_avg")
        if m is not None and self.masks(self.beta1):
            m.index_fill_(0, idx, 0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="digits,lm")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seeds", default="", help="default: digits 0-7, lm 0")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=None,
                   help="the density warm-up's steps (default: the package's for --density)")
    p.add_argument("--min-k", type=int, default=32, help="auto_min_k's threshold")
    p.add_argument("--epochs", type=int, default=0, help="0: digits 10, lm 3 (of 100 steps)")
    p.add_argument("--no-seed", action="store_true",
                   help="local rules start fresh instead of from the optimizer's state")
    p.add_argument("--profiling", type=int, default=5,
                   help="dense steps before sparsifying, the zero step included (a planned "
                        "scheme's warmup_steps)")
    p.add_argument("--model", default="cnn", choices=("cnn", "mlp", "mlp_deep", "gru"),
                   help="digits task's model")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"), help="digits task's")
    p.add_argument("--freeze", type=int, default=50, help="frozen_v: dense Adam steps")
    p.add_argument("--refresh", type=int, default=1,
                   help="shared_v: the shared second moment is updated every N steps (at most, "
                        "with --refresh-dense)")
    p.add_argument("--refresh-dense", type=int, default=0,
                   help="shared_v: updated every step until this step, then at intervals "
                        "doubling up to --refresh")
    p.add_argument("--lm-lr", type=float, default=2e-3, help="the lm task's Adam learning rate")
    p.add_argument("--adam-lr", type=float, default=1e-3,
                   help="the digits task's Adam learning rate (--optimizer adam)")
    p.add_argument("--lr-warmup", type=int, default=0,
                   help="steps of a linear learning-rate warm-up (0: none)")
    p.add_argument("--catch", default="full",
                   help="ef_age_tail's Adam catch-up: full, sqrt, cap:N, none-until:T")
    p.add_argument("--select", default="magnitude", choices=("magnitude", "adam", "arrival", "local_v"),
                   help="the ef_age variants' selection key under Adam: the residual's "
                        "magnitude, or its magnitude over the shared rule's sqrt(v-hat) + eps")
    p.add_argument("--json", default=None)
    p.add_argument("--adam-limit", type=int, default=0, metavar="P",
                   help="measure the Adam rule's dense limit on P ranks instead (see above)")
    return p.parse_args(argv)


def adam_limit(ranks: int, n: int = 10_000, steps: int = 50, seed: int = 0) -> None:
    """The Adam rule at density 1 on ``ranks`` ranks against torch.optim.Adam on the
    averaged gradient (steps 10 to the end)."""
    torch.manual_seed(seed)
    signal = torch.randn(n) * 0.1
    for masking in (False, "auto"):
        mems = [ResidualMemory(AdamRule(masking=masking)) for _ in range(ranks)]
        w = torch.zeros(n, requires_grad=True)
        adam = torch.optim.Adam([w], lr=1.0)
        norms, cosines = [], []
        for _ in range(steps):
            grads = [signal + torch.randn(n) for _ in range(ranks)]
            update = torch.zeros(n)
            for r in range(ranks):
                mems[r].rule.density = 1.0
                v, i = mems[r].select_topk("x", grads[r], n)
                update.index_add_(0, i.long(), v)
            update /= ranks
            before = w.detach().clone()
            w.grad = sum(grads) / ranks
            adam.step()
            ref = before - w.detach()
            norms.append(float(update.norm() / ref.norm()))
            cosines.append(float(update @ ref / update.norm() / ref.norm()))
        print(f"[adam-limit] P={ranks} masking={masking}: update norm / Adam's "
              f"{statistics.mean(norms[10:]):.3f}, cosine {statistics.mean(cosines[10:]):.3f}")


def make_task(task: str, seed: int, ranks: int, args=None):
    """(model, per-rank loss(epoch, step), evaluate(), steps per epoch, optimizer kind, lr)."""
    torch.manual_seed(seed)
    if task == "digits":
        train, test = load_digits_split(seed=seed)
        shards = [shard(train, r, ranks) for r in range(ranks)]
        from ssfusion_hvd.examples.data import DIGITS_MODELS
        model = DIGITS_MODELS.get(getattr(args, "model", "cnn") if args else "cnn", DigitsNet)()
        bs = 32
        orders = {}

        def loss(r, epoch, s):
            key = (epoch, r)
            if key not in orders:
                g = torch.Generator().manual_seed(seed * 1000 + epoch * 10 + r)
                orders[key] = torch.randperm(len(shards[r].y), generator=g)
            idx = orders[key][(s * bs) % len(shards[r].y):][:bs]
            return F.cross_entropy(model(shards[r].x[idx]), shards[r].y[idx])

        def evaluate():
            with torch.no_grad():
                return float((model(test.x).argmax(1) == test.y).float().mean()) * 100
        if args is not None and args.optimizer == "adam":
            return model, loss, evaluate, len(shards[0].y) // bs, "adam", args.adam_lr
        return model, loss, evaluate, len(shards[0].y) // bs, "sgd", 0.05 * ranks
    from ssfusion_hvd.examples import text

    tr, va = text.load_text_split()
    model = text.lm_model()
    gens = {}

    def loss(r, epoch, s):
        key = (epoch, r)
        if key not in gens:
            gens[key] = torch.Generator().manual_seed((seed * 1000 + epoch) * 1000 + r)
        return text.lm_loss(model, *tr.batch(16, gens[key]))
    return model, loss, lambda: text.perplexity(model, va), 100, "adam", getattr(args, "lm_lr", 2e-3)


def _warmup(args) -> int:
    return warmup_length(args.density, DEFAULT_WARMUP_STEPS if args.warmup is None else args.warmup)


def run(task: str, variant: str, seed: int, args) -> dict:
    ranks = args.ranks
    model, loss, evaluate, steps, kind, lr = make_task(task, seed, ranks, args)
    params = list(model.parameters())
    epochs = args.epochs or (10 if task == "digits" else 3)
    warm = 0 if variant == "ef" else _warmup(args)
    schedule = Recipe("none", args.density, warm, True)
    opt = (torch.optim.SGD(params, lr=lr, momentum=0.9) if kind == "sgd"
           else torch.optim.Adam(params, lr=lr))
    masking = {"auto": "auto", "mask": True, "nomask": False, "auto_min_k": "auto",
               "mask_density": "auto", "shared_v": "auto", "frozen_v": "auto",
               "shared_v_mask": True}.get(variant)
    # auto_min_k: what the plan sends dense (decided at the target density, as the planner)
    dense_t = [variant == "auto_min_k" and int(nominal_k(p.numel(), args.density)) < args.min_k
               for p in params]
    by_name = {str(i): p for i, p in enumerate(params)}

    def from_optimizer(names, buffers):  # what Recipe.take_state hands over
        if args.no_seed:
            return None
        st = opt.state.get(by_name[names[0]], {})
        if not all(b in st for b in buffers):
            return None
        return {b: st[b].reshape(-1) for b in buffers}, int(float(st.get("step", 0)))

    aged = {}  # ef_age: parameter index -> AgedAdam, from the optimizer's state
    vloc = {}  # --select local_v: (rank, parameter index) -> [its own gradients' v, steps]
    sq = {}  # ef_age_tail_q / _var: (rank, parameter index) -> [sum of g², steps] since it sent
    shared = {}  # shared_v / frozen_v: key -> [v, steps], seeded from the optimizer
    refreshes, nxt, gap = set(), 0, 1
    while nxt < 100_000:  # every step to --refresh-dense, then doubling gaps up to --refresh
        refreshes.add(nxt)
        if nxt >= args.refresh_dense:
            gap = min(args.refresh, gap * 2) if args.refresh_dense else args.refresh
        nxt += gap if nxt >= args.refresh_dense else 1

    def refresh_at(step):
        return step in refreshes
    mems = []
    for _ in range(ranks):
        rule = None
        if masking is not None:
            adam = DensityMaskedAdam if variant == "mask_density" else AdamRule
            if variant in ("shared_v", "frozen_v", "shared_v_mask"):
                adam = lambda masking: SharedVarianceAdam(shared, ranks, masking=masking)  # noqa: E731
            rule = MomentumRule(0.9, masking=masking) if kind == "sgd" else adam(masking=masking)
        mem = ResidualMemory(rule)
        for i, p in enumerate(params):
            mem.register(str(i), [str(i)], [p.shape])
        mem.seed_from = from_optimizer
        mems.append(mem)
    # as in examples/train.py: hvd.broadcast_optimizer_state steps once with zero gradients,
    # and a planned scheme's first --profiling steps (that one included) are dense
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    sent = total = 0
    t = 1
    for epoch in range(1, epochs + 1):
        for s in range(steps):
            grads = []
            for r in range(ranks):
                model.zero_grad()
                loss(r, epoch, s).backward()
                grads.append([p.grad.detach().clone() for p in params])
            # frozen_v: the density warm-up starts after its dense Adam steps
            density = schedule.density_at(t - (args.freeze if variant == "frozen_v" else 0))
            t += 1
            if args.lr_warmup:  # a linear learning-rate warm-up, as GPT recipes have
                for g in opt.param_groups:
                    g["lr"] = lr * min(1.0, t / args.lr_warmup)
                for rule in aged.values():
                    rule.lr = lr * min(1.0, t / args.lr_warmup)
            dense_until = args.freeze if variant == "frozen_v" else args.profiling
            if variant == "dense" or t <= dense_until:
                for i, p in enumerate(params):
                    p.grad = sum(g[i] for g in grads) / ranks
                    sent += ranks * p.numel()
                    total += ranks * p.numel()
                opt.step()
                continue
            if any(dense_t):  # the plan's dense tensors: the optimizer on their average
                for i, p in enumerate(params):
                    p.grad = sum(g[i] for g in grads) / ranks if dense_t[i] else None
                n_dense = ranks * sum(p.numel() for p, d in zip(params, dense_t) if d)
                sent, total = sent + n_dense, total + n_dense
                opt.step()
            if variant in ("shared_v", "frozen_v", "shared_v_mask"):
                for i, p in enumerate(params):
                    if str(i) not in shared:
                        st = opt.state.get(p, {})
                        shared[str(i)] = [st["exp_avg_sq"].reshape(-1).clone(), int(float(st["step"]))]
                    if variant != "frozen_v" and refresh_at(t):
                        # v of the averaged gradient at the refresh steps (every step: the oracle)
                        gbar = (sum(g[i] for g in grads) / ranks).reshape(-1)
                        v = shared[str(i)]
                        gap = max(1, t - v[1]) if len(v) < 3 else t - v[2]
                        decay = 0.999 ** gap
                        v[0].mul_(decay).addcmul_(gbar, gbar, value=1 - decay)
                        v[1] += gap
                        v[2:] = [t]
            avg = []
            bursts = []
            picks = {}  # ef_age_rank: parameter index -> per rank (indices, values)
            for i, p in enumerate(params):
                if dense_t[i]:
                    avg.append(torch.zeros_like(p))
                    bursts.append(torch.ones(p.numel()))
                    continue
                k = int(nominal_k(p.numel(), density))
                acc_sum = torch.zeros(p.numel())
                b_num, b_den = torch.zeros(p.numel()), torch.zeros(p.numel())
                for r in range(ranks):
                    mems[r].rule.density = density
                    if args.select == "local_v":  # every step, from the rank's own gradient
                        lv = vloc.setdefault((r, i), [torch.zeros(p.numel()), 0])
                        lv[0].mul_(0.999).addcmul_(grads[r][i].reshape(-1), grads[r][i].reshape(-1),
                                                   value=0.001)
                        lv[1] += 1
                    acc = mems[r].compensate(str(i), grads[r][i])
                    if args.select != "magnitude" and kind == "adam" and variant.startswith("ef_age"):
                        # the key in Adam's geometry: what the element would move the
                        # parameter by, per unit of lr (every rank holds the same v)
                        if i in aged:
                            v, steps_v = aged[i].v.reshape(-1), aged[i].t
                            wait = aged[i].age.reshape(-1) + 1
                        else:
                            st = opt.state[p]
                            v, steps_v = st["exp_avg_sq"].reshape(-1), int(float(st["step"]))
                            wait = torch.ones_like(v)
                        if args.select == "local_v":  # this rank's own gradients' second moment
                            lv, ln = vloc.setdefault((r, i), [torch.zeros(p.numel()), 0])
                            v, steps_v = lv, ln
                        if args.select == "arrival":  # v as this arrival would leave it
                            rate = acc.reshape(-1) / wait
                            d2 = 0.999 ** wait
                            v = d2 * v + (1 - d2) * rate * rate
                        denom = (v / (1 - 0.999 ** max(steps_v, 1))).sqrt() + 1e-8
                        _, idx = ops.topk(acc.reshape(-1) / denom, k)
                        values = acc.reshape(-1)[idx.long()]
                    else:
                        values, idx = ops.topk(acc, k)
                    acc_sum.index_add_(0, idx.long(), values)
                    if variant == "ef_age_tail_var":
                        # each rank's Σg² and count since it last sent the element: at a send,
                        # the within-wait variance of its gradient, averaged over the senders
                        q, w = sq.setdefault((r, i), [torch.zeros(p.numel()), torch.zeros(p.numel())])
                        q.add_(grads[r][i].reshape(-1).square())
                        w.add_(1)
                        il = idx.long()
                        mean = values / w[il]
                        b_num.index_add_(0, il, (q[il] / w[il] - mean * mean).clamp(min=0))
                        b_den.index_add_(0, il, torch.ones_like(mean))
                        q[il] = 0
                        w[il] = 0
                    if variant == "ef_age_tail_q":
                        # each rank's burstiness of what it sends: w·Σg² / S² (1 steady, w spike)
                        q, w = sq.setdefault((r, i), [torch.zeros(p.numel()), torch.zeros(p.numel())])
                        q.add_(grads[r][i].reshape(-1).square())
                        w.add_(1)
                        il = idx.long()
                        s2 = values.square()
                        beta = (q[il] * w[il] / s2.clamp_min(1e-30)).clamp(min=1.0)
                        beta = torch.minimum(beta, w[il])
                        b_num.index_add_(0, il, s2 * beta)
                        b_den.index_add_(0, il, s2)
                        q[il] = 0
                        w[il] = 0
                    if variant in ("ef_age_rank", "ef_age_rank_m"):
                        picks.setdefault(i, []).append((idx.long(), values.clone()))
                    mems[r].update(str(i), acc, idx)
                    sent += k
                    total += p.numel()
                avg.append((acc_sum / ranks).view_as(p))
                if variant == "ef_age_tail_var":  # Adam's v of the average: mean² + σ²/P
                    bursts.append(b_num / b_den.clamp_min(1) / ranks)
                else:
                    bursts.append(torch.where(b_den > 0, b_num / b_den.clamp_min(1e-30),
                                              torch.ones_like(b_den)))
            if variant in ("ef_age", "ef_age_lazy", "ef_age_tail", "ef_age_tail_q", "ef_age_tail_var",
                           "ef_age_rank", "ef_age_rank_m"):
                tail = variant in ("ef_age_tail", "ef_age_tail_q", "ef_age_tail_var", "ef_age_rank",
                                   "ef_age_rank_m")
                for i, (p, a) in enumerate(zip(params, avg)):
                    if i not in aged:
                        aged[i] = (AgedMomentum(p, opt.state[p], opt.param_groups[0]["lr"], tail=tail)
                                   if kind == "sgd" else
                                   AgedAdam(p, opt.state[p], opt.param_groups[0]["lr"],
                                            lazy=variant == "ef_age_lazy", tail=tail,
                                            catch=args.catch))
                    if variant in ("ef_age_rank", "ef_age_rank_m"):
                        if not dense_t[i]:
                            rank_catch_up(aged[i], p, picks[i], ranks, variant == "ef_age_rank_m")
                    elif variant == "ef_age_tail_q" and kind == "adam":
                        aged[i].step(p.data, a, bursts[i].view_as(p))
                    elif variant == "ef_age_tail_var" and kind == "adam":
                        aged[i].step(p.data, a, extra_v=bursts[i].view_as(p))
                    else:
                        aged[i].step(p.data, a)
            elif masking is None:  # the optimizer on the sparse average (plain error feedback)
                for p, a in zip(params, avg):
                    p.grad = a
                opt.step()
            else:  # the recipe: the synchronized update applied as is
                with torch.no_grad():
                    torch._foreach_add_(params, avg, alpha=-lr)
    return {"task": task, "variant": variant, "seed": seed, "metric": evaluate(),
            "density_sent": sent / total if total else 1.0}


def main(argv=None):
    args = parse_args(argv)
    if args.adam_limit:
        adam_limit(args.adam_limit)
        return
    out = []
    for task in [t for t in args.tasks.split(",") if t]:
        seeds = [int(s) for s in args.seeds.split(",") if s] or (list(range(8)) if task == "digits" else [0])
        for variant in [v for v in args.variants.split(",") if v]:
            if variant not in VARIANTS:
                raise SystemExit(f"unknown variant {variant!r}; choose from {VARIANTS}")
            for seed in seeds:
                r = run(task, variant, seed, args)
                out.append(r)
                print(f"[ablation] {task} {variant} seed {seed}: {r['metric']:.3f} "
                      f"(density sent {r['density_sent']:.4f})", flush=True)
    for task in dict.fromkeys(r["task"] for r in out):
        name = "test accuracy %" if task == "digits" else "validation perplexity"
        print(f"\n**{task}** ({name}; {args.ranks} replicated ranks, density {args.density}, "
              f"warm-up {_warmup(args)} steps)\n\n| variant | mean | std | min | max | seeds |\n"
              "|---|---:|---:|---:|---:|---:|")
        for variant in dict.fromkeys(r["variant"] for r in out if r["task"] == task):
            xs = [r["metric"] for r in out if r["task"] == task and r["variant"] == variant]
            sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
            print(f"| {variant} | {statistics.mean(xs):.2f} | {sd:.2f} | {min(xs):.2f} | "
                  f"{max(xs):.2f} | {len(xs)} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": out}, indent=1))


if __name__ == "__main__":
    main()
