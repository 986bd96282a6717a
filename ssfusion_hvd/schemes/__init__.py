"""Synchronization schemes, one module each (the SSFusion family shares one); the
registry of ``scheme=`` names is :data:`ssfusion_hvd.registry.SCHEMES`."""
from .base import Option, OutsideTheSet, Scheme, SyncConfig
from .whole import WholeGradientScheme

__all__ = ["Option", "OutsideTheSet", "Scheme", "SyncConfig", "WholeGradientScheme"]
