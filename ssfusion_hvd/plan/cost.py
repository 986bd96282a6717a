"""Cost model of one training iteration (Cupcake §4.1, SSFusion §IV-A).

Every time the planner reasons about is an affine function of bytes:

* communication ``g(x) = α_g + β_g·x`` (Cupcake §4.1), fitted separately for allreduce
  and allgather at one world size; ``x`` is the number of bytes one worker contributes;
* sparsification ``h(x) = α_h + β_h·x`` (Cupcake §4.1, SSFusion §IV-A "sparsification
  time"), fitted per sparsifier and per device ("gpu": on the compute stream, "cpu": on
  the offload worker of SSFusion-O, host copies included); ``x`` is the dense input size;
* backward time ``T_b`` per gradient tensor, in backward order (SSFusion §IV-A
  "computation time"), plus a constant forward time ``A`` (Cupcake Eq. 1);
* decode ``d(x) = α_d + β_d·x`` of one group after its collectives (the copy out of the
  allreduce part, the sums and scatter-adds of the gathered records); ``x`` is the bytes
  the decode touches (:func:`~ssfusion_hvd.plan.timeline.decode_bytes`). Packing a
  group's buffers before they are sent is charged ``β_d`` per byte too (``copy_s``);
* ``shared_cores``: whether the offload worker competes with backward for the same cores
  (a CPU-only job), so that offloading frees nothing.

The numbers come from live profiling (the optimizer's warm-up), from a JSON profile, or
from :meth:`CostModel.from_network` for what-if studies.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

__all__ = [
    "CostModel",
    "DEFAULT_DECODE",
    "DEFAULT_SPARSIFY",
    "SEGMENTED_SPARSIFIERS",
    "default_backward_times",
    "entry_bytes",
    "index_size",
    "nominal_k",
    "parse_bandwidth",
]

# SSFusion Table III: DGC sparsification time (ms) against dense tensor size (KB).
_TABLE_III_KB = (10.0, 100.0, 1000.0, 10000.0)
_TABLE_III_GPU_MS = (0.85, 0.89, 1.06, 1.82)
_TABLE_III_CPU_MS = (1.49, 1.81, 3.22, 8.74)


def _fit_affine(size_kb: Sequence[float], time_ms: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``(α seconds, β seconds/byte)`` through measured (size, time) points."""
    beta_ms_per_kb, alpha_ms = np.polyfit(np.asarray(size_kb), np.asarray(time_ms), 1)
    return float(alpha_ms) * 1e-3, float(beta_ms_per_kb) * 1e-3 / 1024.0


#: Default sparsification costs, fitted to SSFusion Table III (DGC on the paper's
#: testbed). Used only when no profile is given; the CLI prints them as assumptions.
DEFAULT_SPARSIFY: dict[str, dict[str, tuple[float, float]]] = {
    "dgc": {
        "gpu": _fit_affine(_TABLE_III_KB, _TABLE_III_GPU_MS),
        "cpu": _fit_affine(_TABLE_III_KB, _TABLE_III_CPU_MS),
    }
}

#: Sparsifiers whose selections of several tensors run as ONE kernel call per group
#: (``ops.segmented_topk``): a group pays their fixed cost ``α_h`` once. Every other
#: sparsifier is called once per tensor (``core/buffers.py``, part modes).
SEGMENTED_SPARSIFIERS = ("topk",)

#: Default decode cost (an assumption for what-if studies, replaced by live profiling):
#: a fixed 20 us per group and 20 GB/s over the bytes touched (a GPU-class memory pass).
DEFAULT_DECODE = (20e-6, 1.0 / 20e9)

#: Default backward cost: a fixed per-tensor overhead plus a per-element rate (an
#: assumption for what-if studies, not a measurement; live profiling replaces it).
DEFAULT_BACKWARD_PER_TENSOR_S = 20e-6
DEFAULT_BACKWARD_PER_ELEMENT_S = 1e-9


def default_backward_times(
    sizes: Sequence[int],
    per_tensor_s: float = DEFAULT_BACKWARD_PER_TENSOR_S,
    per_element_s: float = DEFAULT_BACKWARD_PER_ELEMENT_S,
) -> tuple[float, ...]:
    """``T_b = per_tensor_s + per_element_s · numel`` for every tensor."""
    return tuple(per_tensor_s + per_element_s * int(n) for n in sizes)


