"""What ``DistributedOptimizer.stats()`` reports: one :class:`StepStats` per finished step.

Counts that need a pass over the outputs or a device-to-host read (non-finite elements,
tensors that sent nothing, ZEN's imbalance) are recorded *lazily*: as a tensor, a list of
counts, or a function, resolved to plain numbers the first time :meth:`StepStats.as_dict`
is called. So the training step never waits on the device for its metrics; a caller reads
them between steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

import torch

__all__ = ["StepStats", "resolve"]


def resolve(value):
    """A lazily recorded value as a plain Python value: a callable is called, a 0-d tensor
    becomes an int, a 1-d tensor a list; anything else is returned as it is."""
    if callable(value):
        return resolve(value())
    if isinstance(value, torch.Tensor):
        return int(value) if value.dim() == 0 else value.tolist()
    return value


def _count(value) -> int:
    """A lazily recorded count: :func:`resolve`, and a list of parts (ints, 0-d tensors) summed."""
    if isinstance(value, list):
        return int(sum(int(resolve(v)) for v in value))
    return int(resolve(value))


@dataclass
class StepStats:
    """The keys every scheme reports (``DistributedOptimizer.stats`` documents them);
    ``extra`` holds a scheme's own (SparDL's teams, ZEN's imbalance, ...)."""

    phase: str = "none"
    iteration: Optional[int] = None
    allreduce_bytes: int = 0
    allgather_bytes: int = 0
    tensors_dense: int = 0
    tensors_sparse: int = 0
    elements: int = 0
    elements_sent: int = 0
    density_target: float = 1.0
    tensors_missing: Any = 0  # lazy: an int, a 0-d tensor, a list of those, a callable
    nonfinite: Any = None  # lazy, as tensors_missing; None: not counted (dense)
    sparsify_s: float = 0.0
    offload_s: float = 0.0
    communicate_s: float = 0.0
    wait_s: float = 0.0
    skipped: bool = False  # the synchronized gradients were not finite: the step was undone
    extra: dict = field(default_factory=dict)
    _resolved: Optional[dict] = field(default=None, repr=False)

    @property
    def density(self) -> float:
        return self.elements_sent / max(self.elements, 1)

    def timed(self, t_first: Optional[float], t_wait: float, t_end: float) -> "StepStats":
        """Sets ``communicate_s`` (first submission to the end of the wait) and ``wait_s``."""
        self.communicate_s = t_end - (t_first if t_first is not None else t_wait)
        self.wait_s = t_end - t_wait
        return self

    def as_dict(self) -> dict:
        if self._resolved is None:
            out = {f.name: getattr(self, f.name) for f in fields(self)
                   if f.name not in ("extra", "_resolved")}
            out["tensors_missing"] = _count(self.tensors_missing)
            out["nonfinite"] = None if self.nonfinite is None else _count(self.nonfinite)
            for key in ("iteration", "nonfinite"):
                if out[key] is None:
                    del out[key]
            out["density"] = self.density
            out.update({k: resolve(v) for k, v in self.extra.items()})
            self._resolved = out
        return dict(self._resolved)
