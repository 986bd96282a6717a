# shellcheck shell=bash
# shellcheck disable=SC2034  # HVD_* are this library's results, read by its callers
# The Horovod build recipe, in one place: sourced (not run) by scripts/install.sh (its
# .venv, CPU or CUDA) and scripts/gpu_setup.sh (a lent GPU machine, offline).
#
#   hvd_gpu_config PY             decides how PY's Horovod is built; sets HVD_GPU (none,
#                                 staged or nccl), HVD_GPU_NOTE and the HVD_* below
#   hvd_key_suffix [GPU]          cache-key suffix of that build ("" for none: the CPU key
#                                 is the one install.sh always used)
#   hvd_build_wheel PY OUT MPI GPU   builds horovod-$HOROVOD_VERSION into the wheel folder
#                                 OUT (published atomically); sets HVD_WHEEL; returns 1 on
#                                 failure (after printing the log's last $HVD_LOG_TAIL lines)
#   hvd_install PY CACHE BASE_KEY MPI KEYFILE
#                                 makes PY's Horovod the HVD_GPU build: the wheel of key
#                                 BASE_KEY$(hvd_key_suffix) from CACHE/<key>/ (built there
#                                 first if missing), installed unless KEYFILE holds that key;
#                                 a NCCL build that fails to build or to load is marked
#                                 (CACHE/<key>.nccl-failed, so later runs skip it) and
#                                 replaced by the staged build. Sets HVD_KEY and HVD_GPU;
#                                 returns 1 on failure. Progress lines go to hvd_step (the
#                                 caller's, else echo).
#
# Knobs (environment):
#   SSFUSION_WHEELS   folder of carried files (the horovod sdist, wheels): the sdist is
#                     taken from there, and install.sh/gpu_setup.sh run pip with
#                     --no-index --find-links on it (no network needed)
#   SSFUSION_CUDA     auto (default): build with CUDA when PY's torch has CUDA and an nvcc
#                     of the same major version is found; 0: never; 1: always (fail if not
#                     possible)
#   SSFUSION_NCCL     auto (default): NCCL GPU operations when torch's NCCL wheel is found
#                     and at least two GPUs are visible; 1: whenever that NCCL is found;
#                     0: never (GPU tensors staged through host memory)
#   SSFUSION_CUDA_CC  compute capabilities, comma-separated (default: those of the visible
#                     GPUs, else 90)
#   HOROVOD_CUDA_HOME CUDA toolkit (default: CUDA_HOME, /usr/local/cuda, or nvcc's)
#   HVD_LOG_TAIL      lines of the build log shown on failure (default 60)
#   HVD_LOG_DIR       folder the build logs are copied to, as horovod-build-<GPU>.log
#                     (default: none; they are removed with the build folder)
#
# The caller provides: PIP (array: "$PY" -m pip ...), HOROVOD_VERSION.

# ------------------------------------------------------------------------- CUDA probe
_hvd_cuda_home() {
    local h
    for h in "${HOROVOD_CUDA_HOME:-}" "${CUDA_HOME:-}" /usr/local/cuda; do
        [[ -n "$h" && -x "$h/bin/nvcc" ]] && { echo "$h"; return 0; }
    done
    h="$(command -v nvcc 2>/dev/null)" || return 1
    # /usr/local/bin/nvcc may be a wrapper script; the toolkit is where the real one lives
    h="$(sed -n 's|^exec \(/[^ ]*\)/bin/nvcc .*|\1|p' "$h" 2>/dev/null | head -n 1)"
    [[ -n "$h" && -x "$h/bin/nvcc" ]] && { echo "$h"; return 0; }
    h="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
    [[ -x "$h/bin/nvcc" ]] && { echo "$h"; return 0; }
    return 1
}

