"""Pure planning for ssfusion-hvd: numbers in, a :class:`Plan` out.

No Horovod and no autograd here (docs/design.md "Layers"): the planner maps tensor sizes,
backward times and α/β fits (:class:`CostModel`) to groups, per-tensor sparsification
decisions, top-k counts, allreduce/allgather parts and CPU offloading, and scores every
decision with one timeline simulator (:func:`simulate`).

* Cupcake (MLSys'23) §4: :func:`optimal_fusion` (exact, dynamic programming).
* SSFusion (ICDE'26) §IV-B: :func:`select_sparsified`, :func:`compensate_density`;
  §IV-C: :func:`choose_offload`; §IV-D: :func:`split_interleaved`.
* :func:`build_plan` assembles the plans of every scheme in :data:`PLANNERS`.
"""
from .cost import CostModel, DEFAULT_SPARSIFY, default_backward_times, nominal_k, parse_bandwidth
from .fusion import SPARSIFICATIONS, fused_plan, optimal_fusion
from .models import MODELS, model_tensors
from .plan import ALLGATHER, ALLREDUCE, Group, Plan
from .schemes import DEFAULT_FUSION_THRESHOLD, PLANNERS, build_plan, choose_plan, threshold_groups
from .selective import (
    DEFAULT_MIN_K,
    MIN_DENSITY,
    choose_offload,
    compensate_density,
    floor_density,
    keep_small_dense,
    wire_budget,
    wire_time,
    select_sparsified,
    split_interleaved,
    split_objective,
)
from .timeline import GroupTimeline, Timeline, decode_bytes, simulate, wire_bytes

__all__ = [
    "ALLGATHER", "ALLREDUCE", "CostModel", "DEFAULT_FUSION_THRESHOLD", "DEFAULT_MIN_K", "DEFAULT_SPARSIFY",
    "Group", "GroupTimeline", "MIN_DENSITY", "MODELS", "Plan", "PLANNERS", "SPARSIFICATIONS",
    "Timeline", "build_plan", "choose_offload", "choose_plan", "compensate_density", "decode_bytes",
    "default_backward_times", "floor_density", "keep_small_dense",
    "wire_budget", "wire_time",
    "fused_plan", "model_tensors", "nominal_k", "optimal_fusion", "parse_bandwidth",
    "select_sparsified", "simulate", "split_interleaved", "split_objective",
    "threshold_groups", "wire_bytes",
]
