#!/usr/bin/env bash
# Accuracy over seeds, the statistics the tests leave to the bench (they check one seed each):
#  - the default head (L-BFGS, L2 by cross-validation) against scikit-learn's optimum on the same split and
#    features (scripts/head-reference.py), seeds 1-5, LFW and digits;
#  - --fine-tune 2 on digits against that head optimum, seeds 1-5, with the run's peak RSS.
#   scripts/bench-seeds.sh          (also the last section of scripts/bench.sh)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
"$here/setup.sh" >&2
trainer="$KESTREL_BIN/trainer"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
seeds=(1 2 3 4 5)

# Prints the features cache of table $1 (prepared once; the runs below read it).
features_of() { "$trainer" prepare --json --data "$1" --cache "$work/cache" 2>/dev/null \
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["features_cache"])'; }

# Table of run summaries ($1: a label) against scikit-learn's optimum, from $2 (kestrel's runs, one dir per seed).
compare() {
  python3 - "$1" "$2" "$3" <<'PY'
import json, os, sys
label, ref, runs = sys.argv[1], sys.argv[2], sys.argv[3].split()
ref = {r["run"]: r["val_accuracy"] for r in map(json.loads, open(ref))}
ours, opt = [], []
for run in runs:
    s = json.load(open(run + ".json"))
    rss = open(run + ".rss").read().split()[-1]
    ours.append(s["val_accuracy"]); opt.append(ref[run])
    print(f"{label:<22}{os.path.basename(run):>8}{s['val_accuracy']:>10.4f}{ref[run]:>12.4f}"
          f"{s['val_accuracy'] - ref[run]:>+10.4f}{int(rss) / 1024:>10.0f}")
mean = lambda v: sum(v) / len(v)
print(f"{label:<22}{'min':>8}{min(ours):>10.4f}{min(opt):>12.4f}")
print(f"{label:<22}{'mean':>8}{mean(ours):>10.4f}{mean(opt):>12.4f}{mean(ours) - mean(opt):>+10.4f}")
PY
}

echo "# Accuracy over seeds $(IFS=,; echo "${seeds[*]}"): validation accuracy against scikit-learn's head optimum on the same split"
echo "# and features (LogisticRegressionCV); peak RSS of each run. $(date -u +%Y-%m-%d), $(nproc) cores"
printf '%-22s%8s%10s%12s%10s%10s\n' recipe seed kestrel scikit-learn diff "peak MB"
for ds in lfw digits; do
  data="$KESTREL_HOME/datasets/$ds/imagefolder"
  cache=$(features_of "$data")
  runs=()
  for seed in "${seeds[@]}"; do
    run="$work/$ds-head-$seed"
    /usr/bin/time -f '%M' -o "$run.rss" "$trainer" fit --json --data "$data" --cache "$work/cache" --seed "$seed" \
      --out "$run" > "$run.json" 2>/dev/null
    runs+=("$run")
  done
  "$KESTREL_PY" "$here/head-reference.py" "$cache" "${runs[@]}" > "$work/$ds-head.ref"
  compare "$ds default head" "$work/$ds-head.ref" "${runs[*]}"
done
data="$KESTREL_HOME/datasets/digits/imagefolder"
cache=$(features_of "$data")
runs=()
for seed in "${seeds[@]}"; do
  run="$work/digits-ft-$seed"
  /usr/bin/time -f '%M' -o "$run.rss" "$trainer" fit --json --data "$data" --cache "$work/cache" --seed "$seed" \
    --fine-tune 2 --out "$run" > "$run.json" 2>/dev/null
  runs+=("$run")
done
"$KESTREL_PY" "$here/head-reference.py" "$cache" "${runs[@]}" > "$work/digits-ft.ref"
compare "digits --fine-tune 2" "$work/digits-ft.ref" "${runs[*]}"