hvd_gpu_config() {
    local py="$1" probe want="${SSFUSION_CUDA:-auto}" nccl="${SSFUSION_NCCL:-auto}" nvcc_ver
    HVD_GPU=none HVD_GPU_NOTE="" HVD_CUDA_HOME="" HVD_TORCH_CUDA="" HVD_NGPU=0 HVD_CC=""
    HVD_NCCL_INCLUDE="" HVD_NCCL_LIBDIR=""
    [[ "$want" == 0 ]] && { HVD_GPU_NOTE="SSFUSION_CUDA=0"; return 0; }
    # One python: torch's CUDA version, the GPUs' compute capabilities, and the NCCL that
    # torch's pip wheel brought (nvidia-nccl-cu1x: nvidia/nccl/{include/nccl.h,lib/libnccl.so.2};
    # a namespace package, hence __path__).
    probe="$("$py" - <<'PYEOF' 2>/dev/null
import glob, os
import torch
cuda = torch.version.cuda or ""
n = torch.cuda.device_count() if cuda else 0
ccs = sorted({"%d%d" % torch.cuda.get_device_capability(i) for i in range(n)})
inc = lib = ""
try:
    import nvidia.nccl as m
    for p in list(m.__path__):
        libs = sorted(glob.glob(os.path.join(p, "lib", "libnccl.so*")))
        if os.path.isfile(os.path.join(p, "include", "nccl.h")) and libs:
            inc, lib = os.path.join(p, "include"), os.path.join(p, "lib")
            break
except Exception:
    pass
print(cuda or "-", n, ",".join(ccs) or "-", inc or "-", lib or "-")
PYEOF
)" || probe=""
    local cuda n ccs inc lib
    read -r cuda n ccs inc lib <<< "${probe:-- 0 - - -}"
    [[ "$cuda" == - ]] && cuda=""
    [[ "$ccs" == - ]] && ccs=""
    [[ "$inc" == - ]] && inc=""
    [[ "$lib" == - ]] && lib=""
    if [[ -z "$cuda" ]]; then
        HVD_GPU_NOTE="torch has no CUDA"
        [[ "$want" == 1 ]] && { echo "[horovod] SSFUSION_CUDA=1 but $py's torch has no CUDA" >&2; return 1; }
        return 0
    fi
    if ! HVD_CUDA_HOME="$(_hvd_cuda_home)"; then
        HVD_GPU_NOTE="torch has CUDA $cuda but no nvcc was found (HOROVOD_CUDA_HOME)"
        [[ "$want" == 1 ]] && { echo "[horovod] SSFUSION_CUDA=1: $HVD_GPU_NOTE" >&2; return 1; }
        HVD_CUDA_HOME=""
        return 0
    fi
    nvcc_ver="$("$HVD_CUDA_HOME/bin/nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9][0-9.]*\).*/\1/p')"
    if [[ "${nvcc_ver%%.*}" != "${cuda%%.*}" && "$want" != 1 ]]; then
        HVD_GPU_NOTE="torch has CUDA $cuda but nvcc is ${nvcc_ver:-unknown} (SSFUSION_CUDA=1 builds anyway)"
        HVD_CUDA_HOME=""
        return 0
    fi
    HVD_TORCH_CUDA="$cuda" HVD_NGPU="$n"
    HVD_CC="${SSFUSION_CUDA_CC:-${ccs:-90}}"
    HVD_GPU=staged
    HVD_GPU_NOTE="CUDA $cuda (nvcc $nvcc_ver at $HVD_CUDA_HOME), sm $HVD_CC, $n GPU(s); GPU tensors staged through host memory"
    # NCCL GPU operations only where they can run our jobs: NCCL refuses two ranks on one
    # GPU ("Duplicate GPU detected"), so on a one-GPU machine a NCCL build could not run a
    # two-rank GPU job at all (tests/hvdrun.py's gpu_built() then skips the GPU test),
    # while the staged build runs it. SSFUSION_NCCL=1 builds with NCCL anyway.
    if [[ -n "$inc" && -n "$lib" ]]; then
        if [[ "$nccl" == 1 || ( "$nccl" == auto && "$n" -ge 2 ) ]]; then
            HVD_GPU=nccl HVD_NCCL_INCLUDE="$inc" HVD_NCCL_LIBDIR="$lib"
            HVD_GPU_NOTE="CUDA $cuda (nvcc $nvcc_ver at $HVD_CUDA_HOME), sm $HVD_CC, $n GPU(s); NCCL GPU operations (NCCL of torch's wheel: $lib)"
        else
            HVD_NCCL_INCLUDE="$inc" HVD_NCCL_LIBDIR="$lib"
            HVD_GPU_NOTE="$HVD_GPU_NOTE (NCCL found at $lib, not used: $n GPU(s), SSFUSION_NCCL=$nccl)"
        fi
    fi
    return 0
}

hvd_key_suffix() {
    local gpu="${1:-$HVD_GPU}"
    case "$gpu" in
        none) echo "" ;;
        staged) echo "-cuda${HVD_TORCH_CUDA}-sm${HVD_CC//,/_}" ;;
        nccl) echo "-cuda${HVD_TORCH_CUDA}-sm${HVD_CC//,/_}-nccl" ;;
    esac
}


# ------------------------------------------------------------------------- build
_hvd_keep_log() {
    [[ -n "${HVD_LOG_DIR:-}" && -f "$1" ]] || return 0
    mkdir -p "$HVD_LOG_DIR" && cp "$1" "$HVD_LOG_DIR/horovod-build-$2.log"
}

