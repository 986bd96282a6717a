"""ssfusion-hvd: tensor fusion with selective sparsification for Horovod + PyTorch.

Drop-in for ``hvd.DistributedOptimizer``::

    opt = ssfusion_hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                            scheme="dense")
"""
__version__ = "0.1.0"

from .optimizer import DistributedOptimizer, SCHEMES  # noqa: E402
from .sparsify import SPARSIFIERS  # noqa: E402

__all__ = ["DistributedOptimizer", "SCHEMES", "SPARSIFIERS", "__version__"]
