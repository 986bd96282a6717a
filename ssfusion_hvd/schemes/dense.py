"""Dense synchronization: exactly what ``hvd.DistributedOptimizer`` does.

Each gradient is allreduced asynchronously as soon as it is ready (one Horovod op per
tensor, which Horovod's background thread re-fuses up to ``HOROVOD_FUSION_THRESHOLD``), or,
with ``groups``, one grouped allreduce per explicit group once all its members are ready.
Compression, ``op``, ``gradient_predivide_factor`` (pre/post scaling), sparse gradients and
``sparse_as_dense`` keep Horovod's meaning. This is the baseline of every comparison.
"""
from __future__ import annotations

import time
from typing import Dict, List, Tuple

import torch
from horovod.common.util import split_list
from horovod.torch.mpi_ops import (Average, allreduce_async_, grouped_allreduce_async_,
                                   sparse_allreduce_async, synchronize)

from .base import Scheme, SyncConfig


class DenseScheme(Scheme):
    name = "dense"

    def __init__(self, config: SyncConfig):
        super().__init__(config)
        self._handles: Dict[object, Tuple[object, object]] = {}  # param or group tuple -> (handle, ctx)
        self._stats: dict = {}
        self._t_first = None
        self._bytes = self._elements = self._tensors = 0
        self._group_of: Dict[torch.Tensor, Tuple[torch.Tensor, ...]] = {}
        self._ready_in_group: Dict[Tuple[torch.Tensor, ...], int] = {}
        if config.groups is not None:
            self._build_groups(config)
        if config.op == Average:
            # Horovod splits the average across the sum; the backend divides by size.
            self._prescale = 1.0 / config.gradient_predivide_factor
            self._postscale = config.gradient_predivide_factor
        else:
            self._prescale = self._postscale = 1.0

    def _build_groups(self, config: SyncConfig) -> None:
        trainable = [p for p in config.declared if p.requires_grad]  # Horovod's order
        if isinstance(config.groups, list):
            members = {id(p) for p in trainable}
            groups: List[Tuple[torch.Tensor, ...]] = []
            placed = set()
            for g in config.groups:
                # keep the user's grouping, in canonical order, of trainable params only
                g = tuple(sorted((p for p in g if id(p) in members), key=config.index.__getitem__))
                if g:
                    groups.append(g)
                    placed.update(id(p) for p in g)
            groups += [(p,) for p in trainable if id(p) not in placed]
        else:
            groups = [tuple(g) for g in split_list(trainable, config.groups)]
        for g in groups:
            self._ready_in_group[g] = 0
            for p in g:
                self._group_of[p] = g

    def _op_name(self, p: torch.Tensor) -> str:
        return f"ssf.dense.{self.config.index[p]}"

    def _allreduce(self, p: torch.Tensor):
        cfg = self.config
        tensor = p.grad
        self._count(tensor)
        if tensor.is_sparse:
            if not cfg.sparse_as_dense:
                return sparse_allreduce_async(tensor, name=self._op_name(p), op=cfg.op,
                                              process_set=cfg.process_set), None
            tensor = tensor.to_dense()
        compressed, ctx = cfg.compression.compress(tensor)
        handle = allreduce_async_(compressed, name=self._op_name(p), op=cfg.op,
                                  prescale_factor=self._prescale,
                                  postscale_factor=self._postscale,
                                  process_set=cfg.process_set)
        return handle, ctx

    def submit(self, p: torch.Tensor) -> None:
        group = self._group_of.get(p)
        if group is None:
            self._handles[p] = self._allreduce(p)
            return
        self._ready_in_group[group] += 1
        if self._ready_in_group[group] == len(group):
            cfg = self.config
            for q in group:
                self._count(q.grad)
            compressed, ctxs = zip(*[cfg.compression.compress(q.grad) for q in group])
            handle = grouped_allreduce_async_(list(compressed), name=self._op_name(group[0]),
                                              op=cfg.op, process_set=cfg.process_set)
            self._handles[group] = (handle, ctxs)
            self._ready_in_group[group] = 0

    def _count(self, grad: torch.Tensor) -> None:
        if self._t_first is None:
            self._t_first = time.perf_counter()
        n = grad._nnz() if grad.is_sparse else grad.numel()
        self._elements += n
        self._tensors += 1
        self._bytes += n * grad.element_size()

    def finish(self) -> None:
        cfg = self.config
        t_wait = time.perf_counter()
        for key, (handle, ctx) in self._handles.items():
            if isinstance(key, tuple):
                for q, out, c in zip(key, synchronize(handle), ctx):
                    q.grad.set_(cfg.compression.decompress(out, c))
                continue
            out = synchronize(handle) if not callable(handle) else handle()
            if key.grad.is_sparse:
                agg = cfg.compression.decompress(out, ctx)
                key.grad.zero_().add_(agg if agg.is_sparse else agg.to_sparse())
            else:
                key.grad.set_(cfg.compression.decompress(out, ctx))
        t_end = time.perf_counter()
        self._stats = {
            "phase": "dense", "allreduce_bytes": self._bytes, "allgather_bytes": 0,
            "tensors_dense": self._tensors, "tensors_sparse": 0, "elements": self._elements,
            "elements_sent": self._elements, "density": 1.0, "density_target": 1.0,
            "tensors_missing": 0,
            "sparsify_s": 0.0, "offload_s": 0.0,
            "communicate_s": t_end - (self._t_first or t_wait), "wait_s": t_end - t_wait}
        self.reset()

    def stats(self) -> dict:
        return dict(self._stats)

    def pending(self) -> bool:
        return bool(self._handles) or any(self._ready_in_group.values())

    def reset(self) -> None:
        self._t_first = None
        self._bytes = self._elements = self._tensors = 0
        self._handles.clear()
        for g in self._ready_in_group:
            self._ready_in_group[g] = 0
