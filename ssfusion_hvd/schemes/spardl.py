"""SparDL: Spar-Reduce-Scatter, global residual collection and Spar-All-Gather.

Paper: "SparDL: Distributed Deep Learning Training with Efficient Sparse Communication"
(ICDE'24), §III-A (overview), §III-B (Spar-Reduce-Scatter, SRS), §III-C (global residual
collection, Algorithm 1), §III-D (Spar-All-Gather: R-SAG and B-SAG with the
compression-ratio adjustment of Algorithm 2).

The whole model gradient is one flat vector (trainable parameters in canonical, name-sorted
order). With ``k = ceil(density * n)`` and ``d`` teams of ``m = P / d`` workers each:

1. **Error feedback**: ``acc = grad + residual`` (the residual of the previous iteration).
2. **SRS** inside each team: ``acc`` is cut into ``m`` contiguous blocks; worker ``w`` keeps
   block ``w`` (preservation bag) and puts the blocks at circular offsets
   ``[2^(i-1), 2^i)`` (the last one clipped at ``m``) into sending bags ``B_1..B_l``,
   ``l = ceil(log2 m)`` — any ``m``, powers of two or not. At step ``s = 1..l`` it sends
   ``B_(l-s+1)`` to worker ``w + 2^(l-s)`` and receives the same bag of worker
   ``w - 2^(l-s)``, whose blocks it still holds (Theorem 1), and adds them in. Right before
   a bag is sent each of its blocks is cut to its top ``L ≈ k / m`` entries (the
   "optimization for SRS": only the blocks about to travel are selected), so every block
   on the wire has ``L`` entries whatever the step (no sparse-gradient accumulation). After
   the last step worker ``w`` holds the team's sum of block ``w`` and cuts it to ``L``.
3. **SAG** (``d > 1``): the ``d`` workers at the same position of the ``d`` teams combine
   their blocks. R-SAG (``d`` a power of two): recursive doubling, ``log2 d`` exchanges
   with the worker of team ``team XOR 2^t``; both sides sum in team order (bit-identical
   results) and cut to ``L``. B-SAG (other ``d``): each worker cuts its block to its top
   ``h`` (``L/d <= h <= L``), a Bruck all-gather (``ceil(log2 d)`` steps) collects the ``d``
   blocks, every worker sums them in team order and cuts to ``L``; ``N_t``, the number of
   distinct indices of that sum, drives Algorithm 2 (below) for the next iteration's ``h``.
4. **All-gather** of the ``m`` blocks of a team: one Horovod ``allgather`` when ``d = 1``,
   a Bruck all-gather inside the team (``ceil(log2 m)`` steps) when ``d > 1``. Blocks are
   disjoint, so decoding is a scatter; the op scaling follows Horovod (Average: the sum
   times ``1/P``, whatever ``gradient_predivide_factor``; Sum: 1).

**Global residual collection** (Algorithm 1): every worker keeps a dense working vector
``W`` that starts as ``acc``; what it sends is removed from ``W``, what it receives is added
to ``W``. Whatever a worker drops — its local selection before the first send, an
in-procedure block top-k of data it received and summed, the final cut of its own block,
a SAG cut (R-SAG: ``1/2^(t+1)`` of the drop on each of the ``2^(t+1)`` workers holding the
same copy; B-SAG: its own top-``h`` drop whole, ``1/d`` of the post-merge drop) — stays in
the ``W`` of the worker that dropped it (line 8: in-procedure residuals live on the
processing worker). At the end, for the indices present in the synchronized gradient the
new residual is ``W`` there; everywhere else it is the worker's own ``acc`` (lines 11-13:
end-procedure residuals stay on the local worker). Summed over workers,
``residuals + delivered == sum of acc`` for every element, up to float rounding (the
additions on the way; ``1/d`` for ``d`` not a power of two): nothing is lost.

Algorithm 2 (B-SAG): ``h0 = L/d``, ``step0 = 0.01 * L * (d-1)/d``. After each iteration,
if ``(N_t > L) XOR (step > 0)`` (the current direction is right: shrink while too many,
grow while too few) the step doubles on every second such iteration, else it is reversed
and halved; then ``h += step``, clamped to ``[L/d, L]`` (the paper's range), ``|step|``
kept in ``[1e-6, L]`` (the paper leaves it unbounded; at a clamp it would double forever).
``h`` and ``N_t`` are the same on the ``d`` workers of a position group (they see the same
sum), so each group adjusts on its own and no extra collective is needed.

Cost (α-β model, payload entries are value + index, paper Eq. 4, 7, 10):

* ``d = 1``: ``2 ceil(log2 P) α + 4 k (P-1)/P β`` (SRS + Bruck; here the final all-gather is
  Horovod's allgather, one collective of the same volume);
* R-SAG: ``(2 ceil(log2 P/d) + log2 d) α + 2k (2(P-d)/P + (d/P) log2 d) β``;
* B-SAG: ``(2 ceil(log2 P/d) + ceil(log2 d)) α`` plus between ``2k (d²+P-2d)/(Pd) β`` and
  ``2k (d²+2P-3d)/P β``.

On Horovod a point-to-point step is an ``alltoall`` whose splits are non-zero for one peer
(each rank sends one payload and receives one); all ranks call the same alltoalls in the
same order with deterministic names, one after another. Gloo's alltoall still exchanges
empty messages with the other peers, so on gloo every step costs a full alltoall's latency,
not one α. Payloads are ``value bytes + index bytes`` of fixed, known size (block-wise top-k
keeps every block at exactly ``min(L, block size)`` entries; B-SAG's ``h`` is shared by the
position group), so no counts are exchanged.

Structure: the algorithm is one pure generator per rank (:func:`run_rank`) that yields its
communication requests (:class:`Send`, :class:`Gather`) and receives the replies; the scheme
(:class:`SparDLScheme`) serves them with Horovod, :func:`simulate` serves all ranks' requests
in memory (used by the tests to check the live scheme bit for bit).

Options and limits:

* Teams: ``SSFUSION_SPARDL_TEAMS`` (environment, read when the optimizer is built; default
  1 = plain SRS + all-gather) must divide ``P`` and be identical on every rank (checked by
  one small allgather at construction). Powers of two use R-SAG, other values B-SAG. The
  paper's advice is to time one epoch per ``d`` and keep the fastest.
* Selection is always exact magnitude top-k (the paper's operator): ``sparsifier=`` other
  than ``"topk"`` is ignored with a warning; ``compression=`` is ignored (nothing is
  allreduced); ``warmup_steps``/``plan``/``profile`` are ignored (SparDL needs no plan).
* The first SRS step starts when the last gradient is submitted; the remaining steps are
  sequential (each needs the previous one's data) and run in ``finish()``. Nothing overlaps
  backward except that first send.
* One dtype (float32, float16, bfloat16) and one device for all trainable gradients.
  Sums are taken in the gradient dtype.
* ``stats()``: the keys of the planned schemes (``phase`` is ``"sparse"``;
  ``allgather_bytes`` is every payload byte this rank sent: its own record in Horovod's
  allgather, as the other schemes count it, and every record it sends or forwards in the
  point-to-point steps; ``elements_sent`` counts entries the same way), plus ``teams``,
  ``sag``, ``srs_steps``, ``collectives``, ``k``, ``block_k`` (largest ``L``),
  ``srs_bytes``/``sag_bytes``/``gather_bytes``, ``delivered`` (entries in the synchronized
  gradient), ``bsag_h`` and ``bsag_count`` (``h`` used and ``N_t``, B-SAG only).

Deviations from the paper, and why:

* Teams are contiguous ranks (team ``t`` = ranks ``t*m .. t*m+m-1``); the paper only asks
  for equal teams.
* R-SAG keeps ``1/2^(t+1)`` of a drop at step ``t`` on each side, not "half": from the
  second step on, ``2^(t+1)`` workers hold the same copy, and half on each would count the
  drop ``2^t`` times. (For ``d = 2`` both read the same.)
* ``k`` is spread over the blocks exactly (see :class:`Layout`) instead of ``k/P`` each, so
  the achieved density is the user's; every block sends at least one entry.
* Algorithm 2 runs after each iteration on the ``N_t`` just counted (the first iteration
  uses the initial ``h``); ``h`` is clamped and ``|step|`` bounded as said above.
* For ``d = 1`` the final all-gather is Horovod's allgather (one collective, same volume as
  Bruck; fewer Horovod cycles), not Bruck's ``ceil(log2 P)`` steps.
"""
from __future__ import annotations

