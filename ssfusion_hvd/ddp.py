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

Not yet here (docs/ddp.md): ``moments="local"``, the planner's choice of ``bucket_cap_mb``
and of dense tensors within a bucket, the offload worker, and NCCL (the code path is the
same; no GPU run yet).
"""
from __future__ import annotations

import math
import warnings
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .core.sparse_part import SparsePart
from .plan.cost import nominal_k
from .recipe import DEFAULT_WARMUP_STEPS, Recipe, resolve_recipe
from .sparsify import SPARSIFIERS, ResidualMemory, make_sparsifier

__all__ = ["SCHEMES", "SparseHook", "register"]

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
    """One bucket's sparse part at one density, its send buffer and the gathered one. A
    record is the part's, then one element: 0, or NaN when this rank's gradients in the
    bucket are not all finite, so every rank learns it from the allgather it makes anyway.
    ``pieces`` > 1: the record is allgathered as that many equal pieces (the last padded),
    which land piece by piece and are put back in rank order once all have arrived."""

    def __init__(self, part: SparsePart, nranks: int, pieces: int = 1):
        self.part = part
        self.nranks = nranks
        self.record_len = part.length + 1
        self.pieces = max(1, int(pieces))
        self.piece_len = -(-self.record_len // self.pieces)
        dev = part.out.device
        #: what this rank puts on the wire: the record, padded to whole pieces
        self.wire = torch.zeros(self.pieces * self.piece_len, dtype=part.dtype, device=dev)
        self.send = self.wire[:self.record_len]
        self.gathered = torch.empty(nranks * self.record_len, dtype=part.dtype, device=dev)
        self._landing = (torch.empty(self.pieces * nranks * self.piece_len, dtype=part.dtype,
                                     device=dev) if self.pieces > 1 else None)

    def allgather(self, group) -> torch.futures.Future:
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


class SparseHook:
    """The hook's state (``register`` makes one): the residuals of every bucket, the
    synchronized step count, and each bucket's buffers at the density in force.
    ``state_dict()`` / ``load_state_dict()`` carry the residuals (by parameter name) and
    the step, so a resumed job continues exactly; each rank saves and loads its own."""

    def __init__(self, names: Dict[torch.Tensor, str], process_group, scheme: str,
                 sparsifier: str, recipe: Recipe, optimizer=None, grad_scaler=None):
        self.names = names
        self.group = process_group
        self.scheme, self.sparsifier = scheme, sparsifier
        #: the density schedule and, with an optimizer, its momentum correction
        self.recipe = recipe
        self.optimizer = optimizer
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
        self._loaded: Optional[dict] = None  # a checkpoint's residuals, taken as keys appear
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
        if first and self.scaler is not None:
            self.memory.checkpoint()
            self._undo_last = True  # unless the wrapped optimizer.step runs
        scale = None
        if self.scaler is not None and getattr(self.scaler, "_scale", None) is not None:
            # the state is kept unscaled: the scale (a power of two: exact) divides the
            # gradients on the way in and multiplies their average on the way out, where
            # GradScaler.unscale_ expects to find it scaled
            scale = self.scaler._scale.detach().clone()
            buffer.mul_(scale.reciprocal().to(buffer.dtype))
        grads = bucket.gradients()
        if self.recipe.corrects():
            # the shared rule error-compensates g + wd·w, where SGD/Adam would add the decay:
            # one foreach call per decay in force (a bucket's tensors mostly share one)
            params = bucket.parameters()
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
        # 0 * (a sum that is finite exactly when every term is) is 0, or NaN
        b.send[-1:].copy_(torch.sum(buffer, dtype=torch.float32).mul_(0.0).reshape(1))
        result = part.select_flat(self.memory, buffer, grads)
        part.pack(result, b.send, 1.0)
        self._count(bucket, b.wire)
        gathered = b.allgather(self.group)

        def decode(fut):
            fut.wait()
            out = part.decode(b.gathered, nranks, b.record_len)[:part.numel]
            # any rank's non-finite gradients make the whole bucket NaN on every rank, so
            # every rank skips the step alike (GradScaler) and no partial sum is applied
            out.add_(b.gathered.view(nranks, b.record_len)[:, -1].sum(dtype=torch.float32))
            out.mul_(1.0 / nranks)
            if scale is not None:
                out.mul_(scale)
            return out.to(buffer.dtype).view_as(buffer)

        return gathered.then(decode)

    def _count(self, bucket, sent: torch.Tensor) -> None:
        """Bytes this rank sends in the step, and the step's end: DDP calls the hook bucket
        by bucket, in index order, the last bucket last."""
        self._bytes += sent.numel() * sent.element_size()
        if bucket.is_last():
            self.step += 1
            self._in_step = False
            self.bytes_sent, self._bytes = self._bytes, 0
            self.sparse_params, self._sent_sparse = frozenset(self._sent_sparse), set()

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
            part = self._part(key, [p.shape for p in params], density, bucket.buffer())
            found = self._buckets[key] = (density, _Bucket(part, nranks, self._pieces(part)))
        return found[1]

    def _pieces(self, part: SparsePart) -> int:
        """How many pieces a bucket's record is allgathered in: gloo on the CPU splits one
        larger than :data:`ALLGATHER_PIECE_BYTES` (NCCL and gloo's CUDA path, which stages
        through the host, take it whole). The same on every rank: it follows the record's
        size, which follows the bucket and the density."""
        nbytes = (part.length + 1) * torch.empty(0, dtype=part.dtype).element_size()
        if part.out.device.type != "cpu" or dist.get_backend(self.group) != "gloo":
            return 1
        return min(64, -(-nbytes // ALLGATHER_PIECE_BYTES))

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
        self.memory.register(key, list(names), shapes, buffer.device)
        if self._loaded is not None:
            have = self._loaded["residuals"]
            if any(n in have for n in names):
                self.memory.residuals[key] = torch.cat(
                    [have.pop(n).reshape(-1) if n in have else torch.zeros(math.prod(s))
                     for n, s in zip(names, shapes)]).to(buffer.device, self.memory.acc_dtype(buffer.dtype))
        return key

    def _part(self, key: str, shapes, density: float, buffer: torch.Tensor) -> SparsePart:
        mode = SCHEMES[self.scheme]
        numels = [math.prod(s) for s in shapes]
        if mode == "buffer":
            ks = [int(nominal_k(sum(numels), density))]
            sps = [make_sparsifier(self.sparsifier)]
        else:
            ks = [int(nominal_k(n, density)) if n else 0 for n in numels]
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
                          acc_dtype=self.recipe.accumulation_dtype(buffer.dtype), floors=floors)

    def _regroup(self) -> None:
        """Every residual, split by parameter, waits for its tensor's new bucket (the
        buckets already selected this step keep their selection; their residuals are
        among those split). DDP rebuilds from a step's first bucket, before anything of the
        step changed them; a rebuild later in a step would leave that step, if a
        GradScaler then skips it, not undone (the new memory has no checkpoint)."""
        self._loaded = {"residuals": self.state_dict()["residuals"]}
        self.memory, self._keys, self._owner, self._buckets = None, {}, {}, {}

    def bucket_names(self) -> List[Tuple[str, ...]]:
        """The tensor names of each bucket since the buckets were last formed, in the order
        the hook met them (for tests and reports)."""
        return list(self._keys)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """This rank's residuals by parameter name, and the step count."""
        named = self.memory.named_state() if self.memory is not None else {"residuals": {}}
        if self._loaded is not None:  # keys not seen since the load keep the loaded values
            named["residuals"] = {**self._loaded.get("residuals", {}), **named["residuals"]}
        out = {"scheme": self.scheme, "density": self.recipe.density, "step": self.step,
               "residuals": named["residuals"], "buckets": [list(b) for b in self._keys]}
        if self.recipe.shared is not None:
            out["ages"] = self.recipe.shared.state_dict(self.names)
        return out

    def load_state_dict(self, state: dict) -> None:
        if state.get("scheme") != self.scheme:
            raise ValueError(f"ssfusion_hvd.ddp: the checkpoint's hook ran scheme "
                             f"{state.get('scheme')!r}, this one runs {self.scheme!r}")
        self.step = int(state["step"])
        self.memory, self._keys, self._owner, self._buckets = None, {}, {}, {}
        self._in_step = self._undo_last = False
        self._loaded = {"residuals": dict(state.get("residuals", {}))}
        self._saved_buckets = {frozenset(b) for b in state.get("buckets", ())}
        if self.recipe.shared is not None:
            self.recipe.shared.load_state_dict(state.get("ages"), self.names)


