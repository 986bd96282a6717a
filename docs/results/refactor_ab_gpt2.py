"""Refactor A/B (issue 35): GPT-2 on a fixed profile; the plan's digest, the bytes of each
step and the step times. Run with PYTHONPATH at the tree to measure."""
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import horovod.torch as hvd
import ssfusion_hvd
from ssfusion_hvd.examples.models import build

hvd.init()
torch.set_num_threads(1)
model, loss_of = build("gpt2", seq_len=64, seed=0, rank=hvd.rank())
opt = ssfusion_hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
    named_parameters=model.named_parameters(), scheme="ssfusion_oi", density=0.01,
    profile=str(Path(__file__).with_name("profile_1gbit.json")), log_plan=False)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
times, sent = [], []
for step in range(int(sys.argv[1])):
    t0 = time.perf_counter()
    opt.zero_grad()
    loss_of(step).backward()
    opt.step()
    times.append(time.perf_counter() - t0)
    st = opt.stats()
    sent.append((st.get("allreduce_bytes"), st.get("allgather_bytes"), st.get("elements_sent")))
params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
if hvd.rank() == 0:
    print(json.dumps({"code": ssfusion_hvd.__file__,
                      "plan": hashlib.md5(opt.plan.to_json().encode()).hexdigest(),
                      "sent": sent, "times": [round(t, 3) for t in times],
                      "median_planned_s": statistics.median(times[7:]),
                      "params": hashlib.md5(params.numpy().tobytes()).hexdigest()}))