def nominal_k(numel, density: float):
    """Per-tensor top-k count ``k = ceil(density · n)``, at least 1 and at most ``n``.

    Works on ints and on numpy arrays with identical arithmetic, so the fusion DP and
    the plan builders agree to the last bit. The ``1e-9`` keeps ``ceil`` from rounding
    ``0.07 · 100 = 7.000000000000001`` up to 8.
    """
    k = np.ceil(np.asarray(numel, dtype=np.float64) * density - 1e-9)
    k = np.minimum(np.maximum(k, 1.0), numel).astype(np.int64)
    return int(k) if k.ndim == 0 else k


def entry_bytes(numel, element_size: int, extra: int = 0) -> int:
    """Bytes of one sparse entry of a tensor (or fusion buffer) of ``numel`` elements: its
    value, its index (:func:`index_size`) and ``extra`` (``CostModel.entry_extra``)."""
    return element_size + index_size(numel) + extra


def index_size(numel) -> int:
    """Bytes per sparse index: int32, or int64 once positions pass 2^31 (docs/design.md "Wire format")."""
    return 4 if int(numel) < 2**31 else 8


_BANDWIDTH_UNITS = {
    "bps": 1.0, "bit": 1.0, "kbps": 1e3, "kbit": 1e3, "mbps": 1e6, "mbit": 1e6,
    "gbps": 1e9, "gbit": 1e9, "tbps": 1e12, "tbit": 1e12,
}


def parse_bandwidth(text: str) -> float:
    """``"10Gbps"``, ``"25gbit"``, ``"1e9"`` -> bits per second."""
    s = text.strip().lower().replace(" ", "")
    for unit in sorted(_BANDWIDTH_UNITS, key=len, reverse=True):
        if s.endswith(unit):
            return float(s[: -len(unit)]) * _BANDWIDTH_UNITS[unit]
    return float(s)


class JsonFile:
    """``save(path)``/``load(path)`` for a class with ``to_json()``/``from_json(text)``."""

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path):
        return cls.from_json(Path(path).read_text())


