"""Multi-tensor sparsification (Cupcake, 2024): tensors fused by the optimal fusion of
Cupcake §4.2 and one top-k taken over each whole fusion buffer
(``k = ceil(density · buffer elements)``), sent by allgather. Cheap, but tensors whose
gradients are small relative to the rest of their buffer send nothing: the tensor missing
rate SSFusion §III-A measures (``opt.stats()["tensors_missing"]``)."""
from .planned import PlannedScheme


class MultiTensorScheme(PlannedScheme):
    name = "multi_tensor"
