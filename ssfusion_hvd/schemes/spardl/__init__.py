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
not one α. Payloads are :mod:`ssfusion_hvd.core.wire` records back to back (per record: its
values, zero padding to the index alignment, its indices), in the value dtype, sent as
bytes; their sizes are fixed and known (block-wise top-k keeps every block at exactly
``min(L, block size)`` entries; B-SAG's ``h`` is shared by the position group), so no counts
are exchanged.

Structure: the algorithm is one pure generator per rank (:func:`run_rank`, in
``algorithm.py`` with the layout, the schedules and the pure steps) that yields its
communication requests (:class:`Send`, :class:`Gather`) and receives the replies; the scheme
(:class:`SparDLScheme`, ``scheme.py``) serves them with the scheme's transport,
:func:`simulate` (``simulate.py``) serves all ranks' requests in memory (used by the tests
to check the live scheme bit for bit).

Options and limits:

* Teams: ``DistributedOptimizer(..., scheme="spardl", scheme_options={"teams": d})``
  (default 1 = plain SRS + all-gather); ``d`` must divide ``P`` (``ValueError`` on every
  rank otherwise) and be identical on every rank (the optimizer compares the scheme options
  of all ranks in its first collective). Powers of two use R-SAG, other values B-SAG. The
  paper's advice is to time one epoch per ``d`` and keep the fastest.
* Selection is always exact top-k (the paper's operator): ``sparsifier=`` other
  than ``"topk"`` is ignored with a warning. By magnitude, except under Adam with shared
  moments, where ``scheme_options["select_by"]`` (``"auto"``, the default, or ``"gain"``)
  ranks every cut by the partial sum times the step the shared rule would take, ordered
  as ``|x| / sqrt(sqrt(v-hat) + eps)`` (``"step"``: by the step, ``|x| / (sqrt(v-hat) +
  eps)``), the same denominators on every rank (``"magnitude"`` keeps the paper's); ``compression=`` is ignored (nothing is
  allreduced); ``warmup_steps``/``plan``/``profile`` are ignored (SparDL needs no plan).
* The first SRS step starts when the last gradient is submitted; the remaining steps are
  sequential (each needs the previous one's data) and run in ``finish()``. Nothing overlaps
  backward except that first send.
* One dtype (float32, float16, bfloat16) and one device for all trainable gradients.
  Values travel and are summed in the accumulation dtype (float32 under
  ``fp32_accumulation=True``, the default; else the gradient dtype).
* ``stats()``: the keys of the planned schemes (``phase`` is ``"sparse"``;
  ``allgather_bytes`` is every payload byte this rank sent, record padding included: its
  own record in Horovod's allgather, as the other schemes count it, and every record it
  sends or forwards in the point-to-point steps; ``elements_sent`` counts entries the same
  way), plus ``teams``, ``sag``, ``srs_steps``, ``collectives``, ``k``, ``block_k``
  (largest ``L``), ``srs_bytes``/``sag_bytes``/``gather_bytes``, ``delivered`` (entries in
  the synchronized gradient), ``bsag_h`` and ``bsag_count`` (``h`` used and ``N_t``, B-SAG
  only).

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
from .algorithm import (BSAGState, Gather, Layout, RankResult, Send, bruck_schedule,
                        output_scale, run_rank)
from .scheme import SparDLScheme
from .simulate import simulate

__all__ = ["SparDLScheme", "Layout", "BSAGState", "RankResult", "Send", "Gather", "run_rank",
           "simulate", "output_scale", "bruck_schedule"]
