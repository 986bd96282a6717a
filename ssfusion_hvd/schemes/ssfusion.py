"""SSFusion (§IV-B): Cupcake's fusion buffers with *selective* sparsification. Inside each
buffer every tensor selects its own top-k (one segmented kernel call per buffer, so no
tensor is missing); small tensors whose sparsification would not pay for itself are sent
dense inside the same allgather (Eq. 2), and the sparsified tensors' densities are raised
so that the elements sent in total stay at ``density`` (density-aware compensation)."""
from .planned import PlannedScheme


class SSFusionScheme(PlannedScheme):
    name = planner = "ssfusion"
