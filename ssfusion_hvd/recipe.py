"""The training recipe every sparse scheme shares (``docs/recipe.md``).

Sparsifying 99 % of every gradient away is only free when the optimizer is told. Three
parts, each a keyword of :func:`ssfusion_hvd.DistributedOptimizer`, on by default, the
same for every sparse scheme:

* **Momentum correction** (``momentum_correction="auto"``), for ``torch.optim.SGD`` with
  momentum and ``Adam``/``AdamW``, in one of two forms (``moments``). ``"shared"``
  (the default): each rank error-compensates its plain gradient, and the synchronized average
  moves the wrapped optimizer's own state, the same on every rank, each element taken as
  the steps it waited in the residuals (:mod:`ssfusion_hvd.moments`); ``p.grad`` is a
  gradient. ``"local"``: for SGD, DGC's correction (Lin et al., ICLR'18): each rank accumulates its local
  velocity and error-compensates *that*, with momentum factor masking
  (:class:`~ssfusion_hvd.rules.MomentumRule`). For ``torch.optim.Adam`` /
  ``AdamW``: each rank keeps Adam's moments of its own gradient and error-compensates the
  bias-corrected Adam update, masking the first moment where it sent
  (:class:`~ssfusion_hvd.rules.AdamRule`). Momentum factor masking
  (``momentum_masking="auto"``): SGD masks only while the density in force is below
  ``1 − momentum`` (in the warm-up's dense stages an element is sent every few steps and
  masking would throw its momentum away), Adam masks always. Under local rules the synchronized sum of a
  sparsified tensor is already the update direction, so ``step()`` applies it as
  ``w -= lr · update`` (AdamW's decoupled decay first) and the wrapped optimizer steps
  only the tensors that travelled densely, with its own state, exactly as it would
  without us. Coupled weight decay is folded into the local gradient before the rule,
  where the wrapped optimizer would have put it. Optimizers without momentum (plain SGD)
  need nothing: error feedback on gradients is already exact for them. Any other
  optimizer gets plain error feedback under ``"auto"`` and a ``ValueError`` under
  ``True``.
* **Density warm-up** (``density_warmup_steps="auto"``): DGC's exponential schedule
  counted in synchronized steps, from ``a = min(0.25, 25 d)``. Step ``t < W`` sends
  density ``max(d, a · (d / a) ** (s / 4))`` for stage ``s = ⌊4 t / W⌋``; four stages
  (0.25, 0.11, 0.05, 0.022 at d = 0.01), then the target. ``"auto"`` lasts
  ``W = max(50, ⌈0.3 / d⌉)`` steps: 50 from d = 0.006 up; below it, as long as the target
  density takes to send 30 % of the model (300 steps at 0.001), so the stages are what a
  short job trains in, at no more bytes (docs/results.md §2b, "Density 0.001"). An int
  sets ``W``. Piecewise constant so a planned scheme allocates its buffers once per
  stage. The planned schemes' dense profiling steps count as steps. ``0`` switches it
  off.
* **float32 accumulation** (``fp32_accumulation=True``): with float16 gradients,
  residuals, the rule's state, the selection input and the decode sums are float32; only
  the sent values are rounded to float16, and the rounding error stays in the residual.

Every decision here is a function of the step count and of hyper-parameters that are
identical on every rank, so all ranks agree without communicating.
"""
from __future__ import annotations

import math
import numbers
import warnings
from contextlib import contextmanager
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Union

import torch

from .moments import SharedMoments
from .rules import AdamRule, GradientRule, LocalRule, MomentumRule
from .sparsify.memory import ResidualMemory

__all__ = ["Recipe", "resolve_recipe", "DEFAULT_WARMUP_STEPS", "DEFAULT_MASKING", "DEFAULT_MOMENTS",
           "WARMUP_START", "WARMUP_STAGES", "warmup_length"]

