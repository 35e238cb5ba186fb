#!/usr/bin/env bash
# Builds the edge agent for the Raspberry Pi and packages it:
#   dist/edge-agent-aarch64   aarch64-unknown-linux-gnu      (Pi 3/4/5, 64-bit OS)
#   dist/edge-agent-armv7     armv7-unknown-linux-gnueabihf  (Pi 2/3/4, 32-bit OS)
#   dist/kestrel-agent_<version>-1_{arm64,armhf}.deb (and kestrel-agent-ort_..._arm64.deb with --ort), dist/SHA256SUMS
#   with --ort also: dist/edge-agent-aarch64-ort (cargo features `ort`: `[inference] engine = "ort"` loads
#   ONNX Runtime at run time, and `multicore`: tract runs one image on `threads` cores) and
#   dist/onnxruntime-aarch64/libonnxruntime.so.* from the PyPI wheel
#
#   scripts/build-edge.sh [--no-deb] [--ort] [TARGET...]     default: both targets
#
# Before building, checks each target's dependency tree for crates that break cross builds or drag in
# C/C++ (OpenSSL, aws-lc, native-tls, cxx, other -sys crates). The binaries use `--profile edge`
# (root Cargo.toml: fat LTO, one codegen unit, panic=abort, opt-level s except tract) and are stripped.
#
# Toolchain, per target (KESTREL_EDGE_TOOLCHAIN=auto|cross|debian|rustup, default auto = the one that built
# the target last if it still works, else the first that works of):
#   cross   `cross` with Docker or Podman answering (Cross.toml; the documented path for users)
#   debian  Debian 12's rustc-web (pinned below) with libstd-rust-web-dev:<arch>, the cross gcc as linker;
#           installed by this script (apt, needs root or sudo), selected per command with RUSTC=/usr/bin/rustc
#   rustup  rustup's toolchain with `rustup target add`, the same cross gcc as linker: used when apt cannot
#           provide the pinned standard library (another point release replaced it, or the mirror's index for
#           that architecture is broken, as bookworm-security's armhf index was on 2026-11-30)
# Each target builds in its own $KESTREL_HOME/target-<arch> (the ONNX Runtime variant in target-aarch64-ort;
# outside the clone, so CI reuses them; another compiler would invalidate the host build's artifacts), all
# targets at once.
# KESTREL_EDGE_MAX_BYTES: size budget of the stripped aarch64 binary (default 12000000), checked: a
#   warning, or a failure with KESTREL_EDGE_STRICT_SIZE=1.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
cd "$here/.."

# Debian 12 (bookworm-security) Rust for Firefox builds: rustc and the target standard libraries must be
# the very same version.
RUSTC_WEB_VERSION="${RUSTC_WEB_VERSION:-1.96.0+dfsg1-1~deb12u2}"
max_bytes="${KESTREL_EDGE_MAX_BYTES:-12000000}"
toolchain="${KESTREL_EDGE_TOOLCHAIN:-auto}"

deb=1
ort=0
targets=()
for a in "$@"; do
  case "$a" in
    --no-deb) deb=0 ;;
    --ort) ort=1 ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) targets+=("$a") ;;
  esac
