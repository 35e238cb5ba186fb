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
# images/s of the model alone: `edge-agent predict` (1 thread) on ENGINE ARTIFACT IMAGES..., from the
# sum of its per-image latencies (decode and preprocessing included, as in the agent's).
predict_rate() {
  local engine=$1 art=$2; shift 2
  "$KESTREL_BIN/edge-agent" --engine "$engine" --threads 1 predict --model "$art" --json "$@" |
    python3 -c 'import json, sys; ms = [json.loads(l)["latency_ms"] for l in sys.stdin]; print(len(ms) / (sum(ms) / 1000))'
}

echo "# Backbone feature extraction: EfficientNet-Lite0, batch 32, $threads threads, decode + preprocess included"
echo "# $(date -u +%Y-%m-%d) on $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'))"
"$trainer" lower --backbone efficientnet-lite0 --output features --out "$work/lite0-features.onnx" >/dev/null
"$KESTREL_PY" "$here/bench_peer.py" --model "$work/lite0-features.onnx" --batch 32 --threads "$threads" \
  --rounds "$rounds" "${images[@]}" > "$work/peer.json"
for engine in tract ort candle; do
  r="$rounds"; [ "$engine" = candle ] && r=1
  "$trainer" bench --threads "$threads" --engine "$engine" --batch 32 --rounds "$r" --json "${images[@]}" > "$work/$engine.json"
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
    "$KESTREL_BIN/trainer" prepare --threads "$threads" --data "$KESTREL_HOME/datasets/$ds/imagefolder" \
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
echo "# Camera photos: prepare + extraction of 400 distinct 640x480 JPEGs (random crops of the scikit-image photos"
echo "# with jitter, scripts/camera_photos.py), fresh cache, $threads threads; the peer decodes with PIL, one image after another"
"$KESTREL_PY" "$here/camera_photos.py" --photos "$KESTREL_HOME/photos" --out "$work/camera" --count 400
"$KESTREL_PY" "$here/bench_peer.py" --all --model "$work/lite0-features.onnx" --batch 32 --threads "$threads" \
  "$work/camera" > "$work/peer-camera.json"
printf '%-16s%10s%12s%12s%10s%10s\n' engine images seconds "images/s" "vs peer" "peak MB"
for engine in ort tract; do
  rm -rf "$work/cache-camera"
  start=$(date +%s.%N)
  /usr/bin/time -f '%M' -o "$work/rss-camera" "$trainer" prepare --threads "$threads" --data "$work/camera" \
    --engine "$engine" --cache "$work/cache-camera" --json > "$work/prep-camera.json" 2>/dev/null
  end=$(date +%s.%N)
  python3 - "$engine" "$start" "$end" "$work/peer-camera.json" "$work/prep-camera.json" "$work/rss-camera" <<'PY'
import json, sys
engine, start, end, peer, prep, rss = sys.argv[1:]
s = float(end) - float(start)
n = json.load(open(prep))["samples"]
p = json.load(open(peer))["seconds"]
mb = int(open(rss).read().split()[-1]) / 1024
print(f"{'kestrel ' + engine:<16}{n:>10}{s:>12.2f}{n / s:>12.1f}{p / s:>9.2f}x{mb:>10.0f}")
PY
done
python3 - "$work/peer-camera.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{'python ort+PIL':<16}{r['images']:>10}{r['seconds']:>12.2f}{r['images_per_s']:>12.1f}{1:>9.2f}x")
PY
echo "(Kestrel: the whole command, table load and caches included; the peer: its decode and inference loop only)"

echo
# The same photos from Spark (issue 37): the package built as a user builds it, then a standalone cluster.
PATH="$KESTREL_HOME/venv/bin:$PATH" "$KESTREL_PY" -m pip install --quiet --no-build-isolation --no-deps "$here/../python" >&2
"$KESTREL_PY" "$here/bench_spark.py" "$work/camera" 2>/dev/null

