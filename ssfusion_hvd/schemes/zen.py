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
3. **Push**: one ``alltoall`` of packed (value, index) records with int32 ``splits`` = the
   partition counts; each owner receives every rank's entries of its partition.
4. **Incremental aggregation**: the owner scatter-adds them, in rank order (deterministic),
   into a dense accumulator and marks the touched positions.
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
``m (b_v + b_i)`` of which ``(P-1)/P`` leaves the rank; pull sends ``|I_p| / 8 + (u / P) b_v``
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
* The hash seed is a fixed constant (:attr:`ZenScheme.seed`): every rank agrees without a
  collective. The paper broadcasts random seeds at start; any seed gives the same guarantee
  as long as it does not depend on the data.
* The serial memory of Algorithm 1 is unbounded here (the paper sizes it r1/10 and would
  lose indices past it), and collisions are resolved by the lowest position instead of the
  GPU's race winner, so the kernels are deterministic.
"""
from __future__ import annotations

import itertools
import time
import zlib
from typing import Optional

import torch
from horovod.torch.mpi_ops import allgather_async, alltoall_async, synchronize

from .. import ops
from ..plan.cost import nominal_k
from ..sparsify import make_sparsifier
from .base import SyncConfig, WholeGradientScheme

__all__ = ["ZenScheme", "imbalance_ratio", "pack_bitmap", "unpack_bitmap"]

_instances = itertools.count()
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


class ZenScheme(WholeGradientScheme):
    """State of ZEN's Balanced Parallelism (see the module docstring for the math).

    Knobs (class attributes, identical on every rank):

    * ``seed``: the universal hash's seed (h_0 and the second-level functions);
    * ``rounds``: second-level hash functions k of Algorithm 1 (the paper's evaluation uses 3);
    * ``table_size``: slots of each partition's parallel memory r1 (None: twice the mean
      partition load, :func:`ssfusion_hvd.ops.default_table_size`).
    """

    name = "zen"
    seed = 0x5A454E  # "ZEN"
    rounds = 3
    table_size: Optional[int] = None

    def __init__(self, config: SyncConfig):
        super().__init__(config)
        self._tag = f"zen{next(_instances)}"  # created in the same order on every rank
        self._bounds = [0] + list(itertools.accumulate(self.flat.sizes))
        self._n = self._bounds[-1]
        self._nranks = config.process_set.size()
        self._rank = config.process_set.rank()
        self._prescale, self._postscale = self.transport.scales()
        self._idx_dtype = ops.index_dtype(self._n)
        kwargs = {"seed": zlib.crc32(b"zen")} if config.sparsifier == "randomk" else {}
        self._sparsifier = make_sparsifier(config.sparsifier, **kwargs)
        self._sets = None  # built on first use: _build_sets()
        self._stats: dict = {}
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

    # ------------------------------------------------------------------ sparsify, hash, push


    def _launch(self) -> None:
        cfg = self.config
        if self._sets is None:
            self._build_sets()
        t0 = time.perf_counter()
        flat = torch.cat([self._grad(p).reshape(-1) for p in self._trainable])
        acc = self._memory.compensate(self._KEY, flat)
        k = int(nominal_k(self._n, self._density())) if self._n else 0
        values, indices = self._sparsifier.select(acc, k)
        values = values.to(self._dtype)  # the wire dtype; the rounding stays in the residual
        self._memory.update(self._KEY, acc, indices, self._dtype)
        order, counts, overflow = ops.hash_partition(indices, self._nranks, self.seed,
                                                     table_size=self.table_size,
                                                     rounds=self.rounds)
        values, indices = values[order], indices[order].to(self._idx_dtype)
        if self._prescale != 1.0:
            values = values * self._prescale
        m = values.numel()
        record = torch.cat([values.view(torch.uint8).view(m, values.element_size()),
                            indices.view(torch.uint8).view(m, indices.element_size())], dim=1)
        splits = counts.to(device="cpu", dtype=torch.int32)
        self._sparsify_s = time.perf_counter() - t0
        self._push = alltoall_async(record, splits=splits, name=f"{self._tag}.push",
                                    process_set=cfg.process_set)
        self._sent = {"indices": indices, "counts": counts, "overflow": overflow,
                      "push_bytes": record.numel()}

    # ------------------------------------------------------------------ aggregate, pull
    def finish(self) -> None:
        if self._push is None:
            if self._submitted:
                raise RuntimeError(f"scheme 'zen': finish() after {self._submitted} of "
                                   f"{len(self._trainable)} gradients were submitted")
            return  # nothing trainable
        t_wait = time.perf_counter()
        cfg = self.config
        S = self._sets
        received, _ = synchronize(self._push)
        vb = torch.empty(0, dtype=self._dtype).element_size()
        rvals = received[:, :vb].contiguous().view(self._dtype).reshape(-1)
        ridx = received[:, vb:].contiguous().view(self._idx_dtype).reshape(-1)
        # incremental aggregation: rows arrive in source-rank order, the sum follows it
        ops.scatter_add(self._agg, rvals.to(self._agg.dtype), ridx)
        self._touched[ridx] = True
        bits = self._touched[S["own"]]
        touched = S["own"][bits]
        own_values = self._agg[touched].to(self._dtype)
        self._agg[ridx] = 0  # ready for the next step, at the touched positions only
        self._touched[ridx] = False
        bitmap = pack_bitmap(bits)
        h_bits = allgather_async(bitmap, name=f"{self._tag}.bitmap", process_set=cfg.process_set)
        # values travel as bytes: Horovod's allgather takes no bfloat16
        h_vals = allgather_async(own_values.view(torch.uint8), name=f"{self._tag}.values",
                                 process_set=cfg.process_set)
        pos = unpack_bitmap(synchronize(h_bits)).nonzero().flatten()
        gathered = synchronize(h_vals).view(self._dtype)
        if self._postscale != 1.0:  # only the pulled entries are non-zero: scale just them
            gathered = gathered * self._postscale
        out = self._out.zero_()
        out[S["bit_index"][pos]] = gathered
        views = [v.view(p.shape) for v, p in zip(out.split(self.flat.sizes), self._trainable)]
        torch._foreach_copy_([p.grad for p in self._trainable], views)
        t_end = time.perf_counter()
        self._finished()
        self._record_stats(pos, gathered, bitmap.numel() + own_values.numel() * vb,
                           received.shape[0], t_wait, t_end)
        self.reset()

    def _record_stats(self, pos, pulled, pull_bytes, received_rows, t_wait, t_end) -> None:
        sent = self._sent
        idx = sent["indices"].long().sort().values
        per_tensor = torch.searchsorted(idx, torch.tensor(self._bounds, device=idx.device))
        per_owner = torch.bincount(torch.searchsorted(self._sets["bit_ends"], pos, right=True),
                                   minlength=self._nranks)
        m = idx.numel()
        self._stats = {
            "phase": "sparse", "iteration": self._iteration,
            "allreduce_bytes": 0, "allgather_bytes": pull_bytes,
            "tensors_dense": 0, "tensors_sparse": len(self._trainable),
            "elements": self._n, "elements_sent": m, "density": m / max(self._n, 1),
            "density_target": self.config.recipe.density_at(self._iteration - 1),
            "tensors_missing": (per_tensor.diff() == 0).sum(),
            "nonfinite": torch.isfinite(pulled).logical_not_().sum(),  # the rest is 0
            "sparsify_s": self._sparsify_s, "offload_s": 0.0,
            "communicate_s": t_end - (self._t_first if self._t_first is not None else t_wait),
            "wait_s": t_end - t_wait,
            # ZEN specifics
            "alltoall_bytes": sent["push_bytes"],
            "partition_counts": sent["counts"],  # this rank's push load per owner
            "imbalance_push": sent["counts"],  # max/mean of the above (Definition 8)
            "imbalance_pull": per_owner,  # max/mean of the aggregated entries per owner
            "hash_overflow": sent["overflow"].sum(),  # entries in serial memory
            "elements_received": received_rows,  # push entries aggregated by this owner
            "elements_aggregated": pos.numel(),  # |union| of all ranks' indices
        }

    def stats(self) -> dict:
        out = dict(self._stats)
        for key in ("tensors_missing", "nonfinite", "hash_overflow"):
            if isinstance(out.get(key), torch.Tensor):
                out[key] = int(out[key])
        for key in ("imbalance_push", "imbalance_pull"):
            if isinstance(out.get(key), torch.Tensor):
                out[key] = imbalance_ratio(out[key].cpu())
        if isinstance(out.get("partition_counts"), torch.Tensor):
            out["partition_counts"] = out["partition_counts"].tolist()
        return out

    def pending(self) -> bool:
        return self._submitted > 0 or self._push is not None

    def reset(self) -> None:
        self._submitted = 0
        self._push = None
        self._sent = None
        self._t_first = None
        self._sparsify_s = 0.0

    # ------------------------------------------------------------------ state
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
