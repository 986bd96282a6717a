"""``ssfusion_hvd.DistributedOptimizer``: a drop-in for ``hvd.DistributedOptimizer``.

Every Horovod argument keeps its meaning; three keyword-only arguments choose how gradients
travel (``scheme``), how sparse ones are selected (``sparsifier``) and how many elements
are sent (``density``). The optimizer owns what Horovod's does — hooks, backward passes per
step, gradients that never arrived, ``synchronize()``/``skip_synchronize()``/``step()`` —
and hands each finished gradient to the scheme (``ssfusion_hvd/schemes/``).
"""
from __future__ import annotations

import weakref
import warnings
from contextlib import contextmanager

import horovod.torch as hvd
import torch
from horovod.torch.compression import Compression
from horovod.torch.mpi_ops import Adasum, Average, global_process_set
from torch.amp.grad_scaler import OptState

from .core import transport
from .core.transport import Transport

from .agreement import RanksDisagree, StepAgreement
from .arguments import check_arguments, named_parameters as _named_parameters
from .consistency import model_check
from .recipe import DEFAULT_MASKING, DEFAULT_MOMENTS, DEFAULT_WARMUP_STEPS, resolve_recipe
from .registry import SCHEMES
from .schemes import SyncConfig
from .state import CheckpointState
from .transaction import StepTransaction
from .world import SchemeWorld

__all__ = ["DistributedOptimizer", "SCHEMES", "broadcast_optimizer_state"]

# step() handles loss scaling (``_step_supports_amp_scaling``): GradScaler hands itself to
# step() instead of checking the gradients before they are synchronized. torch warns that
# it will stop doing so; until another contract exists, only this one lets step() go first.
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself",
                        category=FutureWarning)


def broadcast_optimizer_state(optimizer, root_rank: int = 0, model=None) -> None:
    """``hvd.broadcast_optimizer_state(optimizer, root_rank, model)``, announced to the
    optimizer: while it runs, our optimizer knows its ``step()`` on zero gradients is the
    state initialization (local, no collective) and its ``state_dict()`` carries the
    root's shared scheme state. Calling ``hvd.broadcast_optimizer_state`` directly works
    as well (it is recognized on the stack); this is the explicit form."""
    # (our classes take _DistributedOptimizer's methods, they do not derive from it)
    ours = type(optimizer).__dict__.get("_in_broadcast") is _DistributedOptimizer._in_broadcast
    if ours:
        optimizer._broadcasting = True
    try:
        hvd.broadcast_optimizer_state(optimizer, root_rank=root_rank, model=model)
    finally:
        if ours:
            optimizer._broadcasting = False


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
        self._init_transaction(grad_scaler)  # the step as a transaction (transaction.py)
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
            weakref.finalize(self, lambda handles: [h.remove() for h in handles],
                             list(self._hook_handles))

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
        """Metrics of the last synchronized iteration, on this rank: bytes sent, tensors
        dense, sparse and missing, the density achieved and in force, seconds selecting,
        communicating and waiting, a skipped step (every key: ``docs/schemes.md``, "What
        ``opt.stats()`` reports"). Counts that need a pass over the outputs or a
        device-to-host read are taken here, not in the training step: call it between
        steps."""
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
        self._scheme.submit(p)

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
                                                 self._scheme.shares(), self._scheme.noise()):
            return super(self.__class__, self).step(closure)

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
        return self._broadcasting or transport.in_broadcast_optimizer_state()


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

    The training recipe of every sparse scheme (each keyword in ``docs/recipe.md``):
        momentum_correction: ``"auto"`` (default), ``True`` (``ValueError`` where it
            cannot apply) or ``False`` (plain error feedback): correct the momentum of
            ``SGD``, ``Adam`` and ``AdamW`` for sparsity.
        moments: ``"shared"`` (default: one optimizer state for all ranks, moved by the
            synchronized gradient with each element's age; exactly SGD / Adam at density
            1) or ``"local"`` (DGC's per-rank momentum correction).
        density_warmup_steps: DGC's exponential density warm-up: ``"auto"`` (default: 50
            steps from density 0.25; below density 0.006, ``⌈0.3 / density⌉`` steps from
            25 times the density, ``ssfusion_hvd/recipe.py``), an int (its steps), 0 (off).
        fp32_accumulation: float16 gradients accumulated, selected and decoded in float32.
        momentum_masking: DGC's momentum factor masking under ``moments="local"``.

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
        backward_passes_per_step, op, gradient_predivide_factor, num_groups, groups, grad_scaler)
    recipe = resolve_recipe(optimizer, scheme, density, momentum_correction,
                            density_warmup_steps, fp32_accumulation, momentum_masking, moments)
    named = _named_parameters(named_parameters, optimizer.param_groups)
    # the first collective: every rank must wrap the same model and setup (what shapes the
    # wire: scheme_options["waits"] is read with the recipe), else a clear error everywhere
    check = model_check(named, optimizer.param_groups, process_set,
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


#: the methods of our optimizers' classes: the optimizer's, its state protocol's (state.py),
#: its step transaction's (transaction.py) and its world's (world.py), over the wrapped
#: optimizer's class
_METHODS = {**{k: v for part in (CheckpointState, StepTransaction, SchemeWorld) for k, v in part.__dict__.items()
               if k not in ("__dict__", "__weakref__", "__module__", "__qualname__", "__doc__")},
            **_DistributedOptimizer.__dict__}
