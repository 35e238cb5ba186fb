#!/usr/bin/env bash
# Bench of the fleet console (`trainer console`), run by scripts/bench.sh and on its own:
# 1,000 simulated devices (`edge-agent run --simulate 1000`: one process, a connection, store and
# update machine each, idle) on Mosquitto, the console started after them (it reads the 2,000
# retained statuses and presences), then headless Chromium's time to first render of the page (3
# fresh browsers), the page while every device gets a new status every 2 s (written in the
# devices' names by scripts/bench_console.py, since idle agents publish nothing new): render time
# and the lag until a changed status shows, and the console's memory (VmRSS, VmHWM peak) and CPU.
#   scripts/bench-console.sh     # Env: CONSOLE_DEVICES (1000), CONSOLE_SECONDS (20),
#                                #      CONSOLE_SYNTHETIC=1 (statuses only, no agents)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
devices="${CONSOLE_DEVICES:-1000}"
seconds="${CONSOLE_SECONDS:-20}"
work=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; rm -rf "$work"' EXIT
trainer="$KESTREL_BIN/trainer"
what="simulated devices (edge-agent run --simulate $devices)"
[ -n "${CONSOLE_SYNTHETIC:-}" ] && what="devices (synthetic retained statuses, no agents)"

echo "# Fleet console: $devices $what on Mosquitto, headless Chromium $(/usr/bin/chromium --version 2>/dev/null | awk '{print $2}')"
echo "# $(date -u +%Y-%m-%d) on $(nproc) cores"
bport=$(free_port); cport=$(free_port); dport=$(free_port)
printf 'listener %s 127.0.0.1\nallow_anonymous true\npersistence false\nuser root\nmax_queued_messages 10000\n' "$bport" > "$work/mosquitto.conf"
"$(command -v mosquitto || echo /usr/sbin/mosquitto)" -c "$work/mosquitto.conf" 2>/dev/null & pids+=($!)
wait_port "$bport"
broker="mqtt://127.0.0.1:$bport"
ids="bench-{:04d}"; synthetic=(--synthetic)
if [ -z "${CONSOLE_SYNTHETIC:-}" ]; then
  "$trainer" keygen --out "$work/keys" >/dev/null
  printf 'device_id = "sim"\nstore = "store"\ntrusted_keys = ["%s"]\n[broker]\nurl = "%s"\n' \
    "$work/keys/kestrel.pub" "$broker" > "$work/agent.toml"
  (cd "$work" && exec "$KESTREL_BIN/edge-agent" run --config agent.toml --simulate "$devices" >/dev/null 2>&1) & pids+=($!)
  for _ in $(seq 240); do
    [ "$("$trainer" status --broker "$broker" --json | wc -l)" -ge "$devices" ] && break; sleep 0.5
  done
  ids="sim-{:03d}"; synthetic=()
fi
"$trainer" console --broker "$broker" --listen "127.0.0.1:$cport" >/dev/null 2>"$work/console.log" & cpid=$!
pids+=($cpid)
wait_port "$cport"
/usr/bin/chromedriver --port="$dport" >/dev/null 2>&1 & pids+=($!)
wait_port "$dport"
python3 "$here/bench_console.py" "${synthetic[@]}" --ids "$ids" --console "http://127.0.0.1:$cport/" \
  --broker "127.0.0.1:$bport" --driver "http://127.0.0.1:$dport" --devices "$devices" --seconds "$seconds" \
  --profile "$work/profile" > "$work/bench.json"
python3 - "$work/bench.json" "/proc/$cpid/status" "/proc/$cpid/stat" <<'PY'
import json, os, sys
r = json.load(open(sys.argv[1]))
mem = {l.split(":")[0]: int(l.split()[1]) for l in open(sys.argv[2]) if l.startswith(("VmRSS", "VmHWM"))}
stat = open(sys.argv[3]).read().rsplit(")", 1)[1].split()
cpu_s = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
f = r["first_render_ms"]
print(f"{'what':<44}{'value':>16}")
print(f"{'time to first render (3 fresh browsers)':<44}{' / '.join(f'{x:.0f}' for x in f) + ' ms':>16}")
print(f"{'status update -> shown in the page, p50':<44}{r['update_lag_ms_p50']:>13.0f} ms")
print(f"{'status update -> shown in the page, max':<44}{r['update_lag_ms_max']:>13.0f} ms")
print(f"{'page render of the table, p50 / max':<44}{r['render_ms_p50']:>8.1f} / {r['render_ms_max']:.1f} ms")
print(f"{'console RSS now / peak':<44}{mem['VmRSS'] / 1024:>8.1f} / {mem['VmHWM'] / 1024:.1f} MB")
print(f"{'console CPU time (whole run)':<44}{cpu_s:>14.1f} s")
PY