import itertools
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Generator, List, NamedTuple, Optional, Sequence, Tuple

import torch
from horovod.torch.mpi_ops import (Average, allgather, allgather_async, alltoall_async,
                                   synchronize)

from .. import ops
from ..plan.cost import nominal_k
from .base import SyncConfig, WholeGradientScheme

__all__ = ["SparDLScheme", "Layout", "BSAGState", "RankResult", "Send", "Gather", "run_rank",
           "simulate", "encode", "decode", "output_scale", "teams_from_env", "TEAMS_ENV"]

TEAMS_ENV = "SSFUSION_SPARDL_TEAMS"
_instances = itertools.count()

Sparse = Tuple[torch.Tensor, torch.Tensor]  # (values, global indices), indices ascending


def teams_from_env() -> int:
    raw = os.environ.get(TEAMS_ENV, "1").strip() or "1"
    try:
        d = int(raw)
    except ValueError:
        raise ValueError(f"{TEAMS_ENV} must be a positive integer, got {raw!r}") from None
    if d < 1:
        raise ValueError(f"{TEAMS_ENV} must be a positive integer, got {raw!r}")
    return d


def output_scale(average: bool, nranks: int) -> float:
    """Factor applied to the summed gradient: Horovod's Average is ``sum / P`` (the
    predivide factor cancels), Sum is 1."""
    return 1.0 / nranks if average else 1.0


