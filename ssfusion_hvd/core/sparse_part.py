"""One sparse part of a fusion group: its tensors staged back to back, error-compensated,
selected, packed into the group's allgather buffer, and decoded from every rank's record
(``core/buffers.py`` has the group around it and the wire format).

A sparse part covers several tensors staged back to back in one flat buffer; its
indices are positions in that flat buffer. ``mode`` says how it selects:

* ``"segmented"``: per-tensor top-k of every tensor in ONE kernel call, fused with the error
  feedback (``ops.segmented_ef_topk``);
* ``"group"``: the part's budget (the sum of its tensors' k) shared by magnitude, each
  tensor keeping at least its floor (``ops.group_ef_topk``; SSFusion's default,
  ``docs/schemes.md``, "Group budget");
* ``"per_tensor"``: per-tensor selection by any sparsifier (one call per tensor: the loop runs
  over the sparsified tensors of one group only);
* ``"buffer"``: one selection over the whole fusion buffer (multi-tensor, Cupcake; tensors can
  go missing, SSFusion §III-A).

A part whose sparsifiers select the same indices on every rank (random-k: its seed is
shared) sends ``capacity`` values and no indices; decode sums them over the ranks at the
positions this rank selected.

With ``waits`` (the shared moments, ``scheme_options["waits"]``) a part's record is
followed by one byte per entry, its sender's wait (``core/wire.wait_codes``), and the
decode also computes :attr:`SparsePart.share`, the shares of what arrived that the
moments' rule reads (``moments.share_table``; ``docs/design.md``, "Each sender's wait").
With ``spread`` (the shared Adam rule, ``scheme_options["spread"]``) a byte more per
entry carries its sender's spread (``core/wire.spread_codes``: the variance of the
sender's gradient over the steps the entry waited, as a ratio to its value squared), and
the decode computes :attr:`SparsePart.noise`, the senders' mean variance over P as a
ratio to the arrived sum squared, which the rule adds to Adam's second moment
(``docs/recipe.md``, "The senders' variance").

Sparsifiers that return fewer than ``capacity`` elements are padded with zero values at
distinct *sink* positions past the end of the staged data, so decoding (a scatter-add of P
chunks, which needs distinct indices within a chunk) stays one kernel call and the sink is
never delivered.

A sparse part decodes without a pass over its dense output: ``SparsePart.out`` is zero
between decodes, the records are added into it, and ``ops.deliver_chunks`` moves the
positions they touched, scaled, into the freshly zeroed ``.grad`` tensors and clears them
(:meth:`SparsePart.decode_into`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from .. import ops
from ..moments import share_table
from ..sparsify import ResidualMemory, Sparsifier
from .layout import views
from .wire import code_spreads, code_waits, spread_codes, wait_codes

__all__ = ["DIRECT_MAX_SHARE", "DIRECT_ON_CUDA", "SelectionResult", "SparsePart", "fresh_table"]


@dataclass
class SelectionResult:
    """One sparse part's selection in one iteration (indices are positions in the part)."""

    values: torch.Tensor
    indices: torch.Tensor
    per_tensor: Optional[List[int]] = None  # elements selected per tensor, when known on host
    waits: Optional[torch.Tensor] = None  # this rank's wait per entry, where the wire carries it
    spreads: Optional[torch.Tensor] = None  # this rank's spread per entry, where the wire carries it


def _scaled_copy(out: torch.Tensor, part, grads: List[torch.Tensor],
                 postscale: float) -> torch.Tensor:
    """The full decode's second half: ``out`` (a part's summed records) scaled and copied
    into ``grads``; returns it."""
    if postscale != 1.0:
        out.mul_(postscale)
    torch._foreach_copy_(grads, part.out_views)
    return out


def fresh_table(kind: str, hparams: dict, device) -> Optional[torch.Tensor]:
    """:func:`~ssfusion_hvd.moments.share_table` of every wait code (the wait it stands
    for), float32 on ``device``: a :class:`SparsePart`'s :attr:`~SparsePart.fresh`;
    None where the rule reads no share."""
    table = share_table(kind, hparams, code_waits())
    return None if table is None else table.to(device=device, dtype=torch.float32)


