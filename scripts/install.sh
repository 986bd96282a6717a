#!/usr/bin/env bash
# Installs everything ssfusion-hvd needs into .venv/ (idempotent; fails loudly).
#
#   bash scripts/install.sh            # create/refresh .venv, build what is missing
#
# Steps: venv -> torch==2.13.0 -> Python deps -> Debian packages when missing and root
# (OpenMPI; iproute2 and openssh for scripts/cluster.py) and mpi4py -> Horovod 0.28.1
# with Gloo and MPI (patched for C++17, built once as a wheel and cached under
# ~/.cache/ssfusion-hvd/) -> this package in editable mode (which builds the
# ssfusion_hvd._C extension with CMake).
#
# Environment knobs:
#   PYTHON            interpreter used to create the venv (default: python3)
#   SSFUSION_CACHE    wheel cache (default: ~/.cache/ssfusion-hvd)
#   MAKEFLAGS         parallelism of the Horovod build (default: -j$(nproc))
#   SSFUSION_NO_MPI   1: do not install OpenMPI (Horovod then has Gloo only)
#   SSFUSION_WHEELS   folder of carried files (horovod-0.28.1.tar.gz and wheels, e.g. .whl/):
#                     pip runs offline on it (--no-index --find-links); whatever else is
#                     missing from the venv (torch, the Python deps) must be in it too
#   SSFUSION_CUDA     auto (default): Horovod with CUDA when the venv's torch has CUDA and
#                     nvcc (same major version) is found; 0: never; 1: required
#   SSFUSION_NCCL     auto (default): NCCL GPU operations when torch's NCCL wheel is found
#                     and >= 2 GPUs are visible (else GPU tensors are staged through host
#                     memory); 1: whenever found; 0: never. SSFUSION_CUDA_CC: sm list
#                     (default: the visible GPUs', else 90). The recipe and the details:
#                     scripts/horovod_build.sh (shared with scripts/gpu_setup.sh)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.venv"
PY_BOOT="${PYTHON:-python3}"
CACHE="${SSFUSION_CACHE:-$HOME/.cache/ssfusion-hvd}"
TORCH_VERSION="2.13.0"
HOROVOD_VERSION="0.28.1"
PY_DEPS=(numpy pytest pytest-timeout hypothesis pybind11 ninja tqdm scikit-learn transformers matplotlib
         cloudpickle psutil pyyaml packaging "setuptools>=64" wheel)

t0=$SECONDS
step() { printf '\n[install %4ds] %s\n' "$((SECONDS - t0))" "$*"; }
die() { printf '\n[install] ERROR: %s\n' "$*" >&2; exit 1; }
trap 'die "step failed (line $LINENO): $BASH_COMMAND"' ERR
# shellcheck source=scripts/horovod_build.sh
source "$REPO/scripts/horovod_build.sh"
if [[ -n "${SSFUSION_WHEELS:-}" ]]; then
    [[ -d "$SSFUSION_WHEELS" ]] || die "SSFUSION_WHEELS=$SSFUSION_WHEELS is not a folder"
    SSFUSION_WHEELS="$(cd "$SSFUSION_WHEELS" && pwd)"
    export SSFUSION_WHEELS PIP_NO_INDEX=1 PIP_FIND_LINKS="$SSFUSION_WHEELS"
    PY_DEPS+=(cffi pycparser)   # Horovod's setup_requires, fetched from PyPI when online
fi

# ---------------------------------------------------------------- 1. virtualenv
if [[ ! -x "$VENV/bin/python" ]]; then
    step "creating $VENV with $PY_BOOT"
    command -v "$PY_BOOT" >/dev/null || die "$PY_BOOT not found (set PYTHON=...)"
    "$PY_BOOT" -m venv "$VENV" || die "python venv failed (install python3-venv?)"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)
PYVER="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 9))' || die "Python >= 3.9 needed, found $PYVER"

# ---------------------------------------------------------------- 2. torch
have_torch="$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)"
if [[ "$have_torch" != "$TORCH_VERSION" ]]; then
    step "installing torch==$TORCH_VERSION (found: ${have_torch:-none})"
    "${PIP[@]}" install -q "torch==$TORCH_VERSION"
fi

# ---------------------------------------------------------------- 3. python deps
missing="$("$PY" - "${PY_DEPS[@]}" <<'PYEOF'
import sys
from importlib import metadata
import re
out = []
for req in sys.argv[1:]:
    name = re.split(r"[<>=!~ ]", req, 1)[0]
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        out.append(req)
print(" ".join(out))
PYEOF
)"
if [[ -n "$missing" ]]; then
    step "installing python deps: $missing"
    # shellcheck disable=SC2086
    "${PIP[@]}" install -q $missing
fi

