"""The SSFusion family (ICDE'26): one class for four planned schemes and ``auto``, which
differ only in their planner (``plan.PLANNERS``).

* ``ssfusion`` (§IV-B): optimal fusion buffers (Cupcake's DP, run for per-tensor
  sparsified tensors) with *selective* sparsification. Inside
  each buffer every tensor selects its own top-k (one segmented kernel call per buffer,
  so no tensor is missing); small tensors whose sparsification would not pay for itself
  are sent dense inside the same allgather (Eq. 2), and the sparsified tensors' densities
  are raised so that the elements sent in total stay at ``density`` (density-aware
  compensation).
* ``ssfusion_o`` (§IV-C): plus sparsification offloading. Large tensors whose CPU
  selection finishes inside their group's backward window (decided by the simulator,
  ``plan.choose_offload``) are selected on a CPU worker thread as soon as their gradient
  is ready (``core/offload.py``), overlapping the rest of backward.
* ``ssfusion_i`` (§IV-D): each fusion buffer split into a dense part sent by allreduce and
  a sparse part sent by allgather, at the split point minimizing ``T1 + T2``
  (``plan.split_interleaved``); a group's allreduce part leaves as soon as its own
  tensors are ready, its allgather part once the group is selected and packed.
* ``ssfusion_oi``: both. The recommended scheme.
* ``auto``: after the warm-up, rank 0 builds the plan of every planned scheme and of
  Horovod's dense buckets on the measured cost model and runs the one the simulator
  predicts fastest (``plan.choose_plan``); ``opt.plan.scheme`` and ``stats()`` say which.

Options (``scheme_options=``), all five:

* ``floor`` (default ``plan.selective.DEFAULT_GROUP_FLOOR``): the group budget. The
  tensors a fusion buffer selects inline share the sum of their top-k counts by the
  magnitude of what they accumulated (one selection over the buffer, as multi-tensor
  does), each keeping at least ``max(1, ceil(floor · k))`` of its own, so none is ever
  missing (``ops.group_ef_topk``). ``None``: every tensor sends exactly its own k (the
  paper's per-tensor density). ``docs/schemes.md``, "Group budget", has the measurements.
* ``slack`` (default ``plan.selective.DEFAULT_ACCURACY_SLACK``): under the group budget,
  the planner takes the plan with the largest shared budgets (one group, or the fastest
  plan's groups without offloading) that the simulator predicts within this share of the
  fastest candidate (``plan/schemes.py: _larger_budgets``). 0: the fastest candidate.
* ``waits`` (default "auto": from ``WAITS_MIN_RANKS`` = 3 ranks on; True, False; every
  planned scheme takes it): each sparse entry carries its sender's wait, one byte, and
  the shared moments catch each rank's value up over its own wait instead of the
  union's (``docs/design.md``, "Each sender's wait"; ``docs/results.md`` §2b has the
  measurements: SGD and Adam better with 4 workers; with 2, SGD neutral and Adam better
  on a GRU and worse on the LM).
* ``min_k`` (default 0, the paper's planner): a tensor whose top-k at the target density
  would keep fewer elements is sent dense (``plan.keep_small_dense``: norms and biases with
  e.g. 32). Opt-in: the live example jobs measured no accuracy gain from it
  (``docs/schemes.md``, "Small tensors").
"""
from ..plan.selective import DEFAULT_ACCURACY_SLACK, DEFAULT_GROUP_FLOOR, DEFAULT_MIN_K
from .base import Option, is_int, is_real
from .planned import PlannedScheme

__all__ = ["SSFusionScheme"]


def _is_floor(v) -> bool:
    return v is None or is_real(0.0, 1.0)(v)


class SSFusionScheme(PlannedScheme):
    """The five: the registry lists this class under each name (``Scheme.named`` gives
    the subclass of that name), and the name picks the planner
    (``plan.PLANNERS``: ``SSFusionSteps`` with its -O and -I switches, or ``auto``)."""

    name = "ssfusion"
    options = {
        **PlannedScheme.options,
        "min_k": Option(DEFAULT_MIN_K, is_int(0), "an int >= 0 (0: every tensor may be sparsified)"),
        "floor": Option(DEFAULT_GROUP_FLOOR, _is_floor,
                        "None (each tensor its own k) or a share in [0, 1] (the group budget)"),
        "slack": Option(DEFAULT_ACCURACY_SLACK, is_real(0.0),
                        "a number >= 0 (0: the fastest candidate plan, whatever its budgets)"),
    }
