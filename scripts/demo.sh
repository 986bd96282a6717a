#!/usr/bin/env bash
# The main job on a fresh machine: install what is missing, then a real horovodrun training
# run of the default model (ssfusion_hvd/examples/data.py) on the bundled digits data.
#
#   bash scripts/demo.sh [-np N] [--seeds K] [--scheme S] [--epochs E] [any train.py option]
#
# It ends with one line comparing the run against the same job with dense synchronization,
# over K seeds each, 0 to K-1 (default 3: one seed's last epoch moves by about a point on the
# digits, docs/status.md "The demo"); the first seed's run is shown as it trains.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/install.sh"

np=2
compare=1
seeds=3
args=()
while (($#)); do
    case "$1" in
        -np|--np|--num-proc) np="$2"; shift 2 ;;
        --no-compare) compare=0; shift ;;
        --seeds) seeds="$2"; shift 2 ;;
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
run main "${args[@]}" --seed 0
if ((compare)); then
    # more seeds of the same job, then the job with dense synchronization (the last --scheme
    # and --seed win) on each seed, for the comparison line
    ours=("$out/main.json") dense=()
    for ((s = 1; s < seeds; s++)); do
        run "main$s" "${args[@]}" --seed "$s" --no-progress > "$out/main$s.log"
        tail -n 2 "$out/main$s.log" | head -n 1 | sed "s/^/[seed $s] /"
        ours+=("$out/main$s.json")
    done
    for ((s = 0; s < seeds; s++)); do
        run "dense$s" "${args[@]}" --scheme dense --seed "$s" --no-progress > "$out/dense$s.log"
        tail -n 2 "$out/dense$s.log" | head -n 1 | sed "s/^/[dense, seed $s] /"
        dense+=("$out/dense$s.json")
    done
    "$REPO/.venv/bin/python" -m ssfusion_hvd.examples.compare "${ours[@]}" -- "${dense[@]}"
fi
