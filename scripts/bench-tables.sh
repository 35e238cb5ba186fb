#!/usr/bin/env bash
# Bench: memory and time of reading large image tables (run by scripts/bench.sh; alone too).
#   scripts/bench-tables.sh
# Env: KESTREL_BIN, KESTREL_PY (as in env.sh), BENCH_THREADS (default 2), BENCH_ENGINES (default "ort tract").
# `trainer prepare` (read the table, decode, preprocess, backbone once per image, write both caches)
# of 1,000 and 8,000 distinct 640x480 camera JPEGs in one Parquet table each (~65 MB and ~520 MB,
# row groups of 512, scripts/camera_photos.py --parquet), fresh caches. Peak RSS from /usr/bin/time;
# the 8,000-photo row's ratio is its peak over the 1,000-photo row's (goal: within 1.10x: only the
# feature matrix, 5 kB per photo, grows with the table).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
trainer="$KESTREL_BIN/trainer"
threads="${BENCH_THREADS:-2}"

echo "# Large tables: prepare of camera photos in Parquet, $threads threads, $(date -u +%Y-%m-%d), $(nproc) cores"
for n in 1000 8000; do
  "$KESTREL_PY" "$here/camera_photos.py" --photos "$KESTREL_HOME/photos" --out "$work/p$n.parquet" \
    --count "$n" --parquet
done
printf '%-8s%8s%10s%10s%12s%10s%10s\n' engine photos "table MB" seconds "ms/image" "peak MB" "vs 1000"
for engine in ${BENCH_ENGINES:-ort tract}; do
  for n in 1000 8000; do
    rm -rf "$work/cache"
    start=$(date +%s.%N)
    /usr/bin/time -f '%M' -o "$work/rss" "$trainer" prepare --threads "$threads" --data "$work/p$n.parquet" \
      --engine "$engine" --cache "$work/cache" --json > "$work/prep.json" 2>/dev/null
    end=$(date +%s.%N)
    python3 - "$engine" "$n" "$start" "$end" "$work/p$n.parquet" "$work/prep.json" "$work/rss" "$work/base-$engine" <<'PY'
import json, os, sys
engine, n, start, end, table, prep, rss, base = sys.argv[1:]
s = float(end) - float(start)
got = json.load(open(prep))["samples"]
assert got == int(n), f"{got} samples, expected {n}"
mb = int(open(rss).read().split()[-1]) / 1024
if n == "1000":
    open(base, "w").write(str(mb))
ratio = mb / float(open(base).read())
print(f"{engine:<8}{n:>8}{os.path.getsize(table) / 1e6:>10.0f}{s:>10.1f}{1000 * s / got:>12.2f}{mb:>10.0f}{ratio:>9.2f}x")
PY
  done
done
