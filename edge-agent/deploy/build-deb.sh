#!/usr/bin/env bash
# Packages a built edge-agent binary as a Debian package with dpkg-deb (the Debian tool itself):
#   edge-agent/deploy/build-deb.sh BINARY DEB_ARCH VERSION OUTDIR
#   e.g. build-deb.sh dist/edge-agent-aarch64 arm64 0.1.0 dist  ->  dist/kestrel-agent_0.1.0_arm64.deb
# Called by scripts/build-edge.sh. Install on the Pi with `sudo apt install ./kestrel-agent_*_arm64.deb`.
#
# Contents:
#   /usr/bin/edge-agent                          0755 root:root
#   /etc/kestrel/agent.toml                      0644, a conffile (dpkg keeps local edits on upgrade)
#   /lib/systemd/system/kestrel-agent.service    0644 (hardened; runs as the kestrel system user)
#   /usr/share/doc/kestrel-agent/copyright       0644
# postinst creates the `kestrel` system user and group (home /var/lib/kestrel, no shell) and the state
# directory; the service is not enabled: it needs a device id, a broker and a trusted key first.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
[ $# -eq 4 ] || { sed -n '2,5p' "$0" >&2; exit 2; }
bin="$1" arch="$2" version="$3" out="$4"
[ -x "$bin" ] || { echo "$bin: not an executable" >&2; exit 1; }
case "$arch" in arm64|armhf|amd64) ;; *) echo "unsupported Debian architecture $arch" >&2; exit 2 ;; esac

# The oldest glibc the binary accepts: its highest GLIBC_x.y symbol version.
glibc=$(LC_ALL=C grep -aoE 'GLIBC_2\.[0-9]+' "$bin" | sort -t. -k2,2n -u | tail -1 | cut -d_ -f2)
glibc="${glibc:-2.17}"
# Packed relative relocations (DT_RELR, `-z pack-relative-relocs`) need glibc 2.36.
if LC_ALL=C grep -aq GLIBC_ABI_DT_RELR "$bin" && [ "$(printf "%s\n" "$glibc" 2.36 | sort -V | tail -1)" = 2.36 ]; then glibc=2.36; fi

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
pkg="$root/kestrel-agent"
install -d -m 0755 "$pkg/DEBIAN" "$pkg/usr/bin" "$pkg/etc/kestrel" "$pkg/lib/systemd/system" \
  "$pkg/usr/share/doc/kestrel-agent"
install -m 0755 "$bin" "$pkg/usr/bin/edge-agent"
install -m 0644 "$here/../agent.toml" "$pkg/etc/kestrel/agent.toml"
install -m 0644 "$here/kestrel-agent.service" "$pkg/lib/systemd/system/kestrel-agent.service"
cat > "$pkg/usr/share/doc/kestrel-agent/copyright" <<'EOF'
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: kestrel
Files: *
License: Apache-2.0
 On Debian systems, the full text of the Apache License 2.0 is in
 /usr/share/common-licenses/Apache-2.0.
EOF
chmod 0644 "$pkg/usr/share/doc/kestrel-agent/copyright"

installed_kb=$(du -sk --exclude=DEBIAN "$pkg" | cut -f1)
cat > "$pkg/DEBIAN/control" <<EOF
Package: kestrel-agent
Version: $version
Architecture: $arch
Maintainer: Kestrel maintainers <kestrel@localhost>
Section: misc
Priority: optional
Installed-Size: $installed_kb
Depends: libc6 (>= $glibc), adduser
Description: Kestrel edge agent: signed model delivery over MQTT and on-device inference
 Follows the desired state of its device and groups over MQTT, downloads signed
 ONNX models in verified chunks, health-checks them on their golden samples,
 activates them atomically (keeping the previous one for rollback) and answers
 inference requests with tract (pure Rust, no OpenSSL).
 .
 Configure /etc/kestrel/agent.toml and the trusted key, then
 `systemctl enable --now kestrel-agent`.
EOF
echo /etc/kestrel/agent.toml > "$pkg/DEBIAN/conffiles"

cat > "$pkg/DEBIAN/postinst" <<'EOF'
#!/bin/sh
set -e
if [ "$1" = configure ]; then
    if ! getent passwd kestrel >/dev/null; then
        adduser --system --group --home /var/lib/kestrel --no-create-home \
            --shell /usr/sbin/nologin --gecos "Kestrel edge agent" kestrel
    fi
    install -d -m 0750 -o kestrel -g kestrel /var/lib/kestrel
    # The configuration may name a broker password file: readable by the agent, not by everyone.
    chgrp kestrel /etc/kestrel/agent.toml && chmod 0640 /etc/kestrel/agent.toml || true
    if [ -d /run/systemd/system ]; then
        systemctl daemon-reload >/dev/null || true
        # An upgrade restarts a running agent on the new binary (it resumes from its journal).
        if systemctl is-active --quiet kestrel-agent.service; then
            systemctl restart kestrel-agent.service || true
        fi
    fi
fi
exit 0
EOF
cat > "$pkg/DEBIAN/prerm" <<'EOF'
#!/bin/sh
set -e
if [ "$1" = remove ] && [ -d /run/systemd/system ]; then
    systemctl stop kestrel-agent.service >/dev/null 2>&1 || true
    systemctl disable kestrel-agent.service >/dev/null 2>&1 || true
fi
exit 0
EOF
cat > "$pkg/DEBIAN/postrm" <<'EOF'
#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || true
fi
# Purge removes the model store; the system user stays (Debian practice: its uid may own files elsewhere).
if [ "$1" = purge ]; then
    rm -rf /var/lib/kestrel
fi
exit 0
EOF
chmod 0755 "$pkg/DEBIAN/postinst" "$pkg/DEBIAN/prerm" "$pkg/DEBIAN/postrm"

mkdir -p "$out"
deb="$out/kestrel-agent_${version}_${arch}.deb"
dpkg-deb --root-owner-group -Zxz --build "$pkg" "$deb" >/dev/null
echo "$deb: $(stat -c %s "$deb") bytes (libc6 >= $glibc)"
