"""``python -m ssfusion_hvd.plan``: plan a model offline and compare the schemes.

Example::

    python -m ssfusion_hvd.plan --model gpt2 --world-size 16 --bandwidth 10Gbps --density 0.01
    python -m ssfusion_hvd.plan --model resnet152 --profile profile.json --scheme ssfusion
"""
from __future__ import annotations

import argparse
import sys

from .cost import (
    DEFAULT_BACKWARD_PER_ELEMENT_S,
    DEFAULT_BACKWARD_PER_TENSOR_S,
    CostModel,
    default_backward_times,
    parse_bandwidth,
)
from .models import MODELS, model_tensors
from .schemes import DEFAULT_FUSION_THRESHOLD, PLANNERS, build_plan, choose_plan
from .formulas import FORMULA_SCHEMES, iteration_s
from .selective import DEFAULT_ACCURACY_SLACK, DEFAULT_GROUP_FLOOR, DEFAULT_MIN_K
from .timeline import simulate

_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def _seconds(text: str) -> float:
    s = text.strip().lower()
    for unit in ("us", "ms", "s"):
        if s.endswith(unit):
            return float(s[: -len(unit)]) * _TIME_UNITS[unit]
    return float(s)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ssfusion_hvd.plan", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, choices=sorted(MODELS))
    p.add_argument("--scheme", default="ssfusion_oi", choices=PLANNERS, help="scheme whose plan is printed")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--sparsifier", default="dgc")
    p.add_argument("--profile", help="CostModel JSON (see CostModel.save); replaces the network options")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--bandwidth", default="10Gbps", help="link bandwidth, e.g. 10Gbps, 25gbit, 1e9")
    p.add_argument("--latency", default="25us", help="per-hop latency, e.g. 25us, 0.1ms")
    p.add_argument("--fusion-threshold", type=int, default=DEFAULT_FUSION_THRESHOLD,
                   help="dense scheme: Horovod fusion threshold in bytes (0: one allreduce per tensor)")
    p.add_argument("--min-k", type=int, default=DEFAULT_MIN_K,
                   help="SSFusion schemes: send dense a tensor whose top-k would keep fewer "
                        "elements (as scheme_options['min_k']; default 0: off)")
    p.add_argument("--floor", default=str(DEFAULT_GROUP_FLOOR),
                   help="SSFusion schemes: the group budget's floor share, or 'none' for every "
                        "tensor its own k (as scheme_options['floor']; default %(default)s)")
    p.add_argument("--slack", type=float, default=DEFAULT_ACCURACY_SLACK,
                   help="SSFusion schemes under the group budget: larger shared budgets taken "
                        "within this share of the fastest plan (as scheme_options['slack']; "
                        "default %(default)s)")
    p.add_argument("--save-plan", help="write the printed plan as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.min_k < 0:
        raise SystemExit(f"--min-k must be >= 0, got {args.min_k}")
    if args.slack < 0:
        raise SystemExit(f"--slack must be >= 0, got {args.slack}")
    if args.floor != "none" and not 0.0 <= float(args.floor) <= 1.0:
        raise SystemExit(f"--floor must be 'none' or in [0, 1], got {args.floor}")
    tensors = model_tensors(args.model)
    names = [name for name, _ in tensors]
    sizes = [n for _, n in tensors]
    if args.profile:
        cost = CostModel.load(args.profile)
        if not cost.backward_s:
            cost = cost.with_backward(default_backward_times(sizes))
            print("assumption: the profile has no backward times; using the default rate below")
        print(f"cost model: {args.profile} (world size {cost.world_size})")
    else:
        bandwidth = parse_bandwidth(args.bandwidth)
        cost = CostModel.from_network(bandwidth, _seconds(args.latency), args.world_size,
                                      default_backward_times(sizes))
        print(f"cost model: ring collectives over {bandwidth / 1e9:g} Gbit/s, "
              f"{_seconds(args.latency) * 1e6:g} us latency, {args.world_size} workers (SSFusion Eq. 3-4)")
        print(f"assumption: backward time per tensor = {DEFAULT_BACKWARD_PER_TENSOR_S * 1e6:g} us "
              f"+ {DEFAULT_BACKWARD_PER_ELEMENT_S * 1e9:g} ns x elements")
    for device, (alpha, beta) in sorted(cost.sparsify.get(args.sparsifier, {}).items()):
        print(f"sparsification ({args.sparsifier}, {device}): {alpha * 1e3:.3f} ms "
              f"+ {beta * 1e12:.3f} ms/GB x bytes"
              + ("" if args.profile else "  [assumption: fitted to SSFusion Table III]"))
    print(f"model: {args.model}, {len(sizes)} gradient tensors, {sum(sizes):,} elements\n")

    group = dict(min_k=args.min_k, group_floor=None if args.floor == "none" else float(args.floor),
                 accuracy_slack=args.slack)
    plans = {s: build_plan(s, sizes, cost, args.density, names, args.sparsifier, args.fusion_threshold,
                           **group)
             for s in PLANNERS if s != "auto"}
    plans["auto"] = choose_plan(sizes, cost, density=args.density, names=names,
                                sparsifier=args.sparsifier, fusion_threshold_bytes=args.fusion_threshold,
                                **group)
    timelines = {s: simulate(p, cost) for s, p in plans.items()}
    print(plans[args.scheme].table(timelines[args.scheme]))
    if args.save_plan:
        plans[args.scheme].save(args.save_plan)
        print(f"plan written to {args.save_plan}")

    base = timelines["dense"].iteration_s
    print(f"\n{'scheme':<14} {'groups':>7} {'dense tensors':>14} {'offloaded':>10} "
          f"{'sent/elements':>14} {'iteration ms':>13} {'vs dense':>9}")
    for s in PLANNERS:
        p, t = plans[s], timelines[s].iteration_s
        dense = sum(not x for x in p.sparse)
        print(f"{s:<14} {len(p.groups):>7} {dense:>14} {sum(p.offload):>10} "
              f"{p.sent_elements() / sum(sizes):>14.4f} {t * 1e3:>13.2f} {base / t:>8.2f}x")
    print(f"auto runs the plan of {plans['auto'].scheme}: the fastest simulated, never slower "
          "than dense")
    for s in FORMULA_SCHEMES:  # no fusion plan: the papers' closed forms, after backward
        t = iteration_s(s, cost, sizes, args.density, args.sparsifier)
        print(f"{s:<14} {'-':>7} {0:>14} {0:>10} {args.density:>14.4f} {t * 1e3:>13.2f} "
              f"{base / t:>8.2f}x")
    print("spardl: SparDL Eq. 4 (d=1); zen: ZEN Eq. 1 with independent-index densification; "
          "exdyna: allgather of k/P indices per worker, then allreduce of k values; all three start after backward.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