_hvd_fail() {
    local log="$1"; shift
    if [[ -n "$log" && -f "$log" ]]; then
        tail -n "${HVD_LOG_TAIL:-60}" "$log" >&2
        _hvd_keep_log "$log" "$_hvd_mode"
    fi
    echo "[horovod] $*" >&2
    rm -rf "$_hvd_build"
    return 1
}

hvd_build_wheel() {
    local py="$1" out="$2" mpi="$3" gpu="${4:-none}" src f built mpi_flag
    local -a gpu_env=()
    _hvd_mode="$gpu"
    command -v cmake >/dev/null 2>&1 || "${PIP[@]}" install -q cmake || { echo "[horovod] no cmake" >&2; return 1; }
    _hvd_build="$(mktemp -d "${TMPDIR:-/tmp}/ssfusion-hvd-build.XXXXXX")" || return 1
    local build="$_hvd_build" log="$_hvd_build/horovod-build.log"
    if [[ -n "${SSFUSION_WHEELS:-}" && -f "$SSFUSION_WHEELS/horovod-$HOROVOD_VERSION.tar.gz" ]]; then
        cp "$SSFUSION_WHEELS/horovod-$HOROVOD_VERSION.tar.gz" "$build/" || { _hvd_fail "" "copying the sdist failed"; return 1; }
    else
        "${PIP[@]}" download -q --no-binary :all: --no-deps -d "$build" "horovod==$HOROVOD_VERSION" \
            || { _hvd_fail "" "could not get the horovod==$HOROVOD_VERSION sdist${SSFUSION_WHEELS:+ (not in $SSFUSION_WHEELS either)}"; return 1; }
    fi
    tar -xzf "$build/horovod-$HOROVOD_VERSION.tar.gz" -C "$build" || { _hvd_fail "" "unpacking the sdist failed"; return 1; }
    src="$build/horovod-$HOROVOD_VERSION"
    # torch >= 2.1 headers need C++17; Horovod 0.28.1 hard-codes C++14.
    for f in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
        sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$f"
        grep -q 'set(CMAKE_CXX_STANDARD 17)' "$f" || { _hvd_fail "" "C++17 patch did not apply to $f"; return 1; }
        ! grep -q 'set(CMAKE_CXX_STANDARD 14)' "$f" || { _hvd_fail "" "C++14 still set in $f"; return 1; }
    done
    mpi_flag=HOROVOD_WITHOUT_MPI=1
    [[ $mpi == 1 ]] && mpi_flag=HOROVOD_WITH_MPI=1
    if [[ "$gpu" != none ]]; then
        # The CUDA recipe as it built on the lent H100 machine (Ubuntu 24.04, gcc 13, nvcc
        # 13, torch 2.11+cu130; ~96 s at -j16): the CUDA kernels in C++17 like the rest
        # (Horovod pins CMAKE_CUDA_STANDARD 11), CMake's policy floor for the old
        # cmake_minimum_required of Horovod's bundled CMakeLists (needed by CMake >= 4),
        # and the standard headers that Horovod's sources use without including them
        # (newer libstdc++ no longer brings them in transitively). HOROVOD_GPU_OPERATIONS
        # stays empty: GPU tensors are staged through host memory, unless the NCCL
        # branch below sets it.
        f="$src/horovod/common/ops/cuda/CMakeLists.txt"
        sed -i 's/set(CMAKE_CUDA_STANDARD 11)/set(CMAKE_CUDA_STANDARD 17)/' "$f"
        grep -q 'set(CMAKE_CUDA_STANDARD 17)' "$f" || { _hvd_fail "" "CUDA C++17 patch did not apply to $f"; return 1; }
        gpu_env=(CMAKE_POLICY_VERSION_MINIMUM=3.5 HOROVOD_BUILD_CUDA_CC_LIST="$HVD_CC"
                 HOROVOD_CUDA_HOME="$HVD_CUDA_HOME"
                 CXXFLAGS="-include cstdint -include stdexcept -include limits -include string -include memory -include algorithm${CXXFLAGS:+ $CXXFLAGS}")
        if [[ "$gpu" == nccl ]]; then
            # The wheel has lib/libnccl.so.2 but no libnccl.so (what FindNCCL's
            # find_library(nccl) looks for) and no static library: a shim folder gives
            # it one; the rpath finds the same library at run time (torch also loads it).
            local so="$HVD_NCCL_LIBDIR/libnccl.so.2" cand
            if [[ ! -f "$so" ]]; then
                for cand in "$HVD_NCCL_LIBDIR"/libnccl.so*; do so="$cand"; break; done
            fi
            if ! { mkdir -p "$build/nccl/lib" && ln -s "$HVD_NCCL_INCLUDE" "$build/nccl/include" \
                   && ln -s "$so" "$build/nccl/lib/libnccl.so"; }; then
                _hvd_fail "" "cannot set up the NCCL shim folder"; return 1
            fi
            gpu_env+=(HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED
                      HOROVOD_NCCL_HOME="$build/nccl" HOROVOD_NCCL_INCLUDE="$build/nccl/include"
                      HOROVOD_NCCL_LIB="$build/nccl/lib"
                      LDFLAGS="-Wl,-rpath,$HVD_NCCL_LIBDIR${LDFLAGS:+ $LDFLAGS}")
        fi
    fi
    (cd "$src" && env HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 "$mpi_flag" \
        HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_GPU_OPERATIONS= \
        MAKEFLAGS="${MAKEFLAGS:--j$(nproc)}" "${gpu_env[@]}" \
        "${PIP[@]}" wheel --no-build-isolation --no-deps -w "$build/dist" . \
        > "$log" 2>&1) \
        || { _hvd_fail "$log" "Horovod build failed (log above)"; return 1; }
    _hvd_keep_log "$log" "$gpu"
    mkdir -p "$out" || { _hvd_fail "" "cannot create $out"; return 1; }
    built="$(ls "$build"/dist/horovod-*.whl)" || { _hvd_fail "$log" "no wheel was built"; return 1; }
    if ! { cp "$built" "$out/.tmp.$(basename "$built")" \
           && mv "$out/.tmp.$(basename "$built")" "$out/$(basename "$built")"; }; then   # atomic publish
        _hvd_fail "" "cannot publish the wheel to $out"; return 1
    fi
    HVD_WHEEL="$out/$(basename "$built")"
    rm -rf "$build"
    return 0
}