echo
echo "# Head training on cached features (EfficientNet-Lite0 features): the default L-BFGS solve, and SGD"
echo "# (momentum, batch 32, 30 epochs, candle); samples/s = training samples x iterations (or epochs) / seconds"
printf '%-10s%-12s%10s%12s%14s%12s\n' dataset recipe val_acc seconds samples/s "peak MB"
for ds in lfw digits; do
  for recipe in lbfgs sgd; do
    args=(); [ "$recipe" = sgd ] && args=(--optimizer sgd --epochs 30)
    /usr/bin/time -f '%M' -o "$work/rss-$ds-$recipe" "$KESTREL_BIN/trainer" fit --threads "$threads" \
      --data "$KESTREL_HOME/datasets/$ds/imagefolder" --engine ort --cache "$work/cache" "${args[@]}" --json \
      --out "$work/run-$ds-$recipe" > "$work/fit-$ds-$recipe.json" 2>/dev/null
    python3 - "$ds" "$recipe" "$work/fit-$ds-$recipe.json" "$work/run-$ds-$recipe/metrics.jsonl" "$work/rss-$ds-$recipe" <<'PY'
import json, sys
ds, recipe, fit, metrics, rss = sys.argv[1:]
s = json.load(open(fit))
m = [json.loads(l) for l in open(metrics)]
sps = sum(x["samples_per_s"] for x in m) / len(m)
print(f"{ds:<10}{recipe:<12}{s['val_accuracy']:>10.4f}{s['train_seconds']:>12.2f}{sps:>14.0f}{int(open(rss).read().split()[-1]) / 1024:>12.0f}")
PY
  done
done
ln -sfn "$work/run-lfw-sgd" "$work/run-lfw"

echo
echo "# Fine-tuning (--fine-tune 2: head first, then the last 2 blocks at 7x7 + head, AdamW, batch 32), digits, 3 epochs"
echo "# Ceiling: the two blocks and head are ~0.1 GFLOP forward per sample, ~0.3 GFLOP with the backward pass."
/usr/bin/time -f '%M' -o "$work/rss-ft" "$KESTREL_BIN/trainer" fit --threads "$threads" \
  --data "$KESTREL_HOME/datasets/digits/imagefolder" --engine ort --cache "$work/cache" --fine-tune 2 --epochs 3 \
  --early-stopping 100 --json --out "$work/run-ft" > "$work/fit-ft.json" 2>/dev/null
python3 - "$work/fit-ft.json" "$work/run-ft/metrics.jsonl" "$work/rss-ft" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
m = [json.loads(l) for l in open(sys.argv[2])]
sps = sum(x["samples_per_s"] for x in m) / len(m)
peak = int(open(sys.argv[3]).read().split()[-1]) / 1024
print(f"head alone {s['head_val_accuracy']:.4f}, after fine-tuning {s['val_accuracy']:.4f}; "
      f"{sps:.0f} samples/s ({sps * 0.3:.1f} GFLOP/s), peak RSS {peak:.0f} MB")
PY

echo
echo "# Exported LFW model per form: file size and batch-1 latency, 1 thread (inference only)"
printf '%-14s%10s%10s%10s%12s%14s%14s\n' form "MB" "tract ms" "ort ms" "python ms" "tract/python" "ort f32/this"
for form in none int8-weights int8; do
  "$trainer" export --run "$work/run-lfw" --out "$work/art-$form" --quantize "$form" --cache "$work/cache" >/dev/null 2>&1
  model="$work/art-$form/model.onnx"
  t=$("$trainer" latency --threads 1 --model "$model" --engine tract --json "$KESTREL_HOME/photos/coffee.png")
  o=$("$trainer" latency --threads 1 --model "$model" --engine ort --json "$KESTREL_HOME/photos/coffee.png")
  p=$("$KESTREL_PY" "$here/bench_peer.py" --latency --model "$model" --threads 1 --rounds 50 "$KESTREL_HOME/photos/coffee.png")
  [ "$form" = none ] && ort_f32="$o"
  python3 - "$form" "$model" "$t" "$o" "$p" "$ort_f32" <<'PY'
