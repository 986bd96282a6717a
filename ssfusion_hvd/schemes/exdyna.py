"""ExDyna: exclusive, dynamically partitioned threshold sparsification.

Paper: "Preserving Near-Optimal Gradient Sparsification Cost for Scalable Distributed Deep
Learning" (ExDyna), §IV: A (block-based partitioning, Algorithm 2), B (dynamic partition
allocation, Algorithm 3), C (partition-wise exclusive selection, Algorithm 4), D (online
threshold scaling, Algorithm 5); the whole step is Algorithm 1.

The whole model gradient is one flat vector of ``n_g`` elements (trainable parameters in
canonical, name-sorted order). Per iteration t, on every rank i:

1. ``acc_i = residual_i + grad_i`` (error feedback, :class:`ResidualMemory`);
2. the vector is cut into ``n_b`` blocks of ``sz_blk`` elements (a multiple of 32), grouped
   into P contiguous partitions; rank i owns partition ``(t % P + i) % P`` (cyclic, Alg. 3
   line 29), so every partition is searched by exactly one rank;
3. rank i selects, inside its partition only, every ``|acc_i| >= delta_t`` (Alg. 4): the
   selected index sets of the ranks are disjoint (no gradient build-up); a selection over
   the rank's capacity (``cap`` times its partition's share of k) is trimmed to its largest
   (ours, not the paper's: :meth:`ExDynaState.capacity`);
4. **allgather of the indices** (Horovod allgather with per-rank sizes: its negotiation
   already exchanges the first-dimension sizes, so nothing is padded to ``max k_i``), each
   rank's followed by one entry ``-1 - demand`` (how many passed the threshold before the
   trim), gives every rank the union ``idx_t`` (k' indices), the per-partition counts
   ``k_t`` sent and the demands;
5. **allreduce of ``acc_i[idx_t]``** (k' values, same length on every rank): the summed
   values land at ``idx_t`` of the synchronized gradient (scatter into zeros), scaled by
   ``op`` exactly as Horovod does (``prescale = 1/gradient_predivide_factor``, postscale
   ``gradient_predivide_factor`` then the backend's 1/P for Average);
6. ``residual_i = acc_i`` with ``idx_t`` zeroed: each rank sent its own accumulated value
   at every selected coordinate (also those selected by other ranks), everything else
   stays in its residual, so ``dense(sent) + residual == acc`` bit for bit;
7. from the summed demand (identical on every rank; ``k'`` when nothing was trimmed) the
   threshold is rescaled (Algorithm 5, :meth:`ssfusion_hvd.sparsify.Threshold.scale_factor`,
   beta = 1.2, gamma = 0.05) and the partition boundaries are adjusted from the demands
   per partition (Algorithm 3): between adjacent
   partitions where one selected more than ``alpha`` times the mean ``k'/P`` and the other
   fewer than mean/alpha, ``move_blocks`` blocks move from the heavy to the light one
   (never below ``min_blocks``). Everything that shapes a collective is a function of
   gathered counts, so all ranks take the same decisions.

Cost per iteration and rank: one threshold scan of the own partition (``n_g / P``
elements; exact top-k only in a calibration iteration), one pass over ``n_g`` for error
feedback and one for decode. Communication, in the fits of ``plan.CostModel`` (ring:
``g(x) = alpha + beta * bytes``, bytes per rank) with ``e`` value bytes, ``i`` index bytes
(4 below 2^31 elements) and ``k' ~ k`` once the threshold has settled::

    T = allgather_s(k'/P * i) + allreduce_s(k' * e)

two collectives in sequence (the allreduce needs the gathered indices), against
``allgather_s(k * (e + i))`` for a per-worker top-k allgather (P*k entries arrive, built
up and padded). With ``f(t) = P * max_i k_i / k'`` (Eq. 5, reported as ``imbalance``) the
allgather term is at most ``allgather_s(f * k'/P * i)`` on a backend that pads.

Choices where the paper is silent or differs from a sketch of it:

* The paper's Algorithm 1 exchanges *indices* by allgather and *values* by allreduce; a
  values+indices allgather of the owners' values only would send, at each coordinate, one
  rank's gradient and keep the other P-1 contributions in residuals. We follow the paper.
* The first threshold (``delta_0``; no value given) is calibrated: with no threshold, each
  rank takes the exact top-``k * |partition| / n_g`` of its partition and ``delta`` becomes
  the mean of the ranks' k-th magnitudes (one extra 8-byte allgather, that iteration only).
  The same happens whenever the threshold stops being a positive finite number.
* Algorithm 2 derives ``sz_blk`` from ``n_b``; rounding ``sz_blk`` down to 32 can leave up
  to half of the vector as remainder. We pick ``sz_blk`` (a multiple of 32, at least
  32 when the model allows) for about ``blocks_per_worker`` blocks per partition and set
  ``n_b = n_g // sz_blk``, so the remainder is less than one block; it belongs to the
  last partition. alpha = 1.1, move_blocks = 1, min_blocks = 1 (no values in the paper).
* Algorithm 3 re-indexes the per-worker counts to partitions (lines 2-6); we count per
  partition directly (bucketing the gathered indices), which is the same vector.
* Algorithm 5 is applied after every iteration except a calibration one.
* ``sparsifier=`` is ignored: ExDyna's selector is its own threshold. ``plan=``,
  ``profile=`` and ``warmup_steps`` are ignored too: nothing is planned or profiled.

The cap (``scheme_options={"cap": c}``, default 1.2) is ours. Without it the achieved
density follows the target only as fast as Algorithm 5 moves (+-5 % per iteration far from
it, +-1.25 % near it), while error feedback makes the steady-state threshold several times
the calibrated one (residuals grow for about 1/density iterations; under momentum
correction a velocity is ~1/(1-m) times a gradient) and the density warm-up recalibrates
at every stage: 3-5x the target under the default recipe, and up to 10.7x in single steps
(issue 31's measurements). With it no step sends more than ``cap · k`` (plus one element
per partition whose share of k rounds to zero) and the threshold still tracks the
untrimmed demand; below the target nothing changes. Moving one block
per adjacent pair per iteration balances slowly on strongly skewed gradients. A NaN/Inf
outside a rank's own partition would never be sent by its exclusive selection: the
optimizer's non-finite flag undoes such a step on every rank (docs/horovod.md, "Mixed precision").
All trainable gradients must share one dtype (float32, float16, bfloat16; bfloat16 values
are summed in float32 by the value allreduce) and device.
"""
from __future__ import annotations

