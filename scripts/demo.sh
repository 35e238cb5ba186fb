#!/usr/bin/env bash
# The main job, end to end on one machine: set up, classify real photos with the pretrained
# backbone, turn the LFW-subset table (Parquet, as Spark writes it) into a trained head, export an
# int8-weights artifact, start the embedded broker and an edge agent, publish the signed model,
# wait until the agent reports it active, send the held-out images as MQTT inference requests,
# and print edge accuracy, latency and artifact size. Ends with no stray processes.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
"$here/setup.sh" --demo
trainer="$KESTREL_BIN/trainer"
agent="$KESTREL_BIN/edge-agent"
data="$KESTREL_HOME/datasets/lfw/lfw.parquet"

log "classify photos with the pretrained EfficientNet-Lite0 (tract, pure Rust)"
"$trainer" classify --backbone efficientnet-lite0 --engine tract --top-k 3 \
  "$KESTREL_HOME"/photos/{chelsea.png,coffee.png,astronaut.png,rocket.jpg}

run="$KESTREL_HOME/runs/demo-lfw"
rm -rf "$run"
log "prepare the LFW subset: decode once, backbone once (feature cache)"
"$trainer" prepare --data "$data" --engine ort
log "fit a new head on the cached features (20% held out for testing)"
"$trainer" fit --data "$data" --engine ort --optimizer sgd --epochs 10 --test-fraction 0.2 --out "$run"

art="$KESTREL_HOME/artifacts/demo-lfw-int8-weights"
log "export an int8-weights artifact, verified in tract and ONNX Runtime"
"$trainer" export --run "$run" --out "$art" --quantize int8-weights --model-name lfw --model-version 1

keys="$KESTREL_HOME/demo-keys"
[ -f "$keys/kestrel.key" ] || "$trainer" keygen --out "$keys"

work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
port=$(free_port)
broker="mqtt://127.0.0.1:$port"

log "start the embedded broker (rumqttd) on $broker"
"$trainer" broker --listen "127.0.0.1:$port" --persist "$work/broker" 2>"$work/broker.log" &
pids+=($!)
wait_port "$port"

log "start an edge agent (device demo-pi, trusts $keys/kestrel.pub)"
cat >"$work/agent.toml" <<EOF
device_id = "demo-pi"
groups = ["demo"]
store = "store"
trusted_keys = ["$keys/kestrel.pub"]
[broker]
url = "$broker"
EOF
"$agent" run --config "$work/agent.toml" 2>"$work/agent.log" &
pids+=($!)

log "publish the signed artifact to device/demo-pi"
"$trainer" publish --broker "$broker" --artifact "$art" --key "$keys/kestrel.key" --target device/demo-pi
"$trainer" status --broker "$broker" --device demo-pi --wait-active 1 --timeout 120

log "send the held-out test images as MQTT inference requests"
"$trainer" infer --broker "$broker" --device demo-pi --data "$data" --held-out "$run" --json >"$work/infer.jsonl"
python3 - "$work/infer.jsonl" "$art" <<'PY'
import json, os, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
summary = lines[-1]
ev = summary["evaluation"]
files = json.load(open(os.path.join(sys.argv[2], "manifest.json")))["files"]
size = lambda p: next(f["size"] for f in files if f["path"] == p)
print(f"edge accuracy on {ev['samples']} held-out images: {ev['accuracy']:.3f}")
print(f"edge latency (tract, 1 thread, per image): p50 {summary['device_latency_p50_ms']:.1f} ms, "
      f"p95 {summary['device_latency_p95_ms']:.1f} ms; {summary['requests']} requests in {summary['seconds']:.1f} s")
print(f"artifact: model.onnx {size('model.onnx')/1e6:.1f} MB int8-weights "
      f"(f32 weights {size('model.safetensors')/1e6:.1f} MB)")
PY
"$trainer" status --broker "$broker" --device demo-pi
