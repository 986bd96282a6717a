"""Shared moments: one optimizer state for every rank, moved by what arrives.

The default rule of the sparse schemes (``moments="shared"``, docs/recipe.md §1). Each
rank error-compensates its plain gradient (plus coupled weight decay); the synchronized
average is the same on every rank, and it alone moves the wrapped optimizer's own state:
SGD's ``momentum_buffer``, Adam's ``exp_avg``, ``exp_avg_sq`` and ``step``. So that state
is identical on every rank, lives where torch keeps it, and is what
``hvd.broadcast_optimizer_state`` and a checkpoint carry.

The one thing a sparse stream needs that a dense one does not is the *age* of an
element: how many steps its gradient waited in the residuals before it arrived. An
element sent every step arrives with one step's gradient; one that waited ``a`` steps
arrives with about ``a`` of them summed. Fed to Adam as one gradient, such a burst looks
``a`` times too large to the second moment and the step is mis-scaled by about √a
(plain error feedback under Adam: docs/recipe.md). Here it is taken for what it is,
``a`` steps of the mean gradient ``g = S / a``:

* every element takes the optimizer's step with a zero gradient, every step: its moments
  decay and it moves by them, as it would in dense training between gradients (so an
  element's momentum keeps carrying it while it waits, instead of landing at once at its
  next arrival);
* an element that arrives adds the gradient part of ``a`` steps of ``g``: the moments as
  ``a`` such steps would move them (``m ← β1·m + (1 − β1^a)·g``, Adam's ``v`` alike with
  ``g²``, SGD's velocity by its own recurrence), and the parameter by what ``g`` would
  have added to its ``a − 1`` skipped steps on top of this step's.

At density 1 every age is 1 and this is exactly ``torch.optim.SGD`` / ``Adam`` / ``AdamW``
on the averaged gradient, on any number of ranks (``tests/test_moments.py``). The ages
are the same on every rank (they follow the synchronized tensor), so every rank computes
the same state without communicating.

The union's age is the shortest wait of the senders: on P ranks an element one rank sends
every step while the others hold it for 50 arrives with age 1, and SGD's velocity takes
the 50-step burst as one step's gradient. With ``scheme_options["waits"]`` the planned
schemes carry each sender's own wait beside its entry (one byte) and their decode hands
:meth:`SharedMoments.step` per element the shares of what arrived that the rule needs
(:func:`share_table`, weighted by the senders' values), which it uses instead of the
union's age: SGD the velocity's share ``Σ_r v_r·ψ(a_r) / Σ_r v_r``; Adam the same at β1
for its first moment and the mean rate ``Σ_r v_r/a_r / Σ_r v_r`` for its second
(``docs/design.md``, "Each sender's wait").

A sum tells the rule the mean of the steps it waited, not how much the gradient moved
around it, so Adam's second moment would see the mean's square alone and step too far on
coordinates whose gradient is mostly noise (it diverged at dense's tuned learning rate).
With ``scheme_options["spread"]`` (Adam's default) each sender also carries the variance
of its gradient over its wait, and :meth:`SharedMoments.step` adds the senders' mean
variance over P to ``v`` at an arrival: Adam's ``v`` of an average is ``mean² + σ²/P``
(``docs/recipe.md``, "The senders' variance").
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from .ops import native_op

__all__ = ["SharedMoments", "fresh_share", "share_table", "SHARE_ROWS", "SELECT_BY_CHOICES",
           "selection_key"]

#: ``select_by`` (the schemes' option, the DDP hook's keyword): what an exact top-k ranks
#: under Adam's shared moments (docs/recipe.md, "Selecting by the gain"). Here, below the
#: schemes and the DDP hook, so that the hook needs no Horovod.
SELECT_BY_CHOICES = ("auto", "magnitude", "step", "gain")


def selection_key(select_by: str) -> Optional[bool]:
    """What ``select_by`` keys an exact top-k by under Adam's shared moments: None (the
    magnitude), or whether the key by the pending step takes its denominator's square root
    (``Recipe.step_scales(root=...)``: True for the gain and ``"auto"``, False for the
    step)."""
    if select_by == "magnitude":
        return None
    return select_by != "step"

#: The native step on CUDA tensors too (else they take the foreach path). On since its GPU
#: test (``tests/test_moments_native.py -k gpu``) passed on an H100 (2026-11-27: the CUDA
#: kernel equals the CPU one; GPT-2's step 2 ms against foreach's 9 ms for SGD, 4 against
#: 16 for Adam, ``scripts/bench_moments.py --device cuda``). A switch for measurement.
NATIVE_ON_CUDA = True

#: per rule family, the shares of a decode with each sender's wait (:func:`share_table`)
SHARE_ROWS = {"sgd": 1, "adam": 2}


def fresh_share(momentum: float, a):
    """ψ(a) = (1 − μ^a) / (a·(1 − μ)): of ``a`` steps of one gradient, the share that
    reaches SGD's velocity within those steps (1 at a = 1, about 1/(a·(1 − μ)) for long
    waits); the rest moved the parameter through the velocity on the way. A number or a
    tensor of waits."""
    mu = float(momentum)
    if isinstance(a, torch.Tensor):
        return (1.0 - torch.pow(mu, a)) / (a * (1.0 - mu))
    return (1.0 - mu ** a) / (a * (1.0 - mu))


def share_table(kind: str, hparams: dict, waits: torch.Tensor) -> Optional[torch.Tensor]:
    """Per wait in ``waits``, what a sender's value that waited that long weighs in each
    share the rule ``kind`` reads (rows, ``len(waits)``), float64; None where no rule reads
    one (SGD without momentum, or no correction). ``"momentum"``: ψ at μ (the velocity's
    share). ``"adam"``: ψ at β1 (the first moment's share) and 1/a (the rate: a value that
    waited ``a`` steps is ``a`` steps of ``v/a``)."""
    a = waits.double()
    if kind == "momentum" and 0.0 < float(hparams.get("momentum", 0.0)) < 1.0:
        return fresh_share(hparams["momentum"], a)[None]
    if kind == "adam":
        return torch.stack([fresh_share(hparams["betas"][0], a), 1.0 / a])
    return None


class SharedMoments:
    """The step of the sparsified tensors under ``moments="shared"``, for one optimizer.

    ``kind``: ``"momentum"`` (``hparams``: momentum, dampening, nesterov) or ``"adam"``
    (betas, eps). ``ages[p]``: per element of ``p``, the steps since it last arrived
    (float32, created at ``p``'s first sparse step)."""

    def __init__(self, kind: str, hparams: dict):
        if kind not in ("momentum", "adam"):
            raise ValueError(f"shared moments need SGD with momentum or Adam, got {kind!r}")
        self.kind = kind
        self.hparams = dict(hparams)
        self.ages: Dict[torch.Tensor, torch.Tensor] = {}

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, optimizer, group: dict, params: List[torch.Tensor],
             shares: Optional[Dict[torch.Tensor, torch.Tensor]] = None,
             noise: Optional[Dict[torch.Tensor, torch.Tensor]] = None) -> None:
        """Steps ``params`` (sparsified tensors of ``group``, ``p.grad`` the synchronized
        average of this step) and their state in ``optimizer.state``. Decoupled weight
        decay is the caller's (it applies to every element every step).

        ``shares``: for tensors whose wire carried each sender's wait, per element the
        shares of this step's gradient the decode computed (shape ``(rows, *p.shape)``,
        :func:`share_table`'s rows weighted by the senders' values), used instead of the
        union's age. SGD then needs no age; Adam still ages every element (its second
        moment's gain is the union's).

        ``noise``: for tensors whose wire carried each sender's spread, per element the
        senders' variance over P as a ratio to this step's gradient squared
        (``SparsePart.noise``); Adam adds it, times the gradient squared, to its second
        moment at an arrival: ``v`` of an average of P noisy gradients is the mean's
        square plus their variance over P, of which a sparse sum carries only the first
        (``docs/recipe.md``, "The senders' variance"). SGD reads none."""
        grads = [p.grad.float() for p in params]
        shares = shares or {}
        noise = (noise or {}) if self.kind == "adam" else {}
        if self.kind == "adam":
            state = self._adam_state(optimizer, group, params)
        else:
            state = self._momentum_buffers(optimizer, params)
        # the tensors without shares or noise in one native pass each where the extension
        # has it; the rest (and everything, where it has not) by the foreach path below
        own = [i for i, p in enumerate(params) if p not in shares and p not in noise]
        if own and self._native_step(group, *_pick(own, params, grads, state)):
            rest = [i for i, p in enumerate(params) if p in shares or p in noise]
            if not rest:
                return
            params, grads, state = _pick(rest, params, grads, state)
        if self.kind == "adam" or not shares:
            aged, by_age = params, grads
        else:
            aged = [p for p in params if p not in shares]
            by_age = [g for p, g in zip(params, grads) if p not in shares]
        ages = [self._age(p) for p in aged]
        if ages:
            torch._foreach_add_(ages, 1.0)
        if self.kind == "adam":
            update = self._adam(state, grads, ages, [shares.get(p) for p in params],
                                [noise.get(p) for p in params])
        else:
            share = iter(self.fresh_shares(ages) if ages else [])
            update = self._momentum(state, grads,
                                    [shares[p][0] if p in shares else next(share) for p in params])
        _foreach_add_cast(params, update, -float(group["lr"]))
        # the arrived elements start waiting again: age·(1 - |sign S|)
        if ages:
            arrived = torch._foreach_sign(by_age)
            torch._foreach_abs_(arrived)
            torch._foreach_sub_(arrived, 1.0)
            torch._foreach_mul_(ages, torch._foreach_neg(arrived))

    def fresh_shares(self, ages: List[torch.Tensor], mu: Optional[float] = None) -> List[torch.Tensor]:
        """:func:`fresh_share` of each element's age at ``mu`` (default SGD's momentum)."""
        mu = self.hparams["momentum"] if mu is None else mu
        out = _one_minus_pow(mu, ages)
        torch._foreach_div_(out, ages)
        torch._foreach_div_(out, 1.0 - mu)
        return out

    def _native_step(self, group, params, grads, state) -> bool:
        """The step in one native pass per tensor (``csrc/moments.h``, the same arithmetic
        as the foreach path below): no model-sized temporaries, one read and write of each
        parameter, gradient, state and age. Where the extension has the op for these
        tensors' device and they are all float32 and contiguous; False: the caller takes
        the foreach path."""
        op = "shared_adam_step" if self.kind == "adam" else "shared_momentum_step"
        fn = native_op(op, params[0]) if params else None
        if fn is not None and params[0].is_cuda and not NATIVE_ON_CUDA:
            fn = None
        tensors = state[:2] if self.kind == "adam" else [state]
        if fn is None or not all(_plain(ts, params[0].device) for ts in (params, grads, *tensors)):
            return False
        ages = [self._age(p) for p in params]
        lr = float(group["lr"])
        if self.kind == "adam":
            m, v, steps = state
            b1, b2 = self.hparams["betas"]
            fn(params, grads, m, v, ages, lr, b1, b2, self.hparams["eps"],
               [1.0 - b1 ** t for t in steps], [(1.0 - b2 ** t) ** 0.5 for t in steps])
        else:
            fn(params, grads, state, ages, lr, self.hparams["momentum"],
               self.hparams.get("dampening", 0.0), bool(self.hparams.get("nesterov", False)))
        return True

    @staticmethod
    def _adam_state(optimizer, group, params):
        """``(exp_avg, exp_avg_sq, step counts)`` of ``params``, each step advanced by one,
        the entries created as torch's Adam creates them on its first step."""
        m, v, steps = [], [], []
        for p in params:
            st = optimizer.state[p]
            if st.get("exp_avg") is None:
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["step"] = _step_like(group, p)
            st["step"] += 1
            m.append(st["exp_avg"])
            v.append(st["exp_avg_sq"])
            steps.append(float(st["step"]))
        return m, v, steps  # (a tuple: _pick tells Adam's state from SGD's buffers by it)

    @staticmethod
    def _momentum_buffers(optimizer, params):
        bufs = []
        for p in params:
            st = optimizer.state[p]
            if st.get("momentum_buffer") is None:
                st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            bufs.append(st["momentum_buffer"])
        return bufs

    def _adam(self, state, grads, ages, given, noise):
        b1, b2 = self.hparams["betas"]
        eps = self.hparams["eps"]
        m, v, steps = state
        m32, v32 = _as_float(m), _as_float(v)
        # What arrived, S, is a steps of S/a (per sender, its own a). Of those steps' first
        # moment increments, the share s1 = ψ_β1(a) is still in m, the rest already moved
        # the parameter; its second moment sees the rate r = S/a per step. By the union's
        # age a, or the senders' weighted shares where the wire carried their waits:
        #   m ← β1·m + (1 − β1)·S·s1      (= β1·m + (1 − β1^a)·S/a for one age)
        #   v ← β2·v + (1 − β2^a)·r²
        #   numerator: m + S·(1 − s1)     (what S/a added to m in the a − 1 steps skipped)
        # Every element takes this step's decay (Adam with a zero gradient); S = 0 adds 0.
        by_age = [a for a, g in zip(ages, given) if g is None]  # (ages: one per param)
        own = iter(self.fresh_shares(by_age, b1) if by_age else [])
        inv = iter(torch._foreach_reciprocal(by_age) if by_age else [])
        s1 = [g[0] if g is not None else next(own) for g in given]
        rate = torch._foreach_mul(grads, [g[1] if g is not None else next(inv) for g in given])
        torch._foreach_mul_(m32, b1)
        torch._foreach_addcmul_(m32, grads, s1, value=1.0 - b1)
        torch._foreach_mul_(v32, b2)
        gain = _one_minus_pow(b2, ages)
        torch._foreach_addcmul_(v32, torch._foreach_mul(rate, rate), gain)
        # the senders' variance over P, at the same gain: v ← … + (1 − β2^a)·R·S²
        noisy = [i for i, r in enumerate(noise) if r is not None]
        if noisy:
            sq = torch._foreach_mul([grads[i] for i in noisy], [grads[i] for i in noisy])
            torch._foreach_mul_(sq, [noise[i] for i in noisy])
            torch._foreach_addcmul_([v32[i] for i in noisy], sq, [gain[i] for i in noisy])
        _copy_back(m, m32)
        _copy_back(v, v32)
        rest = torch._foreach_neg(s1)
        torch._foreach_add_(rest, 1.0)
        num = torch._foreach_addcmul(m32, grads, rest)
        denom = torch._foreach_sqrt(v32)
        torch._foreach_div_(denom, [(1.0 - b2 ** t) ** 0.5 for t in steps])
        torch._foreach_add_(denom, eps)
        torch._foreach_div_(num, denom)
        torch._foreach_div_(num, [1.0 - b1 ** t for t in steps])
        return num

    def _momentum(self, bufs, grads, shares):
        mu = self.hparams["momentum"]
        damp = self.hparams.get("dampening", 0.0)
        nesterov = self.hparams.get("nesterov", False)
        u = _as_float(bufs)
        # Every element takes this step's decay (SGD with a zero gradient). What arrived,
        # c = (1 − dampening)·S, is a steps of c/a (per sender, its own a): in those steps
        # it added c·ψ to the velocity (ψ: the fresh share), and moved the parameter by
        # what it added to the velocity in the steps before this one, c·(1 − ψ)/(1 − μ).
        #   u ← μ·u + c·ψ,  moved = u + c·(1 − ψ)/(1 − μ)
        # Every gradient so moves the parameter by c/(1 − μ) in all, as in dense training.
        c = torch._foreach_mul(grads, 1.0 - damp)
        torch._foreach_mul_(u, mu)
        torch._foreach_addcmul_(u, c, shares)
        _copy_back(bufs, u)
        rest = torch._foreach_mul(shares, -1.0 / (1.0 - mu))
        torch._foreach_add_(rest, 1.0 / (1.0 - mu))
        moved = torch._foreach_addcmul(u, c, rest)
        if nesterov:  # each step moves by g + μ·u_j: S = a·g of gradient, μ times the rest
            torch._foreach_mul_(moved, mu)
            torch._foreach_add_(moved, grads)
        return moved

    def _age(self, p: torch.Tensor) -> torch.Tensor:
        a = self.ages.get(p)
        if a is None:
            a = self.ages[p] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        return a

    # ------------------------------------------------------------------ state
    def state_dict(self, names: Dict[torch.Tensor, str]) -> dict:
        return {names[p]: a.clone() for p, a in self.ages.items()}

    def load_state_dict(self, state: Optional[dict], names: Dict[torch.Tensor, str]) -> None:
        """Ages by parameter name; parameters absent (or of another shape) start at 0."""
        self.ages = {}
        for p, n in names.items():
            a = (state or {}).get(n)
            if isinstance(a, torch.Tensor) and a.shape == p.shape:
                self.ages[p] = a.detach().to(device=p.device, dtype=torch.float32).clone()

    def reset(self) -> None:
        """Every age back to 0, on every rank that calls it (after a resume whose
        residuals not every rank kept, the ages must still agree)."""
        self.ages = {}