import json, os, sys
form, model, t, o, p, f32 = sys.argv[1:]
t, o, p, f32 = (json.loads(x)["ms"] for x in (t, o, p, f32))
print(f"{form:<14}{os.path.getsize(model) / 1e6:>10.1f}{t:>10.1f}{o:>10.1f}{p:>12.1f}{t / p:>13.2f}x{f32 / o:>13.2f}x")
PY
done
echo "(Kestrel's engines dequantize int8-weights once at load; Python's ONNX Runtime runs the file as it is. tract runs"
echo " the static int8 QDQ graph in float with extra Q/DQ work: slower than f32, as measured above.)"
echo
echo "# int8-weights against f32 on each engine, interleaved against the VM's drift: f32, int8-weights, f32, ..."
echo "# three times each (trainer latency, 50 rounds, 1 thread); the median of each form's three medians"
printf '%-8s%10s%18s%14s\n' engine "f32 ms" "int8-weights ms" "int8-w / f32"
for engine in tract ort; do
  runs=()
  for _ in 1 2 3; do
    for form in none int8-weights; do
      runs+=("$form" "$("$trainer" latency --threads 1 --model "$work/art-$form/model.onnx" --engine "$engine" \
        --json "$KESTREL_HOME/photos/coffee.png")")
    done
  done
  python3 - "$engine" "${runs[@]}" <<'PY'
import json, statistics, sys
engine, runs = sys.argv[1], sys.argv[2:]
ms = {}
for form, out in zip(runs[::2], runs[1::2]):
    ms.setdefault(form, []).append(json.loads(out)["ms"])
f, q = statistics.median(ms["none"]), statistics.median(ms["int8-weights"])
print(f"{engine:<8}{f:>10.1f}{q:>18.1f}{q / f:>13.2f}x")
PY
done

echo
echo "# Edge agent, batch 1 (one image per request, as on the device): tract with 1 and 2 threads"
echo "# (matrix products on a tract multithread-mm pool, as in an edge-agent built with \`multicore\`; the"
echo "# default device build runs that many requests side by side instead), p50 over the 200 LFW images of edge-agent predict's"
echo "# latency_ms (decode + preprocess + inference); ONNX Runtime's batch-1 latency (inference only) beside it"
printf '%-14s%14s%14s%10s%12s%12s\n' form "tract 1t p50" "tract 2t p50" speedup "ort 1t ms" "ort 2t ms"
lfw_all=("$KESTREL_HOME"/datasets/lfw/imagefolder/*/*.png)
for form in none int8-weights; do
  for t in 1 2; do
    "$KESTREL_BIN/edge-agent" --threads "$t" predict --model "$work/art-$form" --json --top-k 1 "${lfw_all[@]}" \
      > "$work/edge-$form-$t.jsonl"
    "$trainer" latency --threads "$t" --model "$work/art-$form/model.onnx" --engine ort --json \
      "$KESTREL_HOME/photos/coffee.png" > "$work/ort-$form-$t.json"
  done
  python3 - "$form" "$work" <<'PY'
import json, statistics, sys
form, w = sys.argv[1:]
p50 = lambda t: statistics.median(json.loads(l)["latency_ms"] for l in open(f"{w}/edge-{form}-{t}.jsonl"))
ort = lambda t: json.load(open(f"{w}/ort-{form}-{t}.json"))["ms"]
a, b = p50(1), p50(2)
print(f"{form:<14}{a:>12.1f}ms{b:>12.1f}ms{a / b:>9.2f}x{ort(1):>10.1f}ms{ort(2):>10.1f}ms")
PY
done

echo
echo "# Edge over MQTT: embedded rumqttd, one agent (tract, the default engine, 1 thread), the int8-weights LFW artifact above"
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"' EXIT
port=$(free_port)
broker="mqtt://127.0.0.1:$port"
"$trainer" broker --listen "127.0.0.1:$port" --persist "$work/broker" 2>/dev/null & pids+=($!)
"$trainer" keygen --out "$work/keys" >/dev/null
mkdir -p "$work/agent"
printf 'device_id = "bench-pi"\nstore = "store"\ntrusted_keys = ["%s"]\n[broker]\nurl = "%s"\n' \
  "$work/keys/kestrel.pub" "$broker" > "$work/agent/agent.toml"
wait_port "$port"
"$KESTREL_BIN/edge-agent" run --config "$work/agent/agent.toml" 2>/dev/null & pids+=($!)
start=$(date +%s.%N)
"$trainer" publish --broker "$broker" --artifact "$work/art-int8-weights" --key "$work/keys/kestrel.key" \
  --target device/bench-pi --json > "$work/publish.json"
"$trainer" status --broker "$broker" --device bench-pi --wait-active 1 --timeout 120 >/dev/null
active=$(date +%s.%N)
lfw=("$KESTREL_HOME"/datasets/lfw/imagefolder/*/*.png)
"$trainer" infer --broker "$broker" --device bench-pi --json "${lfw[@]}" > "$work/infer.jsonl"
p=$("$KESTREL_PY" "$here/bench_peer.py" --latency --model "$work/art-int8-weights/model.onnx" --threads 1 --rounds 50 "${lfw[0]}")
own=$(predict_rate tract "$work/art-int8-weights" "${lfw[@]}")
python3 - "$work/publish.json" "$start" "$active" "$work/infer.jsonl" "$p" "$own" <<'PY'
import json, sys
pub, start, active, infer, peer, own = sys.argv[1:]
own = float(own)
pub = json.load(open(pub))
s = [json.loads(l) for l in open(infer)][-1]
peer_ms = json.loads(peer)["ms"]
print(f"publish {pub['bytes'] / 1e6:.1f} MB in {pub['chunks']} chunks: {pub['seconds']:.2f} s; "
      f"publish start -> device reports it active: {float(active) - float(start):.2f} s")
