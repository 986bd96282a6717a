"""SparDL's in-memory simulation: every rank's :func:`~.algorithm.run_rank` in one process,
the collectives served by handing the payloads around (the tests check the live scheme
against it bit for bit)."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from .algorithm import BSAGState, Gather, Layout, RankResult, run_rank

__all__ = ["simulate"]


def simulate(layout: Layout, accs: Sequence[torch.Tensor],
             bsag: Optional[Sequence[BSAGState]] = None,
             den: Optional[torch.Tensor] = None) -> List[RankResult]:
    """All ranks of one iteration in one process: :func:`run_rank` with the collectives
    served in memory. ``accs[r]`` is taken over; ``bsag[r]`` is adjusted in place; ``den``
    (every rank's, the same): the selection by the pending step."""
    P = layout.nranks
    if len(accs) != P:
        raise ValueError(f"{len(accs)} inputs for {P} ranks")
    gens = [run_rank(layout, r, accs[r], None if bsag is None else bsag[r], den=den)
            for r in range(P)]
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

