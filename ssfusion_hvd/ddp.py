"""``ssfusion_hvd.ddp``: the sparse engine as a ``DistributedDataParallel`` communication
hook, for jobs on ``torch.distributed`` rather than Horovod.

    from torch.nn.parallel import DistributedDataParallel as DDP
    import ssfusion_hvd.ddp

    model = DDP(model)
    hook = ssfusion_hvd.ddp.register(model, scheme="ssfusion", density=0.01, optimizer=opt)
    ...
    torch.save({"model": ..., "optimizer": ..., "hook": hook.state_dict()}, path)

Each DDP bucket is a fusion group. Its gradients go through the same code as a planned
Horovod scheme's sparse part (``core/sparse_part.py``): error feedback fused with the
selection (``ResidualMemory``, the kernels of ``kernels/``), the same record format, the
same decode; only the collective is ``torch.distributed``'s allgather instead of Horovod's.
The hook returns the bucket's average over the ranks, which DDP writes into ``p.grad``.

Schemes, by how a bucket's budget (``density`` of its elements) is spent:

* ``"per_tensor"``: every tensor its own top-k (one segmented kernel call per bucket);
* ``"multi_tensor"``: one top-k over the whole bucket (tensors may send nothing);
* ``"ssfusion"``: the bucket's budget shared by magnitude, every tensor keeping at least
  one element (SSFusion's group budget, the Horovod engine's default);
* ``"dense"``: DDP's own average, for comparisons.

Residuals are kept per bucket and saved per parameter. DDP rebuilds its buckets once,
after its first iteration (and a resumed job's DDP does so again): when a bucket of new
tensors arrives, every residual is split by parameter and each new bucket takes its
tensors' residuals, so nothing is lost and nothing depends on how DDP groups them.

**The recipe's optimizer side.** Given ``optimizer=``, the hook applies the Horovod
optimizer's training recipe with shared moments (``docs/recipe.md``): coupled weight decay
is folded into each gradient before its error feedback, and ``optimizer.step`` is wrapped
so that the sparsified tensors take the shared-moments step (each element's momentum or
Adam moments moved by the synchronized gradient with its age, exactly SGD / Adam at
density 1; ``recipe.step_dense_only``, ``moments.SharedMoments``), the wrapped step
moving only what the hook sent dense. Without ``optimizer=`` it is plain error feedback.

**Mixed precision** (``grad_scaler=``): residuals in unscaled units, and a step the scaler
skips (any rank's overflow: each record carries a finite-or-NaN flag) undone.

**The planner** (``plan=``): :func:`make_plan` runs the Horovod engine's planner on the
model's gradient tensors and a cost model: Cupcake's optimal fusion gives DDP its buckets
(:func:`ddp_kwargs`: one size cap per bucket, ``bucket_cap_mb_list``), and for
``"ssfusion"`` SSFusion's selective sparsification (Eq. 2) and allreduce/allgather split
decide which tensors of a bucket go dense, by allreduce, while the rest are selected and
allgathered, with the densities compensated for the bytes the dense ones add.

Not yet here (docs/ddp.md): ``moments="local"``, the offload worker.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import math
import warnings
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .core.layout import views
from .core.sparse_part import SparsePart
from .plan import CostModel, Plan, build_plan, default_backward_times, optimal_fusion
from .plan.cost import nominal_k
from .plan.selective import DEFAULT_ACCURACY_SLACK
from .recipe import DEFAULT_WARMUP_STEPS, Recipe, resolve_recipe, warmup_length
from .sparsify import SPARSIFIERS, ResidualMemory, make_sparsifier
from .moments import SELECT_BY_CHOICES, selection_key

__all__ = ["SCHEMES", "SparseHook", "ddp_kwargs", "make_plan", "measure_cost", "register"]

#: scheme -> the sparse part's selection mode (``core/sparse_part.py``); None: dense
SCHEMES = {"dense": None, "per_tensor": "segmented", "multi_tensor": "buffer", "ssfusion": "group"}
#: every rank's record back to back in one tensor (torch 2.13 renamed the call; the old
#: name is what earlier versions have)
_ALLGATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
#: the floating dtypes a sparse bucket may hold (the wire's)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


#: a gloo allgather of CPU tensors larger than this per rank goes as pieces of at most this
#: size, all in flight at once: over gloo one large allgather message moves at about half a
#: slow link's rate, pieces of 1 MiB or less at its rate (a 10 MB allgather at 1 Gbit/s:
#: 126 ms as one message, 85 ms as 16; docs/results/collectives_probe.md)
ALLGATHER_PIECE_BYTES = 1 << 20


class _Bucket:
    """One bucket at one density: its sparse part and, under a plan that sends some of its
    tensors dense, their allreduce buffer. A record is the part's, then one element: 0, or
    NaN when this rank's gradients in the bucket are not all finite, so every rank learns
    it from the allgather it makes anyway (:class:`_Gather`, in ``pieces``). ``part`` None:
    every tensor of the bucket is dense (the bucket is allreduced as DDP would)."""

    def __init__(self, part: Optional[SparsePart], nranks: int, pieces: int = 1,
                 dense: Tuple[int, ...] = (), shapes=(), buffer: Optional[torch.Tensor] = None):
        self.part = part
        self.pieces = 1
        #: whether the part's selection key was settled (SparseHook: by the pending step)
        self.keyed = False
        #: positions (in the bucket) of the tensors the plan sends dense, and of the others
        self.dense = tuple(dense)
        self.sparse = tuple(i for i in range(len(shapes)) if i not in set(self.dense))
        if self.dense and part is not None:
            # allocated once per bucket and stage: the dense tensors back to back (the
            # allreduce's buffer), and the bucket's average assembled from both parts
            self.dense_buf = torch.zeros(sum(math.prod(shapes[i]) for i in self.dense),
                                         dtype=buffer.dtype, device=buffer.device)
            self.dense_views = views(self.dense_buf, [shapes[i] for i in self.dense])
            self.result = torch.empty_like(buffer)
            out = views(self.result, shapes)
            self.result_dense = [out[i] for i in self.dense]
            self.result_sparse = [out[i] for i in self.sparse]
        if part is None:
            return
        self.record_len = part.length + 1
        self.gather = _Gather(self.record_len, nranks, pieces, part.dtype, part.out.device)
        self.pieces = self.gather.pieces


class _Gather:
    """Every rank's record of ``record_len`` elements, allgathered into :attr:`gathered` in
    rank order. ``pieces`` > 1: as that many equal pieces (the last padded), all in flight,
    which land piece by piece and are put back in rank order once all have arrived."""

    def __init__(self, record_len: int, nranks: int, pieces: int, dtype, device):
        self.nranks, self.record_len = nranks, record_len
        self.pieces = max(1, int(pieces))
        self.piece_len = -(-record_len // self.pieces)
        #: what this rank puts on the wire: the record (:attr:`send`), padded to whole pieces
        self.wire = torch.zeros(self.pieces * self.piece_len, dtype=dtype, device=device)
        self.send = self.wire[:record_len]
        self.gathered = torch.empty(nranks * record_len, dtype=dtype, device=device)
        self._landing = (torch.empty(self.pieces * nranks * self.piece_len, dtype=dtype,
                                     device=device) if self.pieces > 1 else None)

    def start(self, group) -> torch.futures.Future:
        """Launches the allgather of this rank's record; the future is done when
        :attr:`gathered` holds every rank's, in rank order."""
        if self.pieces == 1:
            return _ALLGATHER(self.gathered, self.send, group=group, async_op=True).get_future()
        n, size = self.nranks, self.piece_len
        futures = [_ALLGATHER(self._landing[i * n * size:(i + 1) * n * size],
                              self.wire[i * size:(i + 1) * size], group=group,
                              async_op=True).get_future() for i in range(self.pieces)]

        def in_rank_order(fut):
            for f in fut.value():
                f.wait()  # (raises a piece's error)
            landed = self._landing.view(self.pieces, n, size).transpose(0, 1).reshape(n, -1)
            self.gathered.view(n, self.record_len).copy_(landed[:, :self.record_len])
            return None

        return torch.futures.collect_all(futures).then(in_rank_order)