rate = s["requests"] / s["seconds"]
print(f"{'path':<36}{'images/s':>10}{'ms/image':>10}{'vs peer':>10}")
print(f"{'MQTT round trip (window 8)':<36}{rate:>10.1f}{1000 / rate:>10.1f}{rate * peer_ms / 1000:>9.2f}x")
print(f"{'  of which device inference p50':<36}{'':>10}{s['device_latency_p50_ms']:>10.1f}")
print(f"{'python onnxruntime, batch 1':<36}{1000 / peer_ms:>10.1f}{peer_ms:>10.1f}{1:>9.2f}x")
print(f"{'edge-agent predict (the model alone)':<36}{own:>10.1f}{1000 / own:>10.1f}")
print(f"MQTT round trip / edge-agent predict (tract): {rate / own:.2f}x (target >= 0.9)")
PY

echo
echo "# Quality telemetry's cost: the same agent and images with [quality] enabled = false (device inference p50)"
mkdir -p "$work/agent-off"
printf 'device_id = "bench-off"\nstore = "store"\ntrusted_keys = ["%s"]\n[broker]\nurl = "%s"\n[quality]\nenabled = false\n' \
  "$work/keys/kestrel.pub" "$broker" > "$work/agent-off/agent.toml"
kill "${pids[-1]}" 2>/dev/null || true   # one agent at a time: they would share the cores
"$KESTREL_BIN/edge-agent" run --config "$work/agent-off/agent.toml" 2>/dev/null & pids+=($!)
"$trainer" publish --broker "$broker" --artifact "$work/art-int8-weights" --key "$work/keys/kestrel.key" \
  --target device/bench-off --json > /dev/null
"$trainer" status --broker "$broker" --device bench-off --wait-active 1 --timeout 120 >/dev/null
"$trainer" infer --broker "$broker" --device bench-off --json "${lfw[@]}" > "$work/infer-off.jsonl"
"$trainer" status --broker "$broker" --device bench-pi --quality > "$work/quality.txt"
python3 - "$work/infer.jsonl" "$work/infer-off.jsonl" <<'PY'
import json, sys
on, off = ([json.loads(l) for l in open(f)][-1]["device_latency_p50_ms"] for f in sys.argv[1:])
print(f"{'telemetry':<12}{'p50 ms':>10}")
print(f"{'on':<12}{on:>10.2f}\n{'off':<12}{off:>10.2f}\n{'on / off':<12}{on / off:>10.3f}")
PY
cat "$work/quality.txt"

echo
echo "# Edge over MQTT with the agent on ONNX Runtime ([inference] engine = \"ort\", 1 thread), one agent at a time;"
echo "# the peer: Python ONNX Runtime's batch-1 inference alone on the same model.onnx, 1 thread"
echo "# and the model alone: edge-agent --engine ort --threads 1 predict on the same images (images/s from its latencies)"
printf '%-14s%12s%12s%14s%10s%12s%14s\n' form "images/s" "device p50" "python ms" "vs peer" "predict/s" "MQTT/predict"
for form in int8-weights int8; do
  kill "${pids[-1]}" 2>/dev/null || true
  dev="bench-ort-$form"
  mkdir -p "$work/$dev"
  printf 'device_id = "%s"\nstore = "store"\ntrusted_keys = ["%s"]\n[broker]\nurl = "%s"\n[inference]\nengine = "ort"\nthreads = 1\n' \
    "$dev" "$work/keys/kestrel.pub" "$broker" > "$work/$dev/agent.toml"
  "$KESTREL_BIN/edge-agent" run --config "$work/$dev/agent.toml" 2>/dev/null & pids+=($!)
  "$trainer" publish --broker "$broker" --artifact "$work/art-$form" --key "$work/keys/kestrel.key" \
    --target "device/$dev" --json > /dev/null
  "$trainer" status --broker "$broker" --device "$dev" --wait-active 1 --timeout 120 >/dev/null
  "$trainer" infer --broker "$broker" --device "$dev" --json "${lfw[@]}" > "$work/infer-$dev.jsonl"
  p=$("$KESTREL_PY" "$here/bench_peer.py" --latency --model "$work/art-$form/model.onnx" --threads 1 --rounds 50 "${lfw[0]}")
  own=$(predict_rate ort "$work/art-$form" "${lfw[@]}")
  python3 - "$form" "$work/infer-$dev.jsonl" "$p" "$own" <<'PY'