#: default ``density_warmup_steps``: :func:`warmup_length` of the density
DEFAULT_WARMUP_STEPS = "auto"
#: default ``momentum_masking``: "auto" masks only while the density in force is below
#: ``1 - momentum`` (sparse enough for a sent velocity to be stale; docs/recipe.md)
DEFAULT_MASKING = "auto"
#: default ``moments``: "shared" (one optimizer state for all ranks, moved by the
#: synchronized gradient with each element's age, ssfusion_hvd/moments.py) or "local"
#: (each rank's own momentum / Adam moments, error-compensated; DGC's correction)
#: Shared: ahead of the local rules on 17 of the accuracy suite's 18 cells, within 1 point
#: of dense on every 2-worker SGD cell at density 0.01 over three seeds (over ten, the GRU is
#: 1.17 short, as global top-k is; docs/results.md §2b)
DEFAULT_MOMENTS = "shared"
MOMENTS = ("shared", "local")
#: density of the first warm-up stage (DGC: 75 % sparsity) at most, its multiple of the
#: target below that, and the number of stages
WARMUP_START = 0.25
WARMUP_RATIO = 25
WARMUP_STAGES = 4
#: ``"auto"``'s length: at least WARMUP_MIN_STEPS, else the steps in which the target
#: density sends WARMUP_SHARE of the model. At 0.001 in a 132-step job the 50-step
#: warm-up from 0.25 left the deep MLP and the GRU 5.6 and 7.0 points below dense at 0.094
#: of its bytes; from 0.025 over 300 steps (the job ends in the second stage, 0.011) they
#: were +0.9 and -0.7, at 0.082 and 0.080 (7 and 3 seeds, docs/results.md §2b). Chosen
#: among 100, 160 and 300 steps on those two cells, then run on the suite's others.
WARMUP_MIN_STEPS = 50
WARMUP_SHARE = 0.3


def warmup_length(density: float, density_warmup_steps="auto") -> int:
    """The density warm-up's length in steps for ``density_warmup_steps`` (``"auto"``, or
    an int >= 0 taken as is); ``ValueError`` for anything else (the same on every rank)."""
    if isinstance(density_warmup_steps, str) and density_warmup_steps == "auto":
        if not float(density) > 0.0:
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        # (less a hair: 0.3 / 0.006 is 50.000000000000014 in floats, and means 50)
        return max(WARMUP_MIN_STEPS, math.ceil(WARMUP_SHARE / float(density) - 1e-9))
    if isinstance(density_warmup_steps, bool) or not isinstance(density_warmup_steps, int) \
            or density_warmup_steps < 0:
        raise ValueError(f"density_warmup_steps must be 'auto' or an int >= 0, got "
                         f"{density_warmup_steps!r}")
    return density_warmup_steps


def _zero_step(old, p: torch.Tensor, group: dict) -> torch.Tensor:
    """A step count of 0 in the form ``torch.optim.Adam`` keeps it (a scalar tensor; on the
    parameter's device for ``capturable``/``fused``)."""
    if isinstance(old, torch.Tensor):
        return torch.zeros_like(old)
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    on_device = group.get("capturable", False) or group.get("fused", False)
    return torch.zeros((), dtype=dtype, device=p.device) if on_device else torch.tensor(0.0, dtype=dtype)


_KINDS = ("none", "momentum", "adam")


class StepScales(NamedTuple):
    """Per tensor of a sparse part, what the shared Adam rule divides its step by
    (``Recipe.step_scales``; the arguments of ``ops.ef_step_key``)."""
    exp_avg_sqs: List[torch.Tensor]
    #: ``(1 - beta2^step)^(1/2)`` per tensor: host floats, or 0-d tensors on the device
    bias2_sqrt: Union[List[float], List[torch.Tensor]]
    eps: float
    #: the key divides by the denominator's square root (by the gain) rather than by it
    #: (by the step): ``ops.ef_step_key``'s ``root``
    root: bool = False


