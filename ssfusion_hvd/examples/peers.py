"""What a user would pick instead of ssfusion_hvd, run by the same training script on the
same data, seeds and launcher (``examples/train.py --scheme PEER``):

* ``ddp``: torch ``DistributedDataParallel`` over gloo, no compression;
* ``ddp_fp16``: DDP with torch's ``fp16_compress_hook`` (gradients allreduced as float16);
* ``ddp_powersgd1``, ``ddp_powersgd4``: DDP with torch's ``powerSGD_hook`` at rank 1 and
  4, error feedback and warm start on, plain allreduce for the first
  :data:`POWERSGD_START` steps (torch's default is 1,000, longer than the suite's runs; it
  suggests 10 % of the training, and our schemes' own dense steps are 5 plus a 50-step
  density warm-up), a tensor compressed only where that at least halves it (torch's
  default);
* ``hvd_fp16``: Horovod's own ``hvd.DistributedOptimizer`` with ``Compression.fp16``;
* ``ddp_ssfusion``: DDP with our own hook (``ssfusion_hvd.ddp``, scheme ``ssfusion`` at the
  job's density, the recipe's shared moments through the optimizer): the engine's second
  face, beside the peers; ``ddp_ssfusion_plan``: the same with the planner
  (``ssfusion_hvd.ddp.measure_cost`` on the job's own link and model, ``make_plan``, DDP's
  buckets from ``ddp_kwargs``).

The DDP peers run inside the job ``horovodrun`` started (Horovod initialized first): rank
0 picks a free TCP port and every rank learns it by ``hvd.broadcast_object``, then
``torch.distributed`` starts a gloo group of the same ranks. ``bytes_per_step`` is what one
rank sends per step once the peer's compression is in force, counted the way the
collectives carry it (an allreduce's payload, as ``opt.stats()`` counts ours).
"""
from __future__ import annotations

import os
import socket
from typing import Iterable, Tuple

import torch

__all__ = ["PEERS", "POWERSGD_START", "bytes_per_step", "make_peer", "peer_bytes"]

PEERS = ("ddp", "ddp_fp16", "ddp_powersgd1", "ddp_powersgd4", "hvd_fp16", "ddp_ssfusion",
         "ddp_ssfusion_plan")
#: PowerSGD's plain-allreduce steps before it compresses (``start_powerSGD_iter``)
POWERSGD_START = 10
#: DDP's bucket size under the PowerSGD peers: one bucket for any model here (see make_peer)
POWERSGD_BUCKET_MB = 4096


def _powersgd_rank(peer: str) -> int:
    return int(peer[len("ddp_powersgd"):]) if peer.startswith("ddp_powersgd") else 0


def bytes_per_step(peer: str, params: Iterable[torch.Tensor], step: int = POWERSGD_START,
                   start: int = POWERSGD_START) -> int:
    """Bytes one rank sends at (0-based) step ``step`` under ``peer``: a dense float32
    allreduce's during PowerSGD's first ``start`` steps, else
    float32 payloads, float16 for the fp16 peers; PowerSGD sends P (rows x r) and Q
    (cols x r) of each matrix it compresses (torch's rule: a tensor of 2 or more
    dimensions viewed as ``shape[0]`` rows, ``r = min(rows, cols, rank)``, compressed where
    ``2 (rows + cols) r < rows cols``) and every other tensor whole."""
    rank = _powersgd_rank(peer) if step >= start else 0
    total = 0
    for p in params:
        n = p.numel()
        if peer in ("ddp_fp16", "hvd_fp16"):
            total += 2 * n
            continue
        if rank and p.dim() > 1:
            rows, cols = p.shape[0], n // p.shape[0]
            r = min(rows, cols, rank)
            if 2 * (rows + cols) * r < n:
                total += 4 * r * (rows + cols)
                continue
        total += 4 * n
    return total


def peer_bytes(peer: str, module, params, step: int, start: int = POWERSGD_START) -> int:
    """What ``peer`` sent at ``step``: the hook's own count for ``ddp_ssfusion`` (``module``:
    the DDP model ``make_peer`` returned), else :func:`bytes_per_step`."""
    hook = getattr(module, "ssfusion_hook", None)
    return hook.bytes_sent if hook is not None else bytes_per_step(peer, params, step, start)


