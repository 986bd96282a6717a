"""An elastic training job (``horovodrun --gloo`` with a host discovery script), for
tests/test_elastic.py. Not a pytest module: run as a script by every worker.

    python tests/workers_elastic.py --scheme S --dir D [--kill-at N] [--grow-at M]

The hosts the job may use are the lines of ``D/hosts`` (the discovery script prints
them). At step ``--kill-at`` the worker on host ``--victim`` exits (a preempted
machine): its host is taken out of the file, and the job goes on with fewer ranks. At step
``--grow-at`` rank 0 appends ``D/spare`` (a third local host name) to the file, and the
job grows. With ``--replace`` the victim's host is replaced by ``D/spare`` instead: a new
worker takes its place and the job gets its size back. Every worker ends by writing
``D/result.<host>.pt``: its parameters, the losses and the world sizes it trained at.
"""
import argparse
import os
import time
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F

import ssfusion_hvd  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--scheme", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--victim", default="127.0.0.1", help="the host whose worker exits")
    p.add_argument("--grow-at", type=int, default=-1)
    p.add_argument("--replace", action="store_true",
                   help="at --kill-at the victim's host is replaced by D/spare (a new machine "
                        "takes the preempted one's place: the job keeps its size)")
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--moments", default="local")
    p.add_argument("--fixed-plan", action="store_true",
                   help="every rank hands the same plan (plan=): no profiling, no planning")
    args = p.parse_args()
    d = Path(args.dir)
    host = os.environ.get("HOROVOD_HOSTNAME", "?")
    hvd.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    if args.optimizer == "adam":
        inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    else:
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if args.scheme == "horovod":  # the reference: Horovod's own optimizer
        opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    else:
        plan = None
        if args.fixed_plan:  # every tensor sparse, one group
            from ssfusion_hvd.plan import Group, Plan
            from ssfusion_hvd.plan.cost import nominal_k
            named = list(model.named_parameters())
            sizes = [p.numel() for _, p in named]
            plan = Plan(args.scheme, [n for n, _ in named], sizes, [Group(0, len(named))],
                        [True] * len(named), [nominal_k(s, 0.1) for s in sizes],
                        ["allgather"] * len(named), [False] * len(named), 0.1)
        opt = ssfusion_hvd.DistributedOptimizer(
            inner, named_parameters=model.named_parameters(), scheme=args.scheme,
            density=0.1, warmup_steps=3, density_warmup_steps=0, moments=args.moments,
            plan=plan, log_plan=False)
    # a fixed teacher: every rank draws its own batches from the same task
    teacher = torch.Generator().manual_seed(123)
    w_true = torch.randn(16, 4, generator=teacher)

    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0, losses=[], sizes=[],
                                   phases=[])

    @hvd.elastic.run
    def train(state):
        while state.step < args.steps:
            g = torch.Generator().manual_seed(1000 * state.step + hvd.rank())
            x = torch.randn(32, 16, generator=g)
            y = (x @ w_true).argmax(1)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            avg = hvd.allreduce(loss.detach(), name="elastic.loss")
            state.losses.append(float(avg))
            state.sizes.append(hvd.size())
            state.phases.append(opt.stats().get("phase") if args.scheme != "horovod" else None)
            state.step += 1
            if state.step == args.kill_at and hvd.size() > 1 and host == args.victim:
                spare = [(d / "spare").read_text().strip()] if args.replace else []
                _write_hosts(d, [h for h in _hosts(d) if h != host] + spare)
                os._exit(17)  # preempted: no goodbye
            if state.step == args.grow_at and hvd.rank() == 0:
                spare = (d / "spare").read_text().strip()
                if spare not in _hosts(d):
                    _write_hosts(d, _hosts(d) + [spare])
            state.commit()
            if (state.step == args.grow_at or args.replace) and hvd.size() == 1:
                # wait here for the driver to add the new host, so the job grows at this
                # step in every run (check_host_updates raises HostsUpdatedInterrupt); with
                # --replace, wherever the lost worker left the job at one rank
                deadline = time.time() + 90
                while time.time() < deadline:
                    time.sleep(0.2)
                    state.check_host_updates()

    train(state)
    torch.save({"params": [p.detach().clone() for p in model.parameters()],
                "losses": list(state.losses), "sizes": list(state.sizes),
                "phases": list(state.phases),
                "rank": hvd.rank(), "size": hvd.size()}, d / f"result.{host}.pt")


def _hosts(d: Path):
    return [h.split(":")[0] for h in (d / "hosts").read_text().split()]


def _write_hosts(d: Path, hosts):
    tmp = d / "hosts.tmp"
    tmp.write_text("".join(f"{h}:1\n" for h in hosts))
    tmp.replace(d / "hosts")


if __name__ == "__main__":
    main()
