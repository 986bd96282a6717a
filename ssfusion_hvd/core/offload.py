"""SSFusion-O's CPU worker (§IV-C): selection of offloaded tensors beside backward.

One worker thread per planned scheme. An offloaded tensor is handed over as soon as its
gradient is ready (:meth:`OffloadWorker.start`): on a GPU job its gradient is first
copied into the part's pinned host staging buffer by a non-blocking copy on a side stream;
the selection kernels release the GIL, so the thread runs while backward goes on. Work
runs in submission order (one thread, FIFO), so a group's allgather queued with
:meth:`OffloadWorker.then` after its selections keeps plan order.
"""
from __future__ import annotations

import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict

import torch

__all__ = ["OffloadWorker"]


class OffloadWorker:
    """The worker thread, its side stream (GPU jobs) and this step's selection jobs."""

    def __init__(self, device: torch.device):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ssf-offload")
        # the thread ends when the worker is collected, even if close() is never called
        self._finalizer = weakref.finalize(self, self._pool.shutdown, False)
        self._stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._jobs: Dict[str, Future] = {}
        self.seconds = 0.0  # selection time on the worker this step (stats: offload_s)

    def start(self, part, grad: torch.Tensor, memory) -> None:
        """Stages ``grad`` for sparse part ``part`` and queues its error-compensated
        selection (``part.select(memory)``)."""
        copied = None
        if grad.is_cuda:  # pinned host staging, non-blocking copy on the side stream
            ready = torch.cuda.Event()
            ready.record()
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(ready)
                part.stage.copy_(grad.reshape(-1), non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self._stream)
        self._jobs[part.key] = self._pool.submit(self._select, part, grad, copied, memory)

    def _select(self, part, grad, copied, memory):
        t0 = time.perf_counter()
        if copied is not None:
            copied.synchronize()
            result = part.select(memory)  # the kernels release the GIL
        else:
            result = part.select_grads(memory, [grad])
        self.seconds += time.perf_counter() - t0
        return result

    def result(self, key: str):
        """The selection of part ``key`` (called on the worker, after it was queued)."""
        return self._jobs.pop(key).result()

    def then(self, fn, *args) -> Future:
        """Runs ``fn(*args)`` on the worker after everything queued before."""
        return self._pool.submit(fn, *args)

    def settle(self) -> None:
        """Returns once everything queued so far has run (a step abandoned before its
        ``finish()`` waited for its jobs, whose selections write the residuals)."""
        self._pool.submit(lambda: None).result()

    def reset(self) -> None:
        self._jobs.clear()
        self.seconds = 0.0

    def close(self) -> None:
        self._finalizer()  # waits for nothing queued: a closed scheme has no step in flight
