"""ZEN: sparse gradient synchronization by Balanced Parallelism.

Paper: Wang et al., "ZEN: Empowering Distributed Training with Sparsity-driven Data
Synchronization", OSDI'25. §2.2–2.3: the design space (communication, aggregation,
partition, balance) and its optimum *Balanced Parallelism* = [Point-to-point, Incremental
aggregation, Parallelism, Balanced communication]; §3.2: data-independent hierarchical
hashing (Algorithm 1), which balances the partitions whatever the index distribution;
§3.3: the hash bitmap (Algorithm 2), which encodes the pulled indices in |G|/8 bytes per rank
whatever the number of servers.

One step, on the whole model gradient as one flat vector g of n elements (canonical order
``[p for p in config.order if p.requires_grad]``), P ranks, rank p owning partition p:

1. **Sparsify** with error feedback: ``acc = g + residual`` (:class:`ResidualMemory`); the
   user's sparsifier (``config.sparsifier``) selects about ``k = ceil(density * n)`` entries;
   what is not sent stays in the residual, bit for bit.
2. **Partition** (Algorithm 1, :func:`ssfusion_hvd.ops.hash_partition`): entry i goes to owner
   ``h_0(i)``; the seed is the same on every rank, so every rank's copy of an index meets at
   one owner, and a universal hash balances the loads (Theorem 2: imbalance
   ``1 + O(sqrt(P log P / (n d)))``) where contiguous partitions follow the gradient's skew.
3. **Push**: one ``alltoall`` of one :mod:`ssfusion_hvd.core.wire` record per owner (its
   values, zero padding to the index alignment, its indices), sent as bytes with int32
   ``splits`` = the records' byte lengths; each owner receives every rank's entries of its
   partition and reads each source's count off the received split (:func:`wire.count_of`).
4. **Incremental aggregation**: the owner scatter-adds them, in source-rank order
   (deterministic), into a dense accumulator and marks the touched positions.
5. **Pull** (Algorithm 2): owner p's index set ``I_p = {i : h_0(i) = p}`` (sorted, computed
   once) is known to everyone; the owner sends a bitmap of |I_p| bits (bit t: ``I_p[t]`` was
   touched) and the aggregated values of the touched positions, in that order. Every rank
   needs every owner's result, so the pull is two allgathers (bitmaps, fixed sizes; values,
   variable) — the paper's "each server broadcasts its hash bitmap to all workers".
6. **Decode**: the set bits of all gathered bitmaps, mapped through the I_p, are the
   positions of the gathered values; then the ``op`` scaling (sender multiplies by
   ``1 / gradient_predivide_factor``, receiver by ``factor / P`` for Average, 1 for Sum).

The result on every rank is the dense sum of all ranks' sparse vectors (each index summed
in rank order), bit-identical on every rank.

Cost per rank (bytes, b_v / b_i value / index size, m ~ k entries selected per rank, u the
union of the selected indices, ``gamma = u / m`` the densification ratio): push sends
``m (b_v + b_i)`` (plus each record's padding, less than one entry) of which ``(P-1)/P``
leaves the rank; pull sends ``|I_p| / 8 + (u / P) b_v``
and receives ``n / 8 + u b_v``. With COO in both steps this is the paper's Eq. (1),
``T_bp = (P-1)/P (gamma + 1) 2 M d / b``; the hash bitmap replaces the pulled indices by
n/8 bytes.

Known limits:

* Only Balanced Parallelism. ZEN also runs Hierarchical Centralization (SparCML) and picks
  one at run time from profiled densities (§3, Eq. 1 vs 2); the paper finds Balanced
  Parallelism optimal for every model it studies.
* Horovod has no point-to-point send: the push is an alltoall (which is point-to-point
  inside) and the pull an allgather (ring over gloo, where the paper broadcasts).
* The whole model is one bucket (the paper uses DDP buckets of 128 MB), so communication
  starts when the last gradient is ready; ``compression=`` is ignored (values travel in the
  gradient dtype). Every gradient must share one dtype (float32/float16/bfloat16) and device.
* Memory per rank besides the residual: the index sets I_p (one int32 per element, int64
  past 2^31), a dense accumulator and the output (n values each) and a touched mask (n bytes).
* The hash seed is the ``seed`` option (default a fixed constant, 0x5A454E): every rank
  agrees without a collective (the optimizer checks that every rank passes the same
  ``scheme_options``). The paper broadcasts random seeds at start; any seed gives the same
  guarantee as long as it does not depend on the data.
* The serial memory of Algorithm 1 is unbounded here (the paper sizes it r1/10 and would
  lose indices past it), and collisions are resolved by the lowest position instead of the
  GPU's race winner, so the kernels are deterministic.
"""
from __future__ import annotations