#: Largest share of a sparse part's output that its P gathered records may touch for the
#: decode to write them straight into the gradients (:meth:`SparsePart.decode_into`):
#: below it the direct path's scattered writes cost less than the full path's streaming
#: passes; on the CPU the two cross near 4.6 % (``docs/kernels.md``, "Decode").
DIRECT_MAX_SHARE = 0.045

#: Whether a GPU decode may take the direct path at all. It runs fewer kernels but does
#: more host work per call (zeroing every gradient, the per-call tensor table of
#: ``deliver_chunks``), and the host is what the GPU waits on there: the full path
#: measured faster on an H100 (``docs/kernels.md``, "GPU": "Decode").
DIRECT_ON_CUDA = False


class SparsePart:
    """Sparsified tensors of one group: staged, error-compensated, selected, packed.

    ``dtype`` is the wire (gradient) dtype; ``acc_dtype`` (default: the same) that of the
    staged input, the selection and the decode sums (float32 for float16 gradients)."""

    def __init__(self, key: str, tensors: Sequence[int], shapes: Sequence[torch.Size],
                 ks: Sequence[int], mode: str, sparsifiers: Sequence[Sparsifier], offset: int,
                 dtype: torch.dtype, device: torch.device, stage_device: torch.device | None = None,
                 acc_dtype: torch.dtype | None = None, floors: Sequence[int] | None = None,
                 waits: int = 0, spread: bool = False):
        if mode not in ("segmented", "group", "per_tensor", "buffer"):
            raise ValueError(f"unknown sparse part mode {mode!r}")
        self.key = key
        self.tensors = list(tensors)
        self.numels = [math.prod(s) for s in shapes]
        self.bounds = [0]
        for n in self.numels:
            self.bounds.append(self.bounds[-1] + n)
        self.numel = self.bounds[-1]
        self.ks = [int(k) for k in ks]  # per tensor, or one k for mode "buffer"
        self.mode = mode
        self.sparsifiers = list(sparsifiers)  # one per tensor, or one for the buffer
        expect = 1 if mode == "buffer" else len(self.tensors)
        if len(self.ks) != expect or len(self.sparsifiers) != expect:
            raise ValueError(f"part {key}: mode {mode!r} needs {expect} k and sparsifier(s), "
                             f"got {len(self.ks)} and {len(self.sparsifiers)}")
        if (mode == "group") != (floors is not None) or (
                floors is not None and (len(floors) != len(self.ks)
                                        or any(not 0 <= f <= k for f, k in zip(floors, self.ks)))):
            raise ValueError(f"part {key}: mode {mode!r} with floors {floors} for ks {self.ks} "
                             "(mode 'group' needs one floor per tensor, at most its k)")
        self.floors = None if floors is None else [int(f) for f in floors]
        if mode == "buffer":
            self.capacity = self.sparsifiers[0].capacity(self.ks[0])
        else:
            self.capacity = sum(s.capacity(k) for s, k in zip(self.sparsifiers, self.ks)) \
                if mode == "per_tensor" else sum(self.ks)
        self.dtype = dtype
        self.acc_dtype = acc_dtype or dtype
        self.idx_dtype = ops.index_dtype(self.numel + self.capacity)
        self.offset = offset
        #: every rank selects the same indices (random-k's shared seed): only values travel
        self.shared_indices = all(sp.shared_indices for sp in self.sparsifiers)
        self.length = self.capacity if self.shared_indices else \
            ops.record_numel(self.capacity, dtype, self.idx_dtype)
        #: each entry carries its sender's wait (one byte after the record), from which the
        #: decode computes ``waits`` shares (rows of :attr:`share`; True: one). Not for
        #: shared indices: every rank sends the same elements, so the union's age is every
        #: sender's wait.
        self.waits = 0 if self.shared_indices else int(waits)
        #: each entry carries its sender's spread (one byte after the waits', if any), from
        #: which the decode computes :attr:`noise`. Not for shared indices (every rank
        #: sends every entry every step: no wait, no spread).
        self.spread = bool(spread) and not self.shared_indices
        #: per share, what each wait code weighs (``moments.share_table`` of the rule and
        #: hyper-parameters in force; rows, 256), float32 on the decode's device: set by
        #: the owner before a decode (:func:`fresh_table`)
        self.fresh: Optional[torch.Tensor] = None
        # the codes after the record: the waits' bytes, then the spreads'
        code_rows = bool(self.waits) + self.spread
        if code_rows:
            self._codes_at = offset + self.length
            self._code_span = -(-code_rows * self.capacity
                                // torch.empty(0, dtype=dtype).element_size())
            self.length += self._code_span
        if self.spread:
            self._spread_table = code_spreads().to(device=device, dtype=torch.float32)
            #: the senders' mean spread-variance over P, as a ratio to the arrived sum
            #: squared, at the positions the last decode touched (row 0; row 1: the number
            #: of senders there, scratch; finite everywhere)
            self.noise = torch.zeros(2, self.numel + self.capacity, dtype=torch.float32,
                                     device=device)
            #: per tensor, its noise ratio, shaped like it
            self.noise_views = views(self.noise[0], shapes)
        if self.waits:
            #: the shares of the arrived sum (rows), at the positions the last decode
            #: touched (finite everywhere; where nothing arrived the gradient is 0)
            self.share = torch.zeros(self.waits, self.numel + self.capacity,
                                     dtype=torch.float32, device=device)
            #: per tensor, its shares, shape (rows, *shape)
            self.share_views = [self.share[:, lo:hi].view(self.waits, *shape) for lo, hi, shape
                                in zip(self.bounds, self.bounds[1:], shapes)]
        self._sent_indices: Optional[torch.Tensor] = None
        #: where the part's gradients are staged and selected (the host for an offloaded part)
        self.stage_device = device if stage_device is None else stage_device
        self._stage: Optional[torch.Tensor] = None  # allocated at its first use (:attr:`stage`)
        #: the selection in the optimizer's geometry, where its owner sets it
        #: (``Recipe.step_scales``): ``fn()`` returns what the step divides each of the
        #: part's tensors by (Adam: ``StepScales``, sqrt(v-hat) + eps, or its square root
        #: for the gain), or None (no state yet: magnitude this step). The top-k then takes
        #: the largest pending gains (or steps), |acc| / denominator, instead of the largest
        #: pending gradients (docs/recipe.md, "Selecting by the gain"). Exact top-k parts
        #: only.
        self.step_scales = None
        self._key: Optional[torch.Tensor] = None  # its buffer, allocated at first use
        # decode target: the part's tensors plus the sink that padding entries point into;
        # zero wherever the last decode did not write (decode_into keeps it so)
        self.out = torch.zeros(self.numel + self.capacity, dtype=self.acc_dtype, device=device)
        self.out_views = views(self.out, shapes)
        self._out_zero = True  # out is all zero: the next decode needs no zeroing pass
        self._offsets = torch.tensor(self.bounds, dtype=torch.int64)
        self._ks = torch.tensor(self.ks if floors is None else self.floors, dtype=torch.int64)
        self._sink = torch.arange(self.numel, self.numel + self.capacity,
                                  dtype=self.idx_dtype, device=self.stage_device)

    @property
    def stage(self) -> torch.Tensor:
        """The part's gradients back to back (pinned host memory for a GPU job's offloaded
        part), allocated once, at first use: a part whose gradients the fused kernels read
        where they lie (:meth:`select_grads` on the CPU, :meth:`select_flat`) never needs
        it, and on GPT-2 it is a model-sized buffer."""
        if self._stage is None:
            pin = (self.stage_device.type == "cpu" and self.out.device.type == "cuda"
                   and torch.cuda.is_available())
            self._stage = torch.empty(self.numel, dtype=self.acc_dtype, device=self.stage_device,
                                      pin_memory=pin)
        return self._stage

    # -- encode ------------------------------------------------------------------------
    def stage_grads(self, grads: Sequence[torch.Tensor]) -> None:
        torch.cat([g.reshape(-1) for g in grads], out=self.stage)

    def select_grads(self, memory: ResidualMemory, grads: Sequence[torch.Tensor]) -> SelectionResult:
        """:meth:`stage_grads` then :meth:`select`, in one: an exact top-k part whose
        gradients the fused kernel can read where they lie (``ResidualMemory.
        select_topk_tensors``: the CPU, a residual that exists, a rule it takes inside) is
        selected from them directly, without writing the staged copy, a pass over the part's
        bytes (on GPT-2's 124M elements, one thread: 25 ms of a 85 ms stage and select).
        Same result."""
        if self.stage.device == grads[0].device:
            self._square(memory, grads)
            scales = self.step_scales() if self.step_scales is not None and self._exact() else None
            if scales is not None:  # the key's kernel reads the gradients where they lie too
                return self._sent(memory, self._select_steps(memory, grads, scales))
            got = None
            if self.mode in ("segmented", "group"):
                got = memory.select_topk_tensors(self.key, grads, self._group_k(),
                                                 offsets=self._offsets, ks=self._ks,
                                                 wire_dtype=self.dtype)
            elif self.mode == "buffer" and self.sparsifiers[0].exact_topk:
                got = memory.select_topk_tensors(self.key, grads, self.ks[0], wire_dtype=self.dtype)
            if got is not None:
                return self._sent(memory, SelectionResult(got[0], got[1], self._counts()))
            self.stage_grads(grads)
            return self._sent(memory, self._select(memory))
        self.stage_grads(grads)
        return self.select(memory)

    def select_flat(self, memory: ResidualMemory, flat: torch.Tensor,
                    grads: Sequence[torch.Tensor]) -> SelectionResult:
        """:meth:`select_grads` for gradients that already lie back to back in ``flat`` (a
        DDP bucket's buffer): selected from it where it is what the stage would hold (the
        staged dtype, contiguous, on the stage's device), without a staged copy."""
        if (flat.dtype == self.acc_dtype and flat.device == self.stage_device
                and flat.is_contiguous() and flat.numel() == self.numel):
            self._square(memory, [flat])
            return self._sent(memory, self._select(memory, flat))
        return self.select_grads(memory, grads)

    def _sent(self, memory: ResidualMemory, result: SelectionResult) -> SelectionResult:
        """``result``, with this rank's wait and spread per entry where the wire carries
        them (a spread needs the wait, which is then counted even where it does not
        travel)."""
        if self.waits or self.spread:
            result.waits = memory.sent_waits(self.key, result.indices)
        if self.spread:
            result.spreads = memory.sent_spreads(self.key, result.indices, result.values,
                                                 result.waits)
        return result

    def _square(self, memory: ResidualMemory, grads: Sequence[torch.Tensor]) -> None:
        """This step's gradients into the sums of squares a spread reads (before the
        selection that may send them)."""
        if self.spread:
            memory.add_squares(self.key, grads)

    def _group_k(self) -> Optional[int]:
        """The budget of a group part (its tensors' k summed; ``_ks`` holds the floors),
        None for a segmented one."""
        return self.capacity if self.mode == "group" else None

    def _counts(self) -> Optional[List[int]]:
        """Elements selected per tensor where the host knows them without a sync: a
        segmented part's ks (a group part's split follows the magnitudes)."""
        return list(self.ks) if self.mode == "segmented" else None

    def select(self, memory: ResidualMemory) -> SelectionResult:
        """Error feedback around the selection: acc = grad + residual; what is not sent
        becomes the new residual (``ResidualMemory``: bit-exact bookkeeping). Exact top-k
        (segmented, or over the buffer) runs fused with the error feedback, one kernel."""
        self._square(memory, [self.stage])
        return self._sent(memory, self._select(memory))

    def _select(self, memory: ResidualMemory, staged: Optional[torch.Tensor] = None) -> SelectionResult:
        staged = self.stage if staged is None else staged
        if self.step_scales is not None and self._exact():
            scales = self.step_scales()
            if scales is not None:
                return self._select_steps(memory, list(staged.split(self.numels)), scales)
        if self.mode in ("segmented", "group"):
            values, indices = memory.select_topk(self.key, staged, self._group_k(),
                                                 offsets=self._offsets, ks=self._ks,
                                                 wire_dtype=self.dtype)
            return SelectionResult(values, indices, self._counts())
        if self.mode == "buffer" and self.sparsifiers[0].exact_topk:
            values, indices = memory.select_topk(self.key, staged, self.ks[0],
                                                 wire_dtype=self.dtype)
            return SelectionResult(values, indices)
        acc = memory.compensate(self.key, staged)
        if self.mode == "buffer":
            values, indices = self.sparsifiers[0].select(acc, self.ks[0])
            result = SelectionResult(values, indices)
        else:
            vals, idxs, counts = [], [], []
            for s, k, lo, hi in zip(self.sparsifiers, self.ks, self.bounds, self.bounds[1:]):
                v, i = s.select(acc[lo:hi], k)
                vals.append(v)
                idxs.append(i.to(self.idx_dtype) + lo)
                counts.append(v.numel())
            result = SelectionResult(torch.cat(vals), torch.cat(idxs), counts)
        memory.update(self.key, acc, result.indices, self.dtype)
        return result

    def _exact(self) -> bool:
        """Whether the part's selection is an exact top-k (what a key can replace)."""
        return self.mode in ("segmented", "group") or (
            self.mode == "buffer" and self.sparsifiers[0].exact_topk)

    def _select_steps(self, memory: ResidualMemory, grads: Sequence[torch.Tensor],
                      scales) -> SelectionResult:
        """The exact top-k of the part's pending steps (``grads``: its tensors' gradients,
        one per tensor), ``|acc| / (sqrt(v-hat) + eps)`` from ``scales``
        (``Recipe.step_scales``), under the part's budget (one k, per tensor, or the group's
        with floors): error feedback as the fused kernels do it (the same residual bits),
        the values sent are ``acc``'s. The key is written into a buffer of the part's,
        allocated once."""
        if self._key is None:
            self._key = torch.empty(self.numel, dtype=torch.float32, device=self.stage_device)
        if self.mode == "buffer":
            values, indices = memory.select_steps(self.key, grads, scales, self._key, self.ks[0],
                                                  wire_dtype=self.dtype)
        else:
            values, indices = memory.select_steps(self.key, grads, scales, self._key,
                                                  self._group_k(), offsets=self._offsets,
                                                  ks=self._ks, wire_dtype=self.dtype)
        return SelectionResult(values, indices, self._counts())

    def pack(self, result: SelectionResult, send: torch.Tensor, prescale: float) -> None:
        """Writes the record of ``result`` (padded to capacity) at this part's offset."""
        values, indices = result.values, result.indices.to(self.idx_dtype)
        count = values.numel()
        if count > self.capacity:
            raise RuntimeError(f"part {self.key}: selection of {count} exceeds its capacity "
                               f"{self.capacity}")
        waits, spreads = result.waits, result.spreads
        if count < self.capacity:
            values = torch.cat([values, values.new_zeros(self.capacity - count)])
            indices = torch.cat([indices, self._sink[count:]])
            if waits is not None:
                waits = torch.cat([waits, waits.new_ones(self.capacity - count)])
            if spreads is not None:
                spreads = torch.cat([spreads, spreads.new_zeros(self.capacity - count)])
        if prescale != 1.0:
            values = values * prescale
        values, indices = values.to(send.device, send.dtype), indices.to(send.device)
        if self.shared_indices:  # the values alone; the indices are this rank's own
            send[self.offset:self.offset + self.capacity].copy_(values)
            self._sent_indices = indices
            return
        end = ops.pack(values, indices, send, self.offset)
        if self.waits or self.spread:
            end = self._codes_at + self._code_span
            codes = send.view(torch.uint8)[self._codes_at * send.element_size():
                                           end * send.element_size()]
            at = 0
            if self.waits:
                codes[:self.capacity].copy_(wait_codes(waits.to(send.device)))
                at = self.capacity
            if self.spread:
                codes[at:at + self.capacity].copy_(spread_codes(spreads.to(send.device)))
                at += self.capacity
            codes[at:].zero_()
        if end != self.offset + self.length:
            raise RuntimeError(f"part {self.key}: record ends at {end}, its slot at "
                               f"{self.offset + self.length}")

    # -- decode ------------------------------------------------------------------------
    def decode(self, gathered: torch.Tensor, nranks: int, record_len: int) -> torch.Tensor:
        """The summed records in ``out``, unscaled, after a zeroing pass over ``out``: the
        full path's first half (see :meth:`decode_into`)."""
        self.out.zero_()
        self._out_zero = False
        if self.shared_indices:  # the same positions on every rank: sum the values there
            chunks = gathered.view(nranks, record_len)[:, self.offset:self.offset + self.capacity]
            summed = torch.sum(chunks, dim=0, dtype=self.out.dtype)
            self.out.index_copy_(0, self._sent_indices.to(self.out.device).long(), summed)
        else:
            ops.scatter_add_chunks(self.out, gathered, nranks, self.offset, self.capacity,
                                   self.idx_dtype)
            self._decode_codes(gathered, nranks, record_len)
        return self.out[:self.numel]

    def _decode_codes(self, gathered: torch.Tensor, nranks: int, record_len: int) -> None:
        """:attr:`share` and :attr:`noise` from the records' codes, where the wire carries
        them. Reads the sums from ``out``, so it runs after the records were added into it
        and before they are scaled or delivered."""
        if not (self.waits and self.fresh is not None) and not self.spread:
            return
        rows = gathered.view(nranks, record_len)
        vspan, ispan = ops.record_spans(self.capacity, self.dtype, self.idx_dtype)
        values = rows[:, self.offset:self.offset + self.capacity]
        at = self.offset + vspan
        idx = rows[:, at:at + ispan].clone().view(self.idx_dtype)[:, :self.capacity].long()
        codes = rows[:, self._codes_at:self._codes_at + self._code_span].contiguous()
        codes = codes.view(torch.uint8)
        flat = idx.reshape(-1)
        sums = self.out.index_select(0, flat).float()
        if self.waits:
            self._decode_shares(values, idx, codes[:, :self.capacity].long(), flat, sums)
        if self.spread:
            at = self.capacity if self.waits else 0
            self._decode_noise(values, idx, codes[:, at:at + self.capacity].long(), flat, sums,
                               nranks)

    def _decode_noise(self, values, idx, codes, flat, sums, nranks: int) -> None:
        """:attr:`noise` at the positions the records touch: ``P · mean_r(σ_r²) / S²``, the
        senders' variance ``σ_r² = spread_r · v_r²`` averaged over the ranks that sent an
        entry there, over the arrived sum ``S = Σ_r v_r`` squared: what the averaged
        gradient's variance over one step (``mean σ² / P`` in its units) is to its arrival
        squared. A ratio, so the optimizer's step may rescale the gradient first (a loss
        scale, clipping); scale-free on the wire too (a prescale cancels). 0 where the sum
        is exactly 0 or the ratio is not finite (see :meth:`_decode_shares`). Summed one
        rank at a time, in rank order: the same bits on every rank."""
        var = self._spread_table[codes] * values.float().square()
        ones = torch.ones_like(var[0])
        self.noise.index_fill_(1, flat, 0.0)
        for r in range(nranks):
            self.noise[0].index_add_(0, idx[r], var[r])
            self.noise[1].index_add_(0, idx[r], ones)
        ratio = self.noise[0].index_select(0, flat).div_(
            self.noise[1].index_select(0, flat)).mul_(float(nranks)).div_(sums.square())
        keep = (sums != 0) & torch.isfinite(ratio)
        self.noise[0].index_copy_(0, flat, torch.where(keep, ratio, torch.zeros_like(ratio)))

    def _decode_shares(self, values, idx, codes, flat, sums) -> None:
        """:attr:`share` at the positions the records touch: per row of :attr:`fresh`
        (``w``: a sender's wait's weight), ``Σ_r v_r·w(a_r) / Σ_r v_r`` over the ranks'
        entries there; 0 where they sum to exactly 0 or the ratio is not finite (a step
        whose records hold NaN/Inf is skipped, but its positions keep their shares until
        touched again, and a share multiplies a zero gradient there: it must stay finite,
        or 0·NaN would reach the moments). Reads the sums from ``out``, so it runs after the
        records were added into it and before they are scaled or delivered. A ratio, so
        the optimizer's step may rescale the gradient first (a loss scale, clipping).
        O(P·capacity), no pass over the part; the weighted values are added one rank at a
        time (a record's indices are distinct), so the sums run in rank order and every
        rank gets the same bits, on a GPU too. Nothing without a :attr:`fresh` table
        (an SGD without momentum: no rule reads a share)."""
        if self.fresh is None:
            return
        if self.fresh.shape[0] != self.waits:
            raise RuntimeError(f"part {self.key}: {self.fresh.shape[0]} share tables for "
                               f"{self.waits} shares")
        weighted = self.fresh[:, codes] * values  # (shares, ranks, capacity)
        self.share.index_fill_(1, flat, 0.0)
        for r in range(idx.shape[0]):
            self.share.index_add_(1, idx[r], weighted[:, r])
        ratio = self.share.index_select(1, flat).div_(sums)
        keep = (sums != 0) & torch.isfinite(ratio)
        self.share.index_copy_(1, flat, torch.where(keep, ratio, torch.zeros_like(ratio)))

    def _direct(self, grads: List[torch.Tensor], nranks: int) -> bool:
        """Whether the records are delivered straight into ``grads``: the part has indices,
        the gradients are contiguous, of the wire dtype, on out's device, and the records
        touch at most :data:`DIRECT_MAX_SHARE` of the output (past that, random accesses to
        out and the gradients cost more than the streaming passes they replace); on a GPU
        only with :data:`DIRECT_ON_CUDA`."""
        return (not self.shared_indices
                and (self.out.device.type == "cpu" or DIRECT_ON_CUDA)
                and nranks * self.capacity <= DIRECT_MAX_SHARE * self.numel
                and all(g.is_contiguous() and g.dtype == self.dtype
                        and g.device == self.out.device for g in grads))

    def decode_into(self, gathered: torch.Tensor, nranks: int, record_len: int,
                    grads: List[torch.Tensor], postscale: float) -> torch.Tensor:
        """Decodes into ``grads``, scaled by ``postscale`` (see :func:`unpack`).

        With indices (the usual case), the gradients are touched once and ``out`` only where
        the records point: ``grads`` zeroed (one write pass), the records scatter-added into
        ``out`` (zero there by the invariant: all zero between decodes), then
        ``ops.deliver_chunks`` writes ``out * postscale`` at those positions into ``grads``
        and re-zeroes them in ``out``. Returns a 0-d int64 count of the non-finite values
        written. Bit for bit the result of the full path below.

        Random-k parts (values only), records touching more than :data:`DIRECT_MAX_SHARE`
        of the output, and gradients the native op cannot write (not contiguous) take the
        full path: zero ``out``, add, scale it, copy it into ``grads``;
        returns the scaled flat output."""
        if self._direct(grads, nranks):
            if not self._out_zero:  # a full-path decode ran last
                self.out.zero_()
            torch._foreach_zero_(grads)
            self._out_zero = False  # until the records are out of it again
            ops.scatter_add_chunks(self.out, gathered, nranks, self.offset, self.capacity,
                                   self.idx_dtype)
            self._decode_codes(gathered, nranks, record_len)
            count = ops.deliver_chunks(self.out, grads, gathered, nranks, self.offset,
                                       self.capacity, self.idx_dtype, postscale)
            self._out_zero = True
            return count
        return _scaled_copy(self.decode(gathered, nranks, record_len), self, grads, postscale)

    def missing(self, result: SelectionResult) -> torch.Tensor | int:
        """Tensors of this part with no element selected (host int when known, else a
        0-d device tensor: no host sync in the backward path)."""
        if result.per_tensor is not None:
            return sum(1 for c in result.per_tensor if c == 0)
        if self.floors is not None and min(self.floors) >= 1:
            return 0  # every tensor sends at least its floor
        if len(self.tensors) == 1:
            return int(result.values.numel() == 0)
        owner = torch.bucketize(result.indices.long(), self._offsets[1:-1].to(result.indices.device),
                                right=True)
        hit = torch.zeros(len(self.tensors), dtype=torch.bool, device=owner.device)
        hit[owner] = True
        return (~hit).sum()
