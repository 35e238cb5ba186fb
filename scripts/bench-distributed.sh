#!/usr/bin/env bash
# Bench: data-parallel feature extraction and parallel tuning (run by scripts/bench.sh; alone too).
#   scripts/bench-distributed.sh
# Env: KESTREL_BIN (the trainer's directory, as in env.sh), BENCH_DATASET (default digits).
# Extraction is timed on the backbone step only (`feature_seconds` of `trainer prepare --json`:
# engine build, reading the worker's own shards, the backbone, gathering); the sample cache is built
# once beforehand. "1 thread per worker" rows show scaling with ranks at equal per-rank resources.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
trainer="$KESTREL_BIN/trainer"
ds="${BENCH_DATASET:-digits}"
data="$KESTREL_HOME/datasets/$ds/imagefolder"

echo "# Feature extraction over workers: $ds, EfficientNet-Lite0, $(date -u +%Y-%m-%d), $(nproc) cores, load average $(cut -d' ' -f1 /proc/loadavg)"
printf '%-8s%10s%10s%12s%12s%10s\n' engine workers threads seconds images/s speedup
for engine in ort tract; do
  # Sample cache with 2 shards (decode + resize once), then only the features are redone.
  "$trainer" prepare --threads 2 --data "$data" --engine "$engine" --workers 2 --cache "$work/cache" --json >/dev/null 2>&1
  base=""
  for cfg in "1 1" "2 2" "1 2"; do
    set -- $cfg
    rm -rf "$work/cache/features"
    "$trainer" prepare --threads "$2" --data "$data" --engine "$engine" --workers "$1" \
      --cache "$work/cache" --json > "$work/prep.json" 2>/dev/null
    s=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["feature_seconds"])' "$work/prep.json")
    [ -z "$base" ] && base="$s"
    python3 - "$engine" "$1" "$2" "$s" "$base" "$work/prep.json" <<'PY'
import json, sys
engine, workers, threads, s, base, prep = sys.argv[1:]
n = json.load(open(prep))["samples"]
s, base = float(s), float(base)
print(f"{engine:<8}{workers:>10}{threads:>10}{s:>12.2f}{n / s:>12.1f}{base / s:>9.2f}x")
PY
  done
done

echo
echo "# trainer tune on LFW: 50 trials (TPE after 10 random), features cached, ort"
printf '%-10s%12s%16s\n' parallel seconds "best val acc"
lfw="$KESTREL_HOME/datasets/lfw/imagefolder"
"$trainer" prepare --data "$lfw" --engine ort --cache "$work/cache" >/dev/null 2>&1
for p in 1 2; do
  start=$(date +%s.%N)
  "$trainer" tune --threads 2 --data "$lfw" --engine ort --cache "$work/cache" --trials 50 --parallel "$p" \
    --out "$work/tune-$p" --json > "$work/tune.json" 2>/dev/null
  end=$(date +%s.%N)
  python3 - "$p" "$start" "$end" "$work/tune.json" <<'PY'
import json, sys
p, start, end, t = sys.argv[1:]
best = json.load(open(t))["best"]
print(f"{p:<10}{float(end) - float(start):>12.1f}{best['val_accuracy']:>16.4f}")
PY
done
