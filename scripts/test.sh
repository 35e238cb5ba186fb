#!/usr/bin/env bash
# The test command: sets up what it needs (idempotent), then runs every test of the workspace.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
"$here/setup.sh"
source "$here/env.sh" # again: the set-up may have installed Open MPI
# (qemu user mode, installed by the set-up, runs the ARM binaries in tests/tests/e2e/arm.rs; they skip,
# saying so, without it.)
cd "$here/.."
# The ARM agent binaries (with the aarch64 ONNX Runtime variant) and .deb files (dist/) that tests/tests/e2e/arm.rs runs under qemu. Bounded, so a
# cold cross build cannot hold the test command indefinitely (unchanged: seconds; after a change to the
# agent's crates: ~5 min, fat LTO for three targets; cold: ~13 min on 2 cores, measured 2026-12-04).
# KESTREL_SKIP_EDGE_BUILD=1 skips it (the ARM tests then skip, or test what dist/ already holds).
# The slow optional steps (the ARM build, fuzzing) share one deadline, KESTREL_SLOW_DEADLINE seconds
# after this script started (default 2100), so a cold run still leaves the tests (~16 min on 2 cores) their time.
slow_budget() { # the smaller of $1 and what is left before the deadline (at least 60 s)
  local left=$(( ${KESTREL_SLOW_DEADLINE:-2100} - SECONDS ))
  [ "$left" -lt 60 ] && left=60
  [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}
if [ "${KESTREL_SKIP_EDGE_BUILD:-0}" != 1 ]; then
  log "ARM edge agent: scripts/build-edge.sh"
  # At normal priority here (build-edge.sh alone runs at nice 10): the tests wait for it, and
  # beside another busy process a niced fat-LTO link got a tenth of a core.
  export KESTREL_EDGE_NICE="${KESTREL_EDGE_NICE:-0}"
  rc=0
  timeout "$(slow_budget "${KESTREL_EDGE_BUILD_TIMEOUT:-2400}")" "$here/build-edge.sh" --ort || rc=$?
  if [ "$rc" = 124 ]; then
    # Out of time (a cold cross build on a busy box): the ARM tests say they skip and why; the
    # next run continues from the partial build in $KESTREL_HOME/target-{aarch64,armv7}.
    log "WARNING: the ARM build ran out of its ${KESTREL_EDGE_BUILD_TIMEOUT:-2400} s: ARM tests will skip"
  elif [ "$rc" != 0 ]; then
    exit "$rc"
  fi
fi
# Bounded fuzzing of the parsers untrusted bytes reach (fuzz/, scripts/fuzz.sh): a crash, or a target
# that does not compile, fails the test command; running out of time (a cold build of the fuzz
# targets) only warns.
if [ "${KESTREL_SKIP_FUZZ:-0}" != 1 ]; then
  log "fuzzing: scripts/fuzz.sh, ${KESTREL_FUZZ_SECONDS:-20} s per target"
  rc=0
  timeout "$(slow_budget "${KESTREL_FUZZ_TIMEOUT:-1200}")" "$here/fuzz.sh" "${KESTREL_FUZZ_SECONDS:-20}" || rc=$?
  if [ "$rc" = 124 ]; then
    log "WARNING: fuzzing did not run: out of time (the next run continues the build in \$KESTREL_HOME/target-fuzz)"
  elif [ "$rc" = 3 ] && ! cargo fuzz --version >/dev/null 2>&1; then
    log "WARNING: fuzzing did not run: cargo-fuzz could not be installed"
  elif [ "$rc" != 0 ]; then
    # A fuzz target that does not compile is a broken test, as a crash is a bug.
    exit "$rc"
  fi
fi
log "layers: no trainer module uses one that builds on it, no two files use each other, no wire value compared as a string (scripts/layers.py)"
python3 "$here/layers.py" --self-test
python3 "$here/keep-mtimes.py" --self-test
log "function length: no function over 120 lines without a written reason"
python3 "$here/long-functions.py" --max 120 --top 5
# The trainer's CUDA build compiles on these CPU machines (docs/gpu.md): candle's CUDA backend with its
# kernels, nvcc from PyPI's CUDA wheels (scripts/setup-cuda.sh, ~90 MB of downloads). In its own shell, so
# the CUDA variables stay out of the build below. Cold: ~9 min on 2 cores (nvcc); unchanged: seconds.
log "CUDA: scripts/setup-cuda.sh, then cargo check -p kestrel-trainer --features kestrel-trainer/cuda"
"$here/setup-cuda.sh"
# shellcheck disable=SC1091
(source "$KESTREL_HOME/cuda/env.sh" && cargo check --release --locked -p kestrel-trainer --features kestrel-trainer/cuda)
# cargo-nextest (.config/nextest.toml): a process per test, a 5-minute deadline per test, no retries,
# and a JUnit report whose slowest tests scripts/test-times.sh prints.
if ! cargo nextest --version >/dev/null 2>&1; then
  log "installing cargo-nextest (crates.io)"
  cargo install --locked cargo-nextest >&2
fi
# One test more than cores (.config/nextest.toml: the CPU-bound ones stay at one per core).
export NEXTEST_TEST_THREADS="${NEXTEST_TEST_THREADS:-$(( $(nproc) + 1 ))}"
log "cargo nextest run (release, $NEXTEST_TEST_THREADS at a time) ${KESTREL_FEATURES:-without MPI}"
rc=0
# shellcheck disable=SC2086
cargo nextest run --release --locked --workspace --no-fail-fast $KESTREL_FEATURES || rc=$?
"$here/test-times.sh" 15 || true
# The Python package, built as a user builds it (maturin, through pip), and its tests on a standalone
# Spark cluster (python/tests/conftest.py starts it).
log "Python package: pip install ./python, then pytest python/tests (Spark: a master and two workers)"
PATH="$KESTREL_HOME/venv/bin:$PATH" "$KESTREL_PY" -m pip install --quiet --no-build-isolation \
  --force-reinstall --no-deps ./python >&2 || rc=1
(cd python/tests && KESTREL_BIN="$KESTREL_BIN" "$KESTREL_PY" -m pytest -q -p no:cacheprovider .) || rc=1
exit "$rc"
