"""SSFusion-OI: the interleaved allreduce/allgather split of SSFusion-I (§IV-D) with the
sparsification offloading of SSFusion-O (§IV-C). The recommended scheme."""
from .planned import PlannedScheme


class SSFusionOIScheme(PlannedScheme):
    name = planner = "ssfusion_oi"