# --------------------------------------------------------------------------- layout


class Layout:
    """Everything shape-like about one SparDL iteration; identical on every rank.

    ``numel`` elements, ``nranks`` workers in ``teams`` teams of ``team_size``; the flat
    vector is cut into ``team_size`` contiguous blocks (the first ``numel % team_size`` one
    element longer); block ``b`` travels with ``block_k[b]`` entries: ``k = ceil(density *
    numel)`` spread over the blocks (``k // team_size``, the first ``k % team_size`` blocks
    one more; at least 1, at most the block's length), so a team's blocks carry ``k`` in all
    (the paper's ``L(k, d, P) = dk/P`` per block) and no block is starved. ``L`` is the
    largest ``block_k``.
    """

    def __init__(self, numel: int, nranks: int, teams: int, density: float,
                 dtype: torch.dtype = torch.float32):
        if nranks < 1 or teams < 1 or nranks % teams:
            raise ValueError(f"SparDL teams must divide the number of workers: {teams} teams "
                             f"for {nranks} workers (set {TEAMS_ENV})")
        self.numel, self.nranks, self.teams = int(numel), int(nranks), int(teams)
        self.density, self.dtype = float(density), dtype
        self.team_size = m = nranks // teams
        self.k = int(nominal_k(numel, density)) if numel else 0
        base, extra = divmod(self.numel, m)
        sizes = [base + (1 if b < extra else 0) for b in range(m)]
        self.bounds = tuple(itertools.accumulate([0] + sizes))
        per, more = divmod(self.k, m)  # k spread over the blocks, every block at least 1
        self.block_k = tuple(min(s, max(1, per + (1 if b < more else 0)))
                             for b, s in enumerate(sizes))
        self.L = max(self.block_k) if self.block_k else 0
        self.idx_dtype = ops.index_dtype(max(self.numel, 1))
        self.steps = max(0, math.ceil(math.log2(m))) if m > 1 else 0
        if teams == 1:
            self.sag = "none"
        elif teams & (teams - 1) == 0:
            self.sag = "rsag"
        else:
            self.sag = "bsag"

    def team_of(self, rank: int) -> int:
        return rank // self.team_size

    def pos_of(self, rank: int) -> int:
        return rank % self.team_size

    def rank_of(self, team: int, pos: int) -> int:
        return team * self.team_size + pos

    def block(self, b: int) -> Tuple[int, int]:
        return self.bounds[b], self.bounds[b + 1]

    def srs_schedule(self) -> List[Tuple[int, int, int]]:
        """Per SRS step: (distance, first offset, end offset) of the bag sent; offsets are
        circular block offsets from the sender's own block (§III-B, "partitioning")."""
        out = []
        for s in range(1, self.steps + 1):
            dist = 1 << (self.steps - s)
            out.append((dist, dist, min(2 * dist, self.team_size)))
        return out

    def bsag_range(self, pos: int) -> Tuple[float, float]:
        L = self.block_k[pos]
        return L / self.teams, float(L)

    def __repr__(self):
        return (f"Layout(numel={self.numel}, nranks={self.nranks}, teams={self.teams}, "
                f"k={self.k}, L={self.L}, sag={self.sag!r})")


