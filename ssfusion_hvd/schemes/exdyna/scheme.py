"""ExDyna as a scheme: error feedback, exclusive selection in this rank's partition,
the index allgather, the values' allreduce and the decode."""
from __future__ import annotations

import copy
import math
import time
from typing import Optional

import torch

from ... import ops
from ...core.transport import Sum
from ...core.wire import noise_ratio, noise_shares
from ...sparsify.base import trim
from ..base import SELECT_BY, SPREAD, Option, SyncConfig, carries_spread, is_int, is_real
from ..whole import WholeGradientScheme
from .state import ExDynaState


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
        # the threshold on Adam's pending gain (or step) instead of the magnitude, as the
        # other schemes' top-k (docs/recipe.md, "Selecting by the gain")
        "select_by": SELECT_BY,
        # each rank's variance after its values, as a float16 share in a second allreduce
        # (docs/recipe.md, "The senders' variance"): every rank sends every selected
        # element, so the sum of the ranks' variances is an allreduce too
        "spread": SPREAD,
    }

    def __init__(self, config: SyncConfig):
        super().__init__(config)
        self._numel = self.flat.numel
        self._nranks, self._rank = self.transport.size, self.transport.rank
        self._idx_dtype = ops.index_dtype(self._numel)
        self.state = ExDynaState(self._numel, self._nranks, self._density(),
                                 **{k: v for k, v in self.opts.items()
                                    if k not in ("select_by", "spread")})
        self.spread = carries_spread(config, self.opts["spread"])
        # per element, the noise ratio of its last arrival (flat), and its views per tensor
        self._noise = (torch.zeros(self._numel, dtype=torch.float32, device=self._device)
                       if self.spread else None)
        self._noise_views = (dict(zip(self._trainable, self.flat.views(self._noise)))
                             if self.spread else {})
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
        if self.spread:  # this step's gradients into the sums of squares a spread reads
            self._memory.add_squares(self._KEY, [self._flat])
        acc = self._memory.compensate(self._KEY, self._flat)
        st.set_density(self._density())  # density warm-up: the target of this step
        scales = self._step_scales()  # every rank alike: the optimizer's state is shared
        st.set_keyed(scales is not None and ("gain" if scales.root else "step"))
        if scales is not None and st.density > self.config.recipe.density:
            # the density warm-up on the key: Adam's first steps move v-hat, and with it the
            # key's scale, faster than Algorithm 5 follows (the threshold sent 0.04 of the
            # elements in the first epoch against the schedule's 0.19); an exact top-k
            # each warm-up step keeps to the schedule (docs/results/accuracy_bystep_whole.md)
            st.threshold = None
        lo, hi = st.partition(self._rank)
        part = acc[lo:hi]
        if scales is not None and hi > lo:  # the partition's pending steps, |acc| / denominator
            if self._den is None:
                self._den = torch.empty(self._numel, dtype=torch.float32, device=acc.device)
            # the denominators of this rank's partition only (1/P of the model's)
            vs, which = self.flat.window(scales.exp_avg_sqs, lo, hi)
            den = ops.step_denominator(vs, [scales.bias2_sqrt[i] for i in which], scales.eps,
                                       self._den[:hi - lo], root=scales.root)
            part = torch.div(part, den, out=den).abs_()
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
        values = self._acc.index_select(0, gathered.long())
        if self.spread:
            # every rank sends every gathered element: its variance over its wait, to go
            # as its share of the noise ratio once the values are summed (below)
            variances = self._memory.sent_spreads(
                self._KEY, gathered, values, self._memory.sent_waits(self._KEY, gathered)
            ).mul_(values.float().square())
        # (the allreduce is in place: ``values`` itself where no cast or compression copies)
        compressed, ctx = cfg.compression.compress(values.to(self._dtype))  # the wire dtype
        pre, post = tr.horovod_scales()
        handle = tr.allreduce(compressed, "val", prescale=pre, postscale=post)
        reduced = cfg.compression.decompress(tr.wait(handle), ctx).to(self._out.dtype)
        if self.spread:
            # the noise ratio Σ_r σ_r² / (Σ_r v_r)², ``reduced`` being c·Σ_r v_r (c the
            # allreduce's scale): each rank's share in 16 bits, summed by a second, small
            # allreduce (riding the values' one as a variance took 4 bytes an element, and
            # a float16 wire underflowed it)
            pre, post = tr.scales()
            where = gathered.long()
            against = self._noise_against(where, reduced)
            shares = noise_shares(variances, against, pre * post, self._nranks)
            self._noise[where] = noise_ratio(tr.wait(tr.allreduce(shares, "var", op=Sum)),
                                             against, reduced)
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

    def noise(self) -> dict:
        return self._noise_views if self._last_sparse else {}

    def pending(self) -> bool:
        return self._submitted > 0 or self._ag is not None

    def reset(self) -> None:
        super().reset()
        self._ag = self._kth = None
        self._acc = None
        self._calibrating = False

    def signature(self):
        """``(iteration, keyed)``: whether this step's threshold is on Adam's pending step
        decides whether it calibrates, an allgather more; it follows the optimizer's state,
        which a checkpoint loaded on some ranks only (not broadcast) leaves different, so
        the ranks agree on it before any collective, or all raise."""
        return (self._iteration, int(self._step_scales() is not None))

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