done
[ ${#targets[@]} -eq 0 ] && targets=(aarch64-unknown-linux-gnu armv7-unknown-linux-gnueabihf)

# target -> short name, Debian architecture, GNU triple of the cross gcc
short_of() { case "$1" in aarch64-*) echo aarch64 ;; armv7-*) echo armv7 ;; *) echo "unsupported target $1" >&2; return 1 ;; esac; }
debarch_of() { case "$1" in aarch64-*) echo arm64 ;; armv7-*) echo armhf ;; esac; }
gnu_of() { case "$1" in aarch64-*) echo aarch64-linux-gnu ;; armv7-*) echo arm-linux-gnueabihf ;; esac; }

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo -n "$@"; fi; }
apt_updated=0
apt_update() {
  # An index that fails to download (e.g. a mirror mid-sync) is reported by apt but is not fatal here:
  # whether the packages needed are available is checked afterwards.
  [ $apt_updated -eq 1 ] && return 0
  # A job killed during an earlier install leaves dpkg "interrupted", and every apt-get install
  # then refuses until it is finished.
  as_root env DEBIAN_FRONTEND=noninteractive dpkg --configure -a >&2 || true
  as_root apt-get update -qq >&2 || log "apt-get update reported errors (continuing; availability is checked per package)"
  apt_updated=1
}
# Installs the packages (name or name=version) that are not installed yet.
apt_ensure() {
  local need=() p name ver
  for p in "$@"; do
    name="${p%%=*}"; ver=""; [ "$name" != "$p" ] && ver="${p#*=}"
    if [ -n "$ver" ]; then
      [ "$(dpkg-query -W -f='${Version}' "$name" 2>/dev/null || true)" = "$ver" ] || need+=("$p")
    else
      dpkg-query -W -f='${Status}' "$name" 2>/dev/null | grep -q 'ok installed' || need+=("$p")
    fi
  done
  [ ${#need[@]} -eq 0 ] && return 0
  log "installing ${need[*]}"
  apt_update
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >&2
}

container_engine() {
  command -v docker >/dev/null 2>&1 && timeout 10 docker info >/dev/null 2>&1 && return 0
  command -v podman >/dev/null 2>&1 && timeout 10 podman info >/dev/null 2>&1 && return 0
  return 1
}

# Makes the Debian toolchain for target $1 available; fails (status 1) when apt cannot provide it.
debian_ready() {
  local t="$1" arch gnu
  arch=$(debarch_of "$t"); gnu=$(gnu_of "$t")
  command -v apt-get >/dev/null 2>&1 || return 1
  if [ "$(dpkg-query -W -f='${Version}' "libstd-rust-web-dev:$arch" 2>/dev/null || true)" != "$RUSTC_WEB_VERSION" ]; then
    local added=0
    if ! dpkg --print-foreign-architectures | grep -qx "$arch"; then
      as_root dpkg --add-architecture "$arch" && added=1
      apt_updated=0
    fi
    apt_update
    if ! apt-cache policy "libstd-rust-web-dev:$arch" 2>/dev/null | grep -qF "$RUSTC_WEB_VERSION"; then
      log "$t: apt has no libstd-rust-web-dev:$arch $RUSTC_WEB_VERSION"
      # Leave no foreign architecture behind whose index breaks everyone's `apt-get update`.
      [ $added -eq 1 ] && as_root dpkg --remove-architecture "$arch" 2>/dev/null || true
      return 1
    fi
  fi
  apt_ensure "rustc-web=$RUSTC_WEB_VERSION" "libstd-rust-web-dev:$arch=$RUSTC_WEB_VERSION" \
    "gcc-$gnu" "libc6-dev-$arch-cross" "binutils-$gnu" || return 1
  apt_ensure lld-16 || log "no lld-16: linking with GNU ld (no packed relative relocations)"
}

rustup_ready() {
  local t="$1" gnu
  gnu=$(gnu_of "$t")
  command -v rustup >/dev/null 2>&1 || return 1
  rustup target list --installed 2>/dev/null | grep -qx "$t" || rustup target add "$t" >&2 || return 1
  apt_ensure "gcc-$gnu" "libc6-dev-$(debarch_of "$t")-cross" "binutils-$gnu" || return 1
  apt_ensure lld-16 || log "no lld-16: linking with GNU ld (no packed relative relocations)"
}

# Code-size flags for the Debian/rustup builds (cross's images have an older linker and glibc):
# - no unwind tables: with panic = "abort" nothing unwinds (a panic ends the process); the tables
#   were 1.7 MB of the aarch64 binary (.eh_frame + .eh_frame_hdr);
# - packed relative relocations (DT_RELR; glibc >= 2.36 at run time: Raspberry Pi OS bookworm has
#   2.36, and the .deb then depends on libc6 >= 2.36): .rela.dyn was 0.86 MB. bookworm's GNU ld for
#   ARM (2.40) cannot write them (aarch64 support came in 2.41), so the link goes through LLVM's lld
#   (Debian's lld-16, installed below) when it is there; lld >= 15 also records the
#   GLIBC_ABI_DT_RELR version need, so an older glibc refuses to start the binary with a clear
#   message instead of running it with unrelocated pointers.
# KESTREL_EDGE_RUSTFLAGS replaces them.
LLD_DIR=/usr/lib/llvm-16/bin
edge_rustflags() {
  local gnu="$1"
  if [ -n "${KESTREL_EDGE_RUSTFLAGS+set}" ]; then echo "$KESTREL_EDGE_RUSTFLAGS"; return; fi
  local flags="-C force-unwind-tables=no"
  if [ -x "$LLD_DIR/ld.lld" ]; then
    flags="$flags -C link-arg=-fuse-ld=lld -C link-arg=-B$LLD_DIR -C link-arg=-Wl,-z,pack-relative-relocs"
  elif "$gnu-ld" --help 2>/dev/null | grep -q pack-relative-relocs; then
    flags="$flags -C link-arg=-Wl,-z,pack-relative-relocs"
  fi
  echo "$flags"
}

# Builds target $1 with toolchain $2 in $KESTREL_HOME/target-<arch>$3 (more cargo arguments after
# them); prints the path of the unstripped binary. (Called as `bin=$(build ...) || ...`, where `set -e` does not apply: every
# failure returns explicitly.)
build() {
  local t="$1" how="$2" suffix="$3" short gnu T dir
  shift 3
  short=$(short_of "$t"); gnu=$(gnu_of "$t")
  T=$(echo "$t" | tr 'a-z-' 'A-Z_')
  dir="$KESTREL_HOME/target-$short$suffix"
  local start=$SECONDS
  case "$how" in
    cross)
      CARGO_TARGET_DIR="$dir" cross build --locked --profile edge -p edge-agent --target "$t" "$@" >&2 || return 1 ;;
    debian|rustup)
      local rustc=/usr/bin/rustc
      [ "$how" = rustup ] && rustc=$(rustup which rustc)
      env RUSTC="$rustc" CARGO_TARGET_DIR="$dir" "CARGO_TARGET_${T}_RUSTFLAGS=$(edge_rustflags "$gnu")" \
        "CARGO_TARGET_${T}_LINKER=$gnu-gcc" "CC_${t//-/_}=$gnu-gcc" "AR_${t//-/_}=$gnu-ar" \
        nice -n "${KESTREL_EDGE_NICE:-10}" cargo build --locked --profile edge -p edge-agent --target "$t" "$@" >&2 || return 1 ;;
  esac
  log "$t${1:+ ($*)}: built with $how in $((SECONDS - start)) s"
  echo "$dir/$t/edge/edge-agent"
}

