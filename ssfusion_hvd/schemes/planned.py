"""The engine of every planned sparse scheme (per-tensor, multi-tensor, SSFusion family).

A planned scheme runs in two phases (SSFusion §IV-B, "online profiling"):

1. **Warm-up**: the first ``warmup_steps`` iterations synchronize densely (exactly the
   ``dense`` scheme) while a :class:`~ssfusion_hvd.profile.BackwardTimer` records when each
   gradient becomes ready. Then the cost model is measured (collective probes, sparsifier
   timings; or read from a JSON profile), rank 0 builds the plan of this scheme
   (``ssfusion_hvd.plan.build_plan``) and broadcasts it: every rank submits the same
   collectives in the same order. A plan given as ``plan=`` skips the warm-up.
2. **Planned**: buffers are allocated once for the plan (``ssfusion_hvd.comm.buffers``).
   When the last tensor of a group is ready its fusion buffers are encoded (dense part
   packed; sparse parts error-compensated, selected, packed) and its collectives submitted
   at once from the backward hook — the allreduce part and the allgather buffer, group
   after group, interleaved (SSFusion-I) — so communication overlaps the rest of backward.
   Offloaded tensors (SSFusion-O) are handed to a CPU worker thread as soon as *they* are
   ready; the selection kernels release the GIL, so it runs beside backward, and the
   worker submits the group's allgather once its selections are packed (FIFO, so groups
   keep plan order). ``finish()`` waits in plan order, decodes (sum of dense chunks,
   scatter-add of sparse records), scales by ``op`` and copies into ``p.grad``.

Scaling follows Horovod: the sender multiplies by ``1 / gradient_predivide_factor`` and
the receiver by ``factor / P`` for Average (1 for Sum); the allreduce part leaves both to
Horovod's own pre/postscale.
"""
from __future__ import annotations

import sys
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Optional

import torch

from .. import profile as _profile
from ..comm.buffers import DensePart, GroupBuffers, SparsePart, _views, build_group
from ..plan import CostModel, Plan, build_plan
from ..sparsify import make_sparsifier
from ..core.transport import Transport
from .base import Scheme, SyncConfig
from .dense import DenseScheme

__all__ = ["PlannedScheme"]

_SPARSE_DTYPES = (torch.float32, torch.float16)


def _load(obj, cls):
    return cls.load(obj) if isinstance(obj, (str, bytes)) or hasattr(obj, "__fspath__") else obj


