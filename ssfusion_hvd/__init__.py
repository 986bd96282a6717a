"""ssfusion-hvd: tensor fusion with selective sparsification for Horovod + PyTorch.

Drop-in for ``hvd.DistributedOptimizer``::

    opt = ssfusion_hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                            scheme="dense")

``DistributedOptimizer`` imports Horovod on first use, so the pure parts
(``ssfusion_hvd.plan``, ``ssfusion_hvd.ops``, ``ssfusion_hvd.sparsify``, ``SCHEMES``) work
without it.
"""
__version__ = "0.1.0"

from .registry import SCHEMES, register_scheme  # noqa: E402
from .sparsify import SPARSIFIERS  # noqa: E402

__all__ = ["DistributedOptimizer", "RanksDisagree", "SCHEMES", "SPARSIFIERS",
           "broadcast_optimizer_state", "register_scheme", "__version__"]


def __getattr__(name):
    if name in ("DistributedOptimizer", "RanksDisagree", "broadcast_optimizer_state"):
        from . import optimizer

        return getattr(optimizer, name)
    raise AttributeError(f"module 'ssfusion_hvd' has no attribute {name!r}")
