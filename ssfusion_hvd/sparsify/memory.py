"""Error feedback: what a rank does not send stays in its residual and is added to the next
gradient (Seide et al. 2014; Stich et al. 2018; GRACE's Memory). Nothing is lost:

    acc      = grad + residual                     (one rounding, done here)
    sent     = acc at the selected indices
    residual = acc with the selected indices zeroed
    => dense(sent) + residual == acc, bit for bit

With ``momentum > 0`` it is DGC's momentum correction (Lin et al., ICLR'18, §3.2): the
velocity u = m*u + grad is accumulated instead of the raw gradient (acc = residual + u),
and both u and the residual are cleared where elements were sent (momentum factor
masking). Use it with a wrapped optimizer that has no momentum of its own.

Residuals are keyed by a name (a tensor or a fusion buffer) and operate on flat tensors:
one fused op per buffer, never a Python loop over the tensors inside it. They are
optimizer state: ``state_dict()`` / ``load_state_dict()``.
"""
from __future__ import annotations

from typing import Dict

import torch


class ResidualMemory:
    def __init__(self, momentum: float = 0.0):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        self.momentum = float(momentum)
        self.residuals: Dict[str, torch.Tensor] = {}
        self.velocities: Dict[str, torch.Tensor] = {}

    def compensate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """The error-compensated tensor to select from (a new flat tensor)."""
        flat = grad.reshape(-1)
        for name, store in (("residual", self.residuals), ("velocity", self.velocities)):
            have = store.get(key)
            if have is not None and (have.shape != flat.shape or have.dtype != flat.dtype):
                raise ValueError(f"{name} {key!r} is {tuple(have.shape)} {have.dtype}, gradient "
                                 f"is {tuple(flat.shape)} {flat.dtype}")
        if self.momentum:
            u = self.velocities.get(key)
            u = flat.clone() if u is None else u.mul_(self.momentum).add_(flat)
            self.velocities[key] = u
            flat = u
        r = self.residuals.get(key)
        if r is None:
            return flat.clone()
        return r.add_(flat)  # reuse the residual's storage: it is replaced in update()

    def update(self, key: str, acc: torch.Tensor, indices: torch.Tensor) -> None:
        """After sending ``acc[indices]``: the residual is ``acc`` with those entries zeroed
        (``acc`` is taken over, not copied)."""
        idx = indices.long()
        acc.index_fill_(0, idx, 0)
        self.residuals[key] = acc
        if self.momentum:
            self.velocities[key].index_fill_(0, idx, 0)

    def state_dict(self) -> dict:
        return {"momentum": self.momentum,
                "residuals": {k: v.clone() for k, v in self.residuals.items()},
                "velocities": {k: v.clone() for k, v in self.velocities.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.momentum = float(state["momentum"])
        self.residuals = {k: v.clone() for k, v in state["residuals"].items()}
        self.velocities = {k: v.clone() for k, v in state["velocities"].items()}