def _one_minus_pow(base: float, ages: List[torch.Tensor]) -> List[torch.Tensor]:
    """``1 − base^a`` per element."""
    out = torch._foreach_pow(base, ages)
    torch._foreach_neg_(out)
    torch._foreach_add_(out, 1.0)
    return out


def _step_like(group: dict, p: torch.Tensor) -> torch.Tensor:
    """Adam's ``step`` entry as torch's Adam creates it for ``group``."""
    if group.get("capturable", False) or group.get("fused", False):
        return torch.zeros((), dtype=torch.float32, device=p.device)
    return torch.tensor(0.0, dtype=torch.float32)


def _pick(idx: List[int], params, grads, state):
    """Entries ``idx`` of a step's parameters, gradients and state (Adam's three lists, or
    SGD's buffers)."""
    sub = lambda xs: [xs[i] for i in idx]  # noqa: E731
    state = tuple(sub(x) for x in state) if isinstance(state, tuple) else sub(state)
    return sub(params), sub(grads), state


def _plain(ts: List[torch.Tensor], device: torch.device) -> bool:
    """float32, contiguous, on ``device``: what the native step reads and writes."""
    return all(t.dtype == torch.float32 and t.is_contiguous() and t.device == device for t in ts)


def _as_float(ts: List[torch.Tensor]) -> List[torch.Tensor]:
    return [t if t.dtype == torch.float32 else t.float() for t in ts]


def _copy_back(dst: List[torch.Tensor], src: List[torch.Tensor]) -> None:
    for d, s in zip(dst, src):
        if d is not s:
            d.copy_(s)


def _foreach_add_cast(params, updates, alpha: float) -> None:
    if all(p.dtype == torch.float32 for p in params):
        torch._foreach_add_(params, updates, alpha=alpha)
        return
    for p, u in zip(params, updates):
        p.add_(u.to(p.dtype), alpha=alpha)
