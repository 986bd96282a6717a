"""Sparsifiers: select about k elements of a gradient -> (values, indices).

One small interface (``base.Sparsifier``; GRACE's Compressor without the communication)
composed with error feedback (``memory.ResidualMemory``) and any scheme. Each module's
docstring names its paper and states its density tolerance.
"""
from .base import Sparsifier
from .dgc import DGC
from .gaussiank import GaussianK
from .memory import ResidualMemory
from .randomk import RandomK
from .redsync import RedSync
from .sidco import SIDCo
from .threshold import Threshold
from .topk import TopK

SPARSIFIERS = {cls.name: cls for cls in (TopK, DGC, GaussianK, RedSync, SIDCo, RandomK, Threshold)}


def make_sparsifier(name: str, **kwargs) -> Sparsifier:
    """A new instance of the named sparsifier (one per tensor or fusion buffer)."""
    if name not in SPARSIFIERS:
        raise ValueError(f"unknown sparsifier {name!r}; available: {', '.join(sorted(SPARSIFIERS))}")
    return SPARSIFIERS[name](**kwargs)


__all__ = ["SPARSIFIERS", "Sparsifier", "ResidualMemory", "make_sparsifier", "TopK", "DGC",
           "GaussianK", "RedSync", "SIDCo", "RandomK", "Threshold"]
