//! Input capture with the real binaries: an agent with `[capture]` keeps what its policy picks
//! within its hourly limit and disk budget (across a SIGKILL and a restart), resends what the
//! broker had not acknowledged, and `trainer collect` stores every capture once in a Delta table
//! that Python's `deltalake` reads too; on both brokers.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kestrel_shared::capture::{Capture, CaptureStats};
use kestrel_shared::protocol::Class;
use kestrel_shared::wire::CaptureReason;
use kestrel_tests::fleet::{
    Broker, BrokerKind, agent_config, fixture, publish_ok, start_agent_with, wait_status,
};
use kestrel_tests::{lfw, python, run, run_fails, run_ok, s, stderr, stdout};
use serde_json::Value;

/// `trainer collect ... --json` as a user types it.
pub(crate) fn collect(b: &Broker, table: &Path, client: &str, idle_s: u64) -> Value {
    let idle = idle_s.to_string();
    let o = run(
        "trainer",
        &[
            "collect",
            "--broker",
            &b.url(),
            "--out",
            &s(table),
            "--client-id",
            client,
            "--until-idle",
            &idle,
            "--json",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    serde_json::from_str(stdout(&o).trim()).unwrap_or_else(|e| panic!("{e}: {}", stderr(&o)))
}

/// (rows, distinct paths) of a Delta table, read by Python's deltalake.
pub(crate) fn python_rows(table: &Path) -> (u64, u64) {
    let o = python(
        "import sys, deltalake\n\
         t = deltalake.DeltaTable(sys.argv[1]).to_pyarrow_table()\n\
         print(t.num_rows, len(set(t.column('path').to_pylist())))",
        &[table],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Vec<u64> = stdout(&o)
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    (v[0], v[1])
}

fn captures(b: &Broker, device: &str) -> CaptureStats {
    let st = kestrel_fleet::statuses(&b.config(), Some(device)).unwrap();
    st[0].captures.clone().unwrap_or_default()
}

/// Bytes of the capture queue's files on the device's disk.
fn queue_bytes(store: &Path) -> u64 {
    std::fs::read_dir(store.join("captures"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
                .filter(|e| e.file_name() != "state.json")
                .map(|e| e.metadata().unwrap().len())
                .sum()
        })
        .unwrap_or(0)
}

fn capture_config(dir: &Path, b: &Broker, budget: u64, upload: u64) -> PathBuf {
    let conf = agent_config(dir, "cap", &b.url(), &fixture().keys, "");
    let mut text = std::fs::read_to_string(&conf).unwrap();
    text.push_str(&format!(
        "[capture]\nenabled = true\npolicy = \"random\"\nrate = 1.0\nmax_per_hour = 12\n\
         max_disk_bytes = {budget}\nmax_upload_bytes_per_s = {upload}\n"
    ));
    std::fs::write(&conf, text).unwrap();
    conf
}

/// A burst of 30 requests/s with every request chosen: 12 are kept (the hourly limit), the
/// queue never holds more than its budget (4 captures' worth) while a 200 B/s upload cap holds
/// it back, the oldest are dropped and counted; a SIGKILL and a restart keep the limit (no new
/// capture in the same hour) and the queue, which then drains; `trainer collect` stores each
/// capture once (a capture delivered twice, and a second collect, add nothing).
fn limits_hold_and_nothing_is_stored_twice(kind: BrokerKind) {
    let f = fixture();
    let dir = f.dir.join(format!("capture-{kind:?}"));
    let b = Broker::start(kind, &dir.join("broker"));
    let table = dir.join("captures");
    let client = "collect-test";
    assert_eq!(collect(&b, &table, client, 1)["stored"], 0); // the session, before any capture
    let faces = PathBuf::from(lfw()).join("face");
    let biggest = std::fs::read_dir(&faces)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .max()
        .unwrap();
    let budget = 4 * (biggest * 4 / 3 + 700);
    let conf = capture_config(&dir.join("dev"), &b, budget, 200);
    let store = dir.join("dev").join("store");
    let feed = ["--feed", &s(&faces), "--feed-rate", "30"];
    let agent = start_agent_with(&conf, &[], &feed);
    publish_ok(&b, &f.v1, &f.key(), "device/cap");
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut max_disk = 0;
    let st = loop {
        max_disk = max_disk.max(queue_bytes(&store));
        let c = captures(&b, "cap");
        if c.taken == 12 && c.rate_limited >= 30 {
            break c;
        }
        assert!(Instant::now() < deadline, "{c:?}\n{}", agent.output());
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!("burst ({kind:?}): {st:?}, queue files up to {max_disk} of {budget} bytes");
    assert!(
        max_disk <= budget && st.queued_bytes <= budget,
        "{max_disk} > {budget}"
    );
    assert!(st.evicted >= 1, "the budget dropped the oldest: {st:?}");
    assert!(st.sent < 12, "the upload cap held captures back: {st:?}");
    agent.kill();
    // Restarted without the upload cap: the queue drains; the hour's limit still holds.
    let conf = capture_config(&dir.join("dev"), &b, budget, 0);
    let agent = start_agent_with(&conf, &[], &feed);
    let st = wait_status(&b.config(), "cap", 60, "queue drained", |s| {
        s.captures
            .as_ref()
            .is_some_and(|c| c.queued == 0 && c.rate_limited > st.rate_limited)
    })
    .captures
    .unwrap();
    eprintln!("after the kill ({kind:?}): {st:?}");
    assert_eq!(
        st.taken, 12,
        "no capture over the hourly limit after the restart"
    );
    let kept = st.taken - st.evicted;
    assert_eq!(st.sent, kept, "{st:?}");
    // One more capture, delivered twice.
    let dup = Capture {
        id: "1-000001".into(),
        device: "other".into(),
        request: "r".into(),
        model: "lfw".into(),
        version: 1,
        top: vec![Class {
            class: 0,
            label: "face".into(),
            score: 0.4,
        }],
        reason: CaptureReason::LowConfidence,
        captured_at: "2026-12-02T10:00:00Z".into(),
        content: Capture::encode_content(&std::fs::read(faces.join("000.png")).unwrap()),
    };
    let topic = kestrel_shared::topics::Topics::new("kestrel").capture("other", &dup.id);
    let msg = (topic, serde_json::to_vec(&dup).unwrap(), false);
    let mut conn = kestrel_fleet::Conn::connect(&b.config(), "test").unwrap();
    conn.publish_all(vec![msg.clone(), msg], None).unwrap();
    let c = collect(&b, &table, client, 3);
    eprintln!("collect ({kind:?}): {c}");
    assert_eq!(c["stored"].as_u64(), Some(kept + 1), "{c}");
    assert!(c["duplicates"].as_u64().unwrap() >= 1, "{c}");
    assert_eq!(
        collect(&b, &table, client, 2)["stored"],
        0,
        "all acknowledged"
    );
    assert_eq!(python_rows(&table), (kept + 1, kept + 1));
    labels_go_in_or_are_refused(&table, &dir, kept + 1);
    drop(agent);
}

/// `trainer label` as a user types it: `--export` lists every unlabelled row with its image; a
/// label that is no class, or a path that is no row, is refused and nothing changes; the
/// exported CSV with its label column filled in labels every row.
fn labels_go_in_or_are_refused(table: &Path, dir: &Path, rows: u64) {
    let t = s(table);
    let version_before = {
        let o = python(
            "import sys, deltalake\nprint(deltalake.DeltaTable(sys.argv[1]).version())",
            &[table],
        );
        stdout(&o).trim().to_string()
    };
    let todo = dir.join("todo.csv");
    run_ok("trainer", &["label", "--table", &t, "--export", &s(&todo)]);
    let text = std::fs::read_to_string(&todo).unwrap();
    let lines: Vec<&str> = text.lines().skip(1).collect();
    assert_eq!(lines.len() as u64, rows, "{text}");
    let first = lines[0].split(',').collect::<Vec<_>>();
    assert!(
        dir.join(first[1]).is_file(),
        "the image beside the CSV: {}",
        first[1]
    );
    let bad = dir.join("bad.csv");
    std::fs::write(&bad, format!("path,label\n{},zebra\n", first[0])).unwrap();
    let e = stderr(&run_fails(
        "trainer",
        &["label", "--table", &t, "--from", &s(&bad)],
    ));
    assert!(e.contains("zebra") && e.contains("--add-classes"), "{e}");
    std::fs::write(&bad, "path,label\nnobody/1-1,face\n").unwrap();
    let e = stderr(&run_fails(
        "trainer",
        &["label", "--table", &t, "--from", &s(&bad)],
    ));
    assert!(e.contains("no row `nobody/1-1`"), "{e}");
    let filled: String = std::iter::once("path,label".to_string())
        .chain(
            lines
                .iter()
                .map(|l| format!("{},face", l.split(',').next().unwrap())),
        )
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(&bad, filled).unwrap();
    let o = run_ok(
        "trainer",
        &["label", "--table", &t, "--from", &s(&bad), "--json"],
    );
    let v: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(
        (v["labelled"].as_u64(), v["unlabelled"].as_u64()),
        (Some(rows), Some(0))
    );
    // Python's deltalake reads the labels table; the capture table kept its version (labelling
    // copied no image).
    let o = python(
        "import sys, deltalake\n\
         t = deltalake.DeltaTable(sys.argv[1] + '/_labels').to_pyarrow_table()\n\
         print(t.num_rows, sorted(set(t.column('label').to_pylist())), deltalake.DeltaTable(sys.argv[1]).version())",
        &[table],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let expected = format!("{rows} ['face'] {version_before}");
    assert_eq!(stdout(&o).trim(), expected);
}

#[test]
fn capture_limits_hold_and_nothing_is_stored_twice_on_rumqttd() {
    limits_hold_and_nothing_is_stored_twice(BrokerKind::Rumqttd);
}

#[test]
fn capture_limits_hold_and_nothing_is_stored_twice_on_mosquitto() {
    limits_hold_and_nothing_is_stored_twice(BrokerKind::Mosquitto);
}