def bruck_schedule(g: int) -> List[Tuple[int, int]]:
    """Bruck all-gather among ``g`` members: per step (distance, items sent)."""
    out, dist = [], 1
    while dist < g:
        out.append((dist, min(dist, g - dist)))
        dist *= 2
    return out


# --------------------------------------------------------------------------- wire codec


def encode(items: Sequence[Sparse]) -> torch.Tensor:
    """Records back to back, each its values' bytes then its indices' bytes (uint8)."""
    parts = []
    for v, i in items:
        parts.append(v.contiguous().view(torch.uint8).reshape(-1))
        parts.append(i.contiguous().view(torch.uint8).reshape(-1))
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat(parts)


def decode(buf: torch.Tensor, counts: Sequence[int], dtype: torch.dtype,
           idx_dtype: torch.dtype) -> List[Sparse]:
    """The records of ``counts`` entries each, in order (copies)."""
    vb = torch.empty(0, dtype=dtype).element_size()
    ib = torch.empty(0, dtype=idx_dtype).element_size()
    want = sum(counts) * (vb + ib)
    if buf.numel() != want:
        raise RuntimeError(f"SparDL: received {buf.numel()} bytes, expected {want} "
                           f"({list(counts)} entries)")
    out, at = [], 0
    for c in counts:
        v = buf[at:at + c * vb].clone().view(dtype)
        at += c * vb
        i = buf[at:at + c * ib].clone().view(idx_dtype)
        at += c * ib
        out.append((v, i))
    return out


# --------------------------------------------------------------------------- pure steps


def select_blocks(layout: Layout, W: torch.Tensor, blocks: Sequence[int]) -> Sparse:
    """Block-wise top-k of the blocks about to be sent (consecutive, circular): removes
    them from ``W`` and returns them (global indices)."""
    runs: List[List[int]] = []
    for b in blocks:
        if runs and runs[-1][-1] + 1 == b:
            runs[-1].append(b)
        else:
            runs.append([b])
    vals, idxs = [], []
    for run in runs:  # at most two: a bag wraps around the circle once
        lo, hi = layout.bounds[run[0]], layout.bounds[run[-1] + 1]
        offsets = [layout.bounds[b] - lo for b in run] + [hi - lo]
        v, i = ops.segmented_topk(W[lo:hi], offsets, [layout.block_k[b] for b in run])
        vals.append(v.clone())
        idxs.append(i + lo)
    v, i = torch.cat(vals), torch.cat(idxs).to(layout.idx_dtype)
    W.index_fill_(0, i.long(), 0)
    return v, i


def select_own(layout: Layout, W: torch.Tensor, pos: int) -> Sparse:
    """The final cut of the preserved block (Algorithm 1, line 9)."""
    lo, hi = layout.block(pos)
    v, i = ops.topk(W[lo:hi], layout.block_k[pos])
    v, i = v.clone(), (i + lo).to(layout.idx_dtype)
    W.index_fill_(0, i.long(), 0)
    return v, i


def absorb(W: torch.Tensor, item: Sparse) -> None:
    """Adds received sparse data into the held blocks (distinct indices)."""
    ops.scatter_add(W, item[0], item[1])


def merge(layout: Layout, pos: int, items: Sequence[Sparse], W: torch.Tensor,
          share: float) -> Tuple[Sparse, torch.Tensor]:
    """SAG merge: sums ``items`` (in the given, canonical team order) in block ``pos``, cuts
    the sum to ``block_k[pos]`` and adds ``share`` of the dropped part to ``W``. Returns the
    kept entries and N_t, the number of distinct indices summed (a 0-dim tensor)."""
    lo, hi = layout.block(pos)
    acc = torch.zeros(hi - lo, dtype=W.dtype, device=W.device)
    seen = torch.zeros(hi - lo, dtype=torch.bool, device=W.device)
    for v, i in items:
        local = (i.long() - lo)
        acc.index_add_(0, local, v)
        seen[local] = True
    v, i = ops.topk(acc, layout.block_k[pos])
    v = v.clone()
    acc.index_fill_(0, i.long(), 0)
    W[lo:hi].add_(acc, alpha=share)
    return (v, (i + lo).to(layout.idx_dtype)), seen.sum()


