#!/usr/bin/env bash
# The slowest tests of the last test command (nextest's JUnit report), slowest first.
#   scripts/test-times.sh [N]        default: 15; names the tests over the 5-minute limit
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
# nextest keeps its store under the workspace (target/nextest), whatever CARGO_TARGET_DIR says.
report="$here/../target/nextest/default/junit.xml"
[ -f "$report" ] || { echo "no test report at $report: run scripts/test.sh first" >&2; exit 1; }
python3 - "$report" "${1:-15}" <<'PY'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
tests = []
for case in root.iter("testcase"):
    outcome = "ok"
    for tag in ("failure", "error", "skipped"):
        if case.find(tag) is not None:
            outcome = tag
    tests.append((float(case.get("time", 0)), case.get("classname", ""), case.get("name", ""), outcome))
tests.sort(reverse=True)
total = sum(t[0] for t in tests)
print(f"{root.get('timestamp', '')}: {len(tests)} tests, {total / 60:.1f} min of test time "
      f"({root.get('time', '?')} s wall), {sum(t[3] != 'ok' for t in tests)} not ok")
print(f"{'seconds':>8}  {'outcome':<8} test")
for secs, cls, name, outcome in tests[: int(sys.argv[2])]:
    print(f"{secs:>8.1f}  {outcome:<8} {cls} {name}")
# The project's limit for one test on 2 cores (nextest kills a test only at twice that, so that a
# loaded machine does not turn slowness into failures: .config/nextest.toml).
over = [t for t in tests if t[0] > 300]
if over:
    print(f"{len(over)} test(s) over the 5-minute limit: {', '.join(t[2] for t in over)}")
PY