@dataclass
class CostModel(JsonFile):
    """α/β fits and backward times for one job at one world size.

    Attributes:
        world_size: number of workers ``P`` the communication fits were taken at.
        allreduce: ``(α, β)`` of ``g(x)`` for allreduce, seconds and seconds per byte.
        allgather: ``(α, β)`` of ``g(x)`` for allgather; ``x`` is one worker's share.
        sparsify: ``{sparsifier: {"gpu" | "cpu": (α_h, β_h)}}``, ``h(x)`` on the dense bytes.
        backward_s: ``T_b`` of every gradient tensor, in backward order.
        element_size: bytes per gradient element (4 for fp32).
        forward_s: forward time ``A`` (a constant of Cupcake Eq. 1; never changes a plan).
        decode: ``(α_d, β_d)`` of one group's decode, seconds and seconds per byte touched.
        shared_cores: the offload worker runs on the cores backward uses (a CPU-only job).
        allgather_curve: the probe's allgather medians, ``((x, seconds), ...)`` by ``x``
            (empty: none measured). Where they, linearly interpolated and extrapolated
            by their last segment, lie above the affine fit, :meth:`allgather_s` takes
            them: over Gloo one large allgather message takes about twice a slow link's
            time, which an affine fit weighted to the small sizes misses
            (``docs/results/collectives_probe.md``).
        entry_extra: bytes a planned scheme's sparse entry carries beside its value and
            index (1 with ``scheme_options["waits"]``, the sender's wait; 0 otherwise).
            Not measured: what the scheme puts on the wire, set for the plan it builds.
    """

    world_size: int
    allreduce: tuple[float, float]
    allgather: tuple[float, float]
    sparsify: dict[str, dict[str, tuple[float, float]]]
    backward_s: tuple[float, ...]
    element_size: int = 4
    forward_s: float = 0.0
    notes: dict[str, str] = field(default_factory=dict)
    decode: tuple[float, float] = (0.0, 0.0)
    shared_cores: bool = False
    entry_extra: int = 0
    allgather_curve: tuple = ()

    def __post_init__(self) -> None:
        self.allgather_curve = tuple(sorted((float(x), float(t)) for x, t in self.allgather_curve))
        self.decode = tuple(map(float, self.decode))
        self.shared_cores = bool(self.shared_cores)
        self.allreduce = tuple(map(float, self.allreduce))
        self.allgather = tuple(map(float, self.allgather))
        self.sparsify = {
            name: {dev: tuple(map(float, ab)) for dev, ab in devices.items()}
            for name, devices in self.sparsify.items()
        }
        self.backward_s = tuple(map(float, self.backward_s))
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")

    def entry_size(self, numel) -> int:
        """Bytes of one sparse entry of a planned scheme's tensor (or fusion buffer) of
        ``numel`` elements: value, index (:func:`index_size`) and :attr:`entry_extra`."""
        return entry_bytes(numel, self.element_size, self.entry_extra)

    # -- the affine costs --------------------------------------------------------------
    def allreduce_s(self, nbytes: float) -> float:
        return self.allreduce[0] + self.allreduce[1] * nbytes

    def allgather_s(self, nbytes: float) -> float:
        return float(self.allgather_many(np.asarray([nbytes], dtype=np.float64))[0])

    def allgather_many(self, nbytes: np.ndarray) -> np.ndarray:
        """:meth:`allgather_s` of every entry of ``nbytes``: the affine fit, or the measured
        curve where it is above the fit (:attr:`allgather_curve`)."""
        x = np.asarray(nbytes, dtype=np.float64)
        fit = self.allgather[0] + self.allgather[1] * x
        if len(self.allgather_curve) < 2:
            return fit
        xs = np.array([c[0] for c in self.allgather_curve])
        ts = np.array([c[1] for c in self.allgather_curve])
        curve = np.interp(x, xs, ts)
        slope = (ts[-1] - ts[-2]) / (xs[-1] - xs[-2])
        beyond = x > xs[-1]
        curve[beyond] = ts[-1] + slope * (x[beyond] - xs[-1])
        curve[x < xs[0]] = -np.inf  # below the smallest probe: the fit alone
        return np.maximum(fit, curve)

    def sparsify_s(self, sparsifier: str, device: str, nbytes: float) -> float:
        alpha, beta = self.sparsify_fit(sparsifier, device)
        return alpha + beta * nbytes

    def select_s(self, sparsifier: str, device: str, nbytes: Sequence[float]) -> float:
        """One group's selection of tensors of ``nbytes`` each, as the engine runs it: one
        segmented call (:data:`SEGMENTED_SPARSIFIERS`) or one call per tensor."""
        if not len(nbytes):
            return 0.0
        alpha, beta = self.sparsify_fit(sparsifier, device)
        calls = 1 if sparsifier in SEGMENTED_SPARSIFIERS else len(nbytes)
        return calls * alpha + beta * float(sum(nbytes))

    def decode_s(self, nbytes: float) -> float:
        return self.decode[0] + self.decode[1] * nbytes

    def copy_s(self, nbytes: float) -> float:
        """A memory pass over ``nbytes`` (packing a fusion buffer): decode's per-byte rate."""
        return self.decode[1] * nbytes

    def sparsify_fit(self, sparsifier: str, device: str) -> tuple[float, float]:
        try:
            return self.sparsify[sparsifier][device]
        except KeyError:
            raise KeyError(
                f"no sparsification fit for {sparsifier!r} on {device!r}; "
                f"profiled: {sorted((s, d) for s in self.sparsify for d in self.sparsify[s])}"
            ) from None

    # -- constructors ------------------------------------------------------------------
    @classmethod
    def from_network(
        cls,
        bandwidth_bps: float,
        latency_s: float,
        world_size: int,
        backward_s: Sequence[float],
        sparsify: Mapping[str, Mapping[str, tuple[float, float]]] | None = None,
        element_size: int = 4,
        forward_s: float = 0.0,
        decode: tuple[float, float] = DEFAULT_DECODE,
    ) -> "CostModel":
        """Ring-collective costs from link bandwidth and latency (SSFusion Eq. 3 and 4).

        Allreduce: ``2(P-1)·latency + 2(P-1)/P · bytes / B``; allgather of one worker's
        ``bytes``: ``(P-1)·latency + (P-1) · bytes / B``, with ``B`` in bytes per second.
        A GPU job: the offload worker has cores of its own (``shared_cores`` False).
        """
        p = int(world_size)
        byte_s = 8.0 / float(bandwidth_bps)
        return cls(
            world_size=p,
            allreduce=(2 * (p - 1) * latency_s, 2 * (p - 1) / p * byte_s),
            allgather=((p - 1) * latency_s, (p - 1) * byte_s),
            sparsify={k: dict(v) for k, v in (sparsify or DEFAULT_SPARSIFY).items()},
            backward_s=tuple(backward_s),
            element_size=element_size,
            forward_s=forward_s,
            decode=decode,
            notes={"source": f"ring model: {bandwidth_bps:.4g} bit/s, {latency_s:.3g} s latency"},
        )

    def with_backward(self, backward_s: Sequence[float]) -> "CostModel":
        """The same fits for another model (other tensor list)."""
        d = asdict(self)
        d["backward_s"] = tuple(backward_s)
        return CostModel(**d)

    # -- JSON --------------------------------------------------------------------------
    def to_json(self) -> str:
        d = asdict(self)
        d["backward_s"] = list(self.backward_s)
        return json.dumps(d, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "CostModel":
        return cls(**json.loads(text))

