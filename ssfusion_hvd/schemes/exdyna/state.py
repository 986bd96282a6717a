"""ExDyna's state: the threshold, the partitions and their moves (Algorithms 3-5), plain
values equal on every rank, driven without Horovod by the unit tests."""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

from ...plan.cost import nominal_k
from ...sparsify.threshold import Threshold


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
        #: the threshold's unit: the accumulated magnitude (False), or Adam's key,
        #: ``"gain"`` (``|acc| / sqrt(sqrt(v-hat) + eps)``) or ``"step"`` (``|acc| /
        #: (sqrt(v-hat) + eps)``) (``scheme_options["select_by"]``)
        self.keyed = False
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

    def set_keyed(self, keyed) -> None:
        """What the threshold is compared with this iteration: the magnitude (False), or
        Adam's key, ``"gain"`` or ``"step"`` (from the step after Adam's first, when the
        optimizer has ``v``). A change of unit recalibrates, as a new density does: also
        from one key to the other (a checkpoint of the step's default resumed under the
        gain's)."""
        keyed = keyed or False
        if keyed != self.keyed:
            self.keyed = keyed
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
                "threshold": self.threshold, "keyed": self.keyed, "iteration": self.iteration}

    def load_state_dict(self, state: dict) -> None:
        if int(state["numel"]) != self.numel:
            raise ValueError(f"checkpoint has {state['numel']} gradient elements, the model "
                             f"has {self.numel}")
        self.threshold = state["threshold"]
        keyed = state.get("keyed", False)  # (checkpoints before it: the magnitude)
        self.keyed = "step" if keyed is True else (keyed or False)  # (True: the step's era)
        self.iteration = int(state["iteration"])
        if "density" in state:  # the density the threshold was tuned to (density warm-up)
            self.density = float(state["density"])
            self.k = _k_of(self.numel, self.density)
        if int(state["nranks"]) == self.nranks:
            self.block_size, self.num_blocks = int(state["block_size"]), int(state["num_blocks"])
            self.blocks = [int(b) for b in state["blocks"]]
        else:  # another world size: start from equal partitions again
            self.partition_blocks()
