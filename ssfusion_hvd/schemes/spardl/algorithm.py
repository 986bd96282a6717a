"""SparDL's algorithm, free of Horovod: the layout, the schedules, the pure steps and one
rank's iteration as a generator of communication requests (:func:`run_rank`).

See the package docstring (:mod:`ssfusion_hvd.schemes.spardl`) for the algorithm, its cost
and its deviations from the paper. Payloads are :mod:`ssfusion_hvd.core.wire` messages
(records back to back) in the layout's value dtype; a reply is the same kind of buffer.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Generator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ... import ops
from ...core import wire
from ...core.wire import Sparse  # (values, global indices), indices ascending
from ...plan.cost import nominal_k

__all__ = ["Layout", "BSAGState", "RankResult", "Send", "Gather", "run_rank", "output_scale",
           "bruck_schedule"]


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
                             f"for {nranks} workers (pass scheme_options={{'teams': d}} "
                             f"with d dividing {nranks})")
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

# --------------------------------------------------------------------------- pure steps


def _top(x: torch.Tensor, k: int, den: Optional[torch.Tensor]) -> Sparse:
    """The top ``k`` of ``x`` (values, positions in ``x``): by magnitude, or, with ``den``
    (``x``'s shared Adam denominators), by the step ``|x| / den`` the rule would take
    (``docs/recipe.md``, "Selecting by the step"; every rank holds the same ``den``)."""
    if den is None:
        return ops.topk(x, k)
    i = ops.keyed_topk(torch.div(x, den).abs_(), k)
    return x.index_select(0, i.long()), i


def select_blocks(layout: Layout, W: torch.Tensor, blocks: Sequence[int],
                  den: Optional[torch.Tensor] = None) -> Sparse:
    """Block-wise top-k of the blocks about to be sent (consecutive, circular): removes
    them from ``W`` and returns them (global indices). ``den``: as :func:`_top`."""
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
        ks = [layout.block_k[b] for b in run]
        if den is None:
            v, i = ops.segmented_topk(W[lo:hi], offsets, ks)
        else:
            i = ops.keyed_topk(torch.div(W[lo:hi], den[lo:hi]).abs_(), None, offsets, ks)
            v = W[lo:hi].index_select(0, i.long())
        vals.append(v.clone())
        idxs.append(i + lo)
    v, i = torch.cat(vals), torch.cat(idxs).to(layout.idx_dtype)
    W.index_fill_(0, i.long(), 0)
    return v, i


def select_own(layout: Layout, W: torch.Tensor, pos: int,
               den: Optional[torch.Tensor] = None) -> Sparse:
    """The final cut of the preserved block (Algorithm 1, line 9)."""
    lo, hi = layout.block(pos)
    v, i = _top(W[lo:hi], layout.block_k[pos], None if den is None else den[lo:hi])
    v, i = v.clone(), (i + lo).to(layout.idx_dtype)
    W.index_fill_(0, i.long(), 0)
    return v, i


def absorb(W: torch.Tensor, item: Sparse) -> None:
    """Adds received sparse data into the held blocks (distinct indices)."""
    ops.scatter_add(W, item[0], item[1])


def merge(layout: Layout, pos: int, items: Sequence[Sparse], W: torch.Tensor,
          share: float, den: Optional[torch.Tensor] = None) -> Tuple[Sparse, torch.Tensor]:
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
    v, i = _top(acc, layout.block_k[pos], None if den is None else den[lo:hi])
    v = v.clone()
    acc.index_fill_(0, i.long(), 0)
    W[lo:hi].add_(acc, alpha=share)
    return (v, (i + lo).to(layout.idx_dtype)), seen.sum()


def trim(S: Sparse, h: int, W: torch.Tensor, den: Optional[torch.Tensor] = None) -> Sparse:
    """B-SAG's extra top-h before the Bruck exchange; the dropped entries go to ``W``."""
    v, i = S
    if h >= v.numel():
        return S
    _, keep = _top(v, h, None if den is None else den.index_select(0, i.long()))
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


def _exchange(layout: Layout, res: RankResult, phase: str, items: Sequence[Sparse],
              request, counts: Sequence[int]):
    """One message (sub-generator): ``items`` encoded, handed out as ``request(payload)``
    (a :class:`Send` or :class:`Gather`) and counted in ``res``; returns the records of
    the reply, ``counts[j]`` entries each."""
    payload = wire.encode(items, layout.dtype, layout.idx_dtype)
    reply = yield request(payload)
    res.bytes[phase] += payload.numel() * payload.element_size()
    res.elements_sent += sum(v.numel() for v, _ in items)
    return wire.decode(reply, counts, layout.idx_dtype)


def _send(name: str, target: int, source: int):
    return lambda payload: Send(name, payload, target, source)


def _bruck(layout: Layout, members: Sequence[int], me: int, item: Sparse,
           counts: Sequence[int], tag: str, out: RankResult, phase: str):
    """Bruck all-gather (sub-generator): member ``me`` of ``members`` (global ranks);
    ``counts[j]`` = entries of member j's item. Returns the items in member order."""
    g = len(members)
    held = [item]  # held[x] is the item of member (me + x) % g
    for j, (dist, count) in enumerate(bruck_schedule(g)):
        src = (me + dist) % g
        held += yield from _exchange(
            layout, out, phase, held[:count],
            _send(f"{tag}{j}", members[(me - dist) % g], members[src]),
            [counts[(src + x) % g] for x in range(count)])
    return [held[(x - me) % g] for x in range(g)]


def run_rank(layout: Layout, rank: int, acc: torch.Tensor,
             bsag: Optional[BSAGState] = None, scratch=None,
             den: Optional[torch.Tensor] = None) -> Generator:
    """One rank's SparDL iteration on its error-compensated flat gradient ``acc`` (taken
    over). Yields :class:`Send` / :class:`Gather` requests, expects the replies, returns a
    :class:`RankResult`. ``bsag`` (B-SAG only) is read and then adjusted in place.
    ``scratch``: two tensors like ``acc`` (the working copy and the delivered output, the
    result's ``delivered``), reused from step to step; by default new ones, whose pages a
    whole model's size costs the kernel to fault in every step. ``den``: every selection
    by the pending step, ``|x| / den`` (Adam's shared denominators, the same on every rank),
    instead of the magnitude."""
    m, d = layout.team_size, layout.teams
    team, pos = layout.team_of(rank), layout.pos_of(rank)
    W = acc.clone() if scratch is None else scratch[0].copy_(acc)
    res = RankResult(delivered=acc, residual=acc, final=acc)  # filled below
    # ---- Spar-Reduce-Scatter inside the team (§III-B)
    for s, (dist, first, end) in enumerate(layout.srs_schedule()):
        blocks = [(pos + o) % m for o in range(first, end)]
        source = (pos - dist) % m
        got = [(source + o) % m for o in range(first, end)]
        received = yield from _exchange(
            layout, res, "srs", [select_blocks(layout, W, blocks, den)],
            _send(f"srs{s}", layout.rank_of(team, (pos + dist) % m), layout.rank_of(team, source)),
            [sum(layout.block_k[b] for b in got)])
        absorb(W, received[0])
    S = select_own(layout, W, pos, den)
    # ---- Spar-All-Gather across teams (§III-D)
    if layout.sag == "rsag":
        for t in range(d.bit_length() - 1):
            partner = team ^ (1 << t)
            peer = layout.rank_of(partner, pos)
            other, = yield from _exchange(layout, res, "sag", [S], _send(f"rsag{t}", peer, peer),
                                          [layout.block_k[pos]])
            items = [S, other] if team < partner else [other, S]
            S, _ = merge(layout, pos, items, W, share=0.5 ** (t + 1), den=den)
    elif layout.sag == "bsag":
        if bsag is None:
            raise ValueError("B-SAG needs its BSAGState")
        h = res.h = bsag.h_int(layout, pos)
        S = trim(S, h, W, den)
        items = yield from _bruck(layout, [layout.rank_of(x, pos) for x in range(d)], team, S,
                                  [h] * d, "bsag", res, "sag")
        S, count = merge(layout, pos, items, W, share=1.0 / d, den=den)
        res.count = int(count)
        bsag.adjust(layout, pos, res.count)
    # ---- All-gather inside the team
    if m == 1:
        items = [S]
    elif d == 1:
        items = yield from _exchange(layout, res, "gather", [S],
                                     lambda payload: Gather("ag", payload), list(layout.block_k))
    else:
        items = yield from _bruck(layout, [layout.rank_of(team, x) for x in range(m)], pos, S,
                                  list(layout.block_k), "ag", res, "gather")
    delivered = torch.zeros_like(acc) if scratch is None else scratch[1].zero_()
    for v, i in items:  # disjoint blocks
        ops.scatter_add(delivered, v, i)
    res.final = torch.cat([i for _, i in items])
    res.delivered = delivered
    res.residual = collect_residual(acc, W, res.final)
    return res
