"""Base of the schemes that synchronize the whole model gradient as one flat vector once
its last tensor is final: SparDL, ZEN, ExDyna, and any written against it
(``tests/test_add_a_scheme.py``). ``_launch`` only enqueues; every wait is in ``finish()``,
which the optimizer runs behind the step's agreement (``agreement.StepAgreement.gate``)."""
from __future__ import annotations

import time

import torch

from ..core.layout import FlatLayout
from ..core.stats import StepStats
from ..core.transport import Transport
from ..core.wire import SPARSE_GRAD_DTYPES
from .base import Scheme, SyncConfig, selection_key

__all__ = ["WholeGradientScheme"]


class WholeGradientScheme(Scheme):
    """Base of the schemes that synchronize the whole model gradient as one flat vector
    once its last tensor is final (SparDL, ZEN, ExDyna): checks that the gradients share
    one dtype (of ``dtypes``) and device, counts submissions and calls ``_launch()`` when
    every trainable parameter's gradient is in."""

    #: gradient dtypes the scheme's collectives can carry
    dtypes = SPARSE_GRAD_DTYPES
    #: prefix of the scheme's collective names (``Transport``)
    prefix = "whole"

    def __init__(self, config: SyncConfig):
        super().__init__(config)
        self._trainable = [p for p in config.order if p.requires_grad]
        kinds = {(p.dtype, p.device) for p in self._trainable}
        if len(kinds) > 1:
            raise ValueError(f"scheme {self.name!r} needs every gradient in one dtype on one "
                             f"device, got {sorted(map(str, kinds))}; use scheme='dense'")
        self._dtype, self._device = (next(iter(kinds)) if kinds
                                     else (torch.float32, torch.device("cpu")))
        if self._dtype not in self.dtypes:
            raise ValueError(f"scheme {self.name!r} supports gradients of "
                             f"{', '.join(map(str, self.dtypes))}, got {self._dtype}; "
                             "use scheme='dense'")
        self._submitted = 0
        self._t_first = None  # first submission of the step (for stats' communicate_s)
        # a model-sized float32 buffer, allocated once where used: Adam's denominators and
        # the keys of a selection by step (SparDL, ExDyna), then the ages
        # ``_noise_against`` reads
        self._den = None
        self._all = frozenset(self._trainable)
        self._last_sparse = frozenset()
        #: the whole model gradient as one flat vector (canonical order)
        self.flat = FlatLayout([p.shape for p in self._trainable],
                               [config.names[p] for p in self._trainable])
        self._iteration = 0
        # (allgather and alltoall names per step: Transport, on hvd.join())
        self.transport = Transport(config, self.prefix, step=lambda: self._iteration)
        self._memory = self._new_memory()

    _KEY = "flat"  # the memory key of the whole flat gradient

    def _new_memory(self):
        """Empty residuals and local rule state for the whole flat gradient."""
        mem = self.config.recipe.make_memory(self._dtype)
        mem.register(self._KEY, self.flat.names, self.flat.shapes)
        return mem

    def sparsifies(self, p: torch.Tensor) -> bool:
        return True

    def sparse_params(self) -> frozenset:
        return self._last_sparse

    def _density(self) -> float:
        """The density in force for the step being synchronized (density warm-up); the
        residual memory's rule is told (its "auto" masking depends on it)."""
        d = self.config.recipe.density_at(self._iteration)
        self._memory.set_density(d)
        return d

    def _acc_dtype(self) -> torch.dtype:
        return self._memory.acc_dtype(self._dtype)

    def _finished(self) -> None:
        """Book-keeping at the end of a synchronized step."""
        self._last_sparse = self._all
        self._iteration += 1

    def memories(self) -> list:
        return [self._memory]

    def _step_state(self) -> dict:
        return {"iteration": self._iteration, "last_sparse": self._last_sparse}

    def _restore_step_state(self, saved: dict) -> None:
        self._iteration, self._last_sparse = saved["iteration"], saved["last_sparse"]

    def _memory_state(self) -> dict:
        return self._memory.named_state()

    def _load_memory_state(self, state: dict) -> None:
        """Restores residuals and the local rule's state (``named_state``'s keys)."""
        self._memory.load_named_state(state, self._device)

    def shared_state(self) -> dict:
        return {"iteration": self._iteration}

    def signature(self):
        return (self._iteration, 0)

    def adopt_shared(self, shared: dict, keep_local: bool, all_keep: bool) -> None:
        if keep_local:
            return
        self.reset()
        self._iteration = int(shared["iteration"])
        self._memory = self._new_memory()  # residuals and rule state from zero

    def _step_scales(self):
        """Adam's shared denominators (``Recipe.step_scales``) when this scheme selects by
        the pending step (``scheme_options["select_by"]``, for the schemes that take it:
        ZEN's top-k, SparDL's cuts, ExDyna's threshold; docs/recipe.md, "Selecting by the
        step"), else None.
        The recipe in force: a broadcast that replaces the hyper-parameters re-resolves it."""
        root = selection_key(self.opts.get("select_by", "magnitude"))
        if root is None:
            return None
        return self.config.recipe.step_scales(self._trainable, root=root)

    def _noise_against(self, idx: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """What a rank's share of the senders' variance is measured against at the flat
        elements ``idx`` (``wire.noise_shares``), the same on every rank: the synchronized
        value's rate per step squared, ``(values / a)²``, ``a`` the steps the element
        waited by the shared moments' age (their state; 1 before their first step). The
        rate is what Adam's second moment takes at the arrival, so a share is the noise
        relative to it, whatever the wait, in the units the wire carries (a loss scale on
        the wire scales both). One copy of the ages into the denominators' buffer."""
        rate = values.float()
        ages = self.config.recipe.arrival_ages(self._trainable)
        if ages is not None:
            if self._den is None:
                self._den = torch.empty(self.flat.numel, dtype=torch.float32, device=idx.device)
            waited = self.flat.gather(ages, out=self._den)[:self.flat.numel].index_select(0, idx)
            rate = rate / waited.add_(1.0)
        return rate.square()

    def _grad(self, p: torch.Tensor) -> torch.Tensor:
        if p.grad.is_sparse:  # sparse gradients travel densely in these schemes
            p.grad = p.grad.to_dense()
        return p.grad

    def _flat_grad(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every trainable gradient, back to back (into ``out`` when given)."""
        return self.flat.gather([self._grad(p) for p in self._trainable], out)

    def _deliver(self, flat: torch.Tensor) -> None:
        """The synchronized flat gradient into every ``p.grad``."""
        self.flat.scatter(flat, [p.grad for p in self._trainable])

    def _step_stats(self, t_wait: float, t_end: float, **values) -> StepStats:
        """The stats of a finished step: every gradient sparsified, ``elements`` the whole
        model, timings from the first submission; ``values`` sets the rest."""
        values = {"phase": "sparse", "iteration": self._iteration, "tensors_dense": 0,
                  "tensors_sparse": len(self._trainable), "elements": self.flat.numel, **values}
        st = StepStats(**values)
        return st.timed(self._t_first, t_wait, t_end)

    def reset(self) -> None:
        """Forgets the step in flight; a subclass adds its own per-step state."""
        self._submitted = 0
        self._t_first = None
        self._sparsify_s = 0.0
        self.transport.reset_counters()

    def submit(self, p: torch.Tensor) -> None:
        if self._t_first is None:
            self._t_first = time.perf_counter()
        self._submitted += 1
        if self._submitted == len(self._trainable):
            self._launch()

    def _launch(self) -> None:
        """With the last gradient: selects and enqueues the step's first collectives. It
        must not wait on one: ranks that disagree (or a rank that joined) may never complete
        it, and only ``finish()``'s waits go behind the step's agreement."""
        raise NotImplementedError
