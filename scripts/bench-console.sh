#!/usr/bin/env bash
# Bench of the fleet console (`trainer console`), run by scripts/bench.sh and on its own:
# 1,000 devices' retained statuses (synthetic: published by scripts/bench_console.py over one MQTT
# connection, since 1,000 simulated agents do not fit beside the browser on 2 cores), then
# headless Chromium's time to first render of the page (3 fresh sessions), the page under a new
# status from every device every 2 s (render time, and the lag until a changed status shows), and
# the console's memory (VmRSS now, VmHWM peak) and CPU time.
#   scripts/bench-console.sh          # Env: CONSOLE_DEVICES (default 1000), CONSOLE_SECONDS (20)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
devices="${CONSOLE_DEVICES:-1000}"
seconds="${CONSOLE_SECONDS:-20}"
work=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; rm -rf "$work"' EXIT
trainer="$KESTREL_BIN/trainer"

echo "# Fleet console: $devices devices (synthetic retained statuses), headless Chromium $(/usr/bin/chromium --version 2>/dev/null | awk '{print $2}')"
echo "# $(date -u +%Y-%m-%d) on $(nproc) cores"
bport=$(free_port); cport=$(free_port); dport=$(free_port)
"$trainer" broker --listen "127.0.0.1:$bport" >/dev/null 2>&1 & pids+=($!)
wait_port "$bport"
"$trainer" console --broker "mqtt://127.0.0.1:$bport" --listen "127.0.0.1:$cport" >/dev/null 2>"$work/console.log" & cpid=$!
pids+=($cpid)
wait_port "$cport"
/usr/bin/chromedriver --port="$dport" >/dev/null 2>&1 & pids+=($!)
wait_port "$dport"
python3 "$here/bench_console.py" --synthetic --console "http://127.0.0.1:$cport/" --broker "127.0.0.1:$bport" \
  --driver "http://127.0.0.1:$dport" --devices "$devices" --seconds "$seconds" --profile "$work/profile" > "$work/bench.json"
python3 - "$work/bench.json" "/proc/$cpid/status" "/proc/$cpid/stat" "$seconds" <<'PY'
import json, os, sys
r = json.load(open(sys.argv[1]))
mem = {l.split(":")[0]: int(l.split()[1]) for l in open(sys.argv[2]) if l.startswith(("VmRSS", "VmHWM"))}
stat = open(sys.argv[3]).read().rsplit(")", 1)[1].split()
cpu_s = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
f = r["first_render_ms"]
print(f"{'what':<44}{'value':>14}")
print(f"{'time to first render (3 fresh browsers)':<44}{' / '.join(f'{x:.0f}' for x in f) + ' ms':>14}")
print(f"{'status update -> shown in the page, p50':<44}{r['update_lag_ms_p50']:>11.0f} ms")
print(f"{'status update -> shown in the page, max':<44}{r['update_lag_ms_max']:>11.0f} ms")
print(f"{'page render of the table, p50 / max':<44}{r['render_ms_p50']:>6.1f} / {r['render_ms_max']:.1f} ms")
print(f"{'console RSS now / peak':<44}{mem['VmRSS'] / 1024:>6.1f} / {mem['VmHWM'] / 1024:.1f} MB")
print(f"{'console CPU time (whole run)':<44}{cpu_s:>12.1f} s")
PY