class Recipe:
    """The resolved recipe of one optimizer (see the module docstring).

    ``kind``: ``"none"`` (plain error feedback on gradients), ``"momentum"`` or ``"adam"``.
    ``moments``: ``"local"`` (each rank's rule) or ``"shared"`` (:attr:`shared` steps the
    sparsified tensors from the synchronized gradient; the local rule is plain error
    feedback).
    """

    def __init__(self, kind: str, density: float, warmup_steps: int, fp32: bool,
                 hparams: Optional[dict] = None, moments: str = "local"):
        if kind not in _KINDS:
            raise ValueError(f"unknown recipe kind {kind!r}")
        if moments not in MOMENTS:
            raise ValueError(f"unknown moments {moments!r}")
        self.kind = kind
        self.moments = moments if kind != "none" else "local"
        #: the shared state's step, or None (local rules, or nothing to correct)
        self.shared: Optional[SharedMoments] = (
            SharedMoments(kind, hparams or {}) if self.moments == "shared" else None)
        self.density = float(density)
        self.warmup_steps = int(warmup_steps)
        #: the first stage's density
        self.warmup_start = min(WARMUP_START, WARMUP_RATIO * self.density)
        self.fp32 = bool(fp32)
        self.hparams = dict(hparams or {})
        self.options: Optional[dict] = None  # resolve_recipe's arguments (set by it)
        #: the wrapped optimizer's family ("sgd", "adam", "other"), by class alone: the
        #: same on every rank whatever its hyper-parameters (set by resolve_recipe)
        self.family = "other"
        self._optimizer = None
        self._names: Dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ schedule
    def stage(self, step: int) -> int:
        """Warm-up stage in force at (0-based) step ``step``; ``WARMUP_STAGES`` after it."""
        if self.warmup_steps <= 0 or step >= self.warmup_steps or self.density >= WARMUP_START:
            return WARMUP_STAGES
        return max(0, step) * WARMUP_STAGES // self.warmup_steps

    def stage_density(self, stage: int) -> float:
        if stage >= WARMUP_STAGES:
            return self.density
        a = self.warmup_start
        d = a * (self.density / a) ** (stage / WARMUP_STAGES)
        return max(self.density, min(1.0, d))

    def density_at(self, step: int) -> float:
        """The density in force at (0-based) step ``step``."""
        return self.stage_density(self.stage(step))

    # ------------------------------------------------------------------ local state
    def accumulation_dtype(self, grad_dtype: torch.dtype) -> Optional[torch.dtype]:
        return torch.float32 if self.fp32 and grad_dtype in (torch.float16, torch.bfloat16) else None

    def make_rule(self) -> LocalRule:
        if self.shared is not None:
            return GradientRule()
        if self.kind == "momentum":
            return MomentumRule(**self.hparams)
        if self.kind == "adam":
            return AdamRule(**self.hparams)
        return GradientRule()

    def make_memory(self, grad_dtype: torch.dtype) -> ResidualMemory:
        """A :class:`ResidualMemory` with this recipe's rule and dtype; a key's rule state
        starts from the wrapped optimizer's state of its tensors (handed over, see
        :meth:`take_state`)."""
        mem = ResidualMemory(self.make_rule(), self.accumulation_dtype(grad_dtype))
        mem.seed_from = self.take_state
        return mem

    #: while a step is in flight, a list: what :meth:`take_state` changed (``undo_takes``)
    journal = None

    def bind(self, optimizer, names: Dict[torch.Tensor, str]) -> None:
        """The wrapped optimizer whose state seeds the local rules (and the parameter names)."""
        self._optimizer = optimizer
        self._names = {n: p for p, n in names.items()}

    def take_state(self, names: Sequence[str], buffers: Sequence[str]):
        """The optimizer's ``buffers`` of parameters ``names``, flattened and joined, plus
        its step count; None if the optimizer holds none of them (the rule starts fresh).

        The rule owns that state from now on. The optimizer keeps *placeholders* in its
        place: zeros, and a step count of 0 for Adam, exactly the entries a fresh
        optimizer's first step on a zero gradient creates. So no stale copy is ever used
        by a later dense step, and the optimizer's state has the same structure on every
        rank whatever each rank sparsifies: ``hvd.broadcast_optimizer_state`` matches its
        broadcasts by (state key, occurrence), and a rank-0 checkpoint must line up with a
        fresh optimizer on the other ranks (docs/horovod.md, "Checkpoint and resume")."""
        opt = self._optimizer
        if opt is None:
            return None
        params = [self._names[n] for n in names]
        states = [opt.state.get(p, {}) for p in params]
        found = any(all(b in s and s[b] is not None for b in buffers) for s in states)
        out = None
        if found:
            out = {b: torch.cat([(s[b] if s.get(b) is not None else torch.zeros_like(p)).reshape(-1)
                                 for p, s in zip(params, states)]) for b in buffers}
            steps = [float(s["step"]) for s in states if "step" in s]
            out = (out, int(max(steps)) if steps else 0)
        undo = self.journal
        with torch.no_grad():
            for p in params:
                if undo is not None:  # what the step in flight changes, to put back if it is skipped
                    if p in opt.state:
                        s = opt.state[p]
                        undo.append((s, dict(s), [(t, t.clone()) for b in buffers
                                                  if isinstance(t := s.get(b), torch.Tensor)]))
                    else:
                        undo.append((p, None, []))
                s = opt.state[p]  # a defaultdict: creates the entry where there was none
                for b in buffers:
                    if isinstance(s.get(b), torch.Tensor):
                        s[b].zero_()
                    else:
                        s[b] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if self.kind == "adam":
                    s["step"] = _zero_step(s.get("step"), p, self._group_of(p))
        return out

    @property
    def selects_by_step(self) -> bool:
        """Whether :meth:`step_scales` applies: Adam stepped by the shared moments.
        (An SGD step is proportional to the gradient, so its largest pending steps are its
        largest pending gradients: the fused kernels' magnitude.)"""
        return self.shared is not None and self.kind == "adam"

    def step_scales(self, params: Sequence[torch.Tensor], optimizer=None,
                    root: bool = False) -> Optional["StepScales"]:
        """What selects a sparse part holding ``params`` back to back in the optimizer's
        geometry (``SparsePart.step_scales``): the shared Adam rule's denominator per tensor,
        ``sqrt(v) / bias2_sqrt + eps`` (``ops.ef_step_key``), from ``optimizer``'s (default
        the bound one's) ``exp_avg_sq`` and ``step``; None where it does not apply
        (:attr:`selects_by_step`) or a tensor has no such state yet. Every rank holds the
        same state, so every rank keys alike; nothing that shapes a collective depends on
        it. No host sync: step counts on the device (fused or capturable Adam) stay there,
        as 0-d tensors of ``1 - beta2^step`` square-rooted as torch's capturable Adam does."""
        if not self.selects_by_step:
            return None
        opt = optimizer if optimizer is not None else self._optimizer
        states = [opt.state.get(p) for p in params]
        if any(not st or st.get("exp_avg_sq") is None for st in states):
            return None
        b2, eps = float(self.shared.hparams["betas"][1]), float(self.shared.hparams["eps"])
        steps = [st["step"] for st in states]
        if all(not isinstance(t, torch.Tensor) or t.device.type == "cpu" for t in steps):
            bias2_sqrt = [math.sqrt(1.0 - b2 ** max(float(t), 1.0)) for t in steps]  # host values
        else:  # on the device: 1 - beta2^step there
            bias2_sqrt = torch._foreach_pow(b2, torch._foreach_clamp_min(
                [t.reshape(()).float() for t in steps], 1.0))
            torch._foreach_neg_(bias2_sqrt)
            torch._foreach_add_(bias2_sqrt, 1.0)
            torch._foreach_sqrt_(bias2_sqrt)
        return StepScales([st["exp_avg_sq"] for st in states], bias2_sqrt, eps, bool(root))

    def arrival_ages(self, params: Sequence[torch.Tensor]) -> Optional[List[torch.Tensor]]:
        """Per element of each of ``params``, the shared moments' age: the steps since it
        last arrived (an arrival this step has waited one more). The same on every rank
        (their state). A tensor without an age yet reads 0, the age its first step gives
        it; None without shared moments or before any tensor has one."""
        if self.shared is None:
            return None
        ages = [self.shared.ages.get(p) for p in params]
        if all(a is None for a in ages):
            return None
        return [a if a is not None else torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                for a, p in zip(ages, params)]

    def undo_takes(self, entries) -> None:
        """Puts back the wrapped optimizer's state that :meth:`take_state` replaced with
        placeholders while :attr:`journal` was ``entries`` (a skipped step)."""
        opt = self._optimizer
        with torch.no_grad():
            for target, before, tensors in reversed(entries):
                if before is None:
                    opt.state.pop(target, None)
                    continue
                for t, old in tensors:
                    t.copy_(old)
                target.clear()
                target.update(before)

    def _group_of(self, p: torch.Tensor) -> dict:
        return next(g for g in self._optimizer.param_groups if any(q is p for q in g["params"]))

    # ------------------------------------------------------------------ step
    def corrects(self) -> bool:
        """True when ``step()`` steps the sparsified tensors itself (momentum correction,
        local or shared), not the wrapped optimizer."""
        return self.kind != "none"

    def owns_state(self) -> bool:
        """True when per-rank local rules hold the sparsified tensors' optimizer state
        (``moments="local"``); under shared moments it stays in the optimizer's entries."""
        return self.kind != "none" and self.shared is None

    def coupled_decay(self, group: dict) -> float:
        """Weight decay to fold into a sparsified tensor's local gradient (SGD, Adam);
        0 for AdamW's decoupled decay and for plain error feedback."""
        if not self.corrects() or group.get("decoupled_weight_decay", False):
            return 0.0
        return float(group.get("weight_decay", 0.0))

    @contextmanager
    def step_dense_only(self, optimizer, sparse: Iterable[torch.Tensor], shares=None,
                        noise=None):
        """Steps the sparsified tensors (AdamW: decoupled decay first): ``w -= lr · update``
        under local rules (``p.grad`` is the synchronized update), the shared moments'
        step under shared ones (``p.grad`` is the synchronized gradient; ``shares`` and
        ``noise``: the scheme's, ``Scheme.shares`` and ``Scheme.noise``). Then runs the body with the wrapped optimizer seeing
        only the other tensors: its ``step()`` steps them with its own state and
        hyper-parameters."""
        sparse = set(sparse) if not isinstance(sparse, (set, frozenset)) else sparse
        if not self.corrects() or not sparse:
            yield
            return
        groups = optimizer.param_groups
        reduced = []
        with torch.no_grad():
            for g in groups:
                mine = [p for p in g["params"] if p in sparse and p.grad is not None]
                rest = [p for p in g["params"] if p not in sparse]
                if mine:
                    lr = float(g["lr"])
                    if g.get("decoupled_weight_decay", False) and g.get("weight_decay", 0.0):
                        torch._foreach_mul_(mine, 1.0 - lr * float(g["weight_decay"]))
                    if self.shared is not None:
                        self.shared.step(optimizer, g, mine, shares, noise)
                    else:
                        torch._foreach_add_(mine, [p.grad for p in mine], alpha=-lr)
                if rest:
                    reduced.append(dict(g, params=rest))
        optimizer.param_groups = reduced
        try:
            yield
        finally:
            optimizer.param_groups = groups

    def describe(self) -> str:
        hp = ", ".join(f"{k}={v}" for k, v in self.hparams.items())
        return (f"recipe: correction={self.kind}{f' ({hp})' if hp else ''}"
                f"{f', {self.moments} moments' if self.kind != 'none' else ''}, "
                f"density warm-up {self.warmup_steps} steps, "
                f"fp32 accumulation {'on' if self.fp32 else 'off'}")