# ------------------------------------------------------------------------- install
_hvd_step() { if declare -F hvd_step >/dev/null; then hvd_step "$@"; else echo "[horovod] $*"; fi; }

hvd_install() {
    local py="$1" cache="$2" base="$3" mpi="$4" keyfile="$5" mode key wheel_dir have wheel
    local -a modes=("$HVD_GPU")
    if [[ $HVD_GPU == nccl ]]; then
        if [[ -e "$cache/$base$(hvd_key_suffix nccl).nccl-failed" ]]; then
            echo "[horovod] the NCCL build failed here before ($cache/$base$(hvd_key_suffix nccl).nccl-failed): staged build"
            modes=(staged)
        else
            modes+=(staged)
        fi
    fi
    for mode in "${modes[@]}"; do
        key="$base$(hvd_key_suffix "$mode")"
        wheel_dir="$cache/$key"
        have="$("$py" -c 'from importlib.metadata import version; print(version("horovod"))' 2>/dev/null || true)"
        if [[ "$have" != "$HOROVOD_VERSION" || ! -f "$keyfile" || "$(cat "$keyfile")" != "$key" ]]; then
            wheel="$(compgen -G "$wheel_dir/horovod-*.whl" | head -n 1 || true)"
            if [[ -z "$wheel" ]]; then
                _hvd_step "building Horovod $HOROVOD_VERSION wheel ($key); takes a few minutes, cached afterwards"
                if ! hvd_build_wheel "$py" "$wheel_dir" "$mpi" "$mode"; then
                    if [[ $mode == nccl ]]; then
                        mkdir -p "$cache" && touch "$cache/$key.nccl-failed"
                        echo "[horovod] the NCCL build failed: building with GPU tensors staged through host memory"
                        continue
                    fi
                    return 1
                fi
                wheel="$HVD_WHEEL"
            fi
            _hvd_step "installing $(basename "$wheel")"
            "${PIP[@]}" install -q --force-reinstall --no-deps "$wheel" \
                || { echo "[horovod] installing $wheel failed" >&2; return 1; }
            echo "$key" > "$keyfile"
        fi
        if [[ $mode != none ]] \
                && ! "$py" -c 'import sys, torch, horovod.torch as h; sys.exit(0 if h.cuda_built() else 1)'; then
            if [[ $mode == nccl ]]; then
                mkdir -p "$cache" && touch "$cache/$key.nccl-failed"
                echo "[horovod] the NCCL build does not load: building with GPU tensors staged through host memory"
                continue
            fi
            echo "[horovod] Horovod ($key) does not load, or has no CUDA" >&2
            return 1
        fi
        HVD_KEY="$key" HVD_GPU="$mode"
        return 0
    done
    return 1
}
