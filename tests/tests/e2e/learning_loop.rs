//! The learning loop as a user runs it: `scripts/loop-demo.sh --json` (train v1 on digits with 4
//! images each of 3 and 8, roll it out to two simulated devices, feed them images of 3 and 8,
//! capture the low-confidence ones, collect, label, retrain on the old table plus the captures,
//! roll v2 out with quality gates) and its numbers asserted.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

/// After one loop the fleet's accuracy on held-out 3s and 8s rises by at least 20 points, and on
/// the held-out images of the other classes drops by no more than 1; v2's backbone ran on the
/// captures at most (the base table's features came from the cache), and its rollout passed its
/// gates.
#[test]
fn one_loop_teaches_the_fleet_the_kind_it_had_not_seen() {
    let tmp = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/loop-demo.sh");
    let o = Command::new("bash")
        .arg(&script)
        .arg("--json")
        .env("KESTREL_LOOP_DIR", tmp.path().join("loop"))
        .env("KESTREL_SKIP_SETUP", "1")
        .output()
        .unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(o.status.success(), "{out}\n{err}");
    eprintln!("{out}");
    let r: Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k}: {r}"));
    let (kb, ka, rb, ra) = (
        f("kind_before"),
        f("kind_after"),
        f("rest_before"),
        f("rest_after"),
    );
    assert!(ka - kb >= 0.20, "new kind: {kb:.3} -> {ka:.3}");
    assert!(rb - ra <= 0.01, "original classes: {rb:.3} -> {ra:.3}");
    let captures = f("captures");
    assert!(captures >= 20.0, "{r}");
    assert!(f("backbone_runs") <= captures, "{r}");
    assert!(f("features_reused") > 0.0, "{r}");
    assert_eq!(r["rollout"], "completed", "{r}");
    let gates = r["gates"].as_array().unwrap();
    assert!(
        !gates.is_empty() && gates.iter().all(|g| g["passed"] == true),
        "{r}"
    );
}