def trim(S: Sparse, h: int, W: torch.Tensor) -> Sparse:
    """B-SAG's extra top-h before the Bruck exchange; the dropped entries go to ``W``."""
    v, i = S
    if h >= v.numel():
        return S
    _, keep = ops.topk(v, h)
    keep = keep.long()
    drop = torch.ones(v.numel(), dtype=torch.bool, device=v.device)
    drop[keep] = False
    ops.scatter_add(W, v[drop], i[drop])
    return v[keep], i[keep]


def collect_residual(acc: torch.Tensor, W: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """Algorithm 1, lines 11-13: ``acc`` (taken over) with the synchronized indices replaced
    by what this worker dropped there."""
    idx = final.long()
    return acc.index_copy_(0, idx, W.index_select(0, idx))


@dataclass
class BSAGState:
    """Algorithm 2's state on one rank (shared by its position group)."""

    h: float
    step: float
    flag: bool = False
    count: int = -1  # N_t of the last iteration

    @classmethod
    def initial(cls, layout: Layout, pos: int) -> "BSAGState":
        lo, hi = layout.bsag_range(pos)
        d = layout.teams
        return cls(h=lo, step=0.01 * hi * (d - 1) / d)

    def h_int(self, layout: Layout, pos: int) -> int:
        return int(min(layout.block_k[pos], max(1, round(self.h))))

    def adjust(self, layout: Layout, pos: int, count: int) -> None:
        lo, hi = layout.bsag_range(pos)
        self.count = int(count)
        if (count > hi) != (self.step > 0):  # the direction is right: keep it, speed up
            if self.flag:
                self.step *= 2
                self.flag = False
            else:
                self.flag = True
        else:  # overshot: turn back, slow down
            self.step = -self.step / 2
            self.flag = False
        bound = max(hi, 1.0)
        mag = min(max(abs(self.step), 1e-6 * bound), bound)
        self.step = math.copysign(mag, self.step)
        self.h = min(max(self.h + self.step, lo), hi)

    def as_dict(self) -> dict:
        return {"h": self.h, "step": self.step, "flag": self.flag, "count": self.count}


class Send(NamedTuple):
    """Point-to-point step: ``payload`` to ``target``; the reply is ``source``'s payload."""

    name: str
    payload: torch.Tensor
    target: int
    source: int


class Gather(NamedTuple):
    """All-gather of every rank's ``payload``; the reply is their concatenation in rank order."""

    name: str
    payload: torch.Tensor


@dataclass
class RankResult:
    delivered: torch.Tensor  # the summed (unscaled) synchronized gradient, flat
    residual: torch.Tensor  # this rank's new residual, flat
    final: torch.Tensor  # indices present in the synchronized gradient
    elements_sent: int = 0
    bytes: dict = field(default_factory=lambda: {"srs": 0, "sag": 0, "gather": 0})
    count: Optional[int] = None  # B-SAG N_t
    h: Optional[int] = None  # B-SAG top-h used


def _bruck(layout: Layout, members: Sequence[int], me: int, item: Sparse,
           counts: Sequence[int], tag: str, out: RankResult, phase: str):
    """Bruck all-gather (sub-generator): member ``me`` of ``members`` (global ranks);
    ``counts[j]`` = entries of member j's item. Returns the items in member order."""
    g = len(members)
    held = [item]  # held[x] is the item of member (me + x) % g
    for j, (dist, count) in enumerate(bruck_schedule(g)):
        payload = encode(held[:count])
        src = (me + dist) % g
        reply = yield Send(f"{tag}{j}", payload, members[(me - dist) % g], members[src])
        out.bytes[phase] += payload.numel()
        out.elements_sent += sum(v.numel() for v, _ in held[:count])
        held += decode(reply, [counts[(src + x) % g] for x in range(count)],
                       layout.dtype, layout.idx_dtype)
    return [held[(x - me) % g] for x in range(g)]


def run_rank(layout: Layout, rank: int, acc: torch.Tensor,
             bsag: Optional[BSAGState] = None) -> Generator:
    """One rank's SparDL iteration on its error-compensated flat gradient ``acc`` (taken
    over). Yields :class:`Send` / :class:`Gather` requests, expects the replies, returns a
    :class:`RankResult`. ``bsag`` (B-SAG only) is read and then adjusted in place."""
    m, d = layout.team_size, layout.teams
    team, pos = layout.team_of(rank), layout.pos_of(rank)
    dtype, idt = layout.dtype, layout.idx_dtype
    W = acc.clone()
    res = RankResult(delivered=acc, residual=acc, final=acc)  # filled below
    # ---- Spar-Reduce-Scatter inside the team (§III-B)
    for s, (dist, first, end) in enumerate(layout.srs_schedule()):
        blocks = [(pos + o) % m for o in range(first, end)]
        item = select_blocks(layout, W, blocks)
        payload = encode([item])
        source = (pos - dist) % m
        reply = yield Send(f"srs{s}", payload, layout.rank_of(team, (pos + dist) % m),
                           layout.rank_of(team, source))
        res.bytes["srs"] += payload.numel()
        res.elements_sent += item[0].numel()
        got = [(source + o) % m for o in range(first, end)]
        absorb(W, decode(reply, [sum(layout.block_k[b] for b in got)], dtype, idt)[0])
    S = select_own(layout, W, pos)
    # ---- Spar-All-Gather across teams (§III-D)
    if layout.sag == "rsag":
        for t in range(d.bit_length() - 1):
            partner = team ^ (1 << t)
            peer = layout.rank_of(partner, pos)
            payload = encode([S])
            reply = yield Send(f"rsag{t}", payload, peer, peer)
            res.bytes["sag"] += payload.numel()
            res.elements_sent += S[0].numel()
            other = decode(reply, [layout.block_k[pos]], dtype, idt)[0]
            items = [S, other] if team < partner else [other, S]
            S, _ = merge(layout, pos, items, W, share=0.5 ** (t + 1))
    elif layout.sag == "bsag":
        if bsag is None:
            raise ValueError("B-SAG needs its BSAGState")
        h = res.h = bsag.h_int(layout, pos)
        S = trim(S, h, W)
        items = yield from _bruck(layout, [layout.rank_of(x, pos) for x in range(d)], team, S,
                                  [h] * d, "bsag", res, "sag")
        S, count = merge(layout, pos, items, W, share=1.0 / d)
        res.count = int(count)
        bsag.adjust(layout, pos, res.count)
    # ---- All-gather inside the team
    if m == 1:
        items = [S]
    elif d == 1:
        payload = encode([S])
        reply = yield Gather("ag", payload)
        res.bytes["gather"] += payload.numel()
        res.elements_sent += S[0].numel()
        items = decode(reply, list(layout.block_k), dtype, idt)
    else:
        items = yield from _bruck(layout, [layout.rank_of(team, x) for x in range(m)], pos, S,
                                  list(layout.block_k), "ag", res, "gather")
    delivered = torch.zeros_like(acc)
    for v, i in items:  # disjoint blocks
        ops.scatter_add(delivered, v, i)
    res.final = torch.cat([i for _, i in items])
    res.delivered = delivered
    res.residual = collect_residual(acc, W, res.final)
    return res


def simulate(layout: Layout, accs: Sequence[torch.Tensor],
             bsag: Optional[Sequence[BSAGState]] = None) -> List[RankResult]:
    """All ranks of one iteration in one process: :func:`run_rank` with the collectives
    served in memory. ``accs[r]`` is taken over; ``bsag[r]`` is adjusted in place."""
    P = layout.nranks
    if len(accs) != P:
        raise ValueError(f"{len(accs)} inputs for {P} ranks")
    gens = [run_rank(layout, r, accs[r], None if bsag is None else bsag[r]) for r in range(P)]
    results: List[Optional[RankResult]] = [None] * P
    replies: List[Optional[torch.Tensor]] = [None] * P
    while True:
        reqs = []
        for r, g in enumerate(gens):
            try:
                reqs.append(g.send(replies[r]))
            except StopIteration as stop:
                results[r] = stop.value
                reqs.append(None)
        if all(q is None for q in reqs):
            return results
        if any(q is None for q in reqs) or len({(type(q), q.name) for q in reqs}) != 1:
            raise RuntimeError(f"ranks disagree on the next collective: {reqs}")
        if isinstance(reqs[0], Gather):
            whole = torch.cat([q.payload for q in reqs])
            replies = [whole] * P
            continue
        replies = [None] * P
        for r, q in enumerate(reqs):
            if reqs[q.target].source != r:
                raise RuntimeError(f"{q.name}: rank {r} sends to {q.target}, which expects "
                                   f"{reqs[q.target].source}")
            replies[q.target] = q.payload


# --------------------------------------------------------------------------- the scheme


class SparDLScheme(WholeGradientScheme):
    """SparDL over Horovod (see the module docstring)."""

    name = "spardl"

    def __init__(self, config: SyncConfig):
        super().__init__(config)
        self._tag = f"spardl{next(_instances)}"  # created in the same order on every rank
        self._shapes = [p.shape for p in self._trainable]
        if config.sparsifier != "topk":
            warnings.warn(f"scheme 'spardl' selects by exact top-k (the paper's operator); "
                          f"sparsifier={config.sparsifier!r} is ignored")
        self._nranks = config.process_set.size()
        self._rank = config.process_set.rank()
        teams = teams_from_env()
        seen = allgather(torch.tensor([teams], dtype=torch.int64), name=f"{self._tag}.teams",
                         process_set=config.process_set)
        if len(set(seen.tolist())) != 1:
            raise ValueError(f"{TEAMS_ENV} differs between ranks: {seen.tolist()}")
        self._teams = teams
        self.layout = None
        self._set_layout()
        self._scale = output_scale(config.op == Average, self._nranks)
        ends = torch.tensor(list(itertools.accumulate(self.flat.sizes)), dtype=torch.int64)
        self._tensor_ends = ends
        self._stats: dict = {}
        self.reset()

    def _set_layout(self) -> None:
        """The layout of the density in force (density warm-up changes it per stage).
        Values travel in the accumulation dtype: relays add partial sums, which float16
        would round at every hop."""
        density = self._density()
        if self.layout is not None and self.layout.density == density:
            return
        self.layout = Layout(sum(self.flat.sizes), self._nranks, self._teams, density,
                             self._acc_dtype())
        pos = self.layout.pos_of(self._rank)
        self._bsag = BSAGState.initial(self.layout, pos) if self.layout.sag == "bsag" else None

    # ------------------------------------------------------------------ submit

    def _launch(self) -> None:
        self._set_layout()
        flat = torch.cat([self._grad(p).reshape(-1) for p in self._trainable])
        acc = self._memory.compensate(self._KEY, flat)
        self._gen = run_rank(self.layout, self._rank, acc, self._bsag)
        self._advance(None)

    def _advance(self, reply) -> None:
        """Runs this rank's algorithm up to its next request and submits it (async)."""
        t0 = time.perf_counter()
        try:
            req = self._gen.send(reply)
        except StopIteration as stop:
            self._result, self._gen, self._handle = stop.value, None, None
            self._sparsify_s += time.perf_counter() - t0
            return
        self._sparsify_s += time.perf_counter() - t0
        ps = self.config.process_set
        name = f"{self._tag}.{req.name}"
        self._collectives += 1
        if isinstance(req, Gather):
            self._handle = ("ag", allgather_async(req.payload, name=name, process_set=ps))
        else:
            splits = torch.zeros(self._nranks, dtype=torch.int32)
            splits[req.target] = req.payload.numel()
            self._handle = ("a2a", alltoall_async(req.payload, splits=splits, name=name,
                                                  process_set=ps), req.source)

    def finish(self) -> None:
        if self._submitted == 0 and self._gen is None and self._result is None:
            return  # nothing was submitted (no trainable parameters)
        if self._submitted < len(self._trainable):
            raise RuntimeError(f"spardl: finish() after {self._submitted} of "
                               f"{len(self._trainable)} gradients were submitted")
        t_wait = time.perf_counter()
        while self._gen is not None:
            kind, handle = self._handle[0], self._handle[1]
            out = synchronize(handle)
            if kind == "a2a":
                out, received = out
                src = self._handle[2]
                if int(received.sum()) != int(received[src]):
                    raise RuntimeError(f"spardl: data from ranks other than {src}: "
                                       f"{received.tolist()}")
            self._advance(out)
        result = self._result
        flat = result.delivered
        if self._scale != 1.0:
            flat.mul_(self._scale)
        views = torch.split(flat, self.flat.sizes)
        torch._foreach_copy_([p.grad for p in self._trainable],
                             [v.view(s) for v, s in zip(views, self._shapes)])
        self._memory.set_residual(self._KEY, result.residual, result.final)
        t_end = time.perf_counter()
        self._finished()
        self._record_stats(result, flat, t_wait, t_end)
        self.reset()

    def _record_stats(self, result: RankResult, flat: torch.Tensor, t_wait, t_end) -> None:
        lay = self.layout
        n = lay.numel
        self._stats = {
            "phase": "sparse", "iteration": self._iteration,
            "allreduce_bytes": 0, "allgather_bytes": sum(result.bytes.values()),
            "tensors_dense": 0, "tensors_sparse": len(self._trainable),
            "elements": n, "elements_sent": result.elements_sent,
            "density": result.elements_sent / max(n, 1), "density_target": lay.density,
            "tensors_missing": (result.final, self._tensor_ends),  # resolved lazily by stats()
            # only the delivered entries can be non-finite (the rest is 0): count those
            "nonfinite": torch.isfinite(flat.index_select(0, result.final.long())).logical_not_().sum(),
            "sparsify_s": self._sparsify_s, "offload_s": 0.0,
            "communicate_s": t_end - (self._t_first if self._t_first is not None else t_wait),
            "wait_s": t_end - t_wait,
            # SparDL extras
            "teams": lay.teams, "sag": lay.sag, "srs_steps": lay.steps,
            "collectives": self._collectives, "block_k": lay.L, "k": lay.k,
            "srs_bytes": result.bytes["srs"], "sag_bytes": result.bytes["sag"],
            "gather_bytes": result.bytes["gather"],
            "delivered": int(result.final.numel()),
            "bsag_h": result.h,
            "bsag_count": result.count,
        }

    def stats(self) -> dict:
        out = dict(self._stats)
        if isinstance(out.get("tensors_missing"), tuple):
            final, ends = out["tensors_missing"]
            which = torch.bucketize(final.long().cpu(), ends, right=True)
            hits = torch.bincount(which, minlength=ends.numel())[:ends.numel()]
            out["tensors_missing"] = int((hits == 0).sum())
        if isinstance(out.get("nonfinite"), torch.Tensor):
            out["nonfinite"] = int(out["nonfinite"])
        return out

    def pending(self) -> bool:
        return self._submitted > 0 or self._gen is not None

    def reset(self) -> None:
        self._submitted = 0
        self._gen = None
        self._handle = None
        self._result: Optional[RankResult] = None
        self._t_first = None
        self._sparsify_s = 0.0
        self._collectives = 0

    # ------------------------------------------------------------------ state
    def shared_state(self) -> dict:
        return {"iteration": self._iteration, "teams": self.layout.teams}

    def adopt_shared(self, shared: dict, keep_local: bool, all_keep: bool) -> None:
        super().adopt_shared(shared, keep_local, all_keep)
        self._set_layout()
        if not all_keep and self._bsag is not None:
            # Algorithm 2's state is shared by a position group; a rank that starts from
            # zero would leave its group: every rank restarts it
            self._bsag = BSAGState.initial(self.layout, self.layout.pos_of(self._rank))

    def state_dict(self) -> dict:
        """Residuals and local rule state per parameter name (they differ per rank: every
        rank saves its own), the iteration count, the team count and Algorithm 2's state
        (B-SAG)."""
        return {"iteration": self._iteration, "teams": self.layout.teams,
                **self._memory_state(),
                "bsag": None if self._bsag is None else self._bsag.as_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.reset()
        self._iteration = int(state["iteration"])
        self._load_memory_state(state)
        self._set_layout()
        if self._bsag is not None:
            if state.get("bsag") is not None and int(state.get("teams", 0)) == self.layout.teams:
                self._bsag = BSAGState(**state["bsag"])
            else:
                self._bsag = BSAGState.initial(self.layout, self.layout.pos_of(self._rank))
