#!/usr/bin/env bash
# Crash loops, load and faults at full size (issue 15), through the same end-to-end tests that
# the test command runs bounded (tests/tests/e2e/chaos.rs, rollout.rs):
#   - the agent SIGKILLed at 100 random moments of its updates (CHAOS_KILLS), restarted each time;
#   - `trainer fit` SIGKILLed 100 times (CHAOS_FIT_KILLS) and resumed: byte-identical weights;
#   - 200 inference requests/s for 60 s at one agent (LOAD_RATE, LOAD_SECONDS): answered, busy,
#     lost, RSS, p50/p99;
#   - a store on a tmpfs that fills up during a download; Mosquitto restarted mid-rollout.
# Prints one line per figure (the "Hardening" table of docs/fleet.md); KESTREL_CHAOS_SEED replays a run.
#   scripts/chaos.sh [TEST_FILTER...]   # default: all of them; the whole output in $KESTREL_HOME/chaos.log
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
"$here/setup.sh" >&2
cd "$here/.."
log="$KESTREL_HOME/chaos.log"
filters=("$@")
[ ${#filters[@]} -eq 0 ] && filters=(chaos:: rollout::broker_restarted)
echo "# Crash loops, load and faults, $(date -u +%Y-%m-%d) on $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'))"
# shellcheck disable=SC2086
KESTREL_CHAOS_KILLS="${CHAOS_KILLS:-100}" KESTREL_CHAOS_FIT_KILLS="${CHAOS_FIT_KILLS:-100}" \
KESTREL_LOAD_RATE="${LOAD_RATE:-200}" KESTREL_LOAD_SECONDS="${LOAD_SECONDS:-60}" \
  cargo test --release --locked --workspace --test e2e $KESTREL_FEATURES -- \
  --test-threads 1 --nocapture "${filters[@]}" >"$log" 2>&1 || status=$?
grep -oE '(agent crash loop|fit crash loop|load|load \([A-Za-z]+\)): .*|KESTREL_CHAOS_SEED=[0-9]+|test [a-z_:]+ \.\.\. (ok|FAILED)|SKIP: .*' "$log" || true
if [ "${status:-0}" != 0 ]; then
  tail -60 "$log" >&2
  exit "$status"
fi