import copy

import math
import time
from typing import List, Optional, Sequence

import torch

from .. import ops
from ..plan.cost import nominal_k
from ..sparsify.base import trim
from ..sparsify.threshold import Threshold
from .base import Option, SyncConfig, is_int, is_real
from .whole import WholeGradientScheme

__all__ = ["ExDynaScheme", "ExDynaState"]


def _k_of(numel: int, density: float) -> int:
    return int(nominal_k(numel, density)) if numel else 1


class ExDynaState:
    """What ExDyna carries from one iteration to the next; identical on every rank.

    * ``block_size``, ``num_blocks``: the block grid (§IV-A); partition j is the blocks
      ``[pos_j, pos_j + blocks[j])`` with ``pos_j = sum(blocks[:j])``, the last partition
      also holding the tail ``numel - num_blocks * block_size`` (< one block).
    * ``blocks``: blocks per partition (``blk_part``), adjusted by :meth:`rebalance`.
    * ``threshold``: delta_t, or None until calibrated.
    * ``iteration``: t, which drives the cyclic allocation ``(t % P + rank) % P``.
    * ``alpha``, ``move_blocks``, ``min_blocks``: Algorithm 3's knobs; ``beta``, ``gamma``:
      Algorithm 5's (see :class:`~ssfusion_hvd.sparsify.Threshold`).

    Pure Python on ints and floats: no Horovod, no tensors (the tests drive it directly).
    """

    def __init__(self, numel: int, nranks: int, density: float, *, blocks_per_worker: int = 128,
                 move_blocks: int = 1, min_blocks: int = 1, alpha: float = 1.1,
                 beta: float = 1.2, gamma: float = 0.05, cap: float = 1.2):
        if nranks < 1 or numel < 0:
            raise ValueError(f"need nranks >= 1 and numel >= 0, got {nranks}, {numel}")
        self.numel, self.nranks, self.density = int(numel), int(nranks), float(density)
        self.k = _k_of(self.numel, self.density)
        self.blocks_per_worker = int(blocks_per_worker)
        self.move_blocks, self.min_blocks = int(move_blocks), int(min_blocks)
        self.alpha = float(alpha)
        self.cap = float(cap)
        self._scaler = Threshold(beta=beta, gamma=gamma)  # Algorithm 5's scale factor
        self.threshold: Optional[float] = None
        self.iteration = 0
        self.partition_blocks()

    def set_density(self, density: float) -> None:
        """A new target density (density warm-up): k follows, and the next iteration
        recalibrates the threshold by exact top-k (Algorithm 5 would take many iterations
        to walk it to a 2-4x lower target)."""
        if float(density) != self.density:
            self.density = float(density)
            self.k = _k_of(self.numel, self.density)
            self.threshold = None

    # ------------------------------------------------------------------ Algorithm 2
    def partition_blocks(self) -> None:
        """Block grid and equal partitions (Algorithm 2; remainder blocks to the first)."""
        n, numel = self.nranks, self.numel
        target = max(n * self.blocks_per_worker, 1)
        size = numel // target
        size -= size % 32
        if size < 32:  # small model: blocks of 32 where possible, else one block per rank
            size = 32 if numel >= 32 * n else max(1, numel // n)
        self.block_size = size
        self.num_blocks = numel // size
        q, r = divmod(self.num_blocks, n)
        self.blocks = [q + 1 if i < r else q for i in range(n)]

    # ------------------------------------------------------------------ allocation
    def bounds(self) -> List[int]:
        """Element offsets ``b`` (P + 1 of them): partition j is ``[b[j], b[j + 1])``."""
        out, pos = [0], 0
        for nb in self.blocks:
            pos += nb
            out.append(min(pos * self.block_size, self.numel))
        out[-1] = self.numel  # the tail belongs to the last partition
        return out

    def allocation(self, rank: int) -> int:
        """The partition rank ``rank`` searches this iteration (Alg. 3 line 29)."""
        return (self.iteration % self.nranks + rank) % self.nranks

    def partition(self, rank: int):
        """``(lo, hi)`` element range searched by ``rank`` this iteration."""
        b = self.bounds()
        a = self.allocation(rank)
        return b[a], b[a + 1]

    def calibration_k(self, rank: int) -> int:
        """Exact top-k count of ``rank``'s partition in a calibration iteration."""
        lo, hi = self.partition(rank)
        return min(hi - lo, math.ceil(self.k * (hi - lo) / max(self.numel, 1) - 1e-9))

    def capacity(self, rank: int) -> int:
        """The most elements ``rank`` sends this iteration: ``cap`` times its partition's
        share of k, rounded down (at least one), so the ranks together send at most
        ``cap · k`` (plus one per partition whose share rounds to zero)."""
        lo, hi = self.partition(rank)
        return max(1, int(self.cap * self.k * (hi - lo) / max(self.numel, 1) + 1e-9))

    # ------------------------------------------------------------------ after the exchange
    def observe(self, counts: Sequence[int], kth: Optional[Sequence[float]] = None) -> None:
        """End of iteration t: ``counts[j]`` elements were selected in partition j;
        ``kth`` (calibration only) the ranks' k-th magnitudes. Rescales the threshold
        (Alg. 5), rebalances the partitions (Alg. 3) and advances t."""
        total = sum(int(c) for c in counts)
        if self.threshold is None:
            good = [float(v) for v in (kth or []) if math.isfinite(v) and v > 0]
            self.threshold = sum(good) / len(good) if good else None
        else:
            self.threshold *= self._scaler.scale_factor(total / self.k)
            if not (math.isfinite(self.threshold) and self.threshold > 0):
                self.threshold = None  # recalibrate next iteration
        self.rebalance(counts)
        self.iteration += 1

    def rebalance(self, counts: Sequence[int]) -> None:
        """Algorithm 3 lines 7-28: move ``move_blocks`` blocks between adjacent partitions
        when one selected more than alpha times the mean and the other less than 1/alpha."""
        k = [float(c) for c in counts]
        total = sum(k)
        if total <= 0 or self.nranks < 2:
            return
        mean, dens = total / self.nranks, total / max(self.numel, 1)
        k_move = self.move_blocks * self.block_size * dens
        hi, lo = self.alpha, 1.0 / self.alpha
        for i in range(self.nranks - 1):
            det, det2 = k[i] / mean, k[i + 1] / mean
            if det > hi and det2 < lo:
                if self.blocks[i] - self.move_blocks < self.min_blocks:
                    continue
                self.blocks[i] -= self.move_blocks
                self.blocks[i + 1] += self.move_blocks
                k[i] -= k_move
                k[i + 1] += k_move
            elif det < lo and det2 > hi:
                if self.blocks[i + 1] - self.move_blocks < self.min_blocks:
                    continue
                self.blocks[i] += self.move_blocks
                self.blocks[i + 1] -= self.move_blocks
                k[i] += k_move
                k[i + 1] -= k_move

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"numel": self.numel, "nranks": self.nranks, "density": self.density,
                "block_size": self.block_size,
                "num_blocks": self.num_blocks, "blocks": list(self.blocks),
                "threshold": self.threshold, "iteration": self.iteration}

    def load_state_dict(self, state: dict) -> None:
        if int(state["numel"]) != self.numel:
            raise ValueError(f"checkpoint has {state['numel']} gradient elements, the model "
                             f"has {self.numel}")
        self.threshold = state["threshold"]
        self.iteration = int(state["iteration"])
        if "density" in state:  # the density the threshold was tuned to (density warm-up)
            self.density = float(state["density"])
            self.k = _k_of(self.numel, self.density)
        if int(state["nranks"]) == self.nranks:
            self.block_size, self.num_blocks = int(state["block_size"]), int(state["num_blocks"])
            self.blocks = [int(b) for b in state["blocks"]]
        else:  # another world size: start from equal partitions again
            self.partition_blocks()


