#!/usr/bin/env bash
# The main job, end to end as far as it is built: set up, classify real photos with the pretrained
# backbone on every engine, turn the LFW-subset table into a trained head, export it as a verified
# artifact and evaluate that through its manifest. (MQTT delivery to the edge agent is not built yet.)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
"$here/setup.sh"
trainer="$KESTREL_BIN/trainer"
photos=("$KESTREL_HOME"/photos/{chelsea.png,coffee.png,astronaut.png,rocket.jpg})
for engine in tract ort candle; do
  log "classify with $engine"
  "$trainer" classify --backbone efficientnet-lite0 --engine "$engine" --top-k 3 "${photos[@]}"
done

run="$KESTREL_HOME/runs/demo-lfw"
rm -rf "$run"
log "prepare the LFW subset (Parquet, as Spark writes it): decode once, backbone once"
"$trainer" prepare --data "$KESTREL_HOME/datasets/lfw/lfw.parquet" --engine ort
log "fit a new head on the cached features"
"$trainer" fit --data "$KESTREL_HOME/datasets/lfw/lfw.parquet" --engine ort --epochs 10 --test-fraction 0.2 --out "$run"
log "evaluate the run on the whole table (ImageFolder form: same images, same cache)"
"$trainer" evaluate --run "$run" --data "$KESTREL_HOME/datasets/lfw/imagefolder"
log "run directory: $run"
ls "$run"
art="$KESTREL_HOME/artifacts/demo-lfw-int8-weights"
log "export an int8-weights artifact, verified in tract and ONNX Runtime"
"$trainer" export --run "$run" --out "$art" --quantize int8-weights
log "evaluate the artifact through its manifest only, as the edge will"
"$trainer" evaluate --model "$art/model.onnx" --data "$KESTREL_HOME/datasets/lfw/manifest.csv" --engine tract
log "the edge agent verifies the artifact (hashes, golden samples) and classifies two images with tract"
"$KESTREL_BIN/edge-agent" check --model "$art"
"$KESTREL_BIN/edge-agent" predict --model "$art" "$KESTREL_HOME"/datasets/lfw/imagefolder/{face/000.png,nonface/199.png}
ls -l "$art"
