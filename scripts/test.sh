#!/usr/bin/env bash
# The test command: sets up what it needs (idempotent), then runs every test of the workspace.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
"$here/setup.sh"
source "$here/env.sh" # again: the set-up may have installed Open MPI
cd "$here/.."
# The ARM agent binaries (with the aarch64 ONNX Runtime variant) and .deb files (dist/) that tests/tests/e2e/arm.rs runs under qemu. Bounded, so a
# cold cross build cannot hold the test command indefinitely (warm: seconds; cold: ~20-40 min on 2 cores).
# KESTREL_SKIP_EDGE_BUILD=1 skips it (the ARM tests then skip, or test what dist/ already holds).
if [ "${KESTREL_SKIP_EDGE_BUILD:-0}" != 1 ]; then
  log "ARM edge agent: scripts/build-edge.sh"
  rc=0
  timeout "${KESTREL_EDGE_BUILD_TIMEOUT:-2400}" "$here/build-edge.sh" --ort || rc=$?
  if [ "$rc" = 124 ]; then
    # Out of time (a cold cross build on a busy box): the ARM tests say they skip and why; the
    # next run continues from the partial build in $KESTREL_HOME/target-{aarch64,armv7}.
    log "WARNING: the ARM build ran out of its ${KESTREL_EDGE_BUILD_TIMEOUT:-2400} s: ARM tests will skip"
  elif [ "$rc" != 0 ]; then
    exit "$rc"
  fi
fi
log "function length: no function over 120 lines without a written reason"
python3 "$here/long-functions.py" --max 120 --top 5
log "cargo test (release) ${KESTREL_FEATURES:-without MPI}"
# shellcheck disable=SC2086
cargo test --release --locked --workspace --no-fail-fast $KESTREL_FEATURES
