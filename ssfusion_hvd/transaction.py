"""The step as a transaction, one owner (the optimizer's class takes these methods,
:class:`StepTransaction`): what a synchronized step may change is remembered at its first
gradient; at its end it is kept, or undone on every rank when any rank's gradients or the
synchronized ones are not finite, or abandoned when the ranks disagree
(:class:`~ssfusion_hvd.agreement.RanksDisagree`). Loss scaling lives here too: the state
is kept in unscaled units, so the scale of the step in flight divides the sparsified
gradients on the way in and multiplies their synchronized sums on the way out
(``docs/horovod.md``, "Mixed precision").
"""
from __future__ import annotations

import math
import warnings

import torch

__all__ = ["StepTransaction"]


class StepTransaction:
    """Mixed into our optimizers' classes (``optimizer._METHODS``); reads the optimizer's
    ``_scheme``, ``_config``, ``_agreement``, ``_requires_update`` and ``_world``."""

    def _init_transaction(self, grad_scaler) -> None:
        self._in_step = False
        self._journal = None  # what the recipe changed in the wrapped optimizer's state
        self._step_undone = False  # the last synchronized step was undone
        self._keep = None  # _keep_step()'s answer for the step in flight
        self._steps_skipped = 0
        # the scaler, learnt from step(grad_scaler=) if not given here
        self._scaler = None
        if grad_scaler is not None and grad_scaler.is_enabled():
            self._scaler = grad_scaler
        self._scale = self._inv_scale = None

    def _begin_step(self) -> None:
        """The step's first gradient: what it may change is remembered, and the loss scale
        in force (``GradScaler.update()`` changes it in place after the step) is taken."""
        self._in_step = True
        if not self._scheme.stateful:
            return
        self._scheme.begin_step()
        self._journal = self._config.recipe.journal = []
        sc = self._scaler
        if sc is not None and sc.is_enabled() and getattr(sc, "_scale", None) is not None:
            self._scale = sc._scale.detach().clone()
            self._inv_scale = self._scale.reciprocal()
        else:
            self._scale = self._inv_scale = None

    def _end_step(self) -> None:
        """After ``finish()``: the step is kept, or, when any rank's gradients or the
        synchronized ones are not finite (the same answer on every rank), undone: the
        scheme's state, the recipe's hand-over of optimizer state, the counters. Every
        synchronized gradient is then NaN, so GradScaler (or the user) skips the step as it
        would with Horovod's optimizer, and no partial sum of it can be applied."""
        keep = self._keep_step()
        self._in_step = False
        self._config.recipe.journal = None
        self._step_undone = False
        self._keep = None
        if not keep:
            self._undo_step()
            for p in self._requires_update:  # all of it: a part of a sum is not the step's
                if p.grad is not None:
                    p.grad.fill_(math.nan)
            return
        if self._scale is not None:
            sparse = [p.grad for p in self._scheme.sparse_params() if p.grad is not None]
            if sparse:  # back in the loss scale's units, as GradScaler.unscale_ expects
                torch._foreach_mul_(sparse, self._scale)

    def _keep_step(self) -> bool:
        """Whether the step in flight is kept: no rank's gradients and none of the
        synchronized ones hold NaN or Inf. The same answer on every rank: the flags are
        summed by an allreduce and the synchronized gradients are the same everywhere.
        Asked once the outputs are in ``p.grad``, by the scheme before it counts the step
        (``Scheme.keep_step``) or by ``_end_step``; one host read per step."""
        if self._keep is None:
            self._keep = not self._agreement.any_nonfinite(self._scheme)
        return self._keep

    def _put_back(self) -> None:
        """The scheme's state and the recipe's hand-over of optimizer state as they were
        before the step's first gradient."""
        self._scheme.rollback()
        if self._journal:
            self._config.recipe.undo_takes(self._journal)
        self._journal = None

    def _abandon_step(self) -> None:
        """The ranks disagree (:class:`RanksDisagree`): the step in flight ends here, and
        what it changed is put back, so the residuals and momentum a checkpoint saves next
        are this rank's own (its selected elements were never applied anywhere)."""
        if self._in_step and self._scheme.stateful:
            self._put_back()
        self._in_step = False
        self._config.recipe.journal = None

    def _undo_step(self) -> None:
        """Undoes the last synchronized step (before the next begins)."""
        if self._step_undone or not self._scheme.stateful:
            return
        self._put_back()
        self._step_undone = True
        self._steps_skipped += 1
        self._scheme.last_stats.skipped = True
        self._scheme.last_stats._resolved = None

    def _meet_scaler(self, scaler) -> None:
        """The first step under ``scaler``: from the next step on, the loss scale divides
        the sparsified gradients before they reach the state. A step already synchronized
        without it (schemes sparse from their first step) left its state in the scale's
        units: converted here, once; and where the local rule's output does not scale with
        the gradient (Adam's update), its synchronized sum is put in the scale's units, as
        the scaler expects to find it."""
        if scaler is self._scaler:
            return
        first, self._scaler = self._scaler is None, scaler
        if not (first and self._scheme.stateful and not self._step_undone):
            return
        memories = self._scheme.memories()
        if not memories or not self._scheme.sparse_params():
            return  # nothing was sparsified yet (a warm-up): nothing in the wrong units
        if self._config.recipe.corrects() and self._world is not None and self._world[1] == 0:
            warnings.warn(
                f"ssfusion_hvd: scheme {self._scheme_name!r} sparsified its first step before "
                "it met the GradScaler (GradScaler.step introduces it); that step's coupled "
                "weight decay and Adam's eps acted at 1/scale of their strength. Pass "
                "DistributedOptimizer(..., grad_scaler=scaler) to make it exact.", stacklevel=3)
        scale = float(scaler._scale)
        for mem in memories:
            mem.rescale(1.0 / scale)
        rule = self._config.recipe.make_rule()
        if rule.units.get("residual", 1) == 0:
            # unscale_ divides by the scale, whether it ran already or runs next
            sparse = [p.grad for p in self._scheme.sparse_params() if p.grad is not None]
            torch._foreach_mul_(sparse, scale)
