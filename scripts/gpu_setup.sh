#!/usr/bin/env bash
# First thing on a lent GPU machine, which has no network: Horovod 0.28.1 built with CUDA
# from the carried files, in a venv that sees the machine's own torch (a venv with the
# system site-packages), so that scripts/gpu_check.sh can then run the schemes' GPU test.
#
#   bash scripts/gpu_setup.sh && PYTHON=build/gpu-venv/bin/python bash scripts/gpu_check.sh OUTDIR
#
# Needs the carried folder .whl/ (pass it in the run's carry list): horovod-0.28.1.tar.gz
# and the wheels Horovod's build and install need (cffi, pycparser, cloudpickle, psutil,
# pyyaml, packaging, setuptools, wheel, pip; docs/gpu.md says how to refill it); a python
# whose torch has CUDA; nvcc; cmake, make and g++. The recipe is scripts/horovod_build.sh's
# (shared with scripts/install.sh); it builds in about 100 s on the H100 machine (16 cores).
#
# Environment:
#   PYTHON            the python whose torch is used (default python3); the venv is made from it
#   SSFUSION_WHEELS   the carried folder (default: <repo>/.whl)
#   SSFUSION_GPU_VENV the venv (default: <repo>/build/gpu-venv); a re-run reuses it
#   SSFUSION_CACHE    wheel cache (default: ~/.cache/ssfusion-hvd): a re-run on the same
#                     machine installs the cached wheel instead of building again
#   SSFUSION_NCCL, SSFUSION_CUDA_CC, HOROVOD_CUDA_HOME, MAKEFLAGS: see scripts/horovod_build.sh
#                     (default on one GPU: no NCCL, GPU tensors staged through host memory)
# Prints the build time and `horovodrun --check-build`; exits non-zero on failure, after
# the last 40 lines of the build log (the whole logs: <venv>/logs/).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="${SSFUSION_WHEELS:-$REPO/.whl}"
VENV="${SSFUSION_GPU_VENV:-$REPO/build/gpu-venv}"
PY_BOOT="${PYTHON:-python3}"
CACHE="${SSFUSION_CACHE:-$HOME/.cache/ssfusion-hvd}"
HOROVOD_VERSION="0.28.1"
HOROVOD_DEPS=(cffi pycparser cloudpickle psutil pyyaml packaging setuptools wheel)

t0=$SECONDS
say() { printf '[gpu_setup %4ds] %s\n' "$((SECONDS - t0))" "$*"; }
fail() { printf '[gpu_setup] ERROR: %s\n' "$*" >&2; exit 1; }
hvd_step() { say "$@"; }

# shellcheck source=scripts/horovod_build.sh
source "$REPO/scripts/horovod_build.sh"

# ---------------------------------------------------------------- carried files, offline pip
[[ -f "$WHEELS/horovod-$HOROVOD_VERSION.tar.gz" ]] \
    || fail "no $WHEELS/horovod-$HOROVOD_VERSION.tar.gz (carry .whl/; docs/gpu.md)"
WHEELS="$(cd "$WHEELS" && pwd)"
export SSFUSION_WHEELS="$WHEELS" PIP_NO_INDEX=1 PIP_FIND_LINKS="$WHEELS" PIP_DISABLE_PIP_VERSION_CHECK=1
command -v "$PY_BOOT" >/dev/null || fail "$PY_BOOT not found (set PYTHON=...)"
"$PY_BOOT" -c 'import torch, sys; print("torch", torch.__version__, "CUDA", torch.version.cuda, "from", torch.__file__); sys.exit(0 if torch.version.cuda else 1)' \
    || fail "$PY_BOOT's torch has no CUDA"

# ---------------------------------------------------------------- venv over the system torch
PY="$VENV/bin/python"
if [[ -x "$PY" ]] && ! "$PY" -c 'import torch' 2>/dev/null; then
    say "$VENV does not see torch: making it again"
    rm -rf "$VENV"
fi
if [[ ! -x "$PY" ]]; then
    say "creating $VENV (--system-site-packages) with $PY_BOOT"
    mkdir -p "$(dirname "$VENV")"
    if ! "$PY_BOOT" -m venv --system-site-packages "$VENV" > /dev/null 2>&1; then
        # Debian/Ubuntu without python3-venv have no ensurepip: a venv without pip, whose
        # pip is then the system's (seen through the system site-packages) or the carried one
        rm -rf "$VENV"
        "$PY_BOOT" -m venv --system-site-packages --without-pip "$VENV" || fail "python venv failed"
    fi
