#!/usr/bin/env bash
# The CUDA side of the trainer (docs/gpu.md), behind its own command so that the default set-up stays
# CPU-only and small. Idempotent; quick when done. Needs no GPU.
#   scripts/setup-cuda.sh            what *builds* the trainer's `cuda` feature (candle's CUDA backend,
#                                    whose build compiles its kernels with nvcc): nvcc, its headers and
#                                    the CUDA runtime from PyPI's CUDA 13 wheels, into
#                                    $KESTREL_HOME/cuda/toolkit (~350 MB)
#   scripts/setup-cuda.sh --runtime  also what a GPU *runs* with, into $KESTREL_HOME/cuda/runtime
#                                    (2.5 GB): onnxruntime-gpu's library with its CUDA execution provider,
#                                    and cuBLAS, cuDNN 9, cuFFT, cuRAND and NVRTC (CUDA 13), which
#                                    ONNX Runtime's provider and the trainer's `cuda` build load at run
#                                    time; linking that build needs them too (and a libcuda stub)
# Both write $KESTREL_HOME/cuda/env.sh: `source` it before `cargo build --features kestrel-trainer/cuda`
# (CUDA_HOME, PATH, LIBRARY_PATH, CUDA_COMPUTE_CAP, CUDARC_CUDA_VERSION) and before running on a GPU
# (with --runtime: ORT_DYLIB_PATH and LD_LIBRARY_PATH). The GPU driver (libcuda.so.1) comes with the
# machine, never from here.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
runtime=0
[ "${1:-}" = --runtime ] && runtime=1
cuda="$KESTREL_HOME/cuda"
mkdir -p "$cuda"

pip_target() { # pip install into directory $1 (not the venv: the CUDA wheels are large and optional)
  local dir="$1"; shift
  log "fetching $* into $dir"
  rm -rf "$dir.partial"
  "$KESTREL_PY" -m pip install --quiet --no-compile --target "$dir.partial" "$@" >&2
  rm -rf "$dir" && mv "$dir.partial" "$dir"
}

# The toolkit: nvcc and what it calls (cicc from nvidia-nvvm), the headers (crt, cccl) and libcudart.
toolkit="$cuda/toolkit"
stamp="$CUDA_TOOLKIT_VERSION $CUDA_CCCL_VERSION"
if [ "$(cat "$toolkit/.kestrel-version" 2>/dev/null)" != "$stamp" ]; then
  [ -x "$KESTREL_PY" ] || "$here/setup.sh" --demo
  pip_target "$toolkit" "nvidia-cuda-nvcc==$CUDA_TOOLKIT_VERSION" "nvidia-nvvm==$CUDA_TOOLKIT_VERSION" \
    "nvidia-cuda-crt==$CUDA_TOOLKIT_VERSION" "nvidia-cuda-runtime==$CUDA_TOOLKIT_VERSION" \
    "nvidia-cuda-cccl==$CUDA_CCCL_VERSION"
  # The link name the linker looks for (the wheel has only the versioned library).
  ln -sf libcudart.so.13 "$toolkit/nvidia/cu13/lib/libcudart.so"
  echo "$stamp" > "$toolkit/.kestrel-version"
fi
home="$toolkit/nvidia/cu13"
"$home/bin/nvcc" --version | tail -2 >&2

lib_path=""
if [ $runtime = 1 ]; then
  rt="$cuda/runtime"
  if [ "$(cat "$rt/.kestrel-version" 2>/dev/null)" != "$ORT_GPU_VERSION" ]; then
    # onnxruntime-gpu's extras name the CUDA libraries its provider was built against.
    pip_target "$rt" "onnxruntime-gpu[cuda,cudnn]==$ORT_GPU_VERSION" "nvidia-cublas==13.*"
    ln -sf "libonnxruntime.so.$ORT_GPU_VERSION" "$rt/onnxruntime/capi/libonnxruntime.so"
    echo "$ORT_GPU_VERSION" > "$rt/.kestrel-version"
  fi
  # Every directory of the wheels that holds a shared library (cu13/lib, cudnn/lib, ...).
  lib_path=$(find "$rt/nvidia" -name 'lib*.so*' -printf '%h\n' | sort -u | paste -sd:)
  # What linking the `cuda` build needs (candle links cudarc's libraries at build time): the link
  # names of the runtime's libraries, and, for the driver's libcuda.so.1 (the machine's, never a
  # wheel's), a stub defining every cu* name of the toolkit's cuda.h, as the CUDA toolkit's own
  # lib64/stubs/libcuda.so does. On the link path (LIBRARY_PATH) only, never on LD_LIBRARY_PATH.
  link="$cuda/link"
  if [ ! -f "$link/libcuda.so" ] || [ "$link/libcuda.so" -ot "$home/include/cuda.h" ]; then
    mkdir -p "$link"
    grep -ohE '\bcu[A-Z][A-Za-z0-9_]*\b' "$home/include/cuda.h" | sort -u | sed 's/.*/void &(void) {}/' \
      > "$link/libcuda-stub.c"
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$link/libcuda.so" "$link/libcuda-stub.c"
    ln -sf libcuda.so "$link/libcuda.so.1" # for starting a binary without a driver (gpu-check.sh)
  fi
  for lib in libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13; do
    ln -sf "$rt/nvidia/cu13/lib/$lib" "$link/${lib%%.so*}.so"
  done
fi

IFS=. read -r major minor _ <<< "$CUDA_TOOLKIT_VERSION"
{
  echo "# Written by scripts/setup-cuda.sh: source it to build or run the trainer's CUDA paths."
  echo "export CUDA_HOME='$home' CUDA_PATH='$home'"
  echo "export PATH='$home/bin':\"\$PATH\" LIBRARY_PATH='$home/lib':\"\${LIBRARY_PATH:-}\""
  echo "# cudarc's bindings for this toolkit; candle's kernels for Hopper (H100, H200) unless set."
  echo "export CUDARC_CUDA_VERSION=${major}0${minor}0"
  echo "export CUDA_COMPUTE_CAP=\"\${CUDA_COMPUTE_CAP:-90}\""
  if [ $runtime = 1 ]; then
    echo "export LIBRARY_PATH='$link':\"\$LIBRARY_PATH\""
    echo "export ORT_DYLIB_PATH='$rt/onnxruntime/capi/libonnxruntime.so'"
    echo "export LD_LIBRARY_PATH='$lib_path':\"\${LD_LIBRARY_PATH:-}\""
  fi
} > "$cuda/env.sh"
log "CUDA set-up done: source $cuda/env.sh"
