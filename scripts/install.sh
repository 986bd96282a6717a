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
key="py${PYVER}-torch${TORCH_VERSION}-hvd${HOROVOD_VERSION}-$([[ $with_mpi == 1 ]] && echo gloo-mpi || echo gloo)"
wheel_dir="$CACHE/$key"
have_hvd="$("$PY" -c 'from importlib.metadata import version; print(version("horovod"))' 2>/dev/null || true)"
hvd_ok=0
if [[ "$have_hvd" == "$HOROVOD_VERSION" && -f "$VENV/.horovod-key" && "$(cat "$VENV/.horovod-key")" == "$key" ]]; then
    hvd_ok=1
fi
if [[ $hvd_ok == 0 ]]; then
    wheel="$(ls "$wheel_dir"/horovod-*.whl 2>/dev/null | head -n 1 || true)"
    if [[ -z "$wheel" ]]; then
        step "building Horovod $HOROVOD_VERSION wheel ($key); takes a few minutes, cached afterwards"
        command -v cmake >/dev/null 2>&1 || "${PIP[@]}" install -q cmake
        build="$(mktemp -d "${TMPDIR:-/tmp}/ssfusion-hvd-build.XXXXXX")"
        trap 'rm -rf "$build"' EXIT
        "${PIP[@]}" download -q --no-binary :all: --no-deps -d "$build" "horovod==$HOROVOD_VERSION"
        tar -xzf "$build"/horovod-"$HOROVOD_VERSION".tar.gz -C "$build"
        src="$build/horovod-$HOROVOD_VERSION"
        # torch >= 2.1 headers need C++17; Horovod 0.28.1 hard-codes C++14.
        for f in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
            sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$f"
            grep -q 'set(CMAKE_CXX_STANDARD 17)' "$f" || die "C++17 patch did not apply to $f"
            ! grep -q 'set(CMAKE_CXX_STANDARD 14)' "$f" || die "C++14 still set in $f"
        done
        mpi_flag=HOROVOD_WITHOUT_MPI=1
        [[ $with_mpi == 1 ]] && mpi_flag=HOROVOD_WITH_MPI=1
        (cd "$src" && env HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 "$mpi_flag" \
            HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_GPU_OPERATIONS= \
            MAKEFLAGS="${MAKEFLAGS:--j$(nproc)}" \
            "${PIP[@]}" wheel --no-build-isolation --no-deps -w "$build/dist" . \
            > "$build/horovod-build.log" 2>&1) \
            || { tail -n 60 "$build/horovod-build.log" >&2; die "Horovod build failed (log above)"; }
        mkdir -p "$wheel_dir"
        built="$(ls "$build"/dist/horovod-*.whl)"
        cp "$built" "$wheel_dir/.tmp.$(basename "$built")"
        mv "$wheel_dir/.tmp.$(basename "$built")" "$wheel_dir/$(basename "$built")"   # atomic publish
        wheel="$wheel_dir/$(basename "$built")"
        rm -rf "$build"; trap - EXIT
    fi
    step "installing $(basename "$wheel")"
    "${PIP[@]}" install -q --force-reinstall --no-deps "$wheel"
    echo "$key" > "$VENV/.horovod-key"
fi
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
