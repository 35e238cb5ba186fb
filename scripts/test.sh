#!/usr/bin/env bash
# The test command: sets up what it needs (idempotent), then runs every test of the workspace.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
"$here/setup.sh"
source "$here/env.sh" # again: the set-up may have installed Open MPI
cd "$here/.."
log "cargo test (release) ${KESTREL_FEATURES:-without MPI}"
# shellcheck disable=SC2086
cargo test --release --locked --workspace --no-fail-fast $KESTREL_FEATURES
