#!/usr/bin/env bash
# The main job. For now: set up, then classify real photos with the pretrained backbone on every engine.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
"$here/setup.sh"
photos=("$KESTREL_HOME"/photos/{chelsea,coffee,astronaut,rocket}.png)
for engine in tract ort candle; do
  log "classify with $engine"
  "$KESTREL_BIN/trainer" classify --backbone efficientnet-lite0 --engine "$engine" --top-k 3 "${photos[@]}"
done
