#!/usr/bin/env bash
# The main job on a fresh machine: install what is missing, then a real horovodrun training
# run of the default model (ssfusion_hvd/examples/data.py) on the bundled digits data.
#
#   bash scripts/demo.sh [-np N] [--scheme S] [--epochs E] [any train.py option]
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/install.sh"

np=2
compare=1
args=()
while (($#)); do
    case "$1" in
        -np|--np|--num-proc) np="$2"; shift 2 ;;
        --no-compare) compare=0; shift ;;
        --json) echo "[demo] --json is set by the demo itself" >&2; exit 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
# One intra-op thread per worker share of the cores; Horovod's knobs set explicitly so the
# run is reproducible (see docs/horovod.md, "Horovod settings").
cores="$(nproc)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( cores / np > 0 ? cores / np : 1 ))}"
export HOROVOD_CYCLE_TIME="${HOROVOD_CYCLE_TIME:-1}"
export HOROVOD_FUSION_THRESHOLD="${HOROVOD_FUSION_THRESHOLD:-67108864}"
out="$(mktemp -d "${TMPDIR:-/tmp}/ssf-demo.XXXXXX")"
trap 'rm -rf "$out"' EXIT
run() {  # run NAME [train.py options]
    local name="$1"; shift
    echo "[demo] horovodrun -np $np --gloo python -m ssfusion_hvd.examples.train $*"
    "$REPO/.venv/bin/horovodrun" -np "$np" -H "localhost:$np" --gloo \
        "$REPO/.venv/bin/python" -m ssfusion_hvd.examples.train --json "$out/$name.json" "$@"
}
# the main job: ssfusion_oi unless --scheme says otherwise
run main "${args[@]}"
if ((compare)); then
    # the same job with dense synchronization (the last --scheme wins), for the comparison line
    run dense "${args[@]}" --scheme dense --no-progress > "$out/dense.log"
    tail -n 2 "$out/dense.log" | sed 's/^/[dense] /'
    "$REPO/.venv/bin/python" -m ssfusion_hvd.examples.compare "$out/main.json" "$out/dense.json"
fi
