"""Peak resident memory of one process training GPT-2 (or any evaluation model) under DDP,
with or without the ``ssfusion_hvd.ddp`` hook: what decides whether 4 ranks fit on one
24 GiB machine (docs/ddp.md, "Memory"). One configuration per process, since the peak is
the process's:

    python scripts/ddp_hook_memory.py ddp
    python scripts/ddp_hook_memory.py ssfusion --optimizer    (the recipe's optimizer side)

One rank over gloo on the CPU, SGD with momentum, density 0.01 without warm-up; prints the
resident memory after each step's backward and update and the peak so far (ru_maxrss)."""
from __future__ import annotations

import argparse
import os
import resource
import tempfile

import torch
import torch.distributed as dist

from ssfusion_hvd.examples.models import MODELS, build
from ssfusion_hvd.examples.peers import make_peer


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="ddp, a DDP peer (ddp_powersgd4, ...) or a hook scheme (ssfusion, ...)")
    p.add_argument("--optimizer", action="store_true", help="give the hook the optimizer")
    p.add_argument("--model", default="gpt2", choices=sorted(MODELS))
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    store = tempfile.mkdtemp(prefix="ssf-hookmem-")
    dist.init_process_group("gloo", init_method=f"file://{store}/s", rank=0, world_size=1)
    model, loss_fn = build(args.model, args.batch_size, args.seq_len, 0, 0, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if args.config.startswith("ddp"):
        module, opt, _ = make_peer(args.config, model, opt, list(model.named_parameters()))
    else:
        import ssfusion_hvd.ddp
        from torch.nn.parallel import DistributedDataParallel as DDP

        module = DDP(model)
        ssfusion_hvd.ddp.register(module, scheme=args.config, density=0.01, density_warmup_steps=0,
                                  optimizer=opt if args.optimizer else None)
    for step in range(args.steps):
        opt.zero_grad()
        loss_fn(step, module).backward()
        after_backward = rss_gb()
        opt.step()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        print(f"[hook_memory] {args.config}{' +optimizer' if args.optimizer else ''} step {step}: "
              f"after backward {after_backward:.2f} GB, after step {rss_gb():.2f} GB, peak {peak:.2f} GB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
