#!/usr/bin/env bash
# What a lent GPU machine is for, in one command for one `run` call of at most 600 s
# (carry .whl; docs/gpu.md, docs/ddp.md), most important first:
#
#   bash scripts/gpu_e2e.sh OUTDIR        (BUDGET: seconds from the start after which no
#                                         run starts, default 500)
#
# 1. the DDP hook (issue 36): its GPU tests (NCCL with one rank, gloo with two ranks sharing
#    the GPU) while Horovod builds, then its added time per GPT-2 step beside PowerSGD's
#    (one rank, NCCL: scripts/ddp_hook_cost.py);
# 2. SSFusion's case where it exists (issue 33): GPT-2, the ranks sharing the GPU, each
#    behind its own paced 1 Gbit/s link (scripts/pace.c: the machine has no tc, and runs
#    under gVisor), DDP + our hook and the Horovod schemes beside DDP + PowerSGD (rank 4)
#    over gloo on the same links, then what the 2026-11-27 call left open.
#
# Builds Horovod with CUDA (scripts/gpu_setup.sh) while the extension builds, then runs
# scripts/bench_e2e.py sweeps, each given what is left of the budget; every finished run is
# already in OUTDIR/e2e_gpu.json when a later one is cut off. bfloat16 autocast; GPT-2 at
# batch 8 x 1024 tokens per rank. The planned schemes profile 3 steps (the default is 5)
# and PowerSGD compresses from its 4th step: at 1 Gbit/s a dense GPT-2 step takes seconds,
# and neither changes the steady state that is timed.
set -uo pipefail
OUT="${1:-build/gpu-e2e}"
BUDGET="${BUDGET:-500}"
PY_SYS="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the scripts import the tree
t0=$SECONDS
say() { printf '[gpu_e2e %4ds] %s\n' "$((SECONDS - t0))" "$*"; }
nvidia-smi -L
# Horovod (about 95 s) while the extension builds (about 35 s) and then the DDP hook's GPU
# tests run, which need no Horovod: the machine has 16 cores
( bash scripts/gpu_setup.sh > "$OUT/setup.log" 2>&1; echo $? > "$OUT/setup.rc" ) &
setup=$!
if ! "$PY_SYS" setup.py build_ext --inplace > "$OUT/ext.log" 2>&1; then
    tail -n 30 "$OUT/ext.log"; wait; exit 1
fi
say "extension built; the DDP hook's GPU tests"
PYTHONPATH="$PWD" timeout 200 "$PY_SYS" -m pytest tests/test_ddp.py tests/test_moments_native.py -k gpu -q \
    -p no:cacheprovider --tb=short > "$OUT/tests_ddp_gpu.log" 2>&1
tail -n 4 "$OUT/tests_ddp_gpu.log"
wait "$setup"
if [[ "$(cat "$OUT/setup.rc")" != 0 ]]; then tail -n 40 "$OUT/setup.log"; exit 1; fi
grep "built/installed\|cuda_built" "$OUT/setup.log"
# the CUDA kernel of the selection by Adam's step (test_ops_cuda.py imports a helper module
# that needs Horovod: the venv's python)
PYTHONPATH="$PWD" timeout 100 build/gpu-venv/bin/python -m pytest tests/test_ops_cuda.py -k step_key -q \
    -p no:cacheprovider --tb=short 2>&1 | tail -n 3
say "Horovod built; the hook's cost per GPT-2 step, one rank (NCCL)"
PYTHONPATH="$PWD" timeout 150 "$PY_SYS" scripts/ddp_hook_cost.py --device cuda --model gpt2 \
    --batch-size 8 --seq-len 1024 --amp bfloat16 --json "$OUT/hook_cost.json" \
    --configs ddp,ddp_powersgd4,ssfusion,per_tensor,multi_tensor,ssfusion:4096 2>&1 \
    | grep "hook_cost\]\|Error" | tail -n 9
PYTHONPATH="$PWD" timeout 60 "$PY_SYS" scripts/bench_moments.py --device cuda 2>&1 | grep "bench_moments\]\|Error"
PY=build/gpu-venv/bin/python
common=(--shaper pace --rate 1gbit --device cuda --amp bfloat16 --workers 2 --warmup-steps 3
        --powersgd-start 3 --timeout 150 --out "$OUT" --name e2e_gpu --merge)