def _pieces(nbytes: int, device: torch.device, group) -> int:
    """How many pieces a record of ``nbytes`` is allgathered in: gloo on the CPU splits one
    larger than :data:`ALLGATHER_PIECE_BYTES` (NCCL and gloo's CUDA path, which stages
    through the host, take it whole). The same on every rank: it follows the record's size."""
    if device.type != "cpu" or dist.get_backend(group) != "gloo":
        return 1
    return min(64, -(-int(nbytes) // ALLGATHER_PIECE_BYTES))


class SparseHook:
    """The hook's state (``register`` makes one): the residuals of every bucket, the
    synchronized step count, and each bucket's buffers at the density in force.
    ``state_dict()`` / ``load_state_dict()`` carry the residuals (by parameter name) and
    the step, so a resumed job continues exactly; each rank saves and loads its own."""

    def __init__(self, names: Dict[torch.Tensor, str], process_group, scheme: str,
                 sparsifier: str, recipe: Recipe, optimizer=None, grad_scaler=None,
                 plan: Optional[Plan] = None, select_by: str = "auto"):
        self.names = names
        #: the planner's decisions (``make_plan``): which tensors go dense, each one's k
        self.plan = plan
        self._plan_sparse = dict(zip(plan.names, plan.sparse)) if plan is not None else {}
        self._plan_k: Dict[float, Dict[str, int]] = {}  # density -> tensor name -> k
        self.group = process_group
        self.scheme, self.sparsifier = scheme, sparsifier
        #: the density schedule and, with an optimizer, its momentum correction
        self.recipe = recipe
        self.optimizer = optimizer
        #: the exact top-k ranks the pending steps in the optimizer's geometry (Adam under
        #: the shared moments; docs/recipe.md, "Selecting by the step"), not the magnitudes
        #: None (by magnitude), or the key's root (True: by the gain, False: by the step)
        self.key_root = selection_key(select_by)
        #: each sparse entry carries its sender's spread, from which the shared Adam rule's
        #: second moment takes the senders' variance (docs/recipe.md, "The senders'
        #: variance"): under an Adam, decided by its class, as the Horovod engine decides it
        self.spread = recipe.shared is not None and recipe.family == "adam"
        #: per tensor the last synchronized step sparsified under :attr:`spread`, its noise
        #: ratio (``SparsePart.noise``; the wrapped step's shared Adam rule reads it)
        self.noise: Dict[torch.Tensor, torch.Tensor] = {}
        self._noise: Dict[torch.Tensor, torch.Tensor] = {}
        #: the job's GradScaler: residuals kept unscaled, a skipped step undone
        self.scaler = grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() else None
        self._in_step = False  # between a step's first bucket and its last
        # the last step changed the residuals and its optimizer.step has not run (yet): at
        # the next step's first bucket it is undone (GradScaler skipped it)
        self._undo_last = False
        # which param group holds p, by position (load_state_dict replaces the group dicts,
        # never which group a parameter is in; the group is read where it is used)
        self._group_index = ({p: i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
                             if optimizer is not None else {})
        self._sent_sparse: set = set()  # the tensors this step sparsified, so far
        #: the tensors the last synchronized step sparsified (the wrapped step's to move)
        self.sparse_params: frozenset = frozenset()
        self.step = 0
        #: bytes this rank sent in the last synchronized step (allgathered records, or the
        #: allreduced buckets under "dense")
        self.bytes_sent = 0
        self._bytes = 0
        self.memory: Optional[ResidualMemory] = None
        self._keys: Dict[Tuple[str, ...], str] = {}  # a bucket's tensor names -> residual key
        self._owner: Dict[str, str] = {}  # tensor name -> its residual key
        self._buckets: Dict[str, Tuple[float, _Bucket]] = {}  # key -> (density, buffers)
        # a checkpoint's per-name state (residuals; under spread each element's wait and sum
        # of squares), taken as keys appear
        self._loaded: Optional[dict] = None
        self._saved_buckets: set = set()  # the checkpoint's buckets, until DDP's first differ

    # ------------------------------------------------------------------ the hook
    def __call__(self, bucket) -> torch.futures.Future:
        step = self.step
        buffer = bucket.buffer()
        nranks = self.group.size()
        if SCHEMES[self.scheme] is None:
            self._count(bucket, buffer)
            buffer.div_(nranks)
            return (dist.all_reduce(buffer, group=self.group, async_op=True)
                    .get_future().then(lambda fut: fut.value()[0]))
        first = not self._in_step
        if first:  # the step's first bucket: a skipped last step never happened
            self._in_step = True
            if self._undo_last and self.memory is not None:
                self.memory.restore()
            self._undo_last = False
        b = self._bucket(bucket, self.recipe.density_at(step), nranks)
        part = b.part
        if first and self.scaler is not None and self.memory is not None:
            self.memory.checkpoint()
            self._undo_last = True  # unless the wrapped optimizer.step runs
        scale = None
        if self.scaler is not None and getattr(self.scaler, "_scale", None) is not None:
            # the state is kept unscaled: the scale (a power of two: exact) divides the
            # gradients on the way in and multiplies their average on the way out, where
            # GradScaler.unscale_ expects to find it scaled
            scale = self.scaler._scale.detach().clone()
            buffer.mul_(scale.reciprocal().to(buffer.dtype))
        if part is None:  # the plan sends every tensor of this bucket dense
            self._count(bucket, buffer)
            buffer.div_(nranks)

            def averaged(fut):
                out = fut.value()[0]
                return out.mul_(scale.to(out.dtype)) if scale is not None else out

            return (dist.all_reduce(buffer, group=self.group, async_op=True)
                    .get_future().then(averaged))
        grads = bucket.gradients()
        params = bucket.parameters()
        if b.dense:
            grads, dense_grads = [grads[i] for i in b.sparse], [grads[i] for i in b.dense]
            params = [params[i] for i in b.sparse]
        if self.recipe.corrects():
            # the shared rule error-compensates g + wd·w, where SGD/Adam would add the decay:
            # one foreach call per decay in force (a bucket's tensors mostly share one); the
            # tensors sent dense take the optimizer's own step, decay included
            by_decay: Dict[float, Tuple[list, list]] = {}
            for p, g in zip(params, grads):
                wd = self.recipe.coupled_decay(self.optimizer.param_groups[self._group_index[p]])
                if wd:
                    gs, ps = by_decay.setdefault(wd, ([], []))
                    gs.append(g)
                    ps.append(p.detach())
            for wd, (gs, ps) in by_decay.items():
                torch._foreach_add_(gs, ps, alpha=wd)
            self._sent_sparse.update(params)
            if part.spread:
                self._noise.update(zip(params, part.noise_views))
            if self.key_root is not None and self.recipe.selects_by_step and not b.keyed:
                part.step_scales = functools.partial(
                    self.recipe.step_scales, params, optimizer=self.optimizer,
                    root=self.key_root)
                b.keyed = True
        # 0 * (a sum that is finite exactly when every term is) is 0, or NaN
        g = b.gather
        g.send[-1:].copy_(torch.sum(buffer, dtype=torch.float32).mul_(0.0).reshape(1))
        dense = None
        if b.dense:  # launched first: the allreduce runs while the sparse part selects
            torch._foreach_copy_(b.dense_views, dense_grads)
            b.dense_buf.div_(nranks)
            dense = dist.all_reduce(b.dense_buf, group=self.group, async_op=True).get_future()
            result = part.select_grads(self.memory, grads)
        else:
            result = part.select_flat(self.memory, buffer, grads)
        part.pack(result, g.send, 1.0)
        self._count(bucket, g.wire, b.dense_buf if b.dense else None)
        gathered = g.start(self.group)

        def decode(fut):
            if dense is not None:
                for f in fut.value():
                    f.wait()  # (raises either collective's error)
            else:
                fut.wait()
            out = part.decode(g.gathered, nranks, b.record_len)[:part.numel]
            # any rank's non-finite gradients make the whole bucket NaN on every rank, so
            # every rank skips the step alike (GradScaler) and no partial sum is applied
            out.add_(g.gathered.view(nranks, b.record_len)[:, -1].sum(dtype=torch.float32))
            out.mul_(1.0 / nranks)
            if dense is None:
                if scale is not None:
                    out.mul_(scale)
                return out.to(buffer.dtype).view_as(buffer)
            torch._foreach_copy_(b.result_sparse, part.out_views)
            torch._foreach_copy_(b.result_dense, b.dense_views)
            if scale is not None:
                b.result.mul_(scale.to(b.result.dtype))
            return b.result

        if dense is None:
            return gathered.then(decode)
        return torch.futures.collect_all([dense, gathered]).then(decode)

    def _count(self, bucket, *sent: Optional[torch.Tensor]) -> None:
        """Bytes this rank sends in the step, and the step's end: DDP calls the hook bucket
        by bucket, in index order, the last bucket last."""
        self._bytes += sum(t.numel() * t.element_size() for t in sent if t is not None)
        if bucket.is_last():
            self.step += 1
            self._in_step = False
            self.bytes_sent, self._bytes = self._bytes, 0
            self.sparse_params, self._sent_sparse = frozenset(self._sent_sparse), set()
            self.noise, self._noise = self._noise, {}

    def _bucket(self, bucket, density: float, nranks: int) -> _Bucket:
        params = bucket.parameters()
        names = tuple(self.names[p] for p in params)
        key = self._keys.get(names)
        if key is None:
            key = self._register(names, [p.shape for p in params], bucket.buffer())
        found = self._buckets.get(key)
        if found is None or found[0] != density:
            # a new warm-up stage: this bucket's buffers at the new density replace the old
            # (allocated once per stage; the residual, under the same key, carries over)
            shapes = [p.shape for p in params]
            dense = tuple(i for i, n in enumerate(names) if not self._sparsified(n))
            sparse = [i for i in range(len(names)) if i not in dense]
            part = self._part(key, [names[i] for i in sparse], [shapes[i] for i in sparse],
                              density, bucket.buffer()) if sparse else None
            found = self._buckets[key] = (density, _Bucket(
                part, nranks, self._pieces(part) if part is not None else 1, dense, shapes,
                bucket.buffer()))
        return found[1]

    def _sparsified(self, name: str) -> bool:
        """Whether the plan (if any) sparsifies tensor ``name``."""
        return self.plan is None or self._plan_sparse[name]

    def _plan_ks(self, density: float) -> Optional[Dict[str, int]]:
        """The plan's k of every tensor at ``density`` (None without a plan)."""
        if self.plan is None:
            return None
        if density not in self._plan_k:
            at = self.plan.at_density(density)
            self._plan_k[density] = dict(zip(at.names, at.k))
        return self._plan_k[density]

    def _pieces(self, part: SparsePart) -> int:
        return _pieces((part.length + 1) * torch.empty(0, dtype=part.dtype).element_size(),
                       part.out.device, self.group)

    def _register(self, names, shapes, buffer: torch.Tensor) -> str:
        if any(n in self._owner for n in names):
            self._regroup()  # DDP rebuilt its buckets (the same on every rank)
        if self._saved_buckets and frozenset(names) not in self._saved_buckets \
                and SCHEMES[self.scheme] in ("buffer", "group"):
            if self.group.rank() == 0:
                warnings.warn(f"ssfusion_hvd.ddp: DDP's first buckets after the load differ "
                              f"from the checkpoint's ({sorted(names)[:3]}...): scheme "
                              f"{self.scheme!r} selects over a bucket, so from this step on the "
                              f"job may differ from the uninterrupted one (the residuals carry "
                              f"over exactly)", stacklevel=2)
            self._saved_buckets = set()

        if buffer.dtype not in _DTYPES:
            raise ValueError(f"ssfusion_hvd.ddp: scheme {self.scheme!r} sparsifies float "
                             f"gradients, a bucket holds {buffer.dtype}")
        if self.memory is None:
            self.memory = ResidualMemory(None, self.recipe.accumulation_dtype(buffer.dtype))
        key = f"b{len(self._keys)}"
        self._keys[names] = key
        self._owner.update({n: key for n in names})
        # residuals for the tensors the bucket sparsifies (all of them without a plan)
        shapes = [s for n, s in zip(names, shapes) if self._sparsified(n)]
        names = [n for n in names if self._sparsified(n)]
        if not names:
            return key
        self.memory.register(key, names, shapes, buffer.device)
        if self._loaded is not None:
            def joined(store):  # the names' saved values, zeros for those the save lacks
                have = self._loaded.get(store, {})
                if not any(n in have for n in names):
                    return None
                return torch.cat([have.pop(n).reshape(-1) if n in have else torch.zeros(math.prod(s))
                                  for n, s in zip(names, shapes)]).to(buffer.device)

            r = joined("residuals")
            if r is not None:
                self.memory.residuals[key] = r.to(self.memory.acc_dtype(buffer.dtype))
            w, q = joined("waits"), joined("squares")
            if w is not None:  # (as ResidualMemory.load_named_state keeps them)
                self.memory.clock[key] = 0
                self.memory.sent_at[key] = w.to(torch.int32).neg_()
            if q is not None:
                self.memory.squares[key] = q.float()
        return key

    def _part(self, key: str, names, shapes, density: float, buffer: torch.Tensor) -> SparsePart:
        """The sparse part of tensors ``names`` of a bucket at ``density``: each tensor's k
        the plan's (compensated for what the bucket sends dense, scaled to the warm-up's
        stage as the Horovod engine scales it: ``Plan.at_density``), else its nominal."""
        mode = SCHEMES[self.scheme]
        numels = [math.prod(s) for s in shapes]
        if mode == "buffer":
            ks = [int(nominal_k(sum(numels), density))]
            sps = [make_sparsifier(self.sparsifier)]
        else:
            planned = self._plan_ks(density)
            ks = [planned[n] if planned is not None else int(nominal_k(m, density)) if m else 0
                  for n, m in zip(names, numels)]
            sps = [make_sparsifier(self.sparsifier) for _ in numels]
        floors = None
        if mode == "group" and len(shapes) > 1:
            floors = [min(k, 1) for k in ks]  # at least one element each: none is missing
        elif mode == "group":
            mode = "segmented"  # (one tensor: its own k either way)
        if mode == "segmented" and not all(s.exact_topk for s in sps):
            mode = "per_tensor"  # one call per tensor, any sparsifier
        return SparsePart(key, list(range(len(shapes))), shapes, ks, mode, sps, 0,
                          buffer.dtype, buffer.device,
                          acc_dtype=self.recipe.accumulation_dtype(buffer.dtype), floors=floors,
                          spread=self.spread)

    def _regroup(self) -> None:
        """Every residual, split by parameter, waits for its tensor's new bucket (the
        buckets already selected this step keep their selection; their residuals are
        among those split). DDP rebuilds from a step's first bucket, before anything of the
        step changed them; a rebuild later in a step would leave that step, if a
        GradScaler then skips it, not undone (the new memory has no checkpoint)."""
        self._loaded = {k: v for k, v in self.state_dict().items() if k in _PER_NAME}
        self.memory, self._keys, self._owner, self._buckets = None, {}, {}, {}

    def bucket_names(self) -> List[Tuple[str, ...]]:
        """The tensor names of each bucket since the buckets were last formed, in the order
        the hook met them (for tests and reports)."""
        return list(self._keys)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """This rank's residuals by parameter name (under :attr:`spread` also each
        element's wait and sum of squares), and the step count."""
        named = self.memory.named_state() if self.memory is not None else {}
        for store in _PER_NAME:  # keys not seen since the load keep the loaded values
            named[store] = {**(self._loaded or {}).get(store, {}), **named.get(store, {})}
        out = {"scheme": self.scheme, "density": self.recipe.density, "step": self.step,
               **{store: named[store] for store in _PER_NAME},
               "buckets": [list(b) for b in self._keys],
               "plan": None if self.plan is None else self.plan.to_json()}
        if self.recipe.shared is not None:
            out["ages"] = self.recipe.shared.state_dict(self.names)
        return out

    def load_state_dict(self, state: dict) -> None:
        if state.get("scheme") != self.scheme:
            raise ValueError(f"ssfusion_hvd.ddp: the checkpoint's hook ran scheme "
                             f"{state.get('scheme')!r}, this one runs {self.scheme!r}")
        mine = None if self.plan is None else self.plan.to_json()
        if state.get("plan") != mine and self.group.rank() == 0:
            warnings.warn("ssfusion_hvd.ddp: the checkpoint's hook ran another plan: the residuals "
                          "of tensors this plan sends dense are kept in the state, not applied",
                          stacklevel=2)
        self.step = int(state["step"])
        self.memory, self._keys, self._owner, self._buckets = None, {}, {}, {}
        self._in_step = self._undo_last = False
        self._loaded = {store: dict(state.get(store) or {}) for store in _PER_NAME}
        self._saved_buckets = {frozenset(b) for b in state.get("buckets", ())}
        if self.recipe.shared is not None:
            self.recipe.shared.load_state_dict(state.get("ages"), self.names)


#: what the hook's state keeps per parameter name (ResidualMemory.named_state's stores)
_PER_NAME = ("residuals", "waits", "squares")


def make_plan(model, cost, scheme: str = "ssfusion", density: float = 0.01,
              sparsifier: str = "topk") -> Plan:
    """The planner's plan for a DDP job: give it to DDP as :func:`ddp_kwargs` and to
    :func:`register` as ``plan=``.

    ``model``: the module (or its ``DistributedDataParallel``); its parameters that need
    gradients, in reverse registration order (DDP's own guess of the backward order, which
    its buckets follow), are the plan's tensors. ``cost``: a
    :class:`~ssfusion_hvd.plan.CostModel` (or the path of one saved as JSON) of the job's
    link at its world size: :func:`measure_cost` measures one, ``CostModel.from_network``
    makes one from a link's bandwidth and latency. Where its backward times are for another
    tensor list, the
    default per-tensor times are used (``plan.notes["backward"]`` says so).

    ``"ssfusion"``: the Horovod engine's SSFusion planner with the allreduce/allgather
    split (``ssfusion_i``) and the group budget: Cupcake's optimal fusion into buckets,
    selective sparsification (Eq. 2), the tensors that go dense by allreduce and the
    densities compensated for their bytes; a plan whose every bucket the simulator
    predicts faster dense is all dense. ``"per_tensor"``, ``"multi_tensor"``, ``"dense"``:
    Cupcake's optimal fusion for that selection, every tensor sparsified (or none). The
    plan is a function of its arguments: every rank that makes it from the same cost
    model makes the same plan (``register`` checks that they agree)."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(cost, (str, bytes)) or hasattr(cost, "__fspath__"):
        cost = CostModel.load(cost)
    if not isinstance(cost, CostModel):
        raise ValueError(f"cost must be a CostModel or the path of one, got {type(cost).__name__}")
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {tuple(SCHEMES)}")
    _check_density(density)
    if "gpu" not in cost.sparsify.get(sparsifier, {}):
        raise ValueError(f"the cost model has no selection time for {sparsifier!r} "
                         f"(cost.sparsify[{sparsifier!r}]['gpu']: the device the gradients "
                         f"are selected on); it has {sorted(cost.sparsify)}")
    module = model.module if isinstance(model, DistributedDataParallel) else model
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad][::-1]
    if not named:
        raise ValueError("the model has no parameters that need gradients")
    names, sizes = [n for n, _ in named], [p.numel() for _, p in named]
    element_sizes = {p.element_size() for _, p in named}
    if len(element_sizes) != 1:
        raise ValueError("make_plan plans one gradient dtype; the model's parameters have "
                         f"element sizes {sorted(element_sizes)}")
    notes = {"ddp_scheme": scheme, "world_size": str(cost.world_size),
             "element_size": str(element_sizes.pop())}
    if len(cost.backward_s) != len(sizes):
        notes["backward"] = (f"the cost model's backward times are for {len(cost.backward_s)} "
                             f"tensors: default times for this model's {len(sizes)}")
        cost = cost.with_backward(default_backward_times(sizes))
    if scheme == "ssfusion":
        plan = build_plan("ssfusion_i", sizes, cost, float(density), names, sparsifier,
                          group_floor=0.0, accuracy_slack=DEFAULT_ACCURACY_SLACK)
    else:
        mode = {"per_tensor": "per_tensor", "multi_tensor": "multi_tensor", "dense": "none"}[scheme]
        plan = optimal_fusion(sizes, cost, mode, float(density), scheme, names, sparsifier)
    plan.notes = {**plan.notes, **notes}
    return plan


def measure_cost(model, backward=None, density: float = 0.01, sparsifier: str = "topk",
                 scheme: str = "ssfusion", group=None, iterations: int = 3) -> CostModel:
    """The cost model of this job for :func:`make_plan`, measured as the Horovod optimizer
    measures its own in its warm-up (``docs/design.md``, "How a plan is made"), with
    ``torch.distributed``'s collectives on ``group`` (default: the world): allreduce and
    allgather times at the probe's sizes (the allgather as the hook makes it, in pieces
    where it would), the selection's encode under the scheme's budget, the decode, and,
    given ``backward`` (a callable that runs one forward and backward of ``model``, e.g.
    ``lambda: loss_fn(model(x), y).backward()``), each tensor's backward time over
    ``iterations`` runs (else the default per-tensor times). Call it before wrapping
    ``model`` in DDP (its backward must not reach DDP's reducer); it leaves no gradients. Collective: every rank calls it; rank 0's numbers are broadcast, so every
    rank plans alike."""
    from . import profile

    group = group if group is not None else dist.group.WORLD
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {tuple(SCHEMES)}")
    _check_density(density)
    if sparsifier not in SPARSIFIERS:
        raise ValueError(f"unknown sparsifier {sparsifier!r}; choose one of {tuple(SPARSIFIERS)}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no parameters that need gradients")
    dev = params[0].device
    nranks = group.size()
    keys = list(range(len(params)))[::-1]  # backward order, as make_plan lists the tensors
    backward_s = default_backward_times([params[i].numel() for i in keys])
    forward_s = 0.0
    if backward is not None:
        backward()  # untimed: allocations, first-call costs
        timer = profile.BackwardTimer(dev)
        handles = [p.register_post_accumulate_grad_hook(lambda _, i=i: timer.mark(i))
                   for i, p in enumerate(params)]
        try:
            for _ in range(max(1, int(iterations))):
                for p in params:
                    p.grad = None
                # every rank's backward at once, as in training, where ranks sharing cores
                # (or a host's memory bandwidth) slow each other down
                dist.barrier(group=group)
                timer.start_iteration()
                backward()
                timer.end_iteration()
        finally:
            for h in handles:
                h.remove()
        # the first gradient's time from the start holds the forward: split as the Horovod
        # path splits it (the first tensor charged the median of the others)
        timed = profile.slowest_rank_times(timer.ready_times(keys, int(iterations))[None])
        if timed is not None:
            forward_s, backward_s = timed
    for p in params:
        p.grad = None
    gathers: Dict[int, _Gather] = {}

    def allgather(t, _name):
        nbytes = t.numel() * t.element_size()
        g = gathers.get(t.numel())
        if g is None:
            g = gathers[t.numel()] = _Gather(t.numel(), nranks, _pieces(nbytes, dev, group),
                                             t.dtype, dev)
        g.send.copy_(t)
        g.start(group).wait()

    comm = profile.time_collectives(
        {"allreduce": lambda t, _name: dist.all_reduce(t, group=group),
         "allgather": allgather},
        lambda: dist.barrier(group=group), dev, curve_sizes=profile.ALLGATHER_CURVE_SIZES)
    fit = (profile.time_sparsifier(sparsifier, device=dev, density=float(density),
                                   grouped=scheme == "ssfusion")
           if scheme != "dense" else (0.0, 0.0))
    cost = CostModel(
        world_size=nranks, allreduce=comm["allreduce"], allgather=comm["allgather"],
        allgather_curve=comm["allgather_curve"], sparsify={sparsifier: {"gpu": fit, "cpu": fit}},
        backward_s=tuple(backward_s), element_size=params[0].element_size(), forward_s=forward_s,
        decode=profile.time_decode(dev, world_size=nranks, density=float(density)),
        notes={"source": "measured (ssfusion_hvd.ddp.measure_cost)", "device": str(dev),
               "backward": "measured" if backward is not None else "default per-tensor times"})
    text = [cost.to_json()]
    dist.broadcast_object_list(text, src=dist.get_global_rank(group, 0), group=group)
    return CostModel.from_json(text[0])


def ddp_kwargs(plan: Plan) -> dict:
    """The ``DistributedDataParallel`` arguments that make its buckets the plan's groups:
    ``bucket_cap_mb_list``, one cap per bucket in backward order, each the group's bytes
    (DDP closes a bucket when it reaches its cap). DDP forms its first iteration's buckets
    in forward order and rebuilds them after it in the order the gradients became ready,
    with these caps: from the second step on they are the plan's groups (where the
    backward order is the reverse of the registration order, which the plan assumes). A
    torch without per-bucket caps gets ``bucket_cap_mb``, the largest group's size."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(plan, Plan):
        raise ValueError(f"plan must be a Plan (ssfusion_hvd.ddp.make_plan), got {type(plan).__name__}")
    es = int(plan.notes.get("element_size", 4))
    caps = [sum(plan.sizes[g.start:g.end]) * es / 2 ** 20 for g in plan.groups]
    if "bucket_cap_mb_list" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"bucket_cap_mb_list": caps}
    return {"bucket_cap_mb": max(caps)}


def _check_density(density) -> None:
    if isinstance(density, bool) or not isinstance(density, (int, float)) \
            or not 0.0 < float(density) <= 1.0 or math.isnan(float(density)):
        raise ValueError(f"density must be in (0, 1], got {density!r}")


def _agree(group, **arguments) -> None:
    """Every rank's ``register`` arguments, compared on every rank before anything is
    checked or built: ranks given different schemes, densities or plans would send records
    of different sizes, so each raises, all alike, instead of a collective that never
    matches. One small allgather, made by every rank whatever its arguments."""
    def fingerprint(v):
        if isinstance(v, Plan):
            return hashlib.sha1(v.to_json().encode()).hexdigest()
        return repr(v) if isinstance(v, (str, int, float, bool, type(None))) else type(v).__name__

    mine = {k: fingerprint(v) for k, v in sorted(arguments.items())}
    every = [None] * group.size()
    dist.all_gather_object(every, mine, group=group)
    differ = sorted(k for k in mine if len({repr(e[k]) for e in every}) > 1)
    if differ:
        raise ValueError(f"ssfusion_hvd.ddp.register: the ranks were given different {differ} "
                         f"(every rank must register the same hook)")


def register(ddp_model, scheme: str = "ssfusion", density: float = 0.01, sparsifier: str = "topk",
             optimizer=None, momentum_correction="auto",
             density_warmup_steps: Union[str, int] = DEFAULT_WARMUP_STEPS,
             fp32_accumulation: bool = True, grad_scaler=None,
             plan: Optional[Plan] = None, select_by: str = "auto") -> SparseHook:
    """Installs the hook on ``ddp_model`` (a ``DistributedDataParallel``) and returns its
    state. ``scheme``: one of :data:`SCHEMES`; ``density``: the share of each bucket's
    elements sent, in (0, 1]; ``sparsifier``: one of ``ssfusion_hvd.SPARSIFIERS``;
    ``optimizer``: the job's optimizer, for the recipe's momentum correction (shared
    moments; ``momentum_correction`` as in the Horovod optimizer: ``"auto"``, ``True``,
    ``False``; without an optimizer, plain error feedback); ``density_warmup_steps``:
    DGC's exponential warm-up (``"auto"``: the Horovod optimizer's, longer below density
    0.006; an int: its steps; 0: off); ``grad_scaler``: the job's ``torch.amp.GradScaler``
    (needs ``optimizer``): the residuals are kept in unscaled units and a step the scaler
    skips is undone; ``plan``: the planner's plan (:func:`make_plan`): which tensors of a
    bucket go dense by allreduce and each sparsified tensor's k (build the DDP model
    with :func:`ddp_kwargs` of the same plan, so its buckets are the plan's groups);
    ``select_by``: what the exact top-k ranks, as the planned schemes'
    ``scheme_options["select_by"]``: ``"auto"`` or ``"gain"`` (Adam given as ``optimizer``:
    the pending sums times their steps; otherwise the magnitudes), ``"step"`` (the pending
    steps), ``"magnitude"``. Call
    ``optimizer.step()`` (or ``scaler.step(optimizer)``) as usual: the
    hook wraps it. Bad arguments raise ``ValueError`` on every rank before any collective (nothing
    in the checks depends on the rank)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise ValueError(f"register takes a DistributedDataParallel model, got "
                         f"{type(ddp_model).__name__}")
    _agree(ddp_model.process_group, scheme=scheme, density=density, sparsifier=sparsifier,
           optimizer=optimizer, momentum_correction=momentum_correction,
           density_warmup_steps=density_warmup_steps, fp32_accumulation=fp32_accumulation,
           grad_scaler=grad_scaler, plan=plan, select_by=select_by)
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {tuple(SCHEMES)}")
    if sparsifier not in SPARSIFIERS:
        raise ValueError(f"unknown sparsifier {sparsifier!r}; choose one of {tuple(SPARSIFIERS)}")
    _check_density(density)
    if select_by not in SELECT_BY_CHOICES:
        raise ValueError(f"select_by must be one of {SELECT_BY_CHOICES}, got {select_by!r}")
    if scheme == "ssfusion" and not make_sparsifier(sparsifier).exact_topk:
        raise ValueError(f"scheme 'ssfusion' shares a bucket's budget by magnitude, which "
                         f"needs an exact top-k sparsifier, got {sparsifier!r}")
    names = {p: n for n, p in ddp_model.module.named_parameters()}
    if plan is not None:
        _check_plan(plan, scheme, float(density), sparsifier, ddp_model)
    if grad_scaler is not None:
        if not isinstance(grad_scaler, torch.amp.GradScaler):
            raise ValueError(f"grad_scaler must be a torch.amp.GradScaler, got "
                             f"{type(grad_scaler).__name__}")
        if optimizer is None:
            raise ValueError("grad_scaler needs the optimizer (register(..., optimizer=opt)): "
                             "a step the scaler skips is seen by its step not running")
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer, got "
                             f"{type(optimizer).__name__}")
        if any(p not in names for g in optimizer.param_groups for p in g["params"]):
            raise ValueError("optimizer steps parameters that are not the DDP model's")
        recipe = resolve_recipe(optimizer, scheme, float(density), momentum_correction,
                                density_warmup_steps, fp32_accumulation, moments="shared")
    else:
        if momentum_correction is True:
            raise ValueError("momentum_correction=True needs the optimizer: "
                             "register(..., optimizer=opt)")
        warmup = warmup_length(density, density_warmup_steps)
        recipe = Recipe("none", float(density), warmup if scheme != "dense" else 0,
                        bool(fp32_accumulation))
    hook = SparseHook(names, ddp_model.process_group, scheme, sparsifier, recipe, optimizer,
                      grad_scaler, plan, select_by)
    ddp_model.register_comm_hook(hook, _call)
    if optimizer is not None:
        _wrap_step(optimizer, hook)
    return hook


def _check_plan(plan, scheme: str, density: float, sparsifier: str, ddp_model) -> None:
    """``register(plan=)``: a plan made by :func:`make_plan` for this model, scheme,
    density, sparsifier and world size."""
    if not isinstance(plan, Plan):
        raise ValueError(f"plan must be a Plan (ssfusion_hvd.ddp.make_plan), got {type(plan).__name__}")
    made = {"scheme": plan.notes.get("ddp_scheme"), "density": plan.density,
            "sparsifier": plan.sparsifier, "world size": plan.notes.get("world_size")}
    given = {"scheme": scheme, "density": density, "sparsifier": sparsifier,
             "world size": str(ddp_model.process_group.size())}
    for what in made:
        if made[what] != given[what]:
            raise ValueError(f"the plan was made for {what} {made[what]!r}, the hook runs "
                             f"{given[what]!r} (ssfusion_hvd.ddp.make_plan)")
    want = sorted(n for n, p in ddp_model.module.named_parameters() if p.requires_grad)
    if sorted(plan.names) != want:
        raise ValueError(f"the plan's tensors are not the model's: {len(plan.names)} against "
                         f"{len(want)} parameters that need gradients")


def _wrap_step(optimizer, hook: SparseHook) -> None:
    """``optimizer.step`` steps the tensors the hook sparsified by the shared moments (under
    momentum correction) and leaves the rest to the optimizer's own step
    (``Recipe.step_dense_only``); that it ran keeps the step's residuals."""
    import functools

    inner = optimizer.step

    @functools.wraps(inner)
    def step(*args, **kwargs):
        hook._undo_last = False
        with hook.recipe.step_dense_only(optimizer, hook.sparse_params, None, hook.noise):
            return inner(*args, **kwargs)

    optimizer.step = step


def _call(state, bucket):
    # (no annotations: DDP compares them with torch.futures.Future[torch.Tensor], and under
    # ``from __future__ import annotations`` they would be strings)
    return state(bucket)
