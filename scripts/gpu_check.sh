#!/usr/bin/env bash
# What a GPU machine is for here (docs/kernels.md, "GPU"), in one command: build the
# extension against that machine's torch, list its cubins, run the CUDA tests (and the
# schemes' GPU test where Horovod is built with CUDA), then the CUDA kernel benchmark in
# float32 and float16. Logs and tables go to OUTDIR.
#
#   bash scripts/gpu_check.sh [OUTDIR]        (default build/gpu-check; PYTHON: the python
#                                              whose torch to use, default python3)
# Nothing here installs anything: the machine needs torch with CUDA, pybind11, cmake,
# ninja, pytest and hypothesis (the lent H100/H200 images have them all). For a Horovod
# built with CUDA, run scripts/gpu_setup.sh first (offline, from the carried .whl/) and
# pass its venv: PYTHON=build/gpu-venv/bin/python bash scripts/gpu_check.sh OUTDIR.
set -uo pipefail
OUT="${1:-build/gpu-check}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi -L
"$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name())'
t0=$SECONDS
if ! "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
    tail -n 40 "$OUT/build.log"; echo "build failed (log: $OUT/build.log)"; exit 1
fi
echo "built in $((SECONDS - t0)) s"
grep "\[ssfusion_hvd\]\|ssfusion_hvd CUDA kernels" "$OUT/build.log"
cuobjdump --list-elf ssfusion_hvd/_C*.so | tee "$OUT/elf.txt"
"$PY" -c 'from ssfusion_hvd import ops; print(ops.build_info())'
rc=0
"$PY" -m pytest tests/test_ops_cuda.py tests/test_ops_hash.py tests/test_toolchain.py -q \
    -p no:cacheprovider --tb=short > "$OUT/tests.log" 2>&1 || rc=1
tail -n 3 "$OUT/tests.log"
if "$PY" -c 'import sys, horovod.torch as h; sys.exit(0 if h.cuda_built() else 1)' 2>/dev/null; then
    "$PY" -m pytest tests/test_schemes.py -k gpu -q -p no:cacheprovider --tb=short \
        > "$OUT/tests_schemes_gpu.log" 2>&1 || rc=1
    tail -n 3 "$OUT/tests_schemes_gpu.log"
    # mixed precision on the GPU: float16 autocast + GradScaler("cuda") with overflows on
    # one rank, bfloat16 autocast; every scheme, SparDL, ZEN and ExDyna included
    "$PY" -m pytest tests/test_precision.py -k gpu -q -p no:cacheprovider --tb=short \
        > "$OUT/tests_precision_gpu.log" 2>&1 || rc=1
    tail -n 3 "$OUT/tests_precision_gpu.log"
else
    echo "no Horovod built with CUDA here: the schemes' GPU test does not run"
fi
for dtype in float32 float16; do
    "$PY" scripts/bench_kernels_cuda.py --reps 30 --dtype "$dtype" > "$OUT/bench_$dtype.txt" \
        2> "$OUT/bench_$dtype.err" || rc=1
done
cat "$OUT/bench_float32.txt"
exit $rc