sweep() {  # sweep MODEL SCHEMES [bench_e2e args...]: what is left of the budget, or nothing
    local left=$((BUDGET - (SECONDS - t0)))
    if (( left <= 20 )); then say "no time left for $1 ($2)"; return; fi
    say "$1: $2 (deadline in $left s)"
    "$PY" scripts/bench_e2e.py "${common[@]}" --models "$1" --schemes "$2" --deadline "$left" "${@:3}" \
        > "$OUT/sweep-$1-$(date +%s).log" 2>&1
    grep "^\[bench_e2e\]" "$OUT"/sweep-"$1"-*.log | tail -n 12
}
gpt=(--batch-size 8 --seq-len 1024 --warmup 4 --iters 5)
pace=(env LD_PRELOAD="$PWD/build/pace/libssfpace.so" SSF_PACE_BYTES_PER_S=125000000)
# 1a. the DDP hook against PowerSGD on the same paced links (issue 36), at density 0.01 and
#     at PowerSGD rank 4's bytes (0.0037: records are 8 bytes an element)
sweep gpt2 ddp_ssfusion,ddp_ssfusion_plan,ddp_powersgd4 "${gpt[@]}" --name e2e_gpu_ddp
sweep gpt2 ddp_ssfusion_plan,ddp_ssfusion,ssfusion_oi "${gpt[@]}" --density 0.0037 --name e2e_gpu_d0037
# 1b. the digits gap on the GPU (docs/gpu.md, 2026-11-27: ssfusion_oi 95.28 % against dense
#     98.33 %, one seed; the CPU is within 0.6 points): 3 seeds, and the schemes that take
#     fewer of the GPU-only paths (no offload worker, no group budget), 10 epochs, unshaped
hvdrun=(timeout 150 build/gpu-venv/bin/horovodrun -np 2 -H localhost:2 --gloo "$PY" -m ssfusion_hvd.examples.train --device cuda --no-progress)
#     On the H200's loopback (2026-11-30) the planner kept every tensor dense, so the runs
#     first take the demo's saved all-sparse plan (one group, the group budget; CPU seeds
#     0-2 with it: 98.33, 99.17, 98.89 %, docs/status.md), then the planner's own
for run in "ssfusion_oi 0 group" "ssfusion_oi 1 group" "ssfusion_oi 2 group" "dense 2" \
           "multi_tensor 2" "ssfusion 0"; do
    set -- $run
    (( BUDGET - (SECONDS - t0) > 40 )) || { say "no time left for digits ($1, seed $2)"; continue; }
    say "digits on the GPU, $1, seed $2${3:+, the saved plan}"
    "${hvdrun[@]}" --scheme "$1" --seed "$2" --epochs 10 ${3:+--plan docs/results/plan_demo_group.json} \
        --json "$OUT/train_digits_$1_$2${3:+_$3}.json" 2>&1 | grep "epoch  *10/\|plan\|Error" | tail -n 3
done
# 1. where GPT-2's sparse collective time went on 2026-11-27 (docs/gpu.md): one 10 MB
#    allgather of host and CUDA tensors, with and without queued GPU work (about 20 s)
mkdir -p build/pace && cc -O2 -shared -fPIC -o build/pace/libssfpace.so scripts/pace.c -ldl -lpthread
if [[ -f build/pace/libssfpace.so ]] && (( BUDGET - (SECONDS - t0) > 60 )); then
    say "collective probe"
    timeout 90 build/gpu-venv/bin/horovodrun -np 2 -H localhost:2 --gloo "${pace[@]}" "$PY" \
        scripts/gpu_probe_collectives.py --json "$OUT/probe.json" 2>&1 | grep "probe\]"
    say "collective probe, unpaced"
    timeout 90 build/gpu-venv/bin/horovodrun -np 2 -H localhost:2 --gloo "$PY" \
        scripts/gpu_probe_collectives.py --json "$OUT/probe_unpaced.json" 2>&1 | grep "probe\]"
fi
# 2. the LM on the GPU converges as on the CPU (4 epochs, 2 ranks on the GPU, unshaped)
for scheme in ssfusion_oi dense; do
    (( BUDGET - (SECONDS - t0) > 60 )) || { say "no time left for the LM ($scheme)"; continue; }
    say "LM on the GPU, $scheme"
    "${hvdrun[@]}" --task lm --scheme "$scheme" --epochs 4 --json "$OUT/train_lm_$scheme.json" 2>&1 | grep "epoch  *4/\|Error" | tail -n 2
done
# 3. ssfusion_oi against PowerSGD at equal bytes: density 0.0037 sends PowerSGD rank 4's
#    3.7 MB per GPT-2 step (records are 8 bytes an element)
sweep gpt2 multi_tensor "${gpt[@]}" --density 0.0037 --name e2e_gpu_d0037
# 4. 4 ranks on the GPU
sweep gpt2 ssfusion_oi,multi_tensor,ddp_powersgd4,dense "${gpt[@]}" --workers 4 --name e2e_gpu_w4
# 5. the rest of the SSFusion family; 10 Gbit/s
sweep gpt2 ssfusion,ssfusion_o,ssfusion_i "${gpt[@]}"
sweep gpt2 ssfusion_oi,ddp_powersgd4,multi_tensor,dense "${gpt[@]}" --rate 10gbit --name e2e_gpu_10g
# 6. issue 34: the agreement check's cost on GPT-2, every sparse scheme run with and without
#    it in one sweep (the ResNet-50 A/B of 2026-11-27 was within run-to-run noise)
sweep gpt2 ssfusion_oi,multi_tensor,per_tensor "${gpt[@]}" --iters 8 --agreement both --name e2e_gpu_ab
say "done"
# the per-run logs stay on the machine: a run's reply brings back a limited number of files
mkdir -p build/gpu-logs && mv "$OUT"/logs "$OUT"/sweep-*.log build/gpu-logs/ 2>/dev/null
ls -la "$OUT"
