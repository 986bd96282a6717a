#!/usr/bin/env python3
"""An SSFusion-I plan with a real allreduce part, for the convergence evaluation.

    .venv/bin/python scripts/split_plan.py --task digits --out docs/results/plan_digits_split.json

On the evaluation's small models the planner, given the 1 Gbit/s profile, keeps nothing
dense (Eq. 2 finds nothing to hide), so ``ssfusion_i``/``ssfusion_oi`` run without an
allreduce part and their accuracy says nothing about the split. This script builds the plan
the paper's own heuristic gives (§III-B: tensors under 200 KB are "small"): Cupcake's
fusion groups for the profile, every small tensor dense in its group's allreduce part, the
rest sparsified into the allgather part, then density-aware compensation by link time
(``plan.compensate_density``: the floor d/2 may send some small tensors sparsified
again). ``train.py --plan`` / ``bench_convergence.py --plan`` replay it from the first step.
"""
from __future__ import annotations

import argparse
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

from ssfusion_hvd.plan import (ALLREDUCE, CostModel, compensate_density, default_backward_times,  # noqa: E402
                               fused_plan, optimal_fusion)

SMALL_BYTES = 200 * 1024  # SSFusion §III-B


def model_for(task: str):
    if task == "digits":
        from ssfusion_hvd.examples.data import DigitsNet
        return DigitsNet()
    from ssfusion_hvd.examples import text
    return text.lm_model()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="digits", choices=("digits", "lm"))
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--profile", default=str(REPO / "docs" / "results" / "profile_1gbit.json"))
    p.add_argument("--sparsifier", default="topk")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    named = list(model_for(args.task).named_parameters())[::-1]  # backward order, roughly
    names = [n for n, _ in named]
    sizes = [t.numel() for _, t in named]
    cost = CostModel.load(args.profile).with_backward(default_backward_times(sizes))
    groups = [(g.start, g.end) for g in
              optimal_fusion(sizes, cost, "multi_tensor", args.density, "x", names, args.sparsifier).groups]
    plan = fused_plan(sizes, groups, "per_tensor", args.density, "ssfusion_i", names, args.sparsifier)
    small = [n * cost.element_size < SMALL_BYTES for n in sizes]
    plan.sparse = [not s for s in small]
    plan.k = [n if s else k for n, s, k in zip(sizes, small, plan.k)]
    plan.collective = [ALLREDUCE if s else c for s, c in zip(small, plan.collective)]
    plan = compensate_density(plan, cost)
    plan.notes = {"made_by": "scripts/split_plan.py: §III-B 200 KB rule, compensated by link time",
                  "profile": str(args.profile)}
    plan.save(args.out)
    print(plan.table())


if __name__ == "__main__":
    main()
