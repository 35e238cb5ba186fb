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

echo
echo "# Prepare + feature extraction of whole tables (fresh cache; decode, preprocess, backbone once per sample), $threads threads"
printf '%-10s%-14s%10s%12s%10s\n' dataset engine samples seconds "vs peer"
for ds in lfw digits; do
  "$KESTREL_PY" "$here/bench_peer.py" --all --model "$work/lite0-features.onnx" --batch 32 --threads "$threads" \
    "$KESTREL_HOME/datasets/$ds/imagefolder" > "$work/peer-$ds.json"
  peer_s=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["seconds"])' "$work/peer-$ds.json")
  for engine in tract ort; do
    rm -rf "$work/cache"
    start=$(date +%s.%N)
    "$KESTREL_BIN/trainer" --threads "$threads" prepare --data "$KESTREL_HOME/datasets/$ds/imagefolder" \
      --engine "$engine" --cache "$work/cache" --json > "$work/prep.json" 2>/dev/null
    end=$(date +%s.%N)
    python3 - "$ds" "$engine" "$start" "$end" "$peer_s" "$work/prep.json" <<'PY'
import json, sys
ds, engine, start, end, peer, prep = sys.argv[1:]
s = float(end) - float(start)
n = json.load(open(prep))["samples"]
print(f"{ds:<10}{'kestrel ' + engine:<14}{n:>10}{s:>12.1f}{float(peer) / s:>9.2f}x")
PY
  done
  python3 - "$work/peer-$ds.json" "$ds" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]:<10}{'python ort':<14}{r['images']:>10}{r['seconds']:>12.1f}{1:>9.2f}x")
PY
done

echo
echo "# Head training on cached features (EfficientNet-Lite0 features, SGD momentum, batch 32, candle)"
printf '%-10s%10s%12s%14s\n' dataset epochs epochs/s samples/s
for ds in lfw digits; do
  "$KESTREL_BIN/trainer" --threads "$threads" fit --data "$KESTREL_HOME/datasets/$ds/imagefolder" --engine ort \
    --cache "$work/cache" --epochs 30 --json --out "$work/run-$ds" > "$work/fit-$ds.json" 2>/dev/null
  python3 - "$ds" "$work/fit-$ds.json" "$work/run-$ds/metrics.jsonl" <<'PY'
import json, sys
ds, fit, metrics = sys.argv[1:]
s = json.load(open(fit))
m = [json.loads(l) for l in open(metrics)]
sps = sum(x["samples_per_s"] for x in m) / len(m)
print(f"{ds:<10}{s['epochs_run']:>10}{s['epochs_run'] / s['train_seconds']:>12.1f}{sps:>14.0f}")
PY
done

echo
echo "# Exported LFW model per form: file size and batch-1 latency, 1 thread (inference only)"
printf '%-14s%10s%10s%10s%12s%14s\n' form "MB" "tract ms" "ort ms" "python ms" "tract/python"
for form in none int8-weights int8; do
  "$trainer" export --run "$work/run-lfw" --out "$work/art-$form" --quantize "$form" --cache "$work/cache" >/dev/null 2>&1
  model="$work/art-$form/model.onnx"
  t=$("$trainer" --threads 1 latency --model "$model" --engine tract --json "$KESTREL_HOME/photos/coffee.png")
  o=$("$trainer" --threads 1 latency --model "$model" --engine ort --json "$KESTREL_HOME/photos/coffee.png")
  p=$("$KESTREL_PY" "$here/bench_peer.py" --latency --model "$model" --threads 1 --rounds 50 "$KESTREL_HOME/photos/coffee.png")
  python3 - "$form" "$model" "$t" "$o" "$p" <<'PY'
import json, os, sys
form, model, t, o, p = sys.argv[1:]
t, o, p = (json.loads(x)["ms"] for x in (t, o, p))
print(f"{form:<14}{os.path.getsize(model) / 1e6:>10.1f}{t:>10.1f}{o:>10.1f}{p:>12.1f}{t / p:>13.2f}x")
PY
done
echo "(tract runs the static int8 QDQ graph in float with extra Q/DQ work: slower than f32 here, as measured above.)"

echo
"$here/bench-distributed.sh"
