"""Synchronization schemes, one module each (the SSFusion family shares one); the
registry of ``scheme=`` names is :data:`ssfusion_hvd.registry.SCHEMES`."""
from .base import Option, Scheme, SyncConfig, WholeGradientScheme

__all__ = ["Option", "Scheme", "SyncConfig", "WholeGradientScheme"]