import copy

import itertools
import time
import zlib

import torch

from .. import ops
from ..core import wire
from ..core.wire import code_spreads, spread_codes
from ..plan.cost import nominal_k
from ..sparsify import make_sparsifier
from .base import SELECT_BY, SPREAD, Option, SyncConfig, carries_spread, is_int
from .whole import WholeGradientScheme

__all__ = ["ZenScheme", "imbalance_ratio", "pack_bitmap", "unpack_bitmap"]

_BIT_WEIGHTS = {}


def imbalance_ratio(loads) -> float:
    """max load / mean load (Definition 8); 1.0 when there is no load."""
    loads = torch.as_tensor(loads, dtype=torch.float64).flatten()
    total = float(loads.sum())
    return float(loads.max()) * loads.numel() / total if total > 0 else 1.0


def _weights(device) -> torch.Tensor:
    w = _BIT_WEIGHTS.get(device)
    if w is None:
        w = _BIT_WEIGHTS[device] = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8,
                                                device=device)
    return w


def pack_bitmap(bits: torch.Tensor) -> torch.Tensor:
    """A bool vector as ceil(len/8) bytes, bit t of byte b = bits[8b + t] (zero padded)."""
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    w = _weights(bits.device)
    return (bits.view(-1, 8).to(torch.uint8) * w).sum(1, dtype=torch.uint8)