# ---------------------------------------------------------------------- resolution


def _uniform(groups, keys) -> Optional[dict]:
    vals = {tuple((k, _hashable(g.get(k))) for k in keys) for g in groups}
    return dict(next(iter(vals))) if len(vals) == 1 else None


def _hashable(v):
    if isinstance(v, torch.Tensor):
        return float(v)
    if isinstance(v, list):
        return tuple(v)
    return v


def _momentum_kind(optimizer) -> tuple:
    """(kind, hparams, why not) for the wrapped optimizer."""
    groups = optimizer.param_groups
    if any(g.get("maximize", False) for g in groups):
        return "none", {}, "maximize=True is not supported by momentum correction"
    if isinstance(optimizer, torch.optim.SGD):
        hp = _uniform(groups, ("momentum", "dampening", "nesterov"))
        if hp is None:
            return "none", {}, "param groups use different momentum/dampening/nesterov"
        if not hp["momentum"]:
            return "none", {}, "the optimizer has no momentum (nothing to correct)"
        return "momentum", {"momentum": float(hp["momentum"]), "dampening": float(hp["dampening"]),
                            "nesterov": bool(hp["nesterov"])}, ""
    if isinstance(optimizer, torch.optim.Adam):  # AdamW too
        if any(g.get("amsgrad", False) for g in groups):
            return "none", {}, "amsgrad=True is not supported"
        hp = _uniform(groups, ("betas", "eps"))
        if hp is None:
            return "none", {}, "param groups use different betas/eps"
        return "adam", {"betas": tuple(float(b) for b in hp["betas"]), "eps": float(hp["eps"])}, ""
    return "none", {}, (f"{type(optimizer).__name__} is not supported (torch.optim.SGD with "
                        "momentum, Adam and AdamW are)")


