"""Timeline simulator: the one scorer of every planner decision.

Cupcake §4.1 defines the iteration time ``f(X)`` of a fusion strategy through the
timelines of backpropagation, compression and communication instead of a closed form;
SSFusion Eq. 2–4 use the same three timelines. The rules (docs/design.md "How a plan is made"):

* one compute stream runs, in backward order, every tensor's backward ``T_b`` and right
  after it that tensor's GPU sparsification ``h_gpu`` (per-tensor sparsification), or,
  after a group's last backward, one sparsification of the whole fusion buffer
  (multi-tensor, Cupcake);
* an offloaded tensor (SSFusion-O, §IV-C) is sparsified by one CPU worker, first come
  first served, starting when its backward ends; it does not occupy the compute stream;
* one link runs the collectives in submission order. A group's collective starts when
  its last tensor is ready (compressed, or backward done if dense) and the previous
  collective ended. An interleaved group (SSFusion-I, §IV-D) submits its allreduce part
  first and its allgather part second; the allgather starts when the allreduce has ended
  and the sparse tensors are ready ("T_AG begins after either T_AR completes or after
  the computations of all tensors in Buffer_AG finish");
* the iteration ends when the forward ``A``, the compute stream, the CPU worker and the
  link are all done. Decoding is not modelled (it is the same for every plan of a scheme).
"""
from __future__ import annotations

from dataclasses import dataclass

from .cost import CostModel, index_size
from .plan import ALLREDUCE, Plan

__all__ = ["GroupTimeline", "Timeline", "simulate", "wire_bytes"]


@dataclass(frozen=True)
class GroupTimeline:
    """Times (seconds from the start of the iteration) of one group.

    ``ready`` is when the last tensor of the group is compressed (or its backward ended,
    if dense); ``ar_*``/``ag_*`` are ``None`` when the group has no such part.
    """

    backward_start: float
    backward_end: float
    ready: float
    ar_start: float | None
    ar_end: float | None
    ag_start: float | None
    ag_end: float | None

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


def wire_bytes(plan: Plan, i: int, element_size: int) -> int:
    """Bytes tensor ``i`` puts into its collective: dense values, or k values + k indices."""
    if not plan.sparse[i]:
        return plan.sizes[i] * element_size
    return plan.k[i] * (element_size + index_size(plan.sizes[i]))


def _run(plan: Plan, cost: CostModel, decide_offload: bool) -> tuple[Timeline, list[bool]]:
    """Simulate ``plan``. With ``decide_offload``, instead of reading ``plan.offload``,
    offload every per-tensor sparsified tensor whose CPU finish time fits in its group's
    backward window (SSFusion-O Step-1), deciding greedily in backward order."""
    if len(cost.backward_s) != len(plan):
        raise ValueError(f"cost model has {len(cost.backward_s)} backward times, plan has {len(plan)} tensors")
    es = cost.element_size
    bwd = cost.backward_s
    gpu_a, gpu_b = cost.sparsify_fit(plan.sparsifier, "gpu")
    if decide_offload or any(plan.offload):
        cpu_a, cpu_b = cost.sparsify_fit(plan.sparsifier, "cpu")
    offload = list(plan.offload)
    compute = cpu = link = cost.forward_s
    out = []
    for g in plan.groups:
        start = compute
        window_end = start + sum(bwd[g.start:g.end])  # SSFusion-O: the group's backward window
        ready_ar = ready_ag = start
        ar_bytes = ag_bytes = 0
        has_ar = has_ag = False
        for i in g.indices():
            compute += bwd[i]
            ready = backward_end = compute
            if plan.sparse[i] and g.buffer_k is None:
                nbytes = plan.sizes[i] * es
                if decide_offload:
                    offload[i] = max(ready, cpu) + cpu_a + cpu_b * nbytes <= window_end
                if offload[i]:
                    cpu = max(ready, cpu) + cpu_a + cpu_b * nbytes
                    ready = cpu
                else:
                    compute += gpu_a + gpu_b * nbytes
                    ready = compute
            if plan.collective[i] == ALLREDUCE:
                has_ar, ready_ar = True, max(ready_ar, ready)
                ar_bytes += plan.sizes[i] * es
            elif g.buffer_k is None:
                has_ag, ready_ag = True, max(ready_ag, ready)
                ag_bytes += wire_bytes(plan, i, es)
        if g.buffer_k is not None:
            elems = sum(plan.sizes[g.start:g.end])
            compute += gpu_a + gpu_b * elems * es
            has_ag, ready_ag = True, compute
            ag_bytes = g.buffer_k * (es + index_size(elems))
        ar_start = ar_end = ag_start = ag_end = None
        if has_ar:
            ar_start = max(ready_ar, link)
            link = ar_end = ar_start + cost.allreduce_s(ar_bytes)
        if has_ag:
            ag_start = max(ready_ag, link)
            link = ag_end = ag_start + cost.allgather_s(ag_bytes)
        out.append(GroupTimeline(start, backward_end, max(ready_ar, ready_ag), ar_start, ar_end, ag_start, ag_end))
    timeline = Timeline(max(compute, cpu, link), compute, cpu, tuple(out))
    return timeline, offload


def simulate(plan: Plan, cost: CostModel) -> Timeline:
    """Iteration time and per-group timeline of ``plan`` under ``cost`` (see module doc)."""
    return _run(plan, cost, decide_offload=False)[0]
