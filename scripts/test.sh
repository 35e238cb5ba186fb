#!/usr/bin/env bash
# The test command: sets up what it needs (idempotent), then runs every test of the workspace.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
"$here/setup.sh"
cd "$here/.."
log "cargo test (release)"
cargo test --release --locked --workspace
