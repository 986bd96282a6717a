"""The door to the compiled extension ``ssfusion_hvd._C``: its import, the choice between
a native kernel and the torch fallback (``backend=``), and the checks and keys every op
shares (``ssfusion_hvd.ops`` documents the semantics)."""
from __future__ import annotations

from typing import Optional

import torch

try:  # the extension links against libtorch: torch must be imported first (it is, above)
    from .. import _C  # type: ignore[attr-defined]

    _IMPORT_ERROR: Optional[BaseException] = None
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    _C = None
    _IMPORT_ERROR = exc


VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT32_MAX = 2**31 - 1
_SIGN_CLEAR = {4: (torch.int32, 0x7FFFFFFF), 2: (torch.int16, 0x7FFF)}


def have_extension() -> bool:
    """True when ``ssfusion_hvd._C`` imported."""
    return _C is not None


def build_info() -> dict:
    """What the extension was built with (``cuda_kernels``, ``cuda_sources_compiled``,
    ``openmp``: whether its CPU kernels fork onto torch's intra-op threads)."""
    if _C is None:
        return {"extension": False, "error": repr(_IMPORT_ERROR)}
    return {"extension": True, **dict(_C.build_info)}


def index_dtype(numel: int) -> torch.dtype:
    """Index dtype of selections from a tensor of ``numel`` elements."""
    return torch.int32 if numel <= _INT32_MAX else torch.int64


def _check_values(x: torch.Tensor, op: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in VALUE_DTYPES:
        raise TypeError(f"{op}: unsupported dtype {x.dtype}; supported: float32, float16, bfloat16")


_NATIVE: dict = {}  # (op, device type) -> the extension's function, or None


def _native(x: torch.Tensor, op: str, backend: Optional[str]):
    """The native function for x's device, or None for the torch fallback. Looked up once per
    op and device type: this runs on every kernel call, where microseconds count."""
    if backend == "torch":
        return None
    if backend not in (None, "native"):
        raise ValueError(f"backend must be None, 'native' or 'torch', got {backend!r}")
    dev = "cpu" if x.is_cpu else x.device.type
    try:
        fn = _NATIVE[op, dev]
    except KeyError:
        fn = _NATIVE[op, dev] = getattr(_C, f"{op}_{dev}", None) if _C is not None else None
    if fn is None and backend == "native":
        raise RuntimeError(f"no native {op} kernel for device {x.device} ({build_info()})")
    return fn


def native_op(op: str, x: torch.Tensor):
    """The extension's ``op`` for ``x``'s device, or None: for callers outside this package
    whose torch fallback is their own (``moments.SharedMoments``' foreach step)."""
    return _native(x, op, None)


def has_native(op: str, x: torch.Tensor) -> bool:
    """Whether the extension has a native ``op`` for ``x``'s device."""
    return _native(x, op, None) is not None


def magnitude_key(x: torch.Tensor) -> torch.Tensor:
    """Integer key whose order is the magnitude order (NaN above Inf), same shape as x."""
    idt, mask = _SIGN_CLEAR[x.element_size()]
    return x.contiguous().view(idt).bitwise_and(mask)
