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

from .scheme import ExDynaScheme
from .state import ExDynaState

__all__ = ["ExDynaScheme", "ExDynaState"]