# ---------------------------------------------------------------- 4. system packages
# Debian packages, installed when missing (needs root and apt-get): OpenMPI for Horovod's
# MPI controller and mpi4py (SSFUSION_NO_MPI=1 skips it), and iproute2 + openssh for
# scripts/cluster.py's namespaced hosts. Without them everything else works (Gloo, one
# host); one line says what is missing, and the tests that need it are skipped.
apt_pkgs=()
if ! command -v mpicxx >/dev/null 2>&1 && [[ "${SSFUSION_NO_MPI:-0}" != 1 ]]; then
    apt_pkgs+=(openmpi-bin libopenmpi-dev)
fi
{ command -v ip && command -v tc; } >/dev/null 2>&1 || apt_pkgs+=(iproute2)
{ command -v ssh && command -v ssh-keygen; } >/dev/null 2>&1 || apt_pkgs+=(openssh-client)
[[ -x /usr/sbin/sshd ]] || command -v sshd >/dev/null 2>&1 || apt_pkgs+=(openssh-server)
if [[ ${#apt_pkgs[@]} -gt 0 ]]; then
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        step "installing Debian packages: ${apt_pkgs[*]}"
        apt_install() { DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -q \
                            --no-install-recommends "${apt_pkgs[@]}" >> "$VENV/.apt.log" 2>&1; }
        if ! apt_install; then
            DEBIAN_FRONTEND=noninteractive timeout 600 apt-get update -q >> "$VENV/.apt.log" 2>&1 || true
            apt_install || true
        fi
    fi
    if ! command -v mpicxx >/dev/null 2>&1 && [[ "${SSFUSION_NO_MPI:-0}" != 1 ]]; then
        echo "[install] no MPI could be installed (needs root and apt-get; log: $VENV/.apt.log): Horovod is built with Gloo only, MPI tests are skipped"
    fi
    if ! { [[ -x /usr/sbin/sshd ]] || command -v sshd; } >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then
        echo "[install] no sshd/iproute2 could be installed (log: $VENV/.apt.log): scripts/cluster.py and its tests are unavailable"
    fi
fi
with_mpi=0
command -v mpicxx >/dev/null 2>&1 && with_mpi=1
if [[ $with_mpi == 1 ]] && ! "$PY" -c 'import mpi4py' 2>/dev/null; then
    step "installing mpi4py (built against $(mpicxx --showme:version 2>/dev/null | head -n 1 || echo MPI))"
    "${PIP[@]}" install -q mpi4py \
        || echo "[install] mpi4py could not be installed: its tests are skipped (Horovod's MPI controller is unaffected)"
fi

# ---------------------------------------------------------------- 5. horovod
# CPU torch (CI): HVD_GPU=none, and the key and the build are what they always were. A
# CUDA torch with nvcc: the CUDA recipe of scripts/horovod_build.sh, under its own key.
hvd_gpu_config "$PY" || die "SSFUSION_CUDA=1 but Horovod cannot be built with CUDA here"
[[ $HVD_GPU != none ]] && echo "[install] Horovod with $HVD_GPU_NOTE"
key="py${PYVER}-torch${TORCH_VERSION}-hvd${HOROVOD_VERSION}-$([[ $with_mpi == 1 ]] && echo gloo-mpi || echo gloo)"
hvd_step() { step "$@"; }
hvd_install "$PY" "$CACHE" "$key" "$with_mpi" "$VENV/.horovod-key" \
    || die "Horovod build or install failed (log above)"
"$VENV/bin/horovodrun" --check-build > "$VENV/.horovod-check" 2>&1 \
    || { cat "$VENV/.horovod-check" >&2; die "horovodrun --check-build failed"; }
grep -q '\[X\] PyTorch' "$VENV/.horovod-check" || { cat "$VENV/.horovod-check"; die "Horovod lacks PyTorch"; }
grep -q '\[X\] Gloo' "$VENV/.horovod-check" || { cat "$VENV/.horovod-check"; die "Horovod lacks Gloo"; }
if [[ $with_mpi == 1 ]]; then
    grep -q '\[X\] MPI' "$VENV/.horovod-check" || { cat "$VENV/.horovod-check"; die "Horovod lacks MPI"; }
fi

# ---------------------------------------------------------------- 6. this package
step "building ssfusion_hvd (editable; CMake extension)"
(cd "$REPO" && "${PIP[@]}" install -q --no-build-isolation --no-deps -e .) \
    || die "building ssfusion_hvd failed (see output above)"
"$PY" -c 'import torch, ssfusion_hvd, ssfusion_hvd.ops as o; assert o.have_extension(), "extension missing"' \
    || die "ssfusion_hvd._C does not import"
step "done: $("$PY" -c 'import torch, horovod, ssfusion_hvd; print(f"torch {torch.__version__}, horovod {horovod.__version__}, ssfusion_hvd {ssfusion_hvd.__version__}")')"
