"""Workers for tests/test_reliability.py.

The functions run on every Horovod rank through tests/_worker.py. Run as a script,
``python tests/workers_reliability.py train SCHEME KILL_RANK KILL_STEP [STACKS_AFTER]`` trains a small model
with ``ssfusion_hvd.DistributedOptimizer`` and has ``KILL_RANK`` SIGKILL itself at
``KILL_STEP`` (no ``os._exit`` courtesy, no atexit, no goodbye to its peers).
"""
import faulthandler
import os
import signal
import sys
import time

import horovod.torch as hvd
import torch
import torch.nn as nn

import ssfusion_hvd
from ssfusion_hvd.consistency import check_same_model


class Net(nn.Module):
    def __init__(self, fc_in=3, extra=False):
        super().__init__()
        self.fc = nn.Linear(fc_in, 10)
        self.out = nn.Linear(10, 2)
        if extra:
            self.extra = nn.Linear(2, 2)


def _build(case):
    """(model, torch optimizer) for ``case``; rank 1 deviates in the mismatch cases."""
    torch.manual_seed(0)
    odd = hvd.rank() == 1
    model = Net(fc_in=4 if case == "shape" and odd else 3, extra=case == "names" and odd)
    params = list(model.parameters())
    if case == "order" and odd:
        params = list(reversed(params))
    return model, torch.optim.SGD(params, lr=0.1)


def _named_and_declared(model, opt):
    named = sorted(model.named_parameters(), key=lambda t: t[0])
    name_of = {id(p): n for n, p in named}
    return named, [name_of[id(p)] for g in opt.param_groups for p in g["params"]]


CASES = ["same", "names", "shape", "order"]


def check_cases():
    """Calls check_same_model for each case; returns {case: message or None}."""
    messages = {}
    for case in CASES:
        named, declared = _named_and_declared(*_build(case))
        try:
            check_same_model(named, declared)
            messages[case] = None
        except ValueError as exc:
            messages[case] = str(exc)
    # every rank is still in step: a collective after the errors neither hangs nor mismatches
    total = hvd.allreduce(torch.ones(1), name="after_check_cases", op=hvd.Sum)
    return {"messages": messages, "total": float(total)}


def optimizer_cases(scheme="dense"):
    """Builds ssfusion_hvd.DistributedOptimizer for each case; returns {case: message or None}."""
    messages = {}
    for case in CASES:
        model, opt = _build(case)
        try:
            ssfusion_hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                              scheme=scheme)
            messages[case] = None
        except ValueError as exc:
            messages[case] = str(exc)
    total = hvd.allreduce(torch.ones(1), name="after_optimizer_cases", op=hvd.Sum)
    return {"messages": messages, "total": float(total)}


def _offload_plan(scheme):
    """Both weights selected on the offload worker thread, biases dense by allreduce: a
    dying peer must not leave that thread (or the main one) blocked."""
    from ssfusion_hvd.plan import Group, Plan
    names, sizes = ["2.bias", "2.weight", "0.bias", "0.weight"], [4, 128, 32, 512]
    return Plan(scheme, names, sizes, [Group(0, 2), Group(2, 4)], [False, True, False, True],
                [4, 13, 32, 52], ["allreduce", "allgather", "allreduce", "allgather"],
                [False, True, False, True], 0.1, "topk")


def train(scheme, kill_rank, kill_step, steps=1000, stacks_after=50.0):
    """Trains until ``steps``; rank ``kill_rank`` SIGKILLs itself at step ``kill_step``.

    Should a surviving rank still be alive ``stacks_after`` seconds in, faulthandler prints
    every thread's stack to stderr: where it blocks.
    """
    torch.set_num_threads(1)
    hvd.init()
    faulthandler.dump_traceback_later(stacks_after, exit=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = ssfusion_hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(), scheme=scheme,
        plan=None if scheme == "dense" else _offload_plan(scheme), log_plan=False)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(hvd.rank())
    for step in range(steps):
        if step == kill_step and hvd.rank() == kill_rank:
            print(f"KILLING rank {kill_rank} at step {step} t={time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        time.sleep(0.01)
    print(f"rank {hvd.rank()} finished {steps} steps", flush=True)


def released():
    """Builds and trains an ssfusion_oi optimizer whose plan offloads (so it starts the
    worker thread), then drops the model and the optimizer (the parameters' gradient hooks
    point at the optimizer, as Horovod's do): the optimizer, its scheme and the thread must
    all go (nothing else may keep a finished optimizer alive)."""
    import gc
    import threading
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = ssfusion_hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(), scheme="ssfusion_oi",
        plan=_offload_plan("ssfusion_oi"), log_plan=False)
    for step in range(3):
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        opt.zero_grad()
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()

    def workers():
        return sum(t.name.startswith("ssf-offload") and t.is_alive() for t in threading.enumerate())

    during = workers()
    ref = weakref.ref(opt)
    del opt, model
    gc.collect()
    for _ in range(100):  # the pool's thread exits once it notices its executor is gone
        if workers() == 0:
            break
        time.sleep(0.05)
    return {"workers_during": during, "optimizer_alive": ref() is not None,
            "workers_after": workers()}


