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
from ..core.stats import StepStats
from ..core.transport import Transport, split_list
from .base import Scheme, SyncConfig


class DenseScheme(Scheme):
    name = "dense"
    stateful = False  # Horovod's allreduce: nothing carries over from step to step

    def __init__(self, config: SyncConfig):
        super().__init__(config)
        self._handles: Dict[object, Tuple[object, object]] = {}  # param or group tuple -> (handle, ctx)
        self.transport = Transport(config, "ssf.dense", counted=False)
        self._t_first = None
        self._elements = self._tensors = 0
        self._group_of: Dict[torch.Tensor, Tuple[torch.Tensor, ...]] = {}
        self._ready_in_group: Dict[Tuple[torch.Tensor, ...], int] = {}
        if config.groups is not None:
            self._build_groups(config)
        # Horovod splits the average across the sum; the backend divides by the size
        self._prescale, self._postscale = self.transport.horovod_scales()

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

    def _op_name(self, p: torch.Tensor) -> int:
        return self.config.index[p]

    def _allreduce(self, p: torch.Tensor):
        cfg = self.config
        tensor = p.grad
        self._count(tensor)
        if tensor.is_sparse:
            if not cfg.sparse_as_dense:
                return self.transport.sparse_allreduce(tensor, self._op_name(p)), None
            tensor = tensor.to_dense()
        compressed, ctx = cfg.compression.compress(tensor)
        handle = self.transport.allreduce(compressed, self._op_name(p), prescale=self._prescale,
                                          postscale=self._postscale)
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
            handle = self.transport.grouped_allreduce(compressed, self._op_name(group[0]))
            self._handles[group] = (handle, ctxs)
            self._ready_in_group[group] = 0

    def _count(self, grad: torch.Tensor) -> None:
        if self._t_first is None:
            self._t_first = time.perf_counter()
        self._elements += grad._nnz() if grad.is_sparse else grad.numel()
        self._tensors += 1

    def finish(self) -> None:
        cfg = self.config
        t_wait = time.perf_counter()
        for key, (handle, ctx) in self._handles.items():
            if isinstance(key, tuple):
                for q, out, c in zip(key, self.transport.wait(handle), ctx):
                    q.grad.set_(cfg.compression.decompress(out, c))
                continue
            out = self.transport.wait(handle) if not callable(handle) else handle()
            if key.grad.is_sparse:
                agg = cfg.compression.decompress(out, ctx)
                key.grad.zero_().add_(agg if agg.is_sparse else agg.to_sparse())
            else:
                key.grad.set_(cfg.compression.decompress(out, ctx))
        t_end = time.perf_counter()
        self.last_stats = StepStats(
            phase="dense", allreduce_bytes=self.transport.sent["allreduce"],
            tensors_dense=self._tensors, elements=self._elements,
            elements_sent=self._elements).timed(self._t_first, t_wait, t_end)
        self.reset()

    def pending(self) -> bool:
        return bool(self._handles) or any(self._ready_in_group.values())

    def reset(self) -> None:
        self._t_first = None
        self._elements = self._tensors = 0
        self.transport.reset_counters()
        self._handles.clear()
        for g in self._ready_in_group:
            self._ready_in_group[g] = 0