import json, sys
form, infer, peer, own = sys.argv[1:]
own = float(own)
s = [json.loads(l) for l in open(infer)][-1]
peer_ms = json.loads(peer)["ms"]
rate = s["requests"] / s["seconds"]
print(f"{form:<14}{rate:>12.1f}{s['device_latency_p50_ms']:>10.1f}ms{peer_ms:>12.1f}ms{rate * peer_ms / 1000:>9.2f}x"
      f"{own:>12.1f}{rate / own:>13.2f}x")
PY
done

echo
echo "# Fleet rollout: 100 simulated devices (one process, one connection each) on Mosquitto, 3 phases (5%, 50%, 100%)"
mport=$(free_port)
mkdir -p "$work/mosq" "$work/fleet"
printf 'listener %s 127.0.0.1\nallow_anonymous true\npersistence false\nuser root\nmax_queued_messages 10000\n' "$mport" > "$work/mosq/m.conf"
mosquitto=$(command -v mosquitto || echo /usr/sbin/mosquitto)
"$mosquitto" -c "$work/mosq/m.conf" 2>/dev/null & pids+=($!)
wait_port "$mport"
printf 'device_id = "sim"\nstore = "store"\ntrusted_keys = ["%s"]\n[broker]\nurl = "mqtt://127.0.0.1:%s"\n' \
  "$work/keys/kestrel.pub" "$mport" > "$work/fleet/agent.toml"
"$KESTREL_BIN/edge-agent" run --config "$work/fleet/agent.toml" --simulate 100 2>/dev/null & pids+=($!)
for _ in $(seq 120); do
  [ "$("$trainer" status --broker "mqtt://127.0.0.1:$mport" --json | wc -l)" -ge 100 ] && break; sleep 0.5
done
printf '[[phases]]\nname = "canary"\npercent = 5\n[[phases]]\nname = "half"\npercent = 50\nfailure = 0.05\n[[phases]]\nname = "all"\npercent = 100\nfailure = 0.05\n' > "$work/fleet/plan.toml"
start=$(date +%s.%N)
"$trainer" rollout --broker "mqtt://127.0.0.1:$mport" --artifact "$work/art-int8-weights" \
  --key "$work/keys/kestrel.key" --fleet "$work/fleet/plan.toml" 2>/dev/null | tail -4
end=$(date +%s.%N)
python3 - "$start" "$end" "$work/publish.json" <<'PY'
import json, sys
mb = json.load(open(sys.argv[3]))["bytes"] / 1e6
print(f"100 devices, 3 phases, {mb:.1f} MB to each: {float(sys.argv[2]) - float(sys.argv[1]):.1f} s (goal <= 60 s)")
PY

echo
echo "# Updates in parts (issue 57): a new LFW head (int8 weights, shared backbone) to 1, 100, 1,000 simulated devices"
echo "# holding v1, in parts vs the whole artifact (publish --whole), on Mosquitto and the embedded broker"
python3 "$here/bench_parts.py"

echo
echo "# Fleets of 1,000 and 10,000 simulated devices (issue 58): rollouts of the whole artifact and of a new head,"
echo "# devices a minute, controller and broker CPU and RSS, trainer status at that size"
python3 "$here/bench_fleet.py"

echo
"$here/bench-console.sh"
"$here/bench-distributed.sh"
"$here/bench-seeds.sh"
"$here/bench-tables.sh"
