"""``ssfusion_hvd.DistributedOptimizer``: a drop-in for ``hvd.DistributedOptimizer``.

Every Horovod argument keeps its meaning; three keyword-only arguments choose how gradients
travel (``scheme``), how sparse ones are selected (``sparsifier``) and how many elements
are sent (``density``). The optimizer owns what Horovod's does — hooks, backward passes per
step, gradients that never arrived, ``synchronize()``/``skip_synchronize()``/``step()`` —
and hands each finished gradient to the scheme (``ssfusion_hvd/schemes/``).
"""
from __future__ import annotations

import functools
import math
import sys
import weakref
import warnings
from contextlib import contextmanager

import horovod.torch as hvd
import horovod.torch.functions as _hvd_functions
import torch
from horovod.torch.compression import Compression
from horovod.torch.mpi_ops import Adasum, Average, global_process_set
from torch.amp.grad_scaler import OptState

from .core import transport
from .core.transport import Transport, numbered_as

from .agreement import RanksDisagree, StepAgreement
from .arguments import check_arguments, named_parameters as _named_parameters
from .consistency import check_same_model
from .recipe import DEFAULT_MASKING, DEFAULT_MOMENTS, DEFAULT_WARMUP_STEPS, resolve_recipe
from .registry import SCHEMES
from .schemes import OutsideTheSet, SyncConfig
from .state import CheckpointState

__all__ = ["DistributedOptimizer", "SCHEMES", "broadcast_optimizer_state"]

# This optimizer declares that its step() handles loss scaling (``_step_supports_amp_scaling``
# and a ``grad_scaler`` argument): GradScaler then hands itself to step() instead of checking
# the gradients before it, which it would do before they are synchronized. torch (2.3 and
# later) warns that it will stop doing so; until another contract gives an optimizer the
# scaler's state to update, this one is the only that lets step() synchronize first.
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself",
                        category=FutureWarning)

def _in_horovod_broadcast() -> bool:
    """Whether Horovod's ``broadcast_optimizer_state`` is running in this thread, whatever
    lies between it and the caller: step wrappers (LR schedulers, AMP, loggers,
    ``torch.compile``), a helper a later Horovod moves its ``step()`` call into. The whole
    stack is searched for its code object; this runs only where a step comes without a
    gradient (``step()``) and in ``state_dict()``, never per step of training.
    :func:`broadcast_optimizer_state` says so explicitly instead."""
    code = _hvd_functions.broadcast_optimizer_state.__code__
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is code:
            return True
        f = f.f_back
    return False


def broadcast_optimizer_state(optimizer, root_rank: int = 0, model=None) -> None:
    """``hvd.broadcast_optimizer_state(optimizer, root_rank, model)``, announced to the
    optimizer: while it runs, our optimizer knows its ``step()`` on zero gradients is the
    state initialization (local, no collective) and its ``state_dict()`` carries the
    root's shared scheme state. Calling ``hvd.broadcast_optimizer_state`` directly works
    as well (it is recognized on the stack); this is the explicit form."""
    # (our optimizers' classes are made by DistributedOptimizer from _DistributedOptimizer's
    # methods, not derived from it)
    ours = type(optimizer).__dict__.get("_in_broadcast") is _DistributedOptimizer._in_broadcast
    if ours:
        optimizer._broadcasting = True
    try:
        hvd.broadcast_optimizer_state(optimizer, root_rank=root_rank, model=model)
    finally:
        if ours:
            optimizer._broadcasting = False


def _remove_hooks(handles) -> None:
    for h in handles:
        h.remove()