def register(ddp_model, scheme: str = "ssfusion", density: float = 0.01, sparsifier: str = "topk",
             optimizer=None, momentum_correction="auto",
             density_warmup_steps: int = DEFAULT_WARMUP_STEPS,
             fp32_accumulation: bool = True, grad_scaler=None) -> SparseHook:
    """Installs the hook on ``ddp_model`` (a ``DistributedDataParallel``) and returns its
    state. ``scheme``: one of :data:`SCHEMES`; ``density``: the share of each bucket's
    elements sent, in (0, 1]; ``sparsifier``: one of ``ssfusion_hvd.SPARSIFIERS``;
    ``optimizer``: the job's optimizer, for the recipe's momentum correction (shared
    moments; ``momentum_correction`` as in the Horovod optimizer: ``"auto"``, ``True``,
    ``False``; without an optimizer, plain error feedback); ``density_warmup_steps``:
    DGC's exponential warm-up (0: off); ``grad_scaler``: the job's ``torch.amp.GradScaler``
    (needs ``optimizer``): the residuals are kept in unscaled units and a step the scaler
    skips is undone. Call ``optimizer.step()`` (or ``scaler.step(optimizer)``) as usual: the
    hook wraps it. Bad arguments raise ``ValueError`` on every rank before any collective (nothing
    in the checks depends on the rank)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise ValueError(f"register takes a DistributedDataParallel model, got "
                         f"{type(ddp_model).__name__}")
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {tuple(SCHEMES)}")
    if sparsifier not in SPARSIFIERS:
        raise ValueError(f"unknown sparsifier {sparsifier!r}; choose one of {tuple(SPARSIFIERS)}")
    if isinstance(density, bool) or not isinstance(density, (int, float)) \
            or not 0.0 < float(density) <= 1.0 or math.isnan(float(density)):
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    if scheme == "ssfusion" and not make_sparsifier(sparsifier).exact_topk:
        raise ValueError(f"scheme 'ssfusion' shares a bucket's budget by magnitude, which "
                         f"needs an exact top-k sparsifier, got {sparsifier!r}")
    names = {p: n for n, p in ddp_model.module.named_parameters()}
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
        if isinstance(density_warmup_steps, bool) or not isinstance(density_warmup_steps, int) \
                or density_warmup_steps < 0:
            raise ValueError(f"density_warmup_steps must be an int >= 0, got "
                             f"{density_warmup_steps!r}")
        recipe = Recipe("none", float(density), density_warmup_steps if scheme != "dense" else 0,
                        bool(fp32_accumulation))
    hook = SparseHook(names, ddp_model.process_group, scheme, sparsifier, recipe, optimizer,
                      grad_scaler)
    ddp_model.register_comm_hook(hook, _call)
    if optimizer is not None:
        _wrap_step(optimizer, hook)
    return hook


def _wrap_step(optimizer, hook: SparseHook) -> None:
    """``optimizer.step`` steps the tensors the hook sparsified by the shared moments (under
    momentum correction) and leaves the rest to the optimizer's own step
    (``Recipe.step_dense_only``); that it ran keeps the step's residuals."""
    import functools

    inner = optimizer.step

    @functools.wraps(inner)
    def step(*args, **kwargs):
        hook._undo_last = False
        with hook.recipe.step_dense_only(optimizer, hook.sparse_params):
            return inner(*args, **kwargs)

    optimizer.step = step


def _call(state, bucket):
    # (no annotations: DDP compares them with torch.futures.Future[torch.Tensor], and under
    # ``from __future__ import annotations`` they would be strings)
    return state(bucket)