def unpack_bitmap(data: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_bitmap`: 8 bools per byte."""
    return (data.view(-1, 1) & _weights(data.device)).ne_(0).view(-1)


def _optional_int(lo: int, hi: int):
    check = is_int(lo, hi)
    return lambda v: v is None or check(v)


class ZenScheme(WholeGradientScheme):
    """State of ZEN's Balanced Parallelism (see the module docstring for the math).

    Options (``scheme_options``, identical on every rank):

    * ``seed``: the universal hash's seed (h_0 and the second-level functions);
    * ``rounds``: second-level hash functions k of Algorithm 1 (the paper's evaluation uses 3);
    * ``table_size``: slots of each partition's parallel memory r1 (None: twice the mean
      partition load, :func:`ssfusion_hvd.ops.default_table_size`);
    * ``select_by``: what each rank's top-k ranks, as the planned schemes' (``"auto"`` =
      ``"gain"``: under Adam with shared moments the accumulated gradient times the step
      the rule would take with it, ``acc² / (sqrt(v-hat) + eps)``; ``"step"`` the step,
      ``|acc| / (sqrt(v-hat) + eps)``; else, and with ``"magnitude"``, the accumulated
      magnitude);
    * ``spread``: each pushed entry carries its sender's spread (a second alltoall, one
      byte per entry); the owner turns its senders' spreads into the noise ratio of each
      aggregated entry, pulled as one byte beside its value (``"auto"``: under Adam with
      shared moments; docs/recipe.md, "The senders' variance").
    """

    name = "zen"
    prefix = "zen"
    options = {
        "seed": Option(0x5A454E, is_int(0, 2**64 - 1), "an int in [0, 2**64)"),  # "ZEN"
        "rounds": Option(3, is_int(0, 64), "an int in [0, 64]"),
        "table_size": Option(None, _optional_int(1, 2**31 - 1),
                             "None or an int in [1, 2**31 - 1]"),
        "select_by": SELECT_BY,
        "spread": SPREAD,
    }

    def __init__(self, config: SyncConfig):
        super().__init__(config)
        opts = self.opts
        self.seed, self.rounds, self.table_size = opts["seed"], opts["rounds"], opts["table_size"]
        self._n = self.flat.numel
        self._nranks, self._rank = self.transport.size, self.transport.rank
        self._prescale, self._postscale = self.transport.scales()
        self._idx_dtype = ops.index_dtype(self._n)
        kwargs = {"seed": zlib.crc32(b"zen")} if config.sparsifier in ("randomk", "dgc") else {}
        self._sparsifier = make_sparsifier(config.sparsifier, **kwargs)
        self._sets = None  # built on first use: _build_sets()
        self._key = None  # the selection key's buffer (by the pending step), allocated once
        #: each sender's spread rides the push, the owners' noise ratios the pull
        self.spread = carries_spread(config, opts["spread"])
        self._noise_table = code_spreads(self._device).float() if self.spread else None
        self._noise = None  # per element, the noise ratio of its last arrival (flat)
        self.reset()

    # ------------------------------------------------------------------ index sets
    def _build_sets(self) -> None:
        """The sorted index sets I_p of the hash bitmap (computed once: they depend on n, P
        and the seed only) and the buffers of aggregation and decoding."""
        n, P, dev = self._n, self._nranks, self._device
        owner = ops.hash_owner(torch.arange(n, dtype=self._idx_dtype, device=dev), P, self.seed)
        sizes = torch.bincount(owner, minlength=P).tolist()
        members = torch.sort(owner, stable=True).indices.to(self._idx_dtype)  # I_0, I_1, ...
        nbytes = [-(-s // 8) for s in sizes]
        # I_p laid out at the bit offsets of the gathered bitmaps (pad bits are never set)
        bit_index = torch.zeros(8 * sum(nbytes), dtype=self._idx_dtype, device=dev)
        lo = bit = 0
        for s, b in zip(sizes, nbytes):  # a loop over ranks
            bit_index[bit:bit + s] = members[lo:lo + s]
            lo, bit = lo + s, bit + 8 * b
        own_lo = sum(sizes[:self._rank])
        self._sets = {
            "sizes": sizes, "bytes": nbytes,
            "own": members[own_lo:own_lo + sizes[self._rank]].clone(),
            "bit_index": bit_index,
            # bit offset where each owner's bitmap ends (imbalance of the pull)
            "bit_ends": torch.tensor(list(itertools.accumulate(8 * b for b in nbytes)),
                                     dtype=torch.int64, device=dev),
        }
        del owner, members
        self._agg = torch.zeros(n, dtype=self._acc_dtype(), device=dev)  # owner sums
        self._touched = torch.zeros(n, dtype=torch.bool, device=dev)
        self._out = torch.zeros(n, dtype=self._dtype, device=dev)
        self._gathered = None  # _gather()'s buffer, allocated when first needed
        if self.spread:  # the owner's sums of its senders' variances and their counts
            self._agg_var = torch.zeros(n, dtype=torch.float32, device=dev)
            self._agg_cnt = torch.zeros(n, dtype=torch.float32, device=dev)
            self._noise = torch.zeros(n, dtype=torch.float32, device=dev)
            self._noise_views = dict(zip(self._trainable, self.flat.views(self._noise)))

    # ------------------------------------------------------------------ sparsify, hash, push
    def _gather(self, grads) -> torch.Tensor:
        """The gradients back to back, where the selection cannot read them where they lie
        (the first step, a rule or sparsifier the fused kernel does not take), into a buffer
        allocated once: a new tensor of the model's size faults its pages in every step."""
        if self._gathered is None:
            self._gathered = torch.empty(self._n, dtype=self._dtype, device=self._device)
        return self.flat.gather(grads, self._gathered)

    def _launch(self) -> None:
        if self._sets is None:
            self._build_sets()
        t0 = time.perf_counter()
        self._step_density = self._density()
        k = int(nominal_k(self._n, self._step_density)) if self._n else 0
        if self.spread:  # this step's gradients into the sums of squares a spread reads
            self._memory.add_squares(self._KEY, [self._grad(p) for p in self._trainable])
        scales = self._step_scales() if self._sparsifier.exact_topk else None
        if scales is not None:  # by the pending gain or step (docs/recipe.md, "Selecting by the gain")
            if self._key is None:
                self._key = torch.empty(self._n, dtype=torch.float32, device=self._device)
            values, indices = self._memory.select_steps(
                self._KEY, [self._grad(p) for p in self._trainable], scales, self._key, k,
                wire_dtype=self._dtype)
        elif self._sparsifier.exact_topk:  # error feedback and top-k in one kernel, reading
            # the gradients where they lie once it can (ResidualMemory.select_topk_tensors)
            grads = [self._grad(p) for p in self._trainable]
            got = self._memory.select_topk_tensors(self._KEY, grads, k, wire_dtype=self._dtype)
            values, indices = got if got is not None else self._memory.select_topk(
                self._KEY, self._gather(grads), k, wire_dtype=self._dtype)
        else:
            acc = self._memory.compensate(self._KEY, self._gather(
                [self._grad(p) for p in self._trainable]))
            values, indices = self._sparsifier.select(acc, k)
            self._memory.update(self._KEY, acc, indices, self._dtype)
        spreads = None
        if self.spread:
            spreads = self._memory.sent_spreads(
                self._KEY, indices, values, self._memory.sent_waits(self._KEY, indices))
        values = values.to(self._dtype)  # the wire dtype; the rounding stays in the residual
        order, counts, overflow = ops.hash_partition(indices, self._nranks, self.seed,
                                                     table_size=self.table_size,
                                                     rounds=self.rounds)
        values, indices = values[order], indices[order].to(self._idx_dtype)
        if self._prescale != 1.0:
            values = values * self._prescale
        # one wire record per owner, sent as bytes (splits in bytes)
        per_owner = counts.tolist()
        push = wire.encode(list(zip(values.split(per_owner), indices.split(per_owner))),
                           self._dtype, self._idx_dtype, device=values.device)
        splits = torch.tensor([wire.record_bytes(c, self._dtype, self._idx_dtype)
                               for c in per_owner], dtype=torch.int32)
        self._sparsify_s = time.perf_counter() - t0
        self._push = self.transport.alltoall(push.view(torch.uint8), splits, "push")
        if self.spread:  # one byte per entry, in the push's order (splits: its counts)
            self._push_spread = self.transport.alltoall(
                spread_codes(spreads[order]), torch.tensor(per_owner, dtype=torch.int32),
                "spread")
        self._sent = {"indices": indices, "counts": counts, "overflow": overflow}

    # ------------------------------------------------------------------ aggregate, pull
    def finish(self) -> None:
        if self._push is None:
            if self._submitted:
                raise RuntimeError(f"scheme 'zen': finish() after {self._submitted} of "
                                   f"{len(self._trainable)} gradients were submitted")
            return  # nothing trainable
        t_wait = time.perf_counter()
        tr, S = self.transport, self._sets
        received, rsplits = tr.wait(self._push)
        # one record per source rank, in source-rank order; its length gives its count
        counts = [wire.count_of(b, self._dtype, self._idx_dtype) for b in rsplits.tolist()]
        records = wire.decode(received.view(self._dtype), counts, self._idx_dtype)
        rvals = torch.cat([v for v, _ in records])
        ridx = torch.cat([i for _, i in records])
        # incremental aggregation: the sum follows the source-rank order
        ops.scatter_add(self._agg, rvals.to(self._agg.dtype), ridx)
        self._touched[ridx] = True
        bits = self._touched[S["own"]]
        touched = S["own"][bits]
        own_values = self._agg[touched].to(self._dtype)
        own_noise = self._owner_noise(rvals, ridx, touched) if self.spread else None
        self._agg[ridx] = 0  # ready for the next step, at the touched positions only
        self._touched[ridx] = False
        h_bits = tr.allgather(pack_bitmap(bits), "bitmap")
        # values travel as bytes: Horovod's allgather takes no bfloat16
        h_vals = tr.allgather(own_values.view(torch.uint8), "values")
        h_noise = tr.allgather(spread_codes(own_noise), "noise") if self.spread else None
        pos = unpack_bitmap(tr.wait(h_bits)).nonzero().flatten()
        gathered = tr.wait(h_vals).view(self._dtype)
        if h_noise is not None:  # (elsewhere the gradient is 0: no pass over the rest)
            self._noise[S["bit_index"][pos]] = self._noise_table[tr.wait(h_noise).long()]
        if self._postscale != 1.0:  # only the pulled entries are non-zero: scale just them
            gathered = gathered * self._postscale
        out = self._out.zero_()
        out[S["bit_index"][pos]] = gathered
        self._deliver(out)
        t_end = time.perf_counter()
        self._finished()
        self._record_stats(pos, gathered, ridx.numel(), t_wait, t_end)
        self.reset()

    def _owner_noise(self, rvals, ridx, touched) -> torch.Tensor:
        """Per aggregated entry of this owner (``touched``), the noise ratio of what
        arrived, ``P · mean_r(spread_r·v_r²) / (Σ_r v_r)²`` over the ranks that pushed it
        (as ``SparsePart.noise``; the sums in source-rank order: the same bits wherever
        it is computed); 0 where the sum is exactly 0 or the ratio is not finite. Clears
        the sums at ``ridx`` for the next step."""
        codes, _ = self.transport.wait(self._push_spread)
        var = self._noise_table[codes.long()] * rvals.float().square()
        ops.scatter_add(self._agg_var, var, ridx)
        ops.scatter_add(self._agg_cnt, torch.ones_like(var), ridx)
        total = self._agg[touched].float()
        ratio = self._agg_var[touched].div(self._agg_cnt[touched]).mul_(
            float(self._nranks)).div_(total.square())
        self._agg_var[ridx] = 0
        self._agg_cnt[ridx] = 0
        return torch.where((total != 0) & torch.isfinite(ratio), ratio, torch.zeros_like(ratio))

    def noise(self) -> dict:
        return self._noise_views if self._noise is not None and self._last_sparse else {}

    def _record_stats(self, pos, pulled, received, t_wait, t_end) -> None:
        sent, tr = self._sent, self.transport
        counts = sent["counts"]
        per_owner = torch.bincount(torch.searchsorted(self._sets["bit_ends"], pos, right=True),
                                   minlength=self._nranks)
        self.last_stats = self._step_stats(
            t_wait, t_end, allgather_bytes=tr.sent["allgather"],
            elements_sent=sent["indices"].numel(), density_target=self._step_density,
            tensors_missing=self.flat.missing(sent["indices"]),
            nonfinite=torch.isfinite(pulled).logical_not_().sum(),  # the rest is 0
            sparsify_s=self._sparsify_s,
            extra={"alltoall_bytes": tr.sent["alltoall"],
                   "partition_counts": counts,  # this rank's push load per owner
                   # max/mean of the above (Definition 8)
                   "imbalance_push": lambda: imbalance_ratio(counts.cpu()),
                   # max/mean of the aggregated entries per owner
                   "imbalance_pull": lambda: imbalance_ratio(per_owner.cpu()),
                   "hash_overflow": sent["overflow"].sum(),  # entries in serial memory
                   "elements_received": received,  # push entries aggregated by this owner
                   "elements_aggregated": pos.numel()})  # |union| of all ranks' indices

    def pending(self) -> bool:
        return self._submitted > 0 or self._push is not None

    def reset(self) -> None:
        super().reset()
        self._push = self._sent = self._push_spread = None

    # ------------------------------------------------------------------ state
    def _step_state(self) -> dict:
        return {**super()._step_state(),
                "sparsifier": copy.deepcopy(self._sparsifier.state_dict())}

    def _restore_step_state(self, saved: dict) -> None:
        super()._restore_step_state(saved)
        self._sparsifier.load_state_dict(saved["sparsifier"])

    def shared_state(self) -> dict:
        # the sparsifier is seeded alike on every rank (randomk) and evolves alike
        return {"iteration": self._iteration, "sparsifier": self._sparsifier.state_dict()}

    def adopt_shared(self, shared: dict, keep_local: bool, all_keep: bool) -> None:
        super().adopt_shared(shared, keep_local, all_keep)
        if not keep_local:
            self._sparsifier.load_state_dict(shared["sparsifier"])

    def state_dict(self) -> dict:
        """Iteration count, this rank's residual and local rule state per parameter name,
        sparsifier state. Residuals differ per rank: every rank saves its own."""
        return {"iteration": self._iteration, **self._memory_state(),
                "sparsifier": self._sparsifier.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.reset()
        self._iteration = int(state["iteration"])
        self._load_memory_state(state)
        self._sparsifier.load_state_dict(state["sparsifier"])
