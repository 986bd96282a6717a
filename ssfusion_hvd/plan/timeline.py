"""Timeline simulator: the one scorer of every planner decision.

Cupcake §4.1 defines the iteration time ``f(X)`` of a fusion strategy through the
timelines of backpropagation, compression and communication instead of a closed form;
SSFusion Eq. 2–4 use the same timelines. This module models the engine as it runs
(``schemes/engine.py``; docs/design.md "How a plan is made"), resource by resource:

* **compute** (the training thread): every tensor's backward ``T_b`` in backward order.
  When a group's last allreduce tensor is done, the thread packs the allreduce part
  (``CostModel.copy_s`` of its bytes); when the group's last tensor is done, it packs the
  rest and selects the inline sparsified tensors: ONE call for the whole group with a
  segmented sparsifier (top-k: ``α_h + β_h·Σ bytes``), one call per tensor otherwise, one
  call over the whole fusion buffer for a multi-tensor group (Cupcake) —
  :meth:`CostModel.select_s`.
* **the offload worker** (SSFusion-O, §IV-C): an offloaded tensor is selected on one CPU
  worker, first come first served, from the end of its backward. On a job whose worker
  shares the cores with backward (``cost.shared_cores``: CPU-only training) that time is
  taken from the compute thread instead: the tensor is selected there, right after its
  backward, at the CPU cost.
* **submission**: a group's allreduce part is submitted as soon as its last allreduce
  tensor's backward ends; its allgather when the group has been selected and packed (and,
  with offloaded tensors, once the worker has finished them).
* **the link** runs one collective at a time, in submission order, ``g(x) = α + β·x``.
  The last is the optimizer's per-step allreduce of the ranks' non-finite flags with the
  step's agreement (``check``: a few bytes, submitted once backward is done).
* **decode**: after backward, ``step()`` waits for the groups in plan order and decodes
  each (:func:`decode_bytes`, ``d(x) = α_d + β_d·x``); the iteration ends when the last
  group is decoded and the agreement is in (and the worker is idle).

:func:`~ssfusion_hvd.plan.fusion.optimal_fusion` is exact for this model without decode
(``cost.decode = (0, 0)``); with a decode fit it charges the last group's decode, which
is exact while the earlier decodes keep up with the link.
"""
from __future__ import annotations

from dataclasses import dataclass

from .cost import CostModel, entry_bytes
from .plan import ALLREDUCE, Plan

__all__ = ["CHECK_BYTES", "GroupTimeline", "Timeline", "decode_bytes", "simulate", "wire_bytes"]

#: Bytes of the optimizer's per-step agreement allreduce (``agreement.StepAgreement.send``:
#: iteration, plan checksum and a 1, their negations, and the non-finite flag, as int64).
CHECK_BYTES = 56


@dataclass(frozen=True)
class GroupTimeline:
    """Times (seconds from the start of the iteration) of one group.

    ``ready`` is when the last of its collectives was submitted; ``ar_*``/``ag_*`` are
    ``None`` when the group has no such part; ``decode_end`` when its gradients are in
    ``p.grad``.
    """

    backward_start: float
    backward_end: float
    ready: float
    ar_start: float | None
    ar_end: float | None
    ag_start: float | None
    ag_end: float | None
    decode_end: float = 0.0

    @property
    def comm_start(self) -> float:
        return self.ar_start if self.ar_start is not None else self.ag_start

    @property
    def comm_end(self) -> float:
        return self.ag_end if self.ag_end is not None else self.ar_end


@dataclass(frozen=True)
class Timeline:
    iteration_s: float
    compute_end: float
    cpu_end: float
    groups: tuple[GroupTimeline, ...]


def wire_bytes(plan: Plan, i: int, element_size: int, entry_extra: int = 0) -> int:
    """Bytes tensor ``i`` puts into its collective: dense values, or k entries of a
    value, an index and ``entry_extra`` bytes (``CostModel.entry_extra``)."""
    if not plan.sparse[i]:
        return plan.sizes[i] * element_size
    return plan.k[i] * entry_bytes(plan.sizes[i], element_size, entry_extra)


def _group_bytes(plan: Plan, gi: int, es: int, extra: int = 0) -> tuple[int, int]:
    """(allreduce bytes, allgather bytes) one worker contributes for group ``gi``."""
    g = plan.groups[gi]
    if g.buffer_k is not None:
        elems = sum(plan.sizes[g.start:g.end])
        return 0, g.buffer_k * entry_bytes(elems, es, extra)
    ar = sum(plan.sizes[i] * es for i in g.indices() if plan.collective[i] == ALLREDUCE)
    ag = sum(wire_bytes(plan, i, es, extra) for i in g.indices()
             if plan.collective[i] != ALLREDUCE)
    return ar, ag