class ExDynaScheme(WholeGradientScheme):
    """ExDyna over Horovod (see the module docstring)."""

    name = "exdyna"
    prefix = "exd"
    #: Algorithm 2's grid, Algorithm 3's block moves and Algorithm 5's scaling
    #: (:class:`ExDynaState`; the paper gives no values, these are ours)
    options = {
        "blocks_per_worker": Option(128, is_int(1), "a positive int"),
        "move_blocks": Option(1, is_int(1), "a positive int"),
        "min_blocks": Option(1, is_int(1), "a positive int"),
        "alpha": Option(1.1, is_real(1.0, open_low=True), "a number > 1"),
        "beta": Option(1.2, is_real(1.0, open_low=True), "a number > 1"),
        "gamma": Option(0.05, is_real(0.0, 1.0, open_low=True), "a number in (0, 1]"),
        "cap": Option(1.2, is_real(1.0), "a number >= 1"),
    }

    def __init__(self, config: SyncConfig):
        super().__init__(config)
        self._numel = self.flat.numel
        self._nranks, self._rank = self.transport.size, self.transport.rank
        self._idx_dtype = ops.index_dtype(self._numel)
        self.state = ExDynaState(self._numel, self._nranks, self._density(), **self.opts)
        self._flat = torch.empty(self._numel, dtype=self._dtype, device=self._device)
        self._out = torch.empty(self._numel, dtype=self._acc_dtype(), device=self._device)
        self.selected: Optional[torch.Tensor] = None  # this rank's indices, last iteration
        self.reset()

    # ------------------------------------------------------------------ submit
    def _launch(self) -> None:
        """Error feedback, exclusive selection in the own partition, index allgather."""
        t0 = time.perf_counter()
        st = self.state
        if self._numel:
            self._flat_grad(out=self._flat)
        acc = self._memory.compensate(self._KEY, self._flat)
        st.set_density(self._density())  # density warm-up: the target of this step
        lo, hi = st.partition(self._rank)
        part = acc[lo:hi]
        self._calibrating = st.threshold is None
        if self._calibrating:
            values, idx = ops.topk(part, st.calibration_k(self._rank))
            kth = float(values.float().abs().nan_to_num(nan=math.inf).min()) \
                if values.numel() else math.nan
            self._kth = self.transport.allgather(torch.tensor([kth], dtype=torch.float64), "kth")
        else:
            values, idx = ops.threshold_select(part, st.threshold)
        # the threshold lags the residuals' growth (they accumulate for ~1/density steps, and
        # a velocity is ~1/(1-m) times a gradient): the largest up to this rank's capacity are
        # sent, the count above the threshold is what Algorithm 5 and 3 see
        demand = values.numel()
        values, idx = trim(values, idx, st.capacity(self._rank))
        idx = idx.to(self._idx_dtype).add_(lo)
        self._acc, self.selected = acc, idx
        self._sparsify_s = time.perf_counter() - t0
        # the demand rides the index allgather as one negative entry after the indices
        tail = torch.tensor([-1 - demand], dtype=self._idx_dtype, device=idx.device)
        self._ag = self.transport.allgather(torch.cat([idx, tail]), "idx")

    # ------------------------------------------------------------------ finish
    def finish(self) -> None:
        """Gathers the indices, allreduces the values there, decodes, updates the residual,
        the threshold and the partitions."""
        if self._ag is None:
            return
        cfg, tr = self.config, self.transport
        t_wait = time.perf_counter()
        st = self.state
        gathered = tr.wait(self._ag)  # per rank (in rank order): its indices, then -1 - demand
        tails = gathered < 0
        demand = (-1 - gathered[tails].long()).tolist()
        gathered = gathered[~tails]  # idx_t: rank-major, disjoint
        bounds = st.bounds()
        counts = torch.bincount(
            torch.bucketize(gathered.long(), torch.tensor(bounds[1:-1], device=gathered.device),
                            right=True), minlength=self._nranks).tolist()
        wanted = [0] * self._nranks  # the demand per partition (rank r searched allocation(r))
        for r, d in enumerate(demand):
            wanted[st.allocation(r)] = d
        kth = tr.wait(self._kth).tolist() if self._calibrating else None
        values = self._acc.index_select(0, gathered.long()).to(self._dtype)  # the wire dtype
        compressed, ctx = cfg.compression.compress(values)
        pre, post = tr.horovod_scales()
        handle = tr.allreduce(compressed, "val", prescale=pre, postscale=post)
        reduced = cfg.compression.decompress(tr.wait(handle), ctx).to(self._out.dtype)
        self._out.zero_()
        ops.scatter_add(self._out, reduced, gathered)
        self._deliver(self._out)
        self._memory.update(self._KEY, self._acc, gathered, self._dtype)
        t_end = time.perf_counter()
        own, total = self.selected.numel(), gathered.numel()
        self._finished()
        self.last_stats = self._step_stats(
            t_wait, t_end, phase="calibration" if self._calibrating else "sparse",
            allreduce_bytes=tr.sent["allreduce"], allgather_bytes=tr.sent["allgather"],
            elements_sent=total, density_target=st.density,
            tensors_missing=self.flat.missing(gathered),
            nonfinite=torch.isfinite(reduced).logical_not_().sum(),
            sparsify_s=self._sparsify_s,
            # ExDyna's own: the threshold used, this rank's partition and count, the
            # per-partition counts and f(t) = P * max k_i / k' (Eq. 5; 1 is perfect balance)
            extra={"threshold": st.threshold, "partition": st.partition(self._rank),
                   "selected": own, "counts": counts, "demand": wanted,
                   "imbalance": self._nranks * max(counts) / total if total else 1.0})
        st.observe(wanted, kth)
        self.reset()

    def pending(self) -> bool:
        return self._submitted > 0 or self._ag is not None

    def reset(self) -> None:
        super().reset()
        self._ag = self._kth = None
        self._acc = None
        self._calibrating = False

    # ------------------------------------------------------------------ state
    def _step_state(self) -> dict:
        # the whole object: Algorithm 5's scale factor is state too
        return {**super()._step_state(), "exdyna": copy.deepcopy(self.state)}

    def _restore_step_state(self, saved: dict) -> None:
        super()._restore_step_state(saved)
        self.state = saved["exdyna"]

    def shared_state(self) -> dict:
        return {"iteration": self._iteration, "exdyna": self.state.state_dict()}

    def adopt_shared(self, shared: dict, keep_local: bool, all_keep: bool) -> None:
        super().adopt_shared(shared, keep_local, all_keep)
        if not keep_local:  # threshold and partitions are agreed on by all ranks
            self.state.load_state_dict(shared["exdyna"])

    def state_dict(self) -> dict:
        """Threshold, partitions, iteration and this rank's residual and local rule state
        per parameter name (they differ per rank: every rank saves its own)."""
        return {"exdyna": self.state.state_dict(), **self._memory_state()}

    def load_state_dict(self, state: dict) -> None:
        self.state.load_state_dict(state["exdyna"])
        self._iteration = self.state.iteration
        self._load_memory_state(state)
