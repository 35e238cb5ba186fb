#!/usr/bin/env bash
# The `kestrel` wheels a cluster installs (`%pip install`, a cluster library): one abi3 wheel per platform
# (CPython 3.9 and later), manylinux_2_28 (glibc 2.28 or later: Databricks runtimes, EMR, Ubuntu 20.04 and
# later). zig (the `ziglang` wheel from PyPI) compiles and links the C parts against glibc 2.28, whatever this
# host's glibc, and cross-compiles aarch64 with Debian's `rustc-web` and its arm64 standard library, or rustup's
# aarch64 target (as scripts/build-edge.sh does for the agent).
#
#   scripts/build-wheel.sh                      # x86_64, CPU                -> dist/wheels/
#   scripts/build-wheel.sh --target aarch64     # aarch64 (Graviton, Ampere), CPU
#   scripts/build-wheel.sh --cuda               # x86_64 with CUDA kernels (needs scripts/setup-cuda.sh)
#
# A cold build compiles the whole trainer for the target: tens of minutes on 2 cores (not part of the tests).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
ZIGLANG_VERSION=0.13.0
arch=x86_64
cuda=0
out="$here/../dist/wheels"
while [ $# -gt 0 ]; do
  case "$1" in
    --target) arch="$2"; shift 2 ;;
    --cuda) cuda=1; shift ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "build-wheel.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$arch" in
  x86_64|aarch64) ;;
  *) echo "build-wheel.sh: --target x86_64 or aarch64, not $arch" >&2; exit 2 ;;
esac
[ "$cuda" = 1 ] && [ "$arch" != x86_64 ] && { echo "build-wheel.sh: the CUDA wheel is x86_64 only" >&2; exit 2; }
"$KESTREL_PY" -m pip install --quiet "maturin==$MATURIN_VERSION" "ziglang==$ZIGLANG_VERSION" >&2
mkdir -p "$out"
args=(build --release --locked --zig --compatibility manylinux_2_28 -m "$here/../python/Cargo.toml" -o "$out")
target="$arch-unknown-linux-gnu"
# Its own target directory: zig as the C compiler rebuilds every crate with C parts, which would
# otherwise be rebuilt again for the tests' builds.
export CARGO_TARGET_DIR="$KESTREL_HOME/target-wheel-$arch"
if [ "$arch" = aarch64 ]; then
  # A compiler with the arm64 standard library: Debian's rustc-web (libstd-rust-web-dev:arm64), else rustup's
  # target (as scripts/build-edge.sh chooses); its own target directory either way.
  if [ -d /usr/lib/rustlib/aarch64-unknown-linux-gnu ] && [ -x /usr/bin/rustc ]; then
    export RUSTC=/usr/bin/rustc
  elif command -v rustup >/dev/null 2>&1 && { rustup target list --installed | grep -qx "$target" || rustup target add "$target" >&2; }; then
    RUSTC="$(rustup which rustc)"
    export RUSTC
  else
    echo "build-wheel.sh: no arm64 standard library: install libstd-rust-web-dev:arm64 (Debian 12) or rustup's $target" >&2
    exit 78
  fi
fi
args+=(--target "$target")
if [ "$cuda" = 1 ]; then
  # shellcheck disable=SC1091
  source "$KESTREL_HOME/cuda/env.sh"
  args+=(--features cuda)
fi
log "maturin ${args[*]}"
PATH="$KESTREL_HOME/venv/bin:$PATH" "$KESTREL_HOME/venv/bin/maturin" "${args[@]}"
ls -1 "$out"/kestrel-*"$arch"*.whl
