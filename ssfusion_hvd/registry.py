"""The one registry of synchronization schemes: ``scheme=`` name -> :class:`SchemeInfo`.

Pure data (no Horovod import): ``ssfusion_hvd.SCHEMES`` is this mapping, the planner
(``plan.build_plan``) builds the plans of :data:`PLANNERS`, and the optimizer loads the
class of the scheme it runs (:meth:`SchemeInfo.load`). Adding a scheme is one entry here
and one module under ``ssfusion_hvd/schemes/`` (``docs/design.md``, "Adding a scheme").
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

__all__ = ["SchemeInfo", "SCHEMES", "PLANNERS", "options_for"]


@dataclass(frozen=True)
class SchemeInfo:
    name: str
    module: str  # under ssfusion_hvd.schemes
    cls: str
    planned: bool  # plan.build_plan builds its plan (dense: Horovod's buckets, for comparisons)
    summary: str

    def load(self):
        """The scheme class (imports Horovod)."""
        return getattr(importlib.import_module(f"ssfusion_hvd.schemes.{self.module}"), self.cls)

    def options_taken(self, **given):
        """The entries of ``given`` that are set (not None) and that this scheme's
        ``scheme_options`` accept, or None when there are none: what a script passes to
        whichever scheme it runs (the examples' ``--min-k``, say)."""
        accepted = self.load().options
        taken = {k: v for k, v in given.items() if v is not None and k in accepted}
        return taken or None


SCHEMES = {s.name: s for s in (
    SchemeInfo("dense", "dense", "DenseScheme", True, "Horovod's allreduce, unchanged"),
    SchemeInfo("per_tensor", "per_tensor", "PerTensorScheme", True,
               "every tensor's own top-k, one allgather per tensor"),
    SchemeInfo("multi_tensor", "multi_tensor", "MultiTensorScheme", True,
               "Cupcake: optimal fusion, one top-k per fusion buffer"),
    SchemeInfo("ssfusion", "ssfusion", "SSFusionScheme", True,
               "optimal fusion, selective per-tensor top-k inside each buffer"),
    SchemeInfo("ssfusion_o", "ssfusion", "SSFusionOScheme", True,
               "ssfusion + large tensors selected on a CPU worker"),
    SchemeInfo("ssfusion_i", "ssfusion", "SSFusionIScheme", True,
               "ssfusion + each buffer split into allreduce and allgather parts"),
    SchemeInfo("ssfusion_oi", "ssfusion", "SSFusionOIScheme", True, "both (recommended)"),
    SchemeInfo("auto", "ssfusion", "AutoScheme", True,
               "whichever planned scheme (or dense) the simulator predicts fastest on the "
               "cost model measured in the job"),
    SchemeInfo("spardl", "spardl", "SparDLScheme", False,
               "SparDL: Spar-Reduce-Scatter and Spar-All-Gather"),
    SchemeInfo("zen", "zen", "ZenScheme", False, "ZEN: hashed balanced parallelism"),
    SchemeInfo("exdyna", "exdyna", "ExDynaScheme", False,
               "ExDyna: exclusive dynamic partitions, online threshold"),
)}

#: the schemes whose plans ``ssfusion_hvd.plan.build_plan`` builds
PLANNERS = tuple(name for name, s in SCHEMES.items() if s.planned)


def options_for(scheme: str, **given):
    """:meth:`SchemeInfo.options_taken` of ``scheme``, None for a name not registered
    (the optimizer then raises its own error for it)."""
    info = SCHEMES.get(scheme)
    return None if info is None else info.options_taken(**given)