class PlannedScheme(Scheme):
    """Base of the planned schemes; a subclass names its planner (``plan.build_plan``)."""

    name = "planned"
    planner = ""  # scheme name understood by ssfusion_hvd.plan.build_plan

    def __init__(self, config: SyncConfig):
        super().__init__(config)
        self.transport = Transport(config, "ssf")
        self._trainable = [p for p in config.order if p.requires_grad]
        self._by_name = {config.names[p]: p for p in self._trainable}
        dev = {p.device for p in self._trainable}
        self._device = next(iter(dev)) if len(dev) == 1 else torch.device("cpu")
        self._nranks = config.process_set.size()
        self._rank = config.process_set.rank()
        self._prescale, self._ag_postscale = self.transport.scales()
        if any(p.dtype == torch.bfloat16 for p in self._trainable):
            # fail at construction, not in the first collective of the warm-up
            raise ValueError(f"scheme {self.name!r}: Horovod 0.28.1 cannot allreduce or "
                             "allgather bfloat16 tensors; train in float32 or float16, or use "
                             "scheme='zen' (it sends bfloat16 values as raw bytes)")
        self._dense = DenseScheme(config)  # the warm-up phase
        self._timer = _profile.BackwardTimer(device=self._device)
        self._memory = None  # residuals and the recipe's local state: created with the plan
        self._iteration = 0
        self.plan: Optional[Plan] = None  # at the target density
        self._active: Optional[Plan] = None  # the plan in force (density warm-up stage)
        self._stage: Optional[int] = None
        self._sparse_set = self._last_sparse = frozenset()
        self._sparsifiers: Dict[str, object] = {}
        self.cost: Optional[CostModel] = None
        self._worker: Optional[ThreadPoolExecutor] = None
        self._side_stream = None
        self._groups: List[GroupBuffers] = []
        self._stats: dict = {}
        self.reset()
        if config.plan is not None:
            plan = _load(config.plan, Plan)
            text = self.transport.broadcast_object(plan.to_json(), "plan")
            self._adopt(Plan.from_json(text))

    # ------------------------------------------------------------------ plan
    def _adopt(self, plan: Plan) -> None:
        """Allocates the buffers of ``plan`` (once per plan)."""
        missing = sorted(set(self._by_name) - set(plan.names))
        unknown = sorted(set(plan.names) - set(self._by_name))
        if missing or unknown:
            raise ValueError(f"plan does not match the model: parameters not in the plan "
                             f"{missing[:5]}, plan tensors not in the model {unknown[:5]}")
        params = [self._by_name[n] for n in plan.names]
        for p, n in zip(params, plan.sizes):
            if p.numel() != n:
                raise ValueError(f"plan says {self.config.names[p]!r} has {n} elements, "
                                 f"the model has {p.numel()}")
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ValueError(f"scheme {self.name!r} needs every gradient in one dtype on one "
                             f"device, got {sorted(map(str, kinds))}; use scheme='dense'")
        dtype, device = next(iter(kinds))
        if dtype not in _SPARSE_DTYPES:
            raise ValueError(f"scheme {self.name!r} supports float32 and float16 "
                             f"gradients, got {dtype}; use scheme='dense'")
        self.plan = plan
        self._plan_crc = zlib.crc32(plan.to_json().encode())
        self._params = params
        self._pos = {p: i for i, p in enumerate(params)}
        self._group_of = plan.group_of()
        self._sparse_set = frozenset(p for p, sp in zip(params, plan.sparse) if sp)
        self._sparsifiers = {}
        self._memory = self.config.recipe.make_memory(dtype)
        self._primed = False
        self._wire = (dtype, device)
        self._stage = None
        self._enter_stage()
        if self.config.log_plan and self._rank == 0:
            print(plan.table(), file=sys.stderr, flush=True)

    def _enter_stage(self) -> None:
        """Buffers for the density in force at the coming step (density warm-up,
        ``ssfusion_hvd/recipe.py``): allocated once per stage, same parts and keys in
        every stage, so residuals and the local rule's state carry over."""
        recipe = self.config.recipe
        stage = recipe.stage(self._iteration)
        if stage == self._stage:
            return
        self._stage = stage
        self._active = active = self.plan.at_density(recipe.stage_density(stage))
        self._memory.rule.density = active.density  # the local rule's "auto" masking reads it
        dtype, device = self._wire
        offload = any(active.offload)
        shapes = [p.shape for p in self._params]
        self._groups = [build_group(gi, active, shapes, dtype, device, self._new_sparsifier,
                                    offload_device=torch.device("cpu") if offload else None,
                                    acc_dtype=self._memory.acc_dtype(dtype))
                        for gi in range(len(active.groups))]
        for gb in self._groups:
            for part in gb.parts:
                if isinstance(part, SparsePart):
                    self._memory.register(part.key, [active.names[i] for i in part.tensors],
                                          [shapes[i] for i in part.tensors], part.stage.device)
        self._offload_part = {part.tensors[0]: part for gb in self._groups for part in gb.offloaded}
        if offload and self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ssf-offload")
        if offload and device.type == "cuda" and self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=device)
        self.reset()

    def _new_sparsifier(self, part_key: str, i: Optional[int]):
        key = part_key if i is None else self.plan.names[i]
        if key in self._sparsifiers:  # one instance per tensor or buffer for the whole run
            return self._sparsifiers[key]
        kwargs = {"seed": zlib.crc32(key.encode())} if self.config.sparsifier == "randomk" else {}
        s = make_sparsifier(self.config.sparsifier, **kwargs)
        self._sparsifiers[key] = s
        return s

    def _make_plan(self) -> None:
        """End of warm-up: measure, plan on rank 0, broadcast (all ranks call this together)."""
        cfg = self.config
        order = self._timer.order()
        seen = set(order)
        order += [p for p in self._trainable if p not in seen]  # never ready: unused layers
        sizes = [p.numel() for p in order]
        backward_s = self._timer.backward_times(order)
        es = order[0].element_size() if order else 4
        self.cost = _profile.measure_cost_model(
            backward_s, cfg.sparsifier, cfg.process_set, device=self._device.type,
            element_size=es, density=cfg.density, profile=cfg.profile)
        text = None
        if self._rank == 0:
            text = build_plan(self.planner, sizes, self.cost, cfg.density,
                              names=[cfg.names[p] for p in order],
                              sparsifier=cfg.sparsifier).to_json()
        text = self.transport.broadcast_object(text, "plan")
        self._adopt(Plan.from_json(text))

    # ------------------------------------------------------------------ submit
    def sparsifies(self, p: torch.Tensor) -> bool:
        return p in self._sparse_set

    def sparse_params(self) -> frozenset:
        return self._last_sparse

    def _grad(self, i: int) -> torch.Tensor:
        p = self._params[i]
        if p.grad.is_sparse:  # sparse schemes send sparse gradients densely
            p.grad = p.grad.to_dense()
        return p.grad

    def submit(self, p: torch.Tensor) -> None:
        if self.plan is None:
            self._timer.mark(p)
            self._dense.submit(p)
            return
        if self._t_first is None:
            self._t_first = time.perf_counter()
            if not self._primed:
                # the local rules take over the wrapped optimizer's state here, on this
                # thread, after its last dense step (not on the offload worker)
                for gb in self._groups:
                    for part in gb.parts:
                        if isinstance(part, SparsePart):
                            self._memory.prime(part.key, part.stage)
                self._primed = True
        i = self._pos[p]
        if i in self._offload_part:
            self._start_offload(self._offload_part[i], self._grad(i))
        gi = self._group_of[i]
        self._ready[gi] += 1
        if self._ready[gi] == len(self._groups[gi].tensors):
            self._launch(self._groups[gi])

    def _launch(self, gb: GroupBuffers) -> None:
        cfg = self.config
        t0 = time.perf_counter()
        ar = None
        if gb.allreduce:
            torch.cat([self._grad(i).reshape(-1) for i in gb.allreduce], out=gb.ar_buf)
            compressed, ctx = cfg.compression.compress(gb.ar_buf)
            pre, post = self.transport.horovod_scales()
            ar = (self.transport.allreduce(compressed, f"{gb.index}.ar", prescale=pre,
                                           postscale=post), ctx)
        for part in gb.parts:
            if isinstance(part, DensePart):
                part.encode([self._grad(i) for i in part.tensors], gb.send, self._prescale)
            elif part not in gb.offloaded:
                part.stage_grads([self._grad(i) for i in part.tensors])
                result = part.select(self._memory)
                part.pack(result, gb.send, self._prescale)
                self._results[part.key] = result
        self._sparsify_s += time.perf_counter() - t0
        if gb.offloaded:  # the worker packs its selections, then submits (FIFO: plan order)
            ag = self._worker.submit(self._submit_offloaded_group, gb)
        else:
            ag = self._allgather(gb)
        self._pending[gb.index] = (ar, ag)

    def _allgather(self, gb: GroupBuffers):
        if gb.send is None:
            return None
        return self.transport.allgather(gb.send, f"{gb.index}.ag")

    # ------------------------------------------------------------------ offload (SSFusion-O)
    def _start_offload(self, part: SparsePart, grad: torch.Tensor) -> None:
        copied = None
        if grad.is_cuda:  # pinned host staging, non-blocking copy on a side stream
            ready = torch.cuda.Event()
            ready.record()
            with torch.cuda.stream(self._side_stream):
                self._side_stream.wait_event(ready)
                part.stage.copy_(grad.reshape(-1), non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self._side_stream)
        self._offload_jobs[part.key] = self._worker.submit(self._offload_select, part, grad, copied)

    def _offload_select(self, part: SparsePart, grad: torch.Tensor, copied):
        t0 = time.perf_counter()
        if copied is not None:
            copied.self.transport.wait()
        else:
            part.stage_grads([grad])
        result = part.select(self._memory)  # the kernels release the GIL
        self._offload_s += time.perf_counter() - t0
        return result

    def _submit_offloaded_group(self, gb: GroupBuffers):
        for part in gb.offloaded:
            result = self._offload_jobs.pop(part.key).result()
            part.pack(result, gb.send, self._prescale)
            self._results[part.key] = result
        if gb.send.is_cuda:
            torch.cuda.current_stream(gb.send.device).self.transport.wait()
        return self._allgather(gb)

    # ------------------------------------------------------------------ finish
    def finish(self) -> None:
        if self.plan is None:
            self._dense.finish()
            self._timer.end_iteration()
            self._iteration += 1
            self._last_sparse = frozenset()
            self._stats = self._dense.stats()
            self._stats.update(phase="warmup", iteration=self._iteration, density_target=1.0)
            if self._iteration >= self.config.warmup_steps:
                self._make_plan()
            return
        t_wait = time.perf_counter()
        cfg = self.config
        nonfinite = []
        for gb in self._groups:
            ar, ag = self._pending[gb.index]
            if isinstance(ag, Future):
                ag = ag.result()
            if ar is not None:
                out = cfg.compression.decompress(self.transport.wait(ar[0]), ar[1])
                views = gb.ar_views if out is gb.ar_buf else _views(
                    out, [self._params[i].shape for i in gb.allreduce])
                torch._foreach_copy_([self._params[i].grad for i in gb.allreduce], views)
                nonfinite.append(out)
            if ag is not None:
                gathered = self.transport.wait(ag)
                nranks = gathered.numel() // gb.record_len
                for part in gb.parts:
                    out = part.decode(gathered, nranks, gb.record_len)
                    if self._ag_postscale != 1.0:
                        out.mul_(self._ag_postscale)
                    torch._foreach_copy_([self._params[i].grad for i in part.tensors],
                                         part.out_views)
                    nonfinite.append(out)
        t_end = time.perf_counter()
        self._iteration += 1
        self._last_sparse = self._sparse_set
        self._record_stats(nonfinite, t_wait, t_end)
        self.reset()
        self._enter_stage()

    def _record_stats(self, outputs, t_wait: float, t_end: float) -> None:
        plan = self.plan
        sent = sum(n for n, s in zip(plan.sizes, plan.sparse) if not s)
        missing = []
        for gb in self._groups:
            for part in gb.parts:
                if isinstance(part, SparsePart):
                    result = self._results[part.key]
                    sent += result.values.numel()
                    missing.append(part.missing(result))
        elements = sum(plan.sizes)
        self._stats = {
            "phase": "planned", "iteration": self._iteration,
            "allreduce_bytes": self.transport.sent["allreduce"],
            "allgather_bytes": self.transport.sent["allgather"],
            "tensors_dense": sum(1 for s in plan.sparse if not s),
            "tensors_sparse": sum(1 for s in plan.sparse if s),
            "elements": elements, "elements_sent": sent, "density": sent / max(elements, 1),
            "density_target": self._active.density,
            "tensors_missing": missing,  # resolved lazily by stats()
            # counted by stats(), not here: a full pass over every output is too costly per
            # step, and the outputs are this plan's buffers, unchanged until the next finish()
            "nonfinite": list(outputs),
            "sparsify_s": self._sparsify_s, "offload_s": self._offload_s,
            "communicate_s": t_end - (self._t_first if self._t_first is not None else t_wait),
            "wait_s": t_end - t_wait,
        }

    def stats(self) -> dict:
        st = self._stats
        if isinstance(st.get("tensors_missing"), list):
            st["tensors_missing"] = int(sum(int(v) for v in st["tensors_missing"]))
        if isinstance(st.get("nonfinite"), list):
            st["nonfinite"] = int(sum(int(torch.isfinite(o).logical_not_().sum())
                                      for o in st["nonfinite"]))
        return dict(st)

    def pending(self) -> bool:
        return self._dense.pending() or any(self._ready) or bool(self._pending)

    def reset(self) -> None:
        self._dense.reset()
        self._ready = [0] * len(self._groups)
        self._pending: Dict[int, tuple] = {}
        self._results: Dict[str, object] = {}
        self._offload_jobs: Dict[str, Future] = {}
        self._t_first = None
        self._sparsify_s = self._offload_s = 0.0
        self.transport.reset_counters()

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The plan, the iteration count, residuals and the recipe's local state per
        parameter name, and sparsifier state. Residuals differ per rank: every rank saves
        its own."""
        state = {"iteration": self._iteration,
                 "plan": None if self.plan is None else self.plan.to_json(),
                 "sparsifiers": {k: s.state_dict() for k, s in self._sparsifiers.items()
                                 if s.state_dict()}}
        if self._memory is not None:
            state.update(self._memory.named_state())
        else:
            state["residuals"] = {}
        return state

    def signature(self):
        return (self._iteration, 0 if self.plan is None else self._plan_crc)

    def shared_state(self) -> dict:
        return {"iteration": self._iteration,
                "plan": None if self.plan is None else self.plan.to_json(),
                "sparsifiers": {k: s.state_dict() for k, s in self._sparsifiers.items()
                                if s.state_dict()}}

    def adopt_shared(self, shared: dict, keep_local: bool, all_keep: bool) -> None:
        if not keep_local:  # the root's plan and step; residuals and rule state from zero
            self.reset()
            self.load_state_dict(dict(shared, residuals={}))

    def load_state_dict(self, state: dict) -> None:
        self._iteration = int(state["iteration"])
        if state["plan"] is None:
            self.plan = self._active = None
            self._memory = None
            self._sparse_set = self._last_sparse = frozenset()
            self._timer = _profile.BackwardTimer(device=self._device)
            return
        self._adopt(Plan.from_json(state["plan"]))
        self._memory.load_named_state(state, self._device)
        for key, s in state["sparsifiers"].items():
            self._sparsifiers[key].load_state_dict(s)
