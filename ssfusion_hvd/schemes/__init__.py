"""Synchronization schemes, one module each; ``SCHEMES`` maps ``scheme=`` names to classes."""
from .base import Scheme, SyncConfig
from .dense import DenseScheme
from .exdyna import ExDynaScheme
from .multi_tensor import MultiTensorScheme
from .per_tensor import PerTensorScheme
from .spardl import SparDLScheme
from .ssfusion import SSFusionScheme
from .ssfusion_i import SSFusionIScheme
from .ssfusion_o import SSFusionOScheme
from .ssfusion_oi import SSFusionOIScheme
from .zen import ZenScheme

SCHEMES = {cls.name: cls for cls in (DenseScheme, PerTensorScheme, MultiTensorScheme,
                                     SSFusionScheme, SSFusionOScheme, SSFusionIScheme,
                                     SSFusionOIScheme, ExDynaScheme, SparDLScheme, ZenScheme)}

__all__ = ["SCHEMES", "Scheme", "SyncConfig"]
