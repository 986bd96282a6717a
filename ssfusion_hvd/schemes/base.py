"""The interface every synchronization scheme implements.

The optimizer (``ssfusion_hvd/optimizer.py``) owns the hooks and the bookkeeping that
Horovod's optimizer has (backward passes per step, missing gradients, ``step()``); a scheme
only decides how finished gradients travel and how the synchronized gradient is rebuilt:

* ``submit(p)`` is called once per step for each parameter whose gradient is final (from
  the backward hook, in the order gradients become ready, or from ``synchronize()`` for a
  parameter whose hook did not fire). It may start asynchronous collectives at once, so
  communication overlaps the rest of backward.
* ``finish()`` waits for everything submitted and leaves the synchronized gradient in
  ``p.grad`` of every submitted parameter.
* ``state_dict()`` / ``load_state_dict()`` carry what a scheme must not lose across a
  checkpoint (residuals, the plan).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple

import torch

from ..core.stats import StepStats
from ..moments import SELECT_BY_CHOICES, selection_key  # noqa: F401 (the schemes' names)


@dataclass
class SyncConfig:
    """Everything a scheme needs to know about the job; identical on every rank."""

    names: Dict[torch.Tensor, str]  # parameter -> user-visible name
    order: List[torch.Tensor]  # parameters in canonical order (sorted by name, as Horovod)
    declared: List[torch.Tensor]  # parameters in the optimizer's param_groups order
    compression: Any
    op: Any
    gradient_predivide_factor: float
    groups: Any
    sparse_as_dense: bool
    process_set: Any
    sparsifier: str
    density: float
    plan: Any = None  # a Plan or a path to its JSON: skips profiling (sparse schemes)
    profile: Any = None  # a CostModel or a path to its JSON: skips the probes
    warmup_steps: int = 5  # dense iterations measured before planning
    log_plan: bool = True  # rank 0 prints the plan table once
    recipe: Any = None  # ssfusion_hvd.recipe.Recipe: local rule, density warm-up, fp32 accumulation
    options: Dict[str, Any] = field(default_factory=dict)  # the scheme's, validated (Scheme.parse_options)
    index: Dict[torch.Tensor, int] = field(init=False)  # parameter -> position in order

    def __post_init__(self):
        self.index = {p: i for i, p in enumerate(self.order)}
        if self.recipe is None:
            from ..recipe import Recipe
            self.recipe = Recipe("none", self.density, 0, True)


class Option(NamedTuple):
    """One entry of ``DistributedOptimizer(scheme_options=...)``: its default, a check
    of a given value (True when valid) and what it accepts, for the error message."""

    default: Any
    check: Callable[[Any], bool]
    accepts: str


def is_int(lo: int, hi: float = float("inf")) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def is_real(lo: float, hi: float = float("inf"), *, open_low: bool = False) -> Callable[[Any], bool]:
    def check(v):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            return False
        v = float(v)
        return (v > lo if open_low else v >= lo) and v <= hi
    return check


#: what an exact top-k ranks (planned schemes, ZEN, SparDL's cuts, ExDyna's threshold):
#: "magnitude" (the accumulated gradient), "step" (the step the optimizer would take with
#: it: Adam's under shared moments; SGD's is the magnitude's), "gain" (the accumulated
#: gradient times that step: the first-order decrease of the loss), "auto": "gain"
#: (docs/recipe.md, "Selecting by the step", "Selecting by the gain")
SELECT_BY = Option("auto", lambda v: v in SELECT_BY_CHOICES,
                   "'auto', 'magnitude', 'step' or 'gain'")

#: ``scheme_options["spread"]`` of the schemes that carry each sender's spread: "auto"
#: (under shared moments with an Adam), True or False (docs/recipe.md, "The senders'
#: variance")
SPREAD = Option("auto", lambda v: isinstance(v, bool) or v == "auto", "'auto', True or False")


def carries_spread(config, wanted) -> bool:
    """Whether a scheme's sparse entries carry their senders' spreads: ``wanted`` (the
    ``spread`` option; "auto": the wrapped optimizer is an Adam) under ``moments="shared"``,
    whose Adam rule alone reads them. Decided from what every rank agrees on (the options,
    the optimizer's class, the ``moments`` argument: ``check_same_model``'s setup), not from
    hyper-parameters a broadcast may still replace: it shapes the collectives."""
    recipe = config.recipe
    if wanted == "auto":
        wanted = recipe.family == "adam"
    return bool(wanted) and (recipe.options or {}).get("moments") == "shared"


#: (class, scheme name) -> the subclass ``Scheme.named`` made
_NAMED: Dict[tuple, type] = {}


class Scheme:
    """Base class of synchronization schemes; see the module docstring."""

    name = "base"
    #: what ``scheme_options`` accepts for this scheme: name -> :class:`Option`
    options: Dict[str, Option] = {}
    #: the plan in use and the cost model it came from (planned schemes, after warm-up)
    plan = None
    cost = None

    @classmethod
    def named(cls, name: str) -> type:
        """The class that runs scheme ``name`` (``registry.SchemeInfo.load``): this one
        where that is its name, else, for a class the registry lists under several names
        (the SSFusion family, whose planner the name picks), its subclass of that name,
        made once."""
        if name == cls.name:
            return cls
        made = _NAMED.get((cls, name))
        if made is None:
            made = _NAMED[cls, name] = type(f"{cls.__name__}[{name}]", (cls,), {"name": name})
        return made

    @classmethod
    def parse_options(cls, given) -> Dict[str, Any]:
        """``given`` validated and completed with the defaults; ``ValueError`` naming the
        unknown or bad option (raised on every rank alike: it depends on arguments only)."""
        given = {} if given is None else given
        if not isinstance(given, dict):
            raise ValueError(f"scheme_options must be a dict, got {type(given).__name__}")
        unknown = sorted(set(given) - set(cls.options), key=str)
        if unknown:
            have = ", ".join(sorted(cls.options)) or "none"
            raise ValueError(f"scheme {cls.name!r} has no option {unknown[0]!r}; its options: {have}")
        out = {}
        for key, opt in cls.options.items():
            value = given.get(key, opt.default)
            if key in given and not opt.check(value):
                raise ValueError(f"scheme {cls.name!r}: option {key!r} must be {opt.accepts}, "
                                 f"got {value!r}")
            out[key] = value
        return out

    def __init__(self, config: SyncConfig):
        self.config = config
        #: this scheme's options, validated and completed with the defaults
        self.opts = self.parse_options(config.options)

    def submit(self, p: torch.Tensor) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError

    def pending(self) -> bool:
        """True while submitted work has not been finished."""
        raise NotImplementedError

    def sparsifies(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s gradient is sparsified in the step being submitted (the recipe
        folds weight decay into it before the local rule)."""
        return False

    def sparse_params(self) -> frozenset:
        """Parameters sparsified in the last finished step: under momentum correction
        their ``p.grad`` holds a synchronized update, which ``step()`` applies itself."""
        return frozenset()

    def shares(self) -> dict:
        """Per sparsified parameter whose wire carried each sender's wait, the shares of
        what arrived in the last finished step that the shared moments' rule reads
        (``moments.share_table``, ``SharedMoments.step``); empty for a scheme without them."""
        return {}

    def noise(self) -> dict:
        """Per sparsified parameter whose wire carried each sender's spread, the noise
        ratio of what arrived in the last finished step (``SparsePart.noise``), which the
        shared Adam rule adds to its second moment; empty for a scheme without them."""
        return {}

    def reset(self) -> None:
        """Forget submitted-but-unfinished work (used by ``load_state_dict``)."""

    def close(self) -> None:
        """Releases what the scheme holds beyond memory (a worker thread) now; without a
        call it is released when the scheme is collected."""

    #: the last finished step's metrics (a scheme replaces it in ``finish()``)
    last_stats: StepStats = StepStats()

    def stats(self) -> dict:
        """Metrics of the last finished iteration (see ``DistributedOptimizer.stats``)."""
        return self.last_stats.as_dict() if self.last_stats.phase != "none" else {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"scheme {self.name!r} has no state, got keys {sorted(state)}")

    def signature(self):
        """``(iteration, plan checksum)``: what every rank must agree on before its
        collectives of a step can match (None: nothing to check, ``dense``). The
        optimizer compares it across ranks every step (``_DistributedOptimizer``)."""
        return None

    def memories(self) -> list:
        """The :class:`~ssfusion_hvd.sparsify.memory.ResidualMemory` objects in use."""
        return []

    # -- the step as a transaction: a step whose synchronized gradients are not finite
    # (a loss-scale overflow) is rolled back, on every rank alike (``_DistributedOptimizer``)
    #: False: the scheme keeps nothing from step to step (``dense``); no transaction
    stateful = True

    def _step_state(self) -> dict:
        """The scheme's own per-step state besides its memories (counters, thresholds,
        sparsifier state), as copies :meth:`_restore_step_state` can put back."""
        return {}

    def _restore_step_state(self, saved: dict) -> None:
        pass

    def keep_step(self) -> bool:
        """Whether the step being finished is kept (its synchronized gradients are finite
        on every rank). The optimizer installs it; a scheme that counts a step in
        ``finish()`` in ways :meth:`rollback` cannot undo (a plan made) asks it first."""
        return True

    def begin_step(self) -> None:
        """Before the step's first change to any state (its first ``submit``)."""
        self._saved_step = self._step_state()
        self._saved_memories = list(self.memories())
        for mem in self._saved_memories:
            mem.checkpoint()

    def rollback(self) -> None:
        """After ``finish()``, before the next step begins: undoes the step (memories,
        counters, thresholds) as if it had never happened."""
        for mem in self._saved_memories:
            mem.restore()
        self._restore_step_state(self._saved_step)
        self._saved_memories = []

    def shared_state(self) -> dict:
        """The part of the state that must be the same on every rank for the next
        collectives to match (iteration count, plan, calibrated thresholds, sparsifier
        state), as plain picklable values. The rest (residuals, the local rule's buffers)
        is this rank's own."""
        return {}

    def adopt_shared(self, shared: dict, keep_local: bool, all_keep: bool) -> None:
        """Continue from ``shared`` (the root's :meth:`shared_state`, delivered by
        ``hvd.broadcast_optimizer_state``). ``keep_local``: this rank's own state belongs
        to the same point of training (its ``shared_state()`` equals ``shared``, e.g. it
        loaded its own checkpoint of the same step) and is kept; otherwise it starts from
        zero, never from another rank's. ``all_keep``: every rank keeps its own."""


class OutsideTheSet(Scheme):
    """What a rank outside the optimizer's process set runs, whatever ``scheme`` says: no
    collective, ever, and nothing kept. Horovod's optimizer registers no hooks there and
    its ``synchronize()`` returns at once, so ``step()`` applies the rank's own gradients
    with the wrapped optimizer; so does ours. Built instead of the scheme because a
    scheme's constructor may already talk to its set (a plan's broadcast, a probe), and
    a rank that is not in it must never join or wait for such a collective."""

    name = "outside"
    stateful = False

    def __init__(self, config: SyncConfig):
        self.config = config
        self.opts = dict(config.options)  # the real scheme's, checked by check_arguments

    def submit(self, p: torch.Tensor) -> None:
        raise RuntimeError("a rank outside the optimizer's process set synchronizes nothing")

    def finish(self) -> None:
        pass

    def pending(self) -> bool:
        return False

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's scheme state belongs to the ranks of the set; this rank, which
        steps on its own gradients, has no use for it."""
