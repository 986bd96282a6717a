"""The one registry of synchronization schemes: ``scheme=`` name -> :class:`SchemeInfo`.

Pure data (no Horovod import): ``ssfusion_hvd.SCHEMES`` is this mapping and the optimizer
loads the class of the scheme it runs from it (:meth:`SchemeInfo.load`). A built-in
scheme is named here by its import path, so listing the schemes imports none of them; a
scheme written elsewhere registers its class with :func:`register_scheme`
(``docs/design.md``, "Adding a scheme"). How a planned scheme's plan is made is the
planner's own table, ``ssfusion_hvd.plan.PLANNERS``, under the same name.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Union

__all__ = ["SchemeInfo", "SCHEMES", "register_scheme", "options_for"]


@dataclass(frozen=True)
class SchemeInfo:
    name: str
    #: the class: itself, or ``"module:Class"`` imported on first use
    target: Union[str, type]
    summary: str

    def load(self):
        """The class that runs this scheme (imports Horovod). A class registered under
        several names (the SSFusion family: one class, its planner named by the scheme)
        gives its subclass of this name (``Scheme.named``)."""
        cls = self.target
        if isinstance(cls, str):
            module, _, attr = cls.partition(":")
            cls = getattr(importlib.import_module(module), attr)
        return cls.named(self.name)

    def options_taken(self, **given):
        """The entries of ``given`` that are set (not None) and that this scheme's
        ``scheme_options`` accept, or None when there are none: what a script passes to
        whichever scheme it runs (the examples' ``--min-k``, say)."""
        accepted = self.load().options
        taken = {k: v for k, v in given.items() if v is not None and k in accepted}
        return taken or None


def _builtin(name: str, target: str, summary: str) -> SchemeInfo:
    return SchemeInfo(name, f"ssfusion_hvd.schemes.{target}", summary)


SCHEMES = {s.name: s for s in (
    _builtin("dense", "dense:DenseScheme", "Horovod's allreduce, unchanged"),
    _builtin("per_tensor", "per_tensor:PerTensorScheme",
             "every tensor's own top-k, one allgather per tensor"),
    _builtin("multi_tensor", "multi_tensor:MultiTensorScheme",
             "Cupcake: optimal fusion, one top-k per fusion buffer"),
    _builtin("ssfusion", "ssfusion:SSFusionScheme",
             "optimal fusion, selective per-tensor top-k inside each buffer"),
    _builtin("ssfusion_o", "ssfusion:SSFusionScheme",
             "ssfusion + large tensors selected on a CPU worker"),
    _builtin("ssfusion_i", "ssfusion:SSFusionScheme",
             "ssfusion + each buffer split into allreduce and allgather parts"),
    _builtin("ssfusion_oi", "ssfusion:SSFusionScheme", "both (recommended)"),
    _builtin("auto", "ssfusion:SSFusionScheme",
             "whichever planned scheme (or dense) the simulator predicts fastest on the "
             "cost model measured in the job"),
    _builtin("spardl", "spardl:SparDLScheme", "SparDL: Spar-Reduce-Scatter and Spar-All-Gather"),
    _builtin("zen", "zen:ZenScheme", "ZEN: hashed balanced parallelism"),
    _builtin("exdyna", "exdyna:ExDynaScheme",
             "ExDyna: exclusive dynamic partitions, online threshold"),
)}


def register_scheme(cls: type, summary: str = "") -> SchemeInfo:
    """Makes ``scheme=cls.name`` run ``cls``, a subclass of
    ``ssfusion_hvd.schemes.Scheme`` (e.g. of ``WholeGradientScheme``). Every rank must
    register it before building its optimizer (defining it in an imported module does);
    a name already taken raises ``ValueError``."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls!r} has no scheme name (class attribute 'name')")
    had = SCHEMES.get(name)
    if had is not None and not (isinstance(had.target, type) and _same_class(had.target, cls)):
        raise ValueError(f"scheme {name!r} is already registered")
    info = SCHEMES[name] = SchemeInfo(name, cls, summary)
    return info


def _same_class(a: type, b: type) -> bool:
    """The same class, or the same definition imported again (a module reloaded)."""
    return (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


def options_for(scheme: str, **given):
    """:meth:`SchemeInfo.options_taken` of ``scheme``, None for a name not registered
    (the optimizer then raises its own error for it)."""
    info = SCHEMES.get(scheme)
    return None if info is None else info.options_taken(**given)
