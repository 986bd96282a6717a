"""Collectives on packed buffers: fusion-buffer layout, wire records, encode/decode."""
from .buffers import DensePart, GroupBuffers, SparsePart, build_group

__all__ = ["DensePart", "GroupBuffers", "SparsePart", "build_group"]
