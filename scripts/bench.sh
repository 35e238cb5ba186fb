#!/usr/bin/env bash
# Bench harness: Kestrel's engines side by side with the peer (ONNX Runtime from Python, PIL +
# numpy preprocessing) on the same ONNX graph and images, with ratios.
#   scripts/bench.sh            # all sections
# Env: BENCH_ROUNDS (timed batches per engine, default 3), BENCH_THREADS (default 2).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
"$here/setup.sh" >&2
rounds="${BENCH_ROUNDS:-3}"
threads="${BENCH_THREADS:-2}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
trainer="$KESTREL_BIN/trainer"
images=("$KESTREL_HOME"/photos/{chelsea,coffee,astronaut,rocket,motorcycle_left,hubble_deep_field}.*)

echo "# Backbone feature extraction: EfficientNet-Lite0, batch 32, $threads threads, decode + preprocess included"
echo "# $(date -u +%Y-%m-%d) on $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'))"
"$trainer" lower --backbone efficientnet-lite0 --output features --out "$work/lite0-features.onnx" >/dev/null
"$KESTREL_PY" "$here/bench_peer.py" --model "$work/lite0-features.onnx" --batch 32 --threads "$threads" \
  --rounds "$rounds" "${images[@]}" > "$work/peer.json"
for engine in tract ort candle; do
  r="$rounds"; [ "$engine" = candle ] && r=1
  "$trainer" --threads "$threads" bench --engine "$engine" --batch 32 --rounds "$r" --json "${images[@]}" > "$work/$engine.json"
done
python3 - "$work" <<'PY'
import json, sys, os
w = sys.argv[1]
peer = json.load(open(os.path.join(w, "peer.json")))
print(f"{'engine':<22}{'images/s':>10}{'vs peer':>10}")
for e in ["tract", "ort", "candle"]:
    r = json.load(open(os.path.join(w, e + ".json")))
    print(f"{'kestrel ' + e:<22}{r['images_per_s']:>10.1f}{r['images_per_s'] / peer['images_per_s']:>9.2f}x")
print(f"{'python onnxruntime ' + peer['ort_version']:<22}{peer['images_per_s']:>10.1f}{1:>9.2f}x")
PY
