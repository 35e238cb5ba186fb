#!/usr/bin/env bash
# Cross-builds edge-agent for the Raspberry Pi targets with `cross` (Docker or Podman required).
# Before building, checks each target's dependency tree for crates that break cross builds or
# drag in C/C++ (OpenSSL, aws-lc, native-tls, cxx, other -sys crates).
#   scripts/build-edge.sh [TARGET...]   default: aarch64-unknown-linux-gnu armv7-unknown-linux-gnueabihf
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
cd "$here/.."
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(aarch64-unknown-linux-gnu armv7-unknown-linux-gnueabihf)
status=0
for t in "${targets[@]}"; do
  bad=$(cargo tree --locked -p edge-agent --target "$t" -e normal,build --prefix none 2>/dev/null \
        | awk '{print $1}' | sort -u | grep -E 'openssl|aws-lc|native-tls|^cxx|-sys$' | grep -vx 'linux-raw-sys' || true)
  if [ -n "$bad" ]; then
    echo "edge-agent for $t depends on: $bad" >&2
    status=1
    continue
  fi
  log "$t: dependency tree is pure Rust"
  if command -v cross >/dev/null 2>&1; then
    cross build --release -p edge-agent --target "$t"
    log "built target/$t/release/edge-agent"
  elif rustup target list --installed 2>/dev/null | grep -qx "$t"; then
    echo "cross is not installed; the $t standard library is, but a cross linker is also needed: install cross (cargo install cross) and Docker or Podman" >&2
    status=1
  else
    echo "cross is not installed and the $t standard library is not either: nothing built for $t (install cross and Docker or Podman)" >&2
    status=1
  fi
done
exit $status