def _init_gloo() -> None:
    """torch.distributed's gloo group over the ranks horovodrun started (a group the
    caller made already, e.g. NCCL in ``scripts/ddp_hook_cost.py``, is used as it is)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    import horovod.torch as hvd

    where = None
    if hvd.rank() == 0:
        # one host: the loopback; several: rank 0's own address, which the others reach
        addr = os.environ.get("SSF_PEER_ADDR") or (
            "127.0.0.1" if hvd.cross_size() == 1 else socket.gethostbyname(socket.gethostname()))
        with socket.socket() as s:
            s.bind((addr, 0))
            where = (addr, s.getsockname()[1])
    addr, port = hvd.broadcast_object(where, root_rank=0, name="peer.port")
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=hvd.rank(),
                            world_size=hvd.size())


def make_peer(peer: str, model: torch.nn.Module, optimizer, named_parameters,
              powersgd_start: int = POWERSGD_START, density: float = 0.01,
              density_warmup_steps="auto", backward=None,
              profile=None) -> Tuple[torch.nn.Module, object, str]:
    """``(module to run forward through, optimizer to step, description)`` for ``peer``.
    Every rank starts from rank 0's parameters (DDP broadcasts them; the Horovod peer is
    broadcast by the caller, as for ours). ``ddp_ssfusion``'s module carries its hook as
    ``ssfusion_hook`` (its ``bytes_sent``). ``backward``: one forward and backward of
    ``model`` (``ddp_ssfusion_plan`` times each tensor's backward with it for the plan).
    ``profile``: a saved cost model (path) ``ddp_ssfusion_plan`` plans on instead of
    measuring the job (as ``--profile`` makes our planned schemes do).
    ``density_warmup_steps``: the hook's, by default the product's (``"auto"``, as the
    Horovod optimizer's runs get; a fixed 50 gave the hook a shorter warm-up than ours
    below density 0.006)."""
    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}; choose one of {PEERS}")
    if peer == "hvd_fp16":
        import horovod.torch as hvd

        opt = hvd.DistributedOptimizer(optimizer, named_parameters=named_parameters,
                                       compression=hvd.Compression.fp16)
        return model, opt, "hvd.DistributedOptimizer, Compression.fp16"
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init_gloo()
    r = _powersgd_rank(peer)
    # PowerSGD in one bucket: with DDP's default 25 MB buckets, GPT-2 (torch 2.x, gloo)
    # stops at its first compressed step with gloo's "Received data size doesn't match
    # expected size" (2 ranks on one loopback, 2026-11-26); in one bucket it runs. The
    # bucket only decides when communication starts, not what PowerSGD sends.
    plan = None
    if peer == "ddp_ssfusion_plan":
        import ssfusion_hvd.ddp

        from ssfusion_hvd.plan import CostModel

        cost = (CostModel.load(profile) if profile else
                ssfusion_hvd.ddp.measure_cost(model, backward, density=density))
        plan = ssfusion_hvd.ddp.make_plan(model, cost, "ssfusion", density)
    if plan is not None:
        ddp = DDP(model, **ssfusion_hvd.ddp.ddp_kwargs(plan))
        ddp.ssfusion_cost = cost  # (what the plan was made on, for the benchmarks' reports)
    else:
        ddp = DDP(model, bucket_cap_mb=POWERSGD_BUCKET_MB) if r else DDP(model)
    if r:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=r,
                                   start_powerSGD_iter=powersgd_start,
                                   use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
        what = (f"DDP (gloo) + PowerSGD rank {r} (error feedback, warm start, plain allreduce "
                f"for the first {state.start_powerSGD_iter} steps)")
    elif peer in ("ddp_ssfusion", "ddp_ssfusion_plan"):
        import ssfusion_hvd.ddp

        ddp.ssfusion_hook = hook = ssfusion_hvd.ddp.register(
            ddp, scheme="ssfusion", density=density, density_warmup_steps=density_warmup_steps,
            optimizer=optimizer, plan=plan)
        what = (f"DDP (gloo) + ssfusion_hvd.ddp hook, scheme ssfusion, density {density}, "
                f"{hook.recipe.describe()}")
        if plan is not None:
            what += (f", planned: {len(plan.groups)} buckets, "
                     f"{sum(not s for s in plan.sparse)} of {len(plan.sparse)} tensors dense")
    elif peer == "ddp_fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        what = "DDP (gloo) + fp16 compression hook"
    else:
        what = "DDP (gloo)"
    return ddp, optimizer, what
