#!/usr/bin/env bash
# The trainer's GPU paths checked in one command (docs/gpu.md): on a machine with an NVIDIA GPU, in
# about 8 minutes once the CUDA set-up and the `cuda` build are there,
#   1. the set-up: scripts/setup-cuda.sh --runtime, and the trainer built with `--features cuda`
#      (in its own target directory, $KESTREL_HOME/target-cuda, so the CPU build stays as it is);
#   2. extraction of the LFW table and of 400 camera photos with ONNX Runtime on CUDA and on the
#      CPU: the features within 1e-3;
#   3. `fit --fine-tune 2`, one epoch, on CUDA and on the CPU: the losses within 1e-3;
#   4. the custom ops on the CPU against their composed forms on the GPU (`trainer bench --ops`), and a
#      table of throughputs (images/s of extraction, samples/s of the epoch).
# Without a GPU it says so, checks that the set-up is there and that the `cuda` build compiles, links
# and starts, and exits 0. Exit 1: a check failed.
#   KESTREL_GPU_SKIP_BUILD=1  use the trainer already in $KESTREL_HOME/target-cuda/release
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
cd "$here/.."
gpu=""
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  gpu=$(nvidia-smi -L | head -1)
fi
"$here/setup.sh" --demo
# --runtime also without a GPU: linking the `cuda` build needs its libraries.
"$here/setup-cuda.sh" --runtime
# shellcheck disable=SC1091
source "$KESTREL_HOME/cuda/env.sh"
export CARGO_TARGET_DIR="$KESTREL_HOME/target-cuda"
trainer="$CARGO_TARGET_DIR/release/trainer"
if [ "${KESTREL_GPU_SKIP_BUILD:-0}" != 1 ]; then
  log "building the trainer with --features cuda (CARGO_TARGET_DIR=$CARGO_TARGET_DIR)"
  cargo build --release --locked -p kestrel-trainer --features kestrel-trainer/cuda
fi
if [ -z "$gpu" ]; then
  # The binary needs the driver's libcuda.so.1 to start: here the link stub stands in (--help calls
  # no CUDA function).
  LD_LIBRARY_PATH="$KESTREL_HOME/cuda/link:$LD_LIBRARY_PATH" "$trainer" fit --help | grep -q -- '--compute-device' \
    || { echo "gpu-check: $trainer does not start or has no --compute-device" >&2; exit 1; }
  log "no GPU here (nvidia-smi lists none): the CUDA set-up is in $KESTREL_HOME/cuda and the trainer" \
    "builds with CUDA ($trainer); nothing was run on a GPU"
  exit 0
fi
log "GPU: $gpu"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$KESTREL_PY" "$here/camera_photos.py" --photos "$KESTREL_HOME/photos" --out "$work/camera" --count 400
lfw="$KESTREL_HOME/datasets/lfw/lfw.parquet"
rows="$work/rows.tsv"
: > "$rows"
for table in lfw camera; do
  data=$lfw; [ $table = camera ] && data="$work/camera"
  for ep in cpu cuda; do
    start=$(date +%s.%N)
    "$trainer" prepare --data "$data" --engine ort --execution-provider "$ep" \
      --cache "$work/cache-$table-$ep" --json > "$work/prep-$table-$ep.json"
    end=$(date +%s.%N)
    printf 'extract %s\t%s\t%s\t%s\n' "$table" "$ep" "$(python3 -c "import json;print(json.load(open('$work/prep-$table-$ep.json'))['samples'])")" \
      "$(python3 -c "print($end - $start)")" >> "$rows"
  done
done
"$trainer" bench --ops --compute-device cuda --rounds 5
for dev in cpu cuda; do
  "$trainer" fit --data "$lfw" --engine ort --cache "$work/cache-lfw-cpu" --fine-tune 2 --epochs 1 \
    --early-stopping 1 --compute-device "$dev" --out "$work/run-$dev" > /dev/null
done
"$KESTREL_PY" - "$work" <<'PY'
import json, sys
from pathlib import Path
import numpy as np
work = Path(sys.argv[1])
ok = True
def features(table, ep):
    prep = json.loads((work / f"prep-{table}-{ep}.json").read_text())
    d = Path(prep["features_cache"])
    return np.fromfile(d / "features.f32", dtype="<f4")
print(f"{'check':<34}{'max |diff|':>12}{'bound':>8}")
for table in ["lfw", "camera"]:
    diff = float(np.abs(features(table, "cpu") - features(table, "cuda")).max())
    ok &= diff <= 1e-3
    print(f"{'features ' + table + ', CUDA vs CPU':<34}{diff:>12.2e}{1e-3:>8}")
epoch = {d: json.loads((work / f"run-{d}" / "metrics.jsonl").read_text().splitlines()[-1]) for d in ["cpu", "cuda"]}
for k in ["train_loss", "val_loss"]:
    diff = abs(epoch["cpu"][k] - epoch["cuda"][k])
    ok &= diff <= 1e-3
    print(f"{'fine-tune ' + k + ', CUDA vs CPU':<34}{diff:>12.2e}{1e-3:>8}")
print()
print(f"{'throughput':<26}{'CPU':>12}{'CUDA':>12}{'ratio':>8}")
rows = [l.split("\t") for l in (work / "rows.tsv").read_text().splitlines()]
for what in sorted({r[0] for r in rows}):
    rate = {r[1]: int(r[2]) / float(r[3]) for r in rows if r[0] == what}
    print(f"{what + ' (images/s)':<26}{rate['cpu']:>12.1f}{rate['cuda']:>12.1f}{rate['cuda'] / rate['cpu']:>7.2f}x")
rate = {d: epoch[d]["samples_per_s"] for d in epoch}
print(f"{'fine-tune (samples/s)':<26}{rate['cpu']:>12.1f}{rate['cuda']:>12.1f}{rate['cuda'] / rate['cpu']:>7.2f}x")
sys.exit(0 if ok else 1)
PY