def decode_bytes(plan: Plan, gi: int, es: int, world_size: int, entry_extra: int = 0) -> int:
    """Bytes group ``gi``'s decode touches: its output (every tensor of the group, written
    once: copied from the allreduce, summed, or, sparse, zeroed and then written where the
    records point) plus the ``world_size`` gathered records it reads (a sparse part's are
    read twice, to add them and to deliver what they touched; counted once, β prices it)."""
    g = plan.groups[gi]
    return (sum(plan.sizes[g.start:g.end]) * es
            + world_size * _group_bytes(plan, gi, es, entry_extra)[1])


def _run(plan: Plan, cost: CostModel, decide_offload: bool,
         check: bool = True) -> tuple[Timeline, list[bool]]:
    """Simulate ``plan``. With ``decide_offload``, instead of reading ``plan.offload``,
    offload every per-tensor sparsified tensor whose CPU finish time fits in its group's
    backward window (SSFusion-O Step-1), deciding greedily in backward order; nothing is
    offloaded when the worker shares the cores (``cost.shared_cores``). ``check``: the
    optimizer's agreement allreduce goes last on the link."""
    if len(cost.backward_s) != len(plan):
        raise ValueError(f"cost model has {len(cost.backward_s)} backward times, plan has {len(plan)} tensors")
    es, bwd, spf = cost.element_size, cost.backward_s, plan.sparsifier
    offload = list(plan.offload)
    if decide_offload and cost.shared_cores:
        decide_offload, offload = False, [False] * len(plan)
    compute = cpu = cost.forward_s
    submits = []  # (time, order, group, "ar" | "ag")
    spans = []    # (backward_start, backward_end, ready) per group
    for gi, g in enumerate(plan.groups):
        start = compute
        window_end = start + sum(bwd[g.start:g.end])  # SSFusion-O: the group's backward window
        ar_left = sum(1 for i in g.indices() if plan.collective[i] == ALLREDUCE)
        ar_bytes, ag_bytes = _group_bytes(plan, gi, es, cost.entry_extra)
        inline, worker_end = [], None
        packed = 0  # bytes packed when the group is complete (dense allgather part, stages)
        ready = start
        for i in g.indices():
            compute += bwd[i]
            if plan.collective[i] == ALLREDUCE:
                ar_left -= 1
                if ar_left == 0:  # the engine packs and submits the allreduce part now
                    compute += cost.copy_s(ar_bytes)
                    submits.append((compute, len(submits), gi, "ar"))
                    ready = compute
                continue
            if g.buffer_k is not None or not plan.sparse[i]:
                packed += plan.sizes[i] * es
                continue
            nbytes = plan.sizes[i] * es
            if decide_offload:
                offload[i] = max(compute, cpu) + cost.sparsify_s(spf, "cpu", nbytes) <= window_end
            if not offload[i]:
                inline.append(nbytes)
                packed += nbytes
            elif cost.shared_cores:  # the worker's time is the cores' time
                compute += cost.sparsify_s(spf, "cpu", nbytes)
            else:
                cpu = worker_end = max(compute, cpu) + cost.sparsify_s(spf, "cpu", nbytes)
        backward_end = compute
        compute += cost.copy_s(packed)
        if g.buffer_k is not None:  # one selection over the whole fusion buffer
            compute += cost.select_s(spf, "gpu", [packed])
        else:
            compute += cost.select_s(spf, "gpu", inline)
        if ag_bytes or g.buffer_k is not None:
            ready = compute if worker_end is None else max(compute, worker_end)
            submits.append((ready, len(submits), gi, "ag"))
        spans.append((start, backward_end, ready))

    link = cost.forward_s
    comm: dict = {}
    for t, _, gi, kind in sorted(submits):
        ar_bytes, ag_bytes = _group_bytes(plan, gi, es, cost.entry_extra)
        begin = max(t, link)
        link = begin + (cost.allreduce_s(ar_bytes) if kind == "ar" else cost.allgather_s(ag_bytes))
        comm[gi, kind] = (begin, link)

    decoded = compute  # step() runs after backward, then decodes group by group
    out = []
    for gi, (start, backward_end, ready) in enumerate(spans):
        ar_start, ar_end = comm.get((gi, "ar"), (None, None))
        ag_start, ag_end = comm.get((gi, "ag"), (None, None))
        done = max(t for t in (ar_end, ag_end, decoded) if t is not None)
        decoded = done + cost.decode_s(decode_bytes(plan, gi, es, cost.world_size, cost.entry_extra))
        out.append(GroupTimeline(start, backward_end, ready, ar_start, ar_end, ag_start, ag_end,
                                 decoded))
    end = max(decoded, cpu)
    if check:  # submitted once the last gradient is in, after every group's collectives
        end = max(end, max(compute, link) + cost.allreduce_s(CHECK_BYTES))
    timeline = Timeline(end, compute, cpu, tuple(out))
    return timeline, offload


def simulate(plan: Plan, cost: CostModel, check: bool = True) -> Timeline:
    """Iteration time and per-group timeline of ``plan`` under ``cost`` (see module doc;
    ``check=False`` leaves out the optimizer's agreement allreduce)."""
    return _run(plan, cost, decide_offload=False, check=check)[0]
