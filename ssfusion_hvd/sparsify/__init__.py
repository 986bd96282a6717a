"""Sparsifiers: select k elements of a gradient -> (values, indices).

One small interface (GRACE's Compressor, without the communication): a sparsifier is a
callable object ``select(x, k) -> (values, indices)`` over ``x.flatten()``, indices in
ascending order, values with sign. Error feedback (residual memory) composes on top.
"""
from .topk import TopK

SPARSIFIERS = {cls.name: cls for cls in (TopK,)}

__all__ = ["SPARSIFIERS", "TopK"]
