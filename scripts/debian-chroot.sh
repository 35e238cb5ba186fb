#!/usr/bin/env bash
# A Debian bookworm root file system for ARCH (arm64, armhf) in DIR, whose programs run here under
# qemu user mode through binfmt_misc: for installing the agent's .deb as a Pi would.
#   scripts/debian-chroot.sh ARCH DIR
# The system (mmdebstrap, variant apt, with systemd) is made once and kept as a tarball in
# $KESTREL_HOME/chroot/ (about 1 minute and 210 MB for arm64); each call unpacks it into DIR.
# Exit 3: this machine cannot run ARCH programs (no binfmt_misc, or qemu not registered), said why.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
[ $# -eq 2 ] || { sed -n '2,6p' "$0" >&2; exit 2; }
arch="$1" dir="$2"
case "$arch" in arm64) qemu=aarch64 ;; armhf) qemu=arm ;; *) echo "unsupported architecture $arch" >&2; exit 2 ;; esac
for tool in mmdebstrap arch-test; do
  command -v "$tool" >/dev/null || { echo "$tool is not installed (scripts/setup.sh installs it)" >&2; exit 1; }
done

# qemu registered with binfmt_misc (the F flag: the chroot needs no copy of it).
bm=/proc/sys/fs/binfmt_misc
if [ ! -e "$bm/register" ]; then
  mount -t binfmt_misc binfmt_misc "$bm" 2>/dev/null || {
    echo "cannot run $arch programs: binfmt_misc is not mounted and cannot be (not root, or a container without it)" >&2
    exit 3
  }
fi
if [ ! -e "$bm/qemu-$qemu" ]; then
  conf="/usr/lib/binfmt.d/qemu-$qemu.conf"
  [ -f "$conf" ] || { echo "cannot run $arch programs: no $conf (Debian's qemu-user-static)" >&2; exit 3; }
  cat "$conf" > "$bm/register" 2>/dev/null || { echo "cannot run $arch programs: registering $conf failed" >&2; exit 3; }
fi
arch-test "$arch" >/dev/null || { echo "cannot run $arch programs: arch-test $arch fails" >&2; exit 3; }

tar="$KESTREL_HOME/chroot/bookworm-$arch.tar"
if [ ! -f "$tar" ]; then
  mkdir -p "$(dirname "$tar")"
  echo "making a Debian bookworm $arch system (mmdebstrap; once, kept in $tar)" >&2
  # --format=tar: the name ends in .tmp, from which mmdebstrap would infer a directory.
  rm -rf "$tar.tmp"
  mmdebstrap --quiet --format=tar --variant=apt --architectures="$arch" --include=systemd bookworm "$tar.tmp" \
    http://deb.debian.org/debian >&2
  mv "$tar.tmp" "$tar"
fi
mkdir -p "$dir"
tar -xf "$tar" -C "$dir"
