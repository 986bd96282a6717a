"""Synchronization schemes, selected by ``scheme=`` in ``ssfusion_hvd.DistributedOptimizer``."""
from .base import Scheme, SyncConfig
from .dense import DenseScheme

SCHEMES = {cls.name: cls for cls in (DenseScheme,)}

__all__ = ["SCHEMES", "Scheme", "SyncConfig", "DenseScheme"]