def _world(process_set):
    """``(size, rank)`` of ``process_set`` as this rank sees it (rank None outside the
    set); None once Horovod is shut down (a checkpoint saved after the job)."""
    try:
        return process_set.size(), (process_set.rank() if process_set.included() else None)
    except ValueError:
        return None


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into the user's optimizer class by :func:`DistributedOptimizer`."""

    # GradScaler.step() hands itself to step(grad_scaler=...) and leaves the skip to it
    _step_supports_amp_scaling = True

    def __init__(self, params, config: SyncConfig, scheme: str, backward_passes_per_step: int,
                 grad_scaler=None):
        super(self.__class__, self).__init__(params)
        self._config = config
        self._scheme_name = scheme
        self._build_scheme()
        included = bool(config.process_set.included())
        self.backward_passes_per_step = backward_passes_per_step
        self._delay = {p: backward_passes_per_step for p in config.order}
        self._submitted = set()
        self._synchronized = False
        self._should_synchronize = True
        self._requires_update = [p for p in config.order if p.requires_grad]
        # which param group holds p, by position: torch's load_state_dict and
        # hvd.broadcast_optimizer_state replace the group dicts (new hyper-parameters), never
        # which group a parameter is in; the group itself is read where it is used
        self._group_index = {p: i for i, g in enumerate(self.param_groups) for p in g["params"]}
        config.recipe.bind(self, config.names)
        # the optimizer's own collectives (agreement check, broadcast adoption); optimizers
        # are created in the same order on every rank
        self._transport = Transport(config, "ssfusion.check.") if included else None
        #: under Horovod elastic, the model check, run at every broadcast adoption (every
        #: rank, joined or not, runs those together); else DistributedOptimizer ran it once
        self._model_check = None
        # the step's agreement across the ranks and their non-finite flags, in one small
        # allreduce (agreement.py)
        self._agreement = StepAgreement(self._transport, self._requires_update, scheme)
        # the step as a transaction (_begin_step, _end_step): a step whose synchronized
        # gradients are not finite is undone on every rank
        self._in_step = False
        self._journal = None  # what the recipe changed in the wrapped optimizer's state
        self._step_undone = False  # the last synchronized step was undone
        self._keep = None  # _keep_step()'s answer for the step in flight
        self._steps_skipped = 0
        # loss scaling (GradScaler): the scaler, learnt from step(grad_scaler=); the state
        # is kept unscaled, so the scale of the step in flight divides the sparsified
        # gradients on the way in and multiplies their synchronized sums on the way out
        self._scaler = None
        if grad_scaler is not None and grad_scaler.is_enabled():
            self._scaler = grad_scaler
        self._scale = self._inv_scale = None
        self._hook_handles = []
        if included:
            # the hooks reach the optimizer through a weak reference, so parameters that
            # outlive it do not keep it (and its scheme, buffers, worker thread) alive;
            # its hooks go with it
            on_ready = weakref.WeakMethod(self._on_grad_ready)

            def hook(p):
                method = on_ready()
                if method is not None:
                    method(p)

            for p in self._requires_update:
                self._hook_handles.append(p.register_post_accumulate_grad_hook(hook))
            weakref.finalize(self, _remove_hooks, list(self._hook_handles))

    # ------------------------------------------------------------------ world
    def _build_scheme(self, tag=None) -> None:
        """The scheme for the process set as it is now. A rank outside the set makes no
        collective and steps on its own gradients, as under Horovod's optimizer: it builds
        no scheme and no transport. ``tag``: the name of the transport being replaced."""
        config = self._config
        with numbered_as(tag):
            self._scheme = (SCHEMES[self._scheme_name].load() if config.process_set.included()
                            else OutsideTheSet)(config)
        self._scheme.keep_step = self._keep_step
        self._world = _world(config.process_set)

    def _follow_world(self) -> None:
        """Horovod elastic: after a reset the process set may have another size (ranks
        left or joined) and this rank another rank. Every rank of the new world sees that
        at the same call (the first ``state_dict``, ``load_state_dict``, backward hook or
        ``synchronize()`` after the reset) and rebuilds its scheme for it: the planned
        schemes profile and plan again, ExDyna calibrates again, and every rank starts
        with empty residuals, which is what a rank that joined has. The optimizer state
        carries over: the wrapped optimizer's (shared moments' too), and the local rules'
        through the torch entries their new buffers start from (docs/horovod.md,
        "Elastic training")."""
        world = _world(self._config.process_set)
        if world is None or world == self._world:
            return
        old = self._scheme
        with torch.no_grad():
            self._mirror_into_live()  # the local rules' state, where the new ones start from
        old.close()
        self._drop_step()
        self._build_scheme(getattr(getattr(old, "transport", None), "tag", None))
        if self._transport is not None:
            with numbered_as(self._transport.tag):
                self._transport = self._agreement.transport = Transport(self._config,
                                                                        "ssfusion.check.")
        if self._config.recipe.shared is not None:
            self._config.recipe.shared.reset()  # the ages went with the residuals

    def _drop_step(self) -> None:
        """Forgets the step in flight (a checkpoint load, a rebuilt scheme)."""
        self._scheme.reset()
        self._agreement.reset()
        self._in_step = False
        self._step_undone = True  # (no step to undo: the state is what was loaded)
        self._config.recipe.journal = self._journal = None
        self._submitted.clear()
        self._synchronized = False
        self._should_synchronize = True
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step

    # ------------------------------------------------------------------ hooks
    @property
    def scheme(self) -> str:
        return self._scheme_name

    @property
    def plan(self):
        """The :class:`ssfusion_hvd.plan.Plan` in use (None for ``dense`` and during warm-up)."""
        return self._scheme.plan

    @property
    def recipe(self):
        """The :class:`ssfusion_hvd.recipe.Recipe` in force: local rule, density warm-up,
        float32 accumulation (``recipe.describe()`` says it in one line)."""
        return self._config.recipe

    @property
    def cost_model(self):
        """The :class:`ssfusion_hvd.plan.CostModel` of the plan (None for schemes without a
        plan and during warm-up). Measured fits are rank 0's, broadcast; the plan itself is
        always rank 0's. With ``profile=`` whose backward times do not fit the model, each
        rank fills in its own measured backward times (only rank 0's shape the plan)."""
        return self._scheme.cost

    def stats(self) -> dict:
        """Metrics of the last synchronized iteration, on this rank: ``allreduce_bytes`` and
        ``allgather_bytes`` sent, ``tensors_dense`` / ``tensors_sparse``, ``elements_sent``
        of ``elements`` and the achieved ``density``, ``tensors_missing`` (tensors that sent
        nothing), ``nonfinite`` (NaN/Inf elements in the synchronized gradients), and seconds
        in ``sparsify_s`` (inline selection), ``offload_s`` (worker selection),
        ``communicate_s`` (first submission to the end of the wait), ``wait_s`` (blocked
        in ``synchronize()``) and ``agreement_s`` (blocked reading the step's agreement:
        for the whole-gradient schemes all that the check costs a step; for the others it
        includes the wait on the ranks' non-finite flags that the agreement carries).
        ``phase`` is ``dense``, ``warmup``, ``planned``, ``sparse`` (SparDL, ExDyna, ZEN)
        or ``calibration`` (ExDyna's exact top-k step); those schemes add their own keys.

        Counts that need a pass over the outputs (``nonfinite`` of the planned schemes) or
        a device-to-host read are taken here, not in the training step: call ``stats()``
        between steps (before the next ``step()``/``synchronize()``).

        ``skipped``: the step's synchronized gradients (or a rank's own) were not finite, so
        it was undone and its synchronized gradients are NaN (docs/horovod.md, "Mixed precision");
        ``nonfinite`` then counts what the synchronized sum held before that.
        ``steps_skipped`` counts such steps."""
        out = self._scheme.stats()
        if out and self._scheme.stateful:
            out["steps_skipped"] = self._steps_skipped
        if out:
            out["agreement_s"] = self._agreement.blocked_s
        return out

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if self._delay[p] <= 0:
            raise AssertionError("Gradients were computed more than backward_passes_per_step "
                                 "times before call to step(). Increase backward_passes_per_step "
                                 "to accumulate gradients locally.")
        if p.grad.requires_grad:
            raise RuntimeError("gradients that require grad (create_graph=True) cannot be "
                               "synchronized; Horovod's optimizer refuses them too")
        self._delay[p] -= 1
        if self._delay[p] == 0:
            self._submit(p)

    def _submit(self, p: torch.Tensor) -> None:
        if not self._submitted:
            self._follow_world()
        self._adopt_broadcast()
        self._agreement.start(self._scheme)
        if not self._in_step:
            self._begin_step()
        if p.grad is None:
            # Another rank may have a gradient for p (dynamic graphs): contribute zeros.
            p.grad = torch.zeros_like(p)
        self._submitted.add(p)
        recipe = self._config.recipe
        if self._scheme.sparsifies(p):
            unscale = self._inv_scale is not None
            wd = (recipe.coupled_decay(self.param_groups[self._group_index[p]])
                  if recipe.corrects() else 0.0)
            if (unscale or wd) and p.grad.is_sparse:
                p.grad = p.grad.to_dense()
            if unscale:  # a power of two: exact
                p.grad.mul_(self._inv_scale)
            if wd:  # the local rule accumulates g + wd·w, where SGD/Adam would add the decay
                p.grad.add_(p.detach(), alpha=wd)
        if self._scheme.agrees_before_launch and len(self._submitted) == len(self._requires_update):
            # the step's last gradient: such a scheme selects and launches everything now.
            # The agreement (sent with the first gradient) is read after its selection,
            # which so overlaps the round trip, and before its first collective: on ranks at
            # different points, or beside a rank that called hvd.join(), the error comes
            # before any collective of the step starts (Horovod 0.28.1's background loop on
            # a joined rank even fails on ExDyna's index allgather, whose length changes
            # every step), and the selection's residuals are put back
            try:
                with transport.first_launch(self._agreement.read):
                    self._scheme.submit(p)
            except RanksDisagree:
                self._abandon_step()
                raise
            self._agreement.read()  # (read already, unless the scheme launched nothing)
            return
        self._scheme.submit(p)

    # ------------------------------------------------------------------ transaction
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

    # ------------------------------------------------------------------ Horovod API
    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._delay:
            self._delay[p] = passes

    def synchronize(self) -> None:
        """Waits for every gradient's collective; synchronized gradients land in ``p.grad``."""
        if not self._submitted:
            self._follow_world()
        self._adopt_broadcast()
        if not self._config.process_set.included():
            self._synchronized = True
            return
        for p in self._requires_update:  # canonical order: every rank submits alike
            if p not in self._submitted:
                self._submit(p)
        self._agreement.send_flags(self._scheme)
        try:
            try:
                with transport.gated(self._agreement.gate):
                    self._scheme.finish()
            except Exception:  # (not an interrupt: nothing more may block then)
                self._agreement.read()  # ranks that disagree explain any failure: theirs first
                raise
            self._agreement.read()
        except RanksDisagree:
            self._abandon_step()
            raise
        self._end_step()
        self._submitted.clear()
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """``step()`` inside this context does not synchronize (after a manual ``synchronize()``)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None, grad_scaler=None):
        """Synchronizes (unless inside ``skip_synchronize()``) and steps. Called by
        ``GradScaler.step(optimizer)`` (``grad_scaler``: that scaler; this optimizer handles
        loss scaling, ``_step_supports_amp_scaling``): the gradients are synchronized first,
        then unscaled and checked by the scaler (unless ``scaler.unscale_`` already did),
        and the step is skipped when they are not finite, as GradScaler would skip it."""
        if not self._submitted and not self._synchronized and self._in_broadcast():
            # hvd.broadcast_optimizer_state initializes an empty state with a step on zero
            # gradients, on the ranks whose state is empty only (in the resume pattern: all
            # but the root). Horovod's own optimizer takes its base class's step there; so
            # do we: no collective may run on a subset of ranks. The parameters are put
            # back: the step is there to create state (weight decay on a zero gradient
            # would move them after hvd.broadcast_parameters made them equal).
            params = [p for g in self.param_groups for p in g["params"]]
            with torch.no_grad():
                kept = [p.detach().clone() for p in params]
                out = super(self.__class__, self).step(closure)
                torch._foreach_copy_(params, kept)
            return out
        self._adopt_broadcast()
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        if grad_scaler is not None and grad_scaler.is_enabled():
            self._meet_scaler(grad_scaler)
            state = grad_scaler._per_optimizer_states[id(self)]
            if state["stage"] is OptState.READY:
                grad_scaler.unscale_(self)
            if sum(v.item() for v in state["found_inf_per_device"].values()):
                # skipped; if only the unscaled gradients overflowed, the step is undone now
                self._undo_step()
                return None
        # sparsified tensors under momentum correction hold an update, applied here; the
        # wrapped optimizer steps the others (recipe.py)
        with self._config.recipe.step_dense_only(self, self._scheme.sparse_params(),
                                                 self._scheme.shares()):
            return super(self.__class__, self).step(closure)

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
        if self._config.recipe.corrects() and hvd.rank() == 0:
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

    def zero_grad(self, set_to_none: bool = True):
        if self._submitted or self._scheme.pending():
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(). This is "
                                 "prohibited as it can cause a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------ state
    # state_dict, load_state_dict and the broadcast's adoption: state.py (CheckpointState)

    #: set by :func:`broadcast_optimizer_state` while it runs
    _broadcasting = False

    def _in_broadcast(self) -> bool:
        return self._broadcasting or _in_horovod_broadcast()


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set, *, scheme="dense", sparsifier="topk",
                         density=0.01, plan=None, profile=None, warmup_steps=5, log_plan=True,
                         momentum_correction="auto", density_warmup_steps=DEFAULT_WARMUP_STEPS,
                         fp32_accumulation=True, momentum_masking=DEFAULT_MASKING,
                         moments=DEFAULT_MOMENTS, scheme_options=None, grad_scaler=None):
    """Wraps ``optimizer`` so that ``step()`` applies gradients synchronized across workers.

    Horovod arguments (same meaning as in ``hvd.DistributedOptimizer``):
        named_parameters: ``model.named_parameters()``; names must be unique and cover every
            optimized parameter.
        compression, backward_passes_per_step, op, gradient_predivide_factor, num_groups,
        groups, sparse_as_dense, process_set: as in Horovod.

    ssfusion-hvd arguments:
        scheme: how gradients travel; one of ``ssfusion_hvd.SCHEMES`` ("dense" behaves
            exactly like Horovod's optimizer).
        sparsifier: how sparse schemes select elements; one of ``ssfusion_hvd.SPARSIFIERS``.
        density: fraction of gradient elements sent by sparse schemes, in (0, 1].
        plan: a ``ssfusion_hvd.plan.Plan`` or the path of its JSON (``opt.plan.save(path)``):
            sparse schemes use it from the first step instead of profiling.
        profile: a ``ssfusion_hvd.plan.CostModel`` or the path of its JSON: used instead of
            the start-up collective probes and sparsifier timings.
        warmup_steps: dense iterations measured before a sparse scheme plans (SSFusion:
            5). The plan is built on rank 0, broadcast, printed once (``log_plan``) and
            exposed as ``opt.plan``.

    The training recipe of every sparse scheme (``ssfusion_hvd/recipe.py``, ``docs/recipe.md``):
        momentum_correction: ``"auto"`` (default): the optimizer's momentum is corrected
            for sparsity (``moments``) for ``torch.optim.SGD`` with momentum and
            ``Adam``/``AdamW``, plain error feedback otherwise (with a warning when that is
            because the optimizer is not supported). ``True``: the same, but
            ``ValueError`` where it cannot apply. ``False``: plain error feedback on
            gradients, the wrapped optimizer applied to the sparse sum.
        moments: where the corrected optimizer's state lives. ``"shared"`` (default): in
            the wrapped optimizer, the same on every rank, moved by the synchronized
            gradient with each element's age (how many steps it waited in the residuals;
            exactly SGD / Adam on the averaged gradient at density 1;
            ``ssfusion_hvd/moments.py``). ``"local"``: DGC's momentum correction, each rank
            error-compensating its own velocity or Adam update, with momentum factor
            masking.
        density_warmup_steps: DGC's exponential density warm-up over this many steps
            (default 50; 0: off): 4 stages from density 0.25 down to ``density``.
            ``stats()["density_target"]`` is the density in force.
        fp32_accumulation: float16 gradients are accumulated, selected and decoded in
            float32; only the sent values are float16 (default True).
        momentum_masking: DGC's momentum factor masking of ``moments="local"``: ``"auto"``
            (default: SGD while the density in force is below ``1 - momentum``, Adam
            always), ``True`` or ``False``.

    scheme_options: a dict of the scheme's own settings (e.g. ``{"teams": 2}`` for
        ``spardl``); each scheme lists what it accepts in ``docs/schemes.md`` and in its
        class's ``options``. Unknown names and bad values raise ``ValueError``.
    grad_scaler: the job's ``torch.amp.GradScaler``, when it has one. Optional: the
        optimizer meets it at the first ``scaler.step(optimizer)``; schemes that sparsify
        their very first step (SparDL, ZEN, ExDyna) need it before, for that step's weight
        decay and Adam eps to be exact (docs/horovod.md, "Mixed precision").

    Bad arguments raise ``ValueError`` on every rank before any collective is submitted.
    The wrapped optimizer's state (e.g. momentum) is carried over.
    """
    options, density, groups = check_arguments(
        optimizer, scheme, sparsifier, scheme_options, density, warmup_steps,
        backward_passes_per_step, op, gradient_predivide_factor, num_groups, groups)
    if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
        raise ValueError(f"grad_scaler must be a torch.amp.GradScaler, got "
                         f"{type(grad_scaler).__name__}")
    recipe = resolve_recipe(optimizer, scheme, density, momentum_correction,
                            density_warmup_steps, fp32_accumulation, momentum_masking, moments)
    named = _named_parameters(named_parameters, optimizer.param_groups)
    # the first collective: every rank must wrap the same model, else a clear error everywhere
    name_of = {id(v): k for k, v in named}
    check = functools.partial(
        check_same_model, named, [name_of[id(v)] for g in optimizer.param_groups
                                  for v in g["params"] if id(v) in name_of], process_set,
        # (what shapes the wire: scheme_options["waits"] is read with these two)
        setup=(scheme, sorted(options.items()), recipe.family, moments))
    # Under Horovod elastic no collective here (transport.elastic): the check runs at every
    # broadcast adoption, which every rank of the new world reaches together
    elastic = transport.elastic()
    if not elastic:
        check()
    if op == Adasum and hvd.size() > 1:
        if scheme != "dense":
            raise ValueError(f"op=Adasum is only supported with scheme='dense', got {scheme!r}")
        # Horovod's Adasum optimizer is a different algorithm: use it as is.
        return hvd.DistributedOptimizer(optimizer, named_parameters=named, compression=compression,
                                        backward_passes_per_step=backward_passes_per_step, op=op,
                                        process_set=process_set)

    config = SyncConfig(
        names={v: k for k, v in named}, order=[v for _, v in named],
        declared=[v for g in optimizer.param_groups for v in g["params"]],
        compression=compression, op=op, gradient_predivide_factor=float(gradient_predivide_factor),
        groups=groups, sparse_as_dense=sparse_as_dense, process_set=process_set,
        sparsifier=sparsifier, density=density, plan=plan, profile=profile,
        warmup_steps=warmup_steps, log_plan=bool(log_plan), recipe=recipe, options=options)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), _METHODS)
    wrapped = cls(optimizer.param_groups, config, scheme, backward_passes_per_step, grad_scaler)
    if optimizer.state:
        super(cls, wrapped).load_state_dict(optimizer.state_dict())  # nothing lost
    if elastic:
        wrapped._model_check = check
    return wrapped


#: the methods of our optimizers' classes: the optimizer's and its state protocol's
#: (state.py), over the wrapped optimizer's class
_METHODS = {**{k: v for k, v in CheckpointState.__dict__.items()
               if k not in ("__dict__", "__weakref__", "__module__", "__qualname__", "__doc__")},
            **_DistributedOptimizer.__dict__}