if __name__ == "__main__":
    if sys.argv[1] != "train":
        raise SystemExit(f"unknown command {sys.argv[1]!r}")
    train(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
          stacks_after=float(sys.argv[5]) if len(sys.argv) > 5 else 50.0)


def options_cases():
    """scheme_options errors: unknown and bad options raise on every rank before any
    collective; options that differ between ranks raise on every rank after the first one
    (the model check). Returns {case: message or None} and a final collective's result."""
    rank = hvd.rank()
    cases = {
        "unknown": ("exdyna", {"blocks": 4}),
        "bad_value": ("exdyna", {"alpha": 0.5}),
        "not_a_dict": ("spardl", [("teams", 1)]),
        "dense_has_none": ("dense", {"teams": 1}),
        "differs": ("exdyna", {"blocks_per_worker": 64 if rank == 0 else 32}),
        "scheme_differs": ("exdyna" if rank == 0 else "zen", None),
        "same": ("exdyna", {"blocks_per_worker": 64}),
        "min_k_bad": ("ssfusion_oi", {"min_k": -1}),
        "min_k_baseline": ("per_tensor", {"min_k": 8}),
        "min_k_differs": ("auto", {"min_k": 32 if rank == 0 else 0}),
        "min_k_same": ("ssfusion", {"min_k": 0}),
        # each sender's wait on the wire: every planned scheme takes it, as a bool
        "waits_bad": ("multi_tensor", {"waits": 1}),
        "waits_zen": ("zen", {"waits": True}),
        "waits_differs": ("ssfusion_oi", {"waits": rank == 0}),
        "waits_same": ("per_tensor", {"waits": True}),
    }
    messages = {}
    for case, (scheme, options) in cases.items():
        model, opt = _build("same")
        try:
            ssfusion_hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                              scheme=scheme, scheme_options=options)
            messages[case] = None
        except ValueError as exc:
            messages[case] = str(exc)
    total = hvd.allreduce(torch.ones(1), name="after_options_cases", op=hvd.Sum)
    return {"messages": messages, "total": float(total)}


def waiting(delay=1.0):
    """Rank 1 submits its allgather ``delay`` seconds after rank 0, which waits for it twice:
    by ``Transport.wait`` and by Horovod's ``synchronize``. Returns this rank's
    {"ours" | "horovod": (wall seconds, process CPU seconds, output ok)} of the wait."""
    from types import SimpleNamespace

    import ssfusion_hvd.core.transport as transport
    from ssfusion_hvd.core.transport import Transport, global_process_set

    transport._SPIN = False  # the sleeping wait, whatever cores this machine has
    config = SimpleNamespace(process_set=global_process_set, op=hvd.Sum, gradient_predivide_factor=1.0)
    tr = Transport(config, "waittest")
    expected = torch.arange(2000, dtype=torch.float32)  # both ranks' 1000 values, in rank order
    out = {}
    for how, wait in (("ours", tr.wait), ("horovod", hvd.synchronize)):
        hvd.allreduce(torch.zeros(1), name=f"waittest.barrier.{how}")
        if hvd.rank() == 1:
            time.sleep(delay)
        mine = torch.arange(1000, dtype=torch.float32) + 1000 * hvd.rank()
        handle = tr.allgather(mine, how)
        wall, cpu = time.perf_counter(), time.process_time()
        gathered = wait(handle)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        out[how] = (wall, cpu, bool(torch.equal(gathered, expected)))
        out[f"{how}_again"] = wait(handle)  # a handle waited twice: None, both ways
    # the same for a bfloat16 allreduce, which Transport widens to float32 and back
    handle = tr.allreduce(torch.ones(4, dtype=torch.bfloat16), "again.bf16")
    out["bf16"] = tr.wait(handle).tolist()
    out["bf16_again"] = tr.wait(handle)
    return out