def resolve_recipe(optimizer, scheme: str, density: float, momentum_correction="auto",
                   density_warmup_steps: Union[str, int] = DEFAULT_WARMUP_STEPS,
                   fp32_accumulation: bool = True,
                   momentum_masking: bool = DEFAULT_MASKING,
                   moments: str = DEFAULT_MOMENTS) -> Recipe:
    """Validates the recipe keywords and resolves them for ``optimizer``; raises
    ``ValueError`` (identically on every rank: nothing here is rank-dependent)."""
    if momentum_correction not in ("auto", True, False) or isinstance(momentum_correction, numbers.Number) \
            and not isinstance(momentum_correction, bool):
        raise ValueError(f"momentum_correction must be 'auto', True or False, got {momentum_correction!r}")
    warmup = warmup_length(density, density_warmup_steps)
    if not isinstance(fp32_accumulation, bool):
        raise ValueError(f"fp32_accumulation must be True or False, got {fp32_accumulation!r}")
    if momentum_masking != "auto" and not isinstance(momentum_masking, bool):
        raise ValueError(f"momentum_masking must be 'auto', True or False, got {momentum_masking!r}")
    if moments not in MOMENTS:
        raise ValueError(f"moments must be one of {MOMENTS}, got {moments!r}")
    kind, hp, why = _momentum_kind(optimizer)
    if momentum_correction is True and kind == "none":
        raise ValueError(f"momentum_correction=True cannot be applied: {why}; pass "
                         "momentum_correction=False (plain error feedback) or 'auto'")
    if momentum_correction is False or scheme == "dense":
        kind, hp = "none", {}
    if kind != "none":
        hp["masking"] = momentum_masking
    elif momentum_correction == "auto" and kind == "none" and why and "no momentum" not in why:
        warnings.warn(f"momentum_correction='auto': {why}; sparse gradients get plain error "
                      "feedback, which converges worse at low density")
    recipe = Recipe(kind, density, warmup if scheme != "dense" else 0, fp32_accumulation, hp,
                    moments)
    recipe.family = ("sgd" if isinstance(optimizer, torch.optim.SGD) else
                     "adam" if isinstance(optimizer, torch.optim.Adam) else "other")
    # what re-resolves it after hvd.broadcast_optimizer_state changed the hyper-parameters
    recipe.options = dict(scheme=scheme, density=density, momentum_correction=momentum_correction,
                          density_warmup_steps=density_warmup_steps,
                          fp32_accumulation=fp32_accumulation, momentum_masking=momentum_masking,
                          moments=moments)
    return recipe
