"""ZEN's hierarchical hashing (``csrc/hash.h``, ``csrc/cpu/hash.cpp``, ``csrc/cuda/hash.cu``): owners and the deterministic partition of
selected indices over the ranks."""
from __future__ import annotations

from typing import Optional

import torch

from .dispatch import _native


#
# The hash functions of csrc/hash.h, on int64 tensors: arithmetic wraps mod 2^64 like the
# C++ uint64_t, ">>" is made logical by masking, constants are their signed 64-bit images.

_M64 = (1 << 64) - 1
_I64_MAX = (1 << 63) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53
_MAX_RANGE = 2**31 - 1
_MAX_ROUNDS = 64


def _signed64(u: int) -> int:
    u &= _M64
    return u - (1 << 64) if u >> 63 else u


def _fmix64_int(h: int) -> int:
    h &= _M64
    h ^= h >> 33
    h = (h * _MIX1) & _M64
    h ^= h >> 33
    h = (h * _MIX2) & _M64
    return h ^ (h >> 33)


def hash_seed(seed: int, i: int) -> int:
    """Seed of hash function ``i`` (0: the partition hash h_0), as an unsigned 64-bit int."""
    return _fmix64_int((int(seed) + (i + 1) * _GOLDEN) & _M64)


def _fmix64(h: torch.Tensor) -> torch.Tensor:
    h = h ^ ((h >> 33) & 0x7FFFFFFF)
    h = h * _signed64(_MIX1)
    h = h ^ ((h >> 33) & 0x7FFFFFFF)
    h = h * _signed64(_MIX2)
    return h ^ ((h >> 33) & 0x7FFFFFFF)


def _hash_to(keys: torch.Tensor, s: int, m: int) -> torch.Tensor:
    """h(keys) reduced to [0, m) by the high 32 bits (csrc/hash.h)."""
    h = _fmix64(keys ^ _signed64(s))
    return (((h >> 32) & 0xFFFFFFFF) * m) >> 32


def _check_hash(indices: torch.Tensor, nparts: int, table_size: int, rounds: int, op: str) -> None:
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"{op}: expected a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype not in (torch.int32, torch.int64) or indices.dim() != 1:
        raise TypeError(f"{op}: indices must be a 1-D int32 or int64 tensor, got "
                        f"{tuple(indices.shape)} {indices.dtype}")
    for name, v, lo, hi in (("nparts", nparts, 1, _MAX_RANGE),
                            ("table_size", table_size, 1, _MAX_RANGE),
                            ("rounds", rounds, 0, _MAX_ROUNDS)):
        if not lo <= v <= hi:
            raise ValueError(f"{op}: {name}={v} out of range [{lo}, {hi}]")


def default_table_size(m: int, nparts: int) -> int:
    """Slots of each partition's parallel memory when not given: twice the mean load."""
    return min(_MAX_RANGE, max(1, 2 * -(-int(m) // int(nparts))))


def hash_owner(indices: torch.Tensor, nparts: int, seed: int, *,
               backend: Optional[str] = None) -> torch.Tensor:
    """h_0 of every index (int32): the partition :func:`hash_partition` puts it in. The index
    sets ``{i : h_0(i) = p}`` are what ZEN's hash bitmap (§3.3, Algorithm 2) is laid over."""
    nparts = int(nparts)
    _check_hash(indices, nparts, 1, 0, "hash_owner")
    seed = int(seed) & _M64
    fn = _native(indices, "hash_owner", backend)
    if fn is not None:
        return fn(indices.contiguous(), nparts, _signed64(seed))
    return _hash_to(indices.long(), hash_seed(seed, 0), nparts).to(torch.int32)


def hash_partition(indices: torch.Tensor, nparts: int, seed: int, *,
                   table_size: Optional[int] = None, rounds: int = 3,
                   backend: Optional[str] = None):
    """ZEN's hierarchical hashing (OSDI'25 §3.2, Algorithm 1): groups the (non-zero) indices
    of a gradient into ``nparts`` balanced partitions, losing none.

    Index ``j`` goes to partition ``h_0(indices[j])`` (the first level: the same ``seed``
    gives the same partition on every rank, so an index from any rank meets its copies at
    one owner). Each partition has a *parallel memory* of ``table_size`` slots (default
    :func:`default_table_size`: twice the mean load) and a *serial memory* without bound.
    ``rounds`` second-level hash functions ``h_1..h_rounds`` are tried in turn: in round i
    every index not yet placed tries slot ``h_i(indices[j])``; a slot that is empty at the
    start of the round goes to the lowest ``j`` trying it (the paper's read-after-write
    collision check, made deterministic so CPU, CUDA and this fallback agree bit for bit),
    the others stay pending. What is still pending after the last round is appended to its
    partition's serial memory in input order (the paper's atomic counter), so nothing is
    lost however small the table. Hash functions: ``csrc/hash.h`` (MurmurHash3's fmix64 with
    per-function seeds derived from ``seed``).

    Returns ``(order, counts, overflow)``, all int64:

    * ``order[m]``: positions into ``indices`` grouped by partition 0..nparts-1; inside
      partition p the occupied slots of its parallel memory in slot order, then its serial
      memory. ``indices[order]`` / ``values[order]`` is what goes to each owner;
    * ``counts[nparts]``: entries per partition (the alltoall splits);
    * ``overflow[nparts]``: entries that went to each partition's serial memory.

    Duplicate indices are each placed (in the same partition).
    """
    nparts, rounds = int(nparts), int(rounds)
    _check_hash(indices, nparts, 1, rounds, "hash_partition")
    if table_size is None:
        table_size = default_table_size(indices.numel(), nparts)
    table_size = int(table_size)
    _check_hash(indices, nparts, table_size, rounds, "hash_partition")
    seed = int(seed) & _M64
    fn = _native(indices, "hash_partition", backend)
    if fn is not None:
        return fn(indices.contiguous(), nparts, _signed64(seed), table_size, rounds)
    dev, m = indices.device, indices.numel()
    keys = indices.long()
    part = _hash_to(keys, hash_seed(seed, 0), nparts)
    table = torch.full((nparts * table_size,), -1, dtype=torch.int64, device=dev)
    pending = torch.arange(m, dtype=torch.int64, device=dev)
    for r in range(1, rounds + 1):  # a loop over the hash functions, not over indices
        if pending.numel() == 0:
            break
        slot = part[pending] * table_size + _hash_to(keys[pending], hash_seed(seed, r), table_size)
        free = table[slot] < 0
        bids = torch.full_like(table, m).scatter_reduce_(0, slot[free], pending[free], "amin")
        won = free & (bids[slot] == pending)
        table[slot[won]] = pending[won]
        pending = pending[~won]
    occupied = (table >= 0).nonzero().flatten()  # (partition, slot) order
    key = torch.cat([(occupied // table_size) * 2, part[pending] * 2 + 1])
    order = torch.cat([table[occupied], pending])[torch.sort(key, stable=True).indices]
    counts = torch.bincount(part, minlength=nparts)
    overflow = torch.bincount(part[pending], minlength=nparts)
    return order, counts, overflow
