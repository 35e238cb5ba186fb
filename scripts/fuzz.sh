#!/usr/bin/env bash
# Bounded fuzzing of every target in fuzz/ (cargo fuzz, libFuzzer): each runs for SECONDS (default
# 30) from its committed seeds (fuzz/corpus/<target>) plus what earlier runs found
# ($KESTREL_HOME/fuzz/corpus/<target>, outside the clone). A crash, a timeout or an allocation over
# the limit fails the run and leaves the input in $KESTREL_HOME/fuzz/artifacts/<target>/.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# Needs a nightly toolchain for AddressSanitizer (rustup's `nightly`); without one it fuzzes with
# the stable toolchain and no sanitizer (`-s none`; Rust's own checks still catch overflows and
# out-of-bounds accesses, as debug assertions are on).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
secs="${1:-30}"
shift || true
CARGO_FUZZ_VERSION=0.13.2
if ! cargo fuzz --version 2>/dev/null | grep -q "$CARGO_FUZZ_VERSION"; then
  log "installing cargo-fuzz $CARGO_FUZZ_VERSION"
  cargo install --quiet --locked cargo-fuzz --version "$CARGO_FUZZ_VERSION" >&2 || { log "could not install cargo-fuzz"; exit 3; }
fi
if rustup run nightly rustc --version >/dev/null 2>&1; then
  toolchain=(+nightly); sanitizer=address
else
  log "no nightly toolchain: fuzzing without a sanitizer"
  toolchain=(); sanitizer=none; export RUSTC_BOOTSTRAP=1
fi
export CARGO_TARGET_DIR="$KESTREL_HOME/target-fuzz"
cd "$here/../fuzz"
targets=("$@")
[ ${#targets[@]} -eq 0 ] && mapfile -t targets < <(cargo "${toolchain[@]}" fuzz list)
log "cargo fuzz build (-s $sanitizer): ${targets[*]}"
# Exit 3 when cargo-fuzz cannot be installed or the targets cannot be built (scripts/test.sh warns
# for the first and fails for the second: a target that does not compile is a broken test); a
# crash found while fuzzing exits 1.
cargo "${toolchain[@]}" fuzz build -a -s "$sanitizer" >&2 || { log "cargo fuzz build failed"; exit 3; }
# One target per core at a time (libFuzzer runs one process per target).
fuzz_one() {
  local t="$1" work="$KESTREL_HOME/fuzz/corpus/$1" artifacts="$KESTREL_HOME/fuzz/artifacts/$1" out
  mkdir -p "$work" "$artifacts" "corpus/$t"
  out="$logs/$t.log"
  if cargo "${toolchain[@]}" fuzz run -a -s "$sanitizer" "$t" "$work" "corpus/$t" -- \
      -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 \
      -artifact_prefix="$artifacts/" -print_final_stats=1 >"$out" 2>&1; then
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$out" | tail -1)
    log "fuzz $t: ${execs:-?} executions, no crash"
  else
    tail -40 "$out" >&2
    log "fuzz $t: FAILED (input in $artifacts/)"
    return 1
  fi
}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
jobs_max=$(nproc)
log "fuzz ${targets[*]}: $secs s each, $jobs_max at a time"
status=0
pids=()
for t in "${targets[@]}"; do
  fuzz_one "$t" &
  pids+=($!)
  if [ ${#pids[@]} -ge "$jobs_max" ]; then
    wait "${pids[0]}" || status=1
    pids=("${pids[@]:1}")
  fi
done
for p in "${pids[@]}"; do wait "$p" || status=1; done
exit $status
