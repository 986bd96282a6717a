"""The local rules of the training recipe: what a rank accumulates in its residual
(``sparsify/memory.py``'s ``ResidualMemory`` holds their state per key).

* :class:`GradientRule`: the raw gradient (plain error feedback; the wrapped optimizer
  then treats the synchronized sparse sum as a gradient);
* :class:`MomentumRule`: DGC's momentum correction (Lin et al., ICLR'18, §3.2): the local
  velocity ``u = m·u + (1 − dampening)·g`` (Nesterov: ``g + m·u``) is accumulated, so
  the synchronized sum is already a momentum update and the wrapped optimizer must not
  apply momentum again; *momentum factor masking* clears ``u`` where elements were sent
  (``masking="auto"``: only while the density in force is below ``1 − m``);
* :class:`AdamRule`: the same idea for Adam: each rank keeps Adam's moment estimates of
  its own gradient and accumulates its bias-corrected update ``m̂ / (√v̂ + ε)``; the first
  moment is masked where elements were sent (``"auto"``: always).

They are the local rules of ``moments="local"``; under ``moments="shared"`` (the default)
a rank accumulates the raw gradient and ``moments.py`` moves the one shared state.
``recipe.py`` picks the rule; ``docs/recipe.md`` has the measurements behind each choice.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple

import torch

__all__ = ["LocalRule", "GradientRule", "MomentumRule", "AdamRule", "RULES"]


class LocalRule:
    """What one rank error-compensates each step, with its per-key state buffers.

    ``apply(key, g)`` returns the flat local update for flat gradient ``g`` (float, the
    accumulation dtype); it may return ``g`` itself. ``mask(key, idx)`` is told which
    elements were sent. ``buffers`` names the per-key state tensors (flat, like ``g``);
    ``steps`` counts applications per key (Adam's bias correction).
    """

    name = "gradient"
    buffers: Tuple[str, ...] = ()
    #: how each state tensor scales with the gradient: ``x -> c·x`` for gradients ``g -> c·g``
    #: multiplies it by ``c ** power`` (``"residual"``: what the rule accumulates)
    units: Dict[str, int] = {"residual": 1}

    def __init__(self):
        self.state: Dict[str, Dict[str, torch.Tensor]] = {}
        self.steps: Dict[str, int] = {}
        #: ``seed(key, buffers)``: the state a key starts from, or None (set by ResidualMemory)
        self.seed: Optional[Callable] = None
        #: the density in force (``ResidualMemory.set_density``; "auto" masking reads it)
        self.density = 1.0
        self.masking = False

    def masks(self, momentum: float) -> bool:
        """Whether sent elements clear the rule's momentum this step. ``"auto"``: when
        the density in force is below ``1 − momentum``, i.e. an element waits longer for
        its next send than the momentum's horizon ``1 / (1 − momentum)``; then its
        accumulated velocity is stale (DGC's case for masking). At higher densities (the
        warm-up's first stages) elements are sent every few steps and masking would
        discard most of the momentum (``docs/recipe.md``)."""
        if self.masking == "auto":
            return self.density < 1.0 - momentum
        return bool(self.masking)

    def apply(self, key: str, g: torch.Tensor) -> torch.Tensor:
        return g

    def fused_velocity(self, key: str, g: torch.Tensor) -> Optional[Tuple[torch.Tensor, float, bool]]:
        """``(u, m, masks)`` when this step's :meth:`apply` is ``u = m·u + g`` on an existing
        contiguous buffer ``u`` of ``g``'s dtype, device and size, and :meth:`mask` clears
        ``u`` where elements are sent iff ``masks``: then the fused kernels take the step
        themselves (``ops.ef_topk(velocity=u, momentum=m, mask_velocity=masks)``) and the
        caller counts it in :attr:`steps` once they have returned. None: call :meth:`apply`
        and :meth:`mask`. Changes no state beyond creating (or seeding) the key's buffers,
        as :meth:`apply` would."""
        return None

    def mask(self, key: str, idx: torch.Tensor) -> None:
        pass

    def hparams(self) -> dict:
        return {}

    def _buffers(self, key: str, g: torch.Tensor) -> Dict[str, torch.Tensor]:
        st = self.state.get(key)
        if st is None:
            seeded = self.seed(key, self.buffers) if self.seed is not None else None
            st = {}
            if seeded is not None:
                bufs, step = seeded
                st = {b: t.to(g.device, g.dtype).reshape(-1).clone() for b, t in bufs.items()}
                self.steps[key] = int(step)
            self.state[key] = st
        return st


class GradientRule(LocalRule):
    """Plain error feedback: the local gradient itself."""


class MomentumRule(LocalRule):
    """DGC momentum correction with momentum factor masking (see the module docstring).

    Matches ``torch.optim.SGD``'s buffer: the first step's velocity is the gradient
    itself (no dampening), then ``u = m·u + (1 − dampening)·g``; Nesterov accumulates
    ``g + m·u``. Weight decay is folded into ``g`` by the caller (coupled, as SGD does).
    """

    name = "momentum"
    buffers = ("momentum_buffer",)
    units = {"residual": 1, "momentum_buffer": 1}

    def __init__(self, momentum: float, dampening: float = 0.0, nesterov: bool = False,
                 masking="auto"):
        super().__init__()
        if not 0.0 < momentum < 1.0:
            raise ValueError(f"momentum correction needs momentum in (0, 1), got {momentum!r}")
        self.momentum, self.dampening, self.nesterov = float(momentum), float(dampening), bool(nesterov)
        self.masking = masking if masking == "auto" else bool(masking)

    def apply(self, key, g):
        st = self._buffers(key, g)
        u = st.get("momentum_buffer")
        if u is None:
            u = st["momentum_buffer"] = g.clone()
        else:
            u.mul_(self.momentum).add_(g, alpha=1.0 - self.dampening)
        self.steps[key] = self.steps.get(key, 0) + 1
        return g.add(u, alpha=self.momentum) if self.nesterov else u

    def fused_velocity(self, key, g):
        if self.dampening or self.nesterov:  # not one product and one sum: apply() runs
            return None
        u = self._buffers(key, g).get("momentum_buffer")
        if (u is None or u.dtype != g.dtype or u.device != g.device or u.numel() != g.numel()
                or not u.is_contiguous()):
            return None  # the first step (u = g) or a state of another layout
        return u, self.momentum, self.masks(self.momentum)

    def mask(self, key, idx):
        u = self.state.get(key, {}).get("momentum_buffer")
        if u is not None and self.masks(self.momentum):
            u.index_fill_(0, idx, 0)

    def hparams(self):
        return {"momentum": self.momentum, "dampening": self.dampening, "nesterov": self.nesterov,
                "masking": self.masking}


class AdamRule(LocalRule):
    """Adam's moments of the rank's own gradient; accumulates the bias-corrected update
    ``m̂ / (√v̂ + ε)``; masks the first moment where elements were sent. Coupled (L2)
    weight decay is folded into ``g`` by the caller, as ``torch.optim.Adam`` does."""

    name = "adam"
    buffers = ("exp_avg", "exp_avg_sq")
    # the accumulated update m̂ / (√v̂ + ε) does not scale (up to ε)
    units = {"residual": 0, "exp_avg": 1, "exp_avg_sq": 2}

    def __init__(self, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 masking="auto"):
        super().__init__()
        self.masking = masking if masking == "auto" else bool(masking)
        b1, b2 = (float(b) for b in betas)
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0 and eps >= 0.0):
            raise ValueError(f"Adam correction needs betas in [0, 1) and eps >= 0, got {betas}, {eps}")
        self.beta1, self.beta2, self.eps = b1, b2, float(eps)

    def apply(self, key, g):
        st = self._buffers(key, g)
        if "exp_avg" not in st:
            st["exp_avg"] = torch.zeros_like(g)
            st["exp_avg_sq"] = torch.zeros_like(g)
        m, v = st["exp_avg"], st["exp_avg_sq"]
        t = self.steps.get(key, 0) + 1
        self.steps[key] = t
        m.mul_(self.beta1).add_(g, alpha=1.0 - self.beta1)
        v.mul_(self.beta2).addcmul_(g, g, value=1.0 - self.beta2)
        bc1 = 1.0 - self.beta1 ** t
        bc2 = 1.0 - self.beta2 ** t
        denom = v.sqrt().div_(math.sqrt(bc2)).add_(self.eps)
        return torch.div(m, denom).div_(bc1)

    def mask(self, key, idx):
        m = self.state.get(key, {}).get("exp_avg")
        # "auto" masks always here: on the LM task masking Adam's first moment through the
        # warm-up's dense stages measured far better than the density rule (docs/recipe.md)
        if m is not None and (self.masking == "auto" or self.masks(self.beta1)):
            m.index_fill_(0, idx, 0)

    def hparams(self):
        return {"betas": (self.beta1, self.beta2), "eps": self.eps, "masking": self.masking}


RULES = {cls.name: cls for cls in (GradientRule, MomentumRule, AdamRule)}
