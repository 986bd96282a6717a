"""The plan: what every rank does with every gradient tensor in one iteration.

A :class:`Plan` is the planner's output and the optimizer's input (docs/design.md: "The planner
is a pure function of numbers ... to a Plan"). Tensors are indexed in backward order
(the order their gradients become ready). Each *group* is a run of consecutive tensors
packed into one fusion buffer; per tensor the plan says whether it is sent dense or
sparsified, its top-k ``k``, whether it rides the group's allreduce part or its
allgather part (SSFusion-I, §IV-D) and whether its sparsification is offloaded to the
CPU worker (SSFusion-O, §IV-C). A group with ``buffer_k`` is sparsified as a whole,
multi-tensor style (Cupcake; SSFusion §III-A): one top-k over the fusion buffer. With
``group_floor`` set, a group's inline sparsified tensors share the sum of their ``k`` by
magnitude, each keeping a floor (:meth:`Plan.floors`; ``docs/schemes.md``, "Group budget").
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from .cost import JsonFile

if TYPE_CHECKING:
    from .timeline import Timeline

__all__ = ["Group", "Plan", "ALLREDUCE", "ALLGATHER"]

ALLREDUCE = "allreduce"
ALLGATHER = "allgather"


@dataclass(frozen=True)
class Group:
    """Tensors ``[start, end)`` (backward order) fused into one buffer.

    ``buffer_k`` is set only for multi-tensor sparsification: top-``buffer_k`` over the
    whole fusion buffer, so single tensors may send nothing (tensor missing, §III-A).
    """

    start: int
    end: int
    buffer_k: int | None = None

    def __len__(self) -> int:
        return self.end - self.start

    def indices(self) -> range:
        return range(self.start, self.end)


@dataclass
class Plan(JsonFile):
    """Groups plus per-tensor decisions; see the module docstring.

    Per tensor ``i`` (backward order): ``sparse[i]`` (sparsified, or sent dense),
    ``k[i]`` (elements sent: ``numel`` when dense, the top-k count when sparsified on
    its own, ``None`` inside a multi-tensor buffer), ``collective[i]`` (``"allreduce"``:
    dense part of the group, or ``"allgather"``) and ``offload[i]`` (sparsified on the
    CPU worker).
    """

    scheme: str
    names: list[str]
    sizes: list[int]
    groups: list[Group]
    sparse: list[bool]
    k: list[int | None]
    collective: list[str]
    offload: list[bool]
    density: float
    sparsifier: str = "dgc"
    notes: dict[str, str] = field(default_factory=dict)
    #: None: every sparsified tensor sends its own ``k`` (the paper's per-tensor density).
    #: A share ``f >= 0``: the tensors a group selects inline share the sum of their
    #: ``k`` by magnitude, tensor ``i`` keeping at least ``max(1, ceil(f · k[i]))``
    #: (exact top-k only; other sparsifiers keep their own ``k``).
    group_floor: float | None = None

    def __post_init__(self) -> None:
        self.sizes = [int(n) for n in self.sizes]
        self.groups = [g if isinstance(g, Group) else Group(**g) for g in self.groups]
        n = len(self.sizes)
        for attr in ("names", "sparse", "k", "collective", "offload"):
            if len(getattr(self, attr)) != n:
                raise ValueError(f"plan.{attr} has {len(getattr(self, attr))} entries, expected {n}")
        cursor = 0
        for g in self.groups:
            if g.start != cursor or g.end <= g.start:
                raise ValueError(f"groups must tile [0, {n}) consecutively; got {self.groups}")
            cursor = g.end
            for i in g.indices():
                self._check_tensor(i, buffered=g.buffer_k is not None)
        if cursor != n:
            raise ValueError(f"groups cover [0, {cursor}) but the plan has {n} tensors")
        if self.group_floor is not None and not 0.0 <= float(self.group_floor) <= 1.0:
            raise ValueError(f"group_floor must be None or in [0, 1], got {self.group_floor!r}")

    def _check_tensor(self, i: int, buffered: bool) -> None:
        n, k, coll = self.sizes[i], self.k[i], self.collective[i]
        if coll not in (ALLREDUCE, ALLGATHER):
            raise ValueError(f"tensor {i}: unknown collective {coll!r}")
        if buffered:
            ok = self.sparse[i] and k is None and coll == ALLGATHER and not self.offload[i]
        elif self.sparse[i]:
            ok = k is not None and 1 <= k <= n and coll == ALLGATHER
        else:
            ok = k == n and not self.offload[i]
        if not ok:
            raise ValueError(
                f"tensor {i} ({self.names[i]}): inconsistent sparse={self.sparse[i]} k={k} "
                f"collective={coll} offload={self.offload[i]} (buffered={buffered})"
            )

    # -- views -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.sizes)

    def group_of(self) -> list[int]:
        """Group index of every tensor."""
        out = [0] * len(self.sizes)
        for gi, g in enumerate(self.groups):
            for i in g.indices():
                out[i] = gi
        return out

    def floors(self, indices) -> list[int]:
        """The floors of sparsified tensors ``indices`` under the group budget
        (``group_floor``): ``max(1, ceil(f · k))``, at most ``k``."""
        f = float(self.group_floor or 0.0)
        return [min(self.k[i], max(1, math.ceil(f * self.k[i] - 1e-9))) for i in indices]

    def at_density(self, density: float) -> "Plan":
        """The same plan at another density, the density warm-up's stages: every
        sparsified tensor and multi-tensor buffer sends ``density / self.density`` times its
        share at the plan's density, ``min(k, self.density · n)``, rounded up (at least its
        ``k``, at most all). Groups, dense tensors, collectives and offloading are
        unchanged, so buffers keep their parts and residuals their shapes.

        The share, not ``k``: a tensor held at its floor (k = 1 where ``d · n`` is 0.03)
        sends its own share of the stage, ``ceil(d' · n)``, as global top-k would, not
        ``d'/d`` floors (at 0.001 that had the warm-up's stages send 1.03-1.20x their
        density on the accuracy suite's models, now 1.00-1.04x)."""
        if density == self.density:
            return self
        ratio = float(density) / self.density

        def scaled(k: int, n: int) -> int:  # (density · n, not share · ratio: nominal_k's rounding)
            return int(min(n, max(k, math.ceil(min(k * ratio, float(density) * n) - 1e-9))))

        k = [scaled(ki, n) if s and ki is not None else ki
             for ki, n, s in zip(self.k, self.sizes, self.sparse)]
        groups = [g if g.buffer_k is None else
                  Group(g.start, g.end, scaled(g.buffer_k, sum(self.sizes[g.start:g.end])))
                  for g in self.groups]
        return Plan(self.scheme, list(self.names), list(self.sizes), groups, list(self.sparse),
                    k, list(self.collective), list(self.offload), float(density),
                    self.sparsifier, dict(self.notes), self.group_floor)

    def sent_elements(self) -> int:
        """Elements (values) one worker sends per iteration, dense tensors included."""
        per_tensor = sum(k for k in self.k if k is not None)
        return per_tensor + sum(g.buffer_k for g in self.groups if g.buffer_k is not None)

    # -- JSON --------------------------------------------------------------------------
    def to_json(self) -> str:
        d = asdict(self)
        d["groups"] = [asdict(g) for g in self.groups]
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls(**json.loads(text))

    # -- text --------------------------------------------------------------------------
    def table(self, timeline: "Timeline | None" = None, max_name: int = 40) -> str:
        """Readable per-tensor table, grouped; with a timeline, per-group times in ms.
        ``select``: where a sparsified tensor's selection runs, ``inline`` (the training
        thread, on the gradients' device) or ``worker`` (the SSFusion-O offload worker)."""
        lines = [
            f"plan: scheme={self.scheme}"
            f"{' (chosen by auto)' if self.notes.get('chosen_by') == 'auto' else ''} "
            f"sparsifier={self.sparsifier} density={self.density:g} "
            f"tensors={len(self)} groups={len(self.groups)} "
            f"sent={self.sent_elements()}/{sum(self.sizes)} elements"
            + ("" if self.group_floor is None else
               f" group budget (floor {self.group_floor:g}: a group's inline k shared by magnitude)")
        ]
        header = f"{'grp':>4} {'idx':>5}  {'tensor':<{max_name}} {'numel':>11} {'mode':<6} {'k':>9} {'density':>8} {'coll':<4} {'select':<6}"
        lines += [header, "-" * len(header)]
        for gi, g in enumerate(self.groups):
            if timeline is not None:
                gt = timeline.groups[gi]
                lines.append(
                    f"{gi:>4} group [{g.start}, {g.end}): backward {gt.backward_start * 1e3:.3f}-"
                    f"{gt.backward_end * 1e3:.3f} ms, ready {gt.ready * 1e3:.3f} ms, "
                    f"communication {gt.comm_start * 1e3:.3f}-{gt.comm_end * 1e3:.3f} ms"
                )
            if g.buffer_k is not None:
                elems = sum(self.sizes[i] for i in g.indices())
                lines.append(
                    f"{gi:>4} fusion buffer: top-{g.buffer_k} of {elems} elements "
                    f"(density {g.buffer_k / elems:.4g}), allgather"
                )
            for i in g.indices():
                name = self.names[i]
                if len(name) > max_name:
                    name = "…" + name[-(max_name - 1):]
                n, k = self.sizes[i], self.k[i]
                mode = "buffer" if g.buffer_k is not None else ("sparse" if self.sparse[i] else "dense")
                k_txt = "-" if k is None else str(k)
                dens = "-" if k is None else f"{k / n:.4g}"
                coll = "AR" if self.collective[i] == ALLREDUCE else "AG"
                # where the selection runs: the offload worker, or the training thread on
                # the gradients' own device (CPU on a CPU job)
                where = "worker" if self.offload[i] else ("inline" if self.sparse[i] else "-")
                lines.append(
                    f"{gi:>4} {i:>5}  {name:<{max_name}} {n:>11} {mode:<6} {k_txt:>9} {dens:>8} {coll:<4} {where:<6}"
                )
        if timeline is not None:
            lines.append(f"simulated iteration time: {timeline.iteration_s * 1e3:.3f} ms")
        return "\n".join(lines)