fi
# --system-site-packages sees the *base* interpreter's packages; where PYTHON is itself a
# venv's (the lent machines: torch lives in /opt/torch/.venv), its site-packages are added
# by a .pth file, after the venv's own
site_pth="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_ssfusion_parent.pth"
"$PY_BOOT" -c 'import site, sys; print("\n".join(p for p in site.getsitepackages() + [site.getusersitepackages()] if p))' > "$site_pth"
"$PY" -c 'import torch' 2>/dev/null || fail "the venv does not see $PY_BOOT's torch"
mkdir -p "$VENV/logs" && rm -f "$VENV"/logs/horovod-build-*.log
if ! "$PY" -m pip --version > /dev/null 2>&1; then
    pip_whl="$(compgen -G "$WHEELS/pip-*.whl" | head -n 1)"
    [[ -n "$pip_whl" ]] || fail "the venv has no pip and $WHEELS has no pip wheel"
    say "installing pip from $(basename "$pip_whl")"
    "$PY" "$pip_whl/pip" install -q --no-index --find-links "$WHEELS" pip || fail "installing pip failed"
fi
PIP=("$PY" -m pip --disable-pip-version-check)
# Horovod's setup_requires and install_requires (and setuptools/wheel for pip's build),
# each only where neither the venv nor the system has it already.
"${PIP[@]}" install -q --no-index --find-links "$WHEELS" "${HOROVOD_DEPS[@]}" \
    || fail "installing ${HOROVOD_DEPS[*]} from $WHEELS failed"
# pip builds the wheel with setuptools' bdist_wheel (setuptools >= 70.1) or the wheel
# package's (its fallback for older setuptools); where neither imports, the carried
# setuptools goes into the venv.
if ! "$PY" -c 'import setuptools.command.bdist_wheel' 2>/dev/null \
        && ! "$PY" -c 'from wheel.bdist_wheel import bdist_wheel' 2>/dev/null; then
    say "no bdist_wheel command: installing the carried setuptools into the venv"
    "${PIP[@]}" install -q --no-index --find-links "$WHEELS" --ignore-installed setuptools \
        || fail "installing setuptools from $WHEELS failed"
fi

# ---------------------------------------------------------------- Horovod with CUDA
SSFUSION_CUDA=1 hvd_gpu_config "$PY" || fail "Horovod cannot be built with CUDA here (above)"
say "Horovod with $HVD_GPU_NOTE"
PYVER="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
TORCHVER="$("$PY" -c 'import torch; print(torch.__version__)')"
key="py${PYVER}-torch${TORCHVER}-hvd${HOROVOD_VERSION}-gloo"   # the recipe: HOROVOD_WITHOUT_MPI
export HVD_LOG_TAIL=40 HVD_LOG_DIR="$VENV/logs"
tb=$SECONDS
if ! hvd_install "$PY" "$CACHE" "$key" 0 "$VENV/.horovod-key"; then
    # the log's tail is mostly setup.py's traceback: the first errors, for the cause
    echo "[gpu_setup] first errors in the build logs:" >&2
    grep -h -m 12 -E 'CMake Error|error:|Error:|No such file' "$VENV"/logs/*.log >&2 || true
    fail "Horovod build or install failed after $((SECONDS - tb)) s (logs: $VENV/logs/)"
fi
say "Horovod ($HVD_KEY) built/installed in $((SECONDS - tb)) s"

# ---------------------------------------------------------------- check
check="$("$VENV/bin/horovodrun" --check-build 2>&1)" || { echo "$check"; fail "horovodrun --check-build failed"; }
echo "$check"
grep -q '\[X\] PyTorch' <<< "$check" || fail "Horovod lacks PyTorch"
grep -q '\[X\] Gloo' <<< "$check" || fail "Horovod lacks Gloo"
"$PY" -c 'import sys, torch, horovod, horovod.torch as h
print("horovod", horovod.__version__, "cuda_built", h.cuda_built(), "nccl_built", h.nccl_built(),
      "| torch", torch.__version__, "GPUs", torch.cuda.device_count())
sys.exit(0 if h.cuda_built() else 1)' || fail "Horovod was built without CUDA"
say "done: PYTHON=$PY bash scripts/gpu_check.sh OUTDIR"
