"""SSFusion-O (§IV-C): SSFusion plus sparsification offloading. Large tensors whose CPU
selection finishes inside their group's backward window (decided by the simulator,
``plan.choose_offload``) are selected on a CPU worker thread as soon as their gradient is
ready (GIL released by the kernels; on GPU through pinned host buffers filled by
non-blocking copies on a side stream), overlapping the rest of backward."""
from .planned import PlannedScheme


class SSFusionOScheme(PlannedScheme):
    name = planner = "ssfusion_o"
