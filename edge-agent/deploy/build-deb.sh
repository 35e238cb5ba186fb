#!/usr/bin/env bash
# The edge agent's Debian package, with cargo-deb ([package.metadata.deb] in edge-agent/Cargo.toml):
#   edge-agent/deploy/build-deb.sh TARGET BINARY [ort] OUTDIR
#   e.g. build-deb.sh aarch64-unknown-linux-gnu dist/edge-agent-aarch64 dist
#        -> dist/kestrel-agent_0.1.0-1_arm64.deb (with `ort`: kestrel-agent-ort_..., the `ort` build)
# Called by scripts/build-edge.sh with the stripped binary it puts in dist/ (the package holds
# exactly that file: staged as dist/deb/edge-agent, which [package.metadata.deb] names).
# Install on the Pi with `sudo apt install ./kestrel-agent_*_arm64.deb`.
#
# Before cargo-deb: the man pages and shell completions (edge-agent-docs, a host tool built with the
# workspace's `edge-agent/docs` feature) and the DEP-5 copyright of every crate linked into the
# binary (scripts/deb-copyright.py), under dist/deb/. After it: DEBIAN/md5sums (cargo-deb 3 writes
# none; dpkg --verify and debsums read them). The unit, the sysusers file, the maintainer scripts
# and the changelog are in edge-agent/deploy/debian/.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$here/../.."
if [ $# -eq 4 ] && [ "$3" = ort ]; then variant=ort; out="$4"
elif [ $# -eq 3 ]; then variant=""; out="$3"
else sed -n '2,5p' "$0" >&2; exit 2; fi
target="$1" bin="$2"
[ -x "$bin" ] || { echo "$bin: not an executable (scripts/build-edge.sh builds it)" >&2; exit 1; }
source "$repo/scripts/env.sh"

# The package says libc6 (>= 2.36): the binary must not ask for more.
glibc=$(LC_ALL=C grep -aoE 'GLIBC_2\.[0-9]+' "$bin" | sort -t. -k2,2n -u | tail -1 | cut -d_ -f2)
if [ -n "$glibc" ] && [ "$(printf '%s\n' "$glibc" 2.36 | sort -V | tail -1)" != 2.36 ]; then
  echo "$bin needs glibc $glibc; edge-agent/Cargo.toml's deb depends says libc6 (>= 2.36)" >&2
  exit 1
fi

docs="$repo/dist/deb"
mkdir -p "$docs"
# One package at a time: build-edge.sh builds its targets side by side, and dist/deb/ (the paths
# [package.metadata.deb] names) holds one package's inputs.
exec 9>"$docs.lock"
flock 9
CARGO_DEB_VERSION=3.8.0 # sysusers support (kestrel-agent.sysusers) came with 3.8 (installed under the lock: the
# targets' jobs may reach here together)
if [ "$(cargo deb --version 2>/dev/null | awk '{print $NF}')" != "$CARGO_DEB_VERSION" ]; then
  echo "installing cargo-deb $CARGO_DEB_VERSION (crates.io)" >&2
  cargo install --locked cargo-deb --version "$CARGO_DEB_VERSION" >&2
fi
tool="$KESTREL_BIN/edge-agent-docs"
if [ ! -x "$tool" ]; then
  # shellcheck disable=SC2086
  (cd "$repo" && cargo build --release --locked --workspace --bins $KESTREL_FEATURES >&2)
fi
"$tool" "$docs"
copyright="$docs/copyright${variant:+-$variant}"
python3 "$repo/scripts/deb-copyright.py" "$target" "$variant" > "$copyright.tmp"
mv "$copyright.tmp" "$copyright"

cp "$bin" "$docs/edge-agent"
mkdir -p "$out"
# --target: the package's architecture (arm64, armhf); nothing is built.
log=$(cd "$repo" && cargo deb -p edge-agent --no-build --locked \
  --target "$target" --profile edge ${variant:+--variant "$variant"} -o "$out" 2>&1) \
  || { echo "$log" >&2; exit 1; }
deb=$(echo "$log" | grep -E '\.deb$' | tail -1)
[ -f "$deb" ] || { echo "cargo deb said: $log" >&2; exit 1; }

# DEBIAN/md5sums of every file the package installs.
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
dpkg-deb -R "$deb" "$root/pkg"
(cd "$root/pkg" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | sort -z \
  | xargs -0 md5sum > DEBIAN/md5sums)
chmod 0644 "$root/pkg/DEBIAN/md5sums"
dpkg-deb --root-owner-group -Zxz --build "$root/pkg" "$deb" >/dev/null
# Older builds of the same package and architecture leave (dist/ holds one of each).
name=$(dpkg-deb -f "$deb" Package) arch=$(dpkg-deb -f "$deb" Architecture)
for old in "$out/${name}_"*"_$arch.deb"; do
  [ "$old" -ef "$deb" ] || rm -f "$old"
done
echo "$deb: $(stat -c %s "$deb") bytes"
