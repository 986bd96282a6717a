"""SSFusion-I (§IV-D): each fusion buffer split into a dense part sent by allreduce and a
sparse part sent by allgather (values + indices), at the split point minimizing
``T1 + T2`` (``plan.split_interleaved``); the two collectives of every group are submitted
back to back, interleaved group after group."""
from .planned import PlannedScheme


class SSFusionIScheme(PlannedScheme):
    name = planner = "ssfusion_i"
