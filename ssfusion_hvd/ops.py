"""The kernels under one name: every call site reads ``ops.<op>``; they live in
``kernels/``, one module per family of ``csrc/`` (``kernels.dispatch`` is the only door to
the compiled extension ``ssfusion_hvd._C``).

Every op here has two implementations with identical results: the native kernel (C++ on
CPU, CUDA on GPU; ``csrc/``) and a pure-torch fallback. ``backend=None`` picks the native
kernel when it is built for the tensor's device, else the fallback; ``"native"`` or
``"torch"`` force one (tests compare them).

Shared semantics (also documented in ``csrc/ops.h``):

* Values are float32, float16 or bfloat16; inputs are read as ``x.flatten()``.
* Magnitude order is a total order: IEEE order of ``|x|`` for numbers, NaN above +Inf, so a
  NaN gradient is always selected and never dropped silently. Ties go to the lower index.
* Selections are returned in ascending index order, indices int32 (int64 from 2^31 elements).
* A *sparse record* of k elements in a flat buffer of the values' dtype is k values, zero
  padding up to the index size, then the k indices stored bit for bit (:func:`record_spans`).
* Hash ops (ZEN's hierarchical hashing, :func:`hash_partition`, :func:`hash_owner`) use the
  hash functions of ``csrc/hash.h``; collisions go to the lowest position, so the partition
  order is deterministic and the same on every backend.
"""
from __future__ import annotations

from .kernels.dispatch import (  # noqa: F401
    build_info, has_native, have_extension, index_dtype, magnitude_key, native_op,
    VALUE_DTYPES, _C)
from .kernels.select import (  # noqa: F401
    sample_positions, sampled_threshold, segmented_topk, threshold_count,
    threshold_select, topk)
from .kernels.feedback import (  # noqa: F401
    ef_step_key, ef_topk, group_ef_topk, keyed_topk, segmented_ef_topk, step_denominator)
from .kernels.codec import (  # noqa: F401
    deliver_chunks, pack, record_numel, record_spans, scatter_add, scatter_add_chunks,
    unpack)
from .kernels.hash import (  # noqa: F401
    default_table_size, hash_owner, hash_partition, hash_seed, _hash_to)

__all__ = [
    "build_info", "has_native", "have_extension", "index_dtype", "magnitude_key", "native_op",
    "VALUE_DTYPES", "sample_positions", "sampled_threshold", "segmented_topk",
    "threshold_count", "threshold_select", "topk", "ef_step_key", "ef_topk", "group_ef_topk", "keyed_topk",
    "segmented_ef_topk", "step_denominator", "deliver_chunks", "pack", "record_numel", "record_spans",
    "scatter_add", "scatter_add_chunks", "unpack", "default_table_size", "hash_owner",
    "hash_partition", "hash_seed"]
