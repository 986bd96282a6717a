"""Per-tensor (layer-wise) sparsification, GRACE-style: every gradient tensor selects its
own top-k (``k = ceil(density · n)``, at least 1) and travels in its own allgather, so no
tensor is ever missing but every tensor pays a collective's latency (SSFusion §III-A)."""
from .planned import PlannedScheme


class PerTensorScheme(PlannedScheme):
    name = "per_tensor"