strip_tool() {
  local gnu="$1"
  for s in "$gnu-strip" llvm-strip; do command -v "$s" >/dev/null 2>&1 && { echo "$s"; return; }; done
  return 1
}

# Copies binary $2 (built for target $1) to $3, stripped.
install_stripped() {
  local t="$1" bin="$2" out="$3" s
  cp "$bin" "$out.tmp"
  if s=$(strip_tool "$(gnu_of "$t")"); then
    "$s" --strip-all "$out.tmp"
  else
    log "$t: no strip tool for $(gnu_of "$t") on the PATH: $out keeps its symbol table"
  fi
  chmod 0755 "$out.tmp"
  mv "$out.tmp" "$out"
  log "$out: $(stat -c %s "$out") bytes ($(file -b "$out" | cut -d, -f1-2))"
}

# The ARM builds, once each target's toolchain is ready: every binary is built in a job of its own,
# all at once (the ONNX Runtime variant in its own target directory). A warm rebuild is mostly
# single-threaded (one codegen unit, then fat LTO), so the jobs share the cores: after a change to
# the device's crates, 386 s one after another, about half that side by side (2 cores).

# Builds variant $3 (extra cargo arguments after it) of target $1 with toolchain $2 into
# dist/edge-agent-<short><suffix> and, for the plain variant, its .deb.
target_job() {
  local t="$1" how="$2" suffix="$3" short bin out bytes
  shift 3
  short=$(short_of "$t")
  bin=$(build "$t" "$how" "$suffix" "$@") || return 1
  out="dist/edge-agent-$short$suffix"
  install_stripped "$t" "$bin" "$out"
  bytes=$(stat -c %s "$out")
  if [ -z "$suffix" ] && [ "$short" = aarch64 ] && [ "$bytes" -gt "$max_bytes" ]; then
    # A warning, or a failure with KESTREL_EDGE_STRICT_SIZE=1 (tests/tests/e2e/arm.rs holds the same budget).
    echo "WARNING: $out is $bytes bytes, over the budget of $max_bytes (KESTREL_EDGE_MAX_BYTES)" >&2
    [ "${KESTREL_EDGE_STRICT_SIZE:-0}" = 1 ] && return 1
  fi
  if [ $deb -eq 1 ]; then
    # cargo-deb ([package.metadata.deb] in edge-agent/Cargo.toml): kestrel-agent, or with the
    # ONNX Runtime build its `ort` variant, kestrel-agent-ort.
    edge-agent/deploy/build-deb.sh "$t" "$out" ${suffix:+ort} dist >&2 || return 1
  fi
}

mkdir -p dist
status=0
jobs=()
for t in "${targets[@]}"; do
  short=$(short_of "$t") || { status=1; continue; }
  bad=$(cargo tree --locked -p edge-agent --target "$t" -e normal,build --prefix none 2>/dev/null \
        | awk '{print $1}' | sort -u | grep -E 'openssl|aws-lc|native-tls|^cxx|-sys$' | grep -vxE 'linux-raw-sys|openssl-probe' || true)
  # (openssl-probe, from rustls-native-certs, only looks up certificate paths: no OpenSSL.)
  if [ -n "$bad" ]; then
    echo "edge-agent for $t depends on: $bad" >&2
    status=1
    continue
  fi
  log "$t: dependency tree is pure Rust"

  how=""
  # auto: the toolchain that built this target last, if it still works (another compiler would
  # rebuild everything: the Debian one appears once apt's index has it), then cross, debian, rustup.
  last=$(cat "$KESTREL_HOME/target-$short/.toolchain" 2>/dev/null || true)
  for c in $([ "$toolchain" = auto ] && echo $last cross debian rustup || echo "$toolchain"); do
    case "$c" in
      cross) command -v cross >/dev/null 2>&1 && container_engine && how=cross ;;
      debian) debian_ready "$t" && how=debian ;;
      rustup) rustup_ready "$t" && how=rustup ;;
      *) echo "KESTREL_EDGE_TOOLCHAIN=$c: expected auto, cross, debian or rustup" >&2; exit 2 ;;
    esac
    [ -n "$how" ] && break
  done
  if [ -z "$how" ]; then
    echo "$t: no toolchain (tried: $toolchain): install cross with Docker or Podman, or run as root on Debian 12 for the Debian cross toolchain, or install rustup" >&2
    status=1
    continue
  fi

  mkdir -p "$KESTREL_HOME/target-$short"
  echo "$how" > "$KESTREL_HOME/target-$short/.toolchain"
  target_job "$t" "$how" "" & jobs+=($!)
  # The ONNX Runtime variant: ONNX Runtime publishes aarch64 Linux wheels only (no armv7). ort-sys
  # with `load-dynamic` links nothing: the library is opened at run time.
  if [ $ort -eq 1 ] && [ "$short" = aarch64 ]; then
    target_job "$t" "$how" -ort --features ort,multicore & jobs+=($!)
    if lib=$(ort_library aarch64 "$KESTREL_HOME/onnxruntime-aarch64"); then
      rm -rf dist/onnxruntime-aarch64 && mkdir -p dist/onnxruntime-aarch64
      cp "$(dirname "$lib")"/libonnxruntime.so.* dist/onnxruntime-aarch64/
    else
      status=1
    fi
  fi
done
for j in "${jobs[@]}"; do
  wait "$j" || status=1
done

# Checksums of everything in dist/ (binaries and packages).
(cd dist && find . -maxdepth 2 -type f \( -name 'edge-agent-*' -o -name 'kestrel-agent*.deb' -o -path './onnxruntime-aarch64/*' \) \
  ! -name '*.tmp' | sed 's|^\./||' | sort | xargs -r sha256sum > SHA256SUMS)
log "dist/:"
(cd dist && for f in $(awk '{print $2}' SHA256SUMS); do printf '  %-40s %10s bytes  sha256 %s\n' "$f" "$(stat -c %s "$f")" "$(grep " $f\$" SHA256SUMS | cut -c1-16)…"; done) >&2
exit $status
