//! Captures under a flood, with the real binaries on both brokers (Mosquitto with the shipped
//! ACL and limits, every client logging in as itself; and `trainer broker`): while the collector
//! is away, one device publishes unique captures of 2 MB on its own topic, more than Mosquitto
//! queues for the collector (`max_queued_bytes`); an honest device beside it then captures. The
//! collector stores the flooder's captures only up to its quota, and every capture of the honest
//! device: the broker's acknowledgement no longer makes a device delete a capture, the
//! collector's does (`P/devices/<id>/capture-ack`), and a device that hears none sends again.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use kestrel_fleet::Conn;
use kestrel_shared::capture::{Capture, CaptureAck, CaptureStats};
use kestrel_shared::protocol::{Class, Status};
use kestrel_shared::topics::Topics;
use kestrel_shared::wire::CaptureReason;
use kestrel_tests::fleet::{
    Broker, BrokerKind, agent_config_on, fixture, publish_ok, start_agent_with, wait_status,
};
use kestrel_tests::{Scratch, bin, lfw, python, s, stderr, stdout};
use serde_json::Value;

const FLOODER: &str = "pi-flood";
const HONEST: &str = "pi-honest";
const COLLECTOR: &str = "kestrel-collector";
/// The honest device's captures (its own hourly limit).
const HONEST_CAPTURES: u64 = 6;
/// Captures the flooder publishes while the collector is away: about 80 MB, over the 64 MiB
/// Mosquitto queues for one client.
const FLOOD: usize = 40;
/// The collector's quota: captures and bytes per device and hour.
const QUOTA_CAPTURES: u64 = 8;
const QUOTA_BYTES: u64 = 12 << 20;

/// `trainer collect` as the collector's user, with a small quota.
fn collect_command(b: &Broker, table: &Path, idle_s: u64) -> Command {
    let c = b.config_as(COLLECTOR);
    let mut cmd = Command::new(bin("trainer"));
    cmd.args(["collect", "--broker", &b.url(), "--out", &s(table)]);
    if let (Some(u), Some(p)) = (c.username, c.password_file) {
        cmd.args(["--username", &u, "--password-file", &s(&p)]);
    }
    cmd.args(["--client-id", "collect-quota", "--until-idle"])
        .arg(idle_s.to_string())
        .args(["--quota-per-hour", &QUOTA_CAPTURES.to_string()])
        .args(["--quota-bytes-per-hour", &QUOTA_BYTES.to_string(), "--json"]);
    cmd
}

/// A unique capture of about 2 MB (1.5 MB of image bytes, base64) of the flooder.
fn flood_capture(i: usize) -> (String, Vec<u8>) {
    let id = format!("{}-{i:06}", 1_800_000_000_000u64 + i as u64);
    let image: Vec<u8> = (0..1_500_000u32)
        .map(|j| (j.wrapping_mul(31).wrapping_add(i as u32)) as u8)
        .collect();
    let c = Capture {
        id: id.clone(),
        device: FLOODER.into(),
        request: format!("f{i}"),
        model: "lfw".into(),
        version: 1,
        top: vec![Class {
            class: 0,
            label: "face".into(),
            score: 0.3,
        }],
        reason: CaptureReason::LowConfidence,
        captured_at: "2026-12-02T10:00:00Z".into(),
        content: Capture::encode_content(&image),
    };
    let topic = Topics::default().capture(FLOODER, &id);
    (topic, serde_json::to_vec(&c).unwrap())
}

/// The flood, published by the flooder as itself; the size of each message.
fn flood(b: &Broker) -> u64 {
    let msgs: Vec<(String, Vec<u8>, bool)> = (0..FLOOD)
        .map(|i| {
            let (topic, payload) = flood_capture(i);
            (topic, payload, false)
        })
        .collect();
    let size = msgs[0].1.len() as u64;
    assert!(size < 2 << 20, "{size}: within the broker's payload limit");
    let mut c = Conn::connect(&b.config_as(FLOODER), FLOODER).unwrap();
    c.publish_all(msgs, None).unwrap();
    c.disconnect();
    size
}

/// The honest device: every request captured, at most six an hour, sent again every 1-2 s while
/// no collector acknowledges it.
fn honest_config(dir: &Path, b: &Broker) -> PathBuf {
    let conf = agent_config_on(dir, HONEST, b, HONEST, "");
    let mut text = std::fs::read_to_string(&conf).unwrap();
    text.push_str(&format!(
        "[capture]\nenabled = true\npolicy = \"random\"\nrate = 1.0\n\
         max_per_hour = {HONEST_CAPTURES}\nresend_after_s = 1\nresend_max_s = 2\n\
         max_resends = 1000\n"
    ));
    std::fs::write(&conf, text).unwrap();
    conf
}

fn captures(s: &Status) -> CaptureStats {
    s.captures.clone().unwrap_or_default()
}

/// Ids of the captures waiting on the device for a collector's acknowledgement.
fn waiting(store: &Path) -> Vec<String> {
    std::fs::read_dir(store.join("captures/unacked"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| Some(e.path().file_stem()?.to_str()?.to_string()))
                .collect()
        })
        .unwrap_or_default()
}

/// Rows of the capture table by device, read by Python's deltalake.
fn rows_by_device(table: &Path) -> BTreeMap<String, u64> {
    let o = python(
        "import sys, json, collections, deltalake\n\
         t = deltalake.DeltaTable(sys.argv[1]).to_pyarrow_table()\n\
         print(json.dumps(collections.Counter(t.column('device').to_pylist())))",
        &[table],
    );
    serde_json::from_str(stdout(&o).trim()).unwrap()
}

/// The collector's JSON summary, once it has stopped (idle).
fn summary(child: Child, log: &Path) -> Value {
    let o = child.wait_with_output().unwrap();
    let err = std::fs::read_to_string(log).unwrap_or_default();
    assert!(o.status.success(), "{err}");
    serde_json::from_str(stdout(&o).trim()).unwrap_or_else(|e| panic!("{e}: {err}"))
}

fn flood_is_cut_at_its_quota_and_every_honest_capture_is_stored(kind: BrokerKind) {
    let f = fixture();
    let w = Scratch::new();
    let users = [FLOODER, HONEST, COLLECTOR];
    let b = Broker::start_with_acl(kind, &w.join("broker"), &users, "");
    let table = w.join("captures");
    // The collector's session first: the broker keeps captures for it while it is away.
    let o = collect_command(&b, &table, 1).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let size = flood(&b);
    let conf = honest_config(&w.join(HONEST), &b);
    let store = w.join(HONEST).join("store");
    let faces = PathBuf::from(lfw()).join("face");
    let agent = start_agent_with(&conf, &[], &["--feed", &s(&faces), "--feed-rate", "10"]);
    publish_ok(&b, &f.v1, &f.key(), &format!("device/{HONEST}"));
    let st = wait_status(&b.config(), HONEST, 120, "its captures sent", |s| {
        captures(s).sent >= HONEST_CAPTURES
    });
    let c = captures(&st);
    assert_eq!((c.taken, c.acked), (HONEST_CAPTURES, 0), "{c:?}");
    if kind == BrokerKind::MosquittoAcl {
        // Mosquitto dropped what did not fit the collector's queue, the honest captures with it.
        let log = b.proc.as_ref().unwrap().output();
        assert!(log.contains("dropped for client collect-quota"), "{log}");
        // And the flooder cannot tell the honest device that its captures are stored.
        let ids = waiting(&store);
        assert_eq!(ids.len() as u64, HONEST_CAPTURES, "{ids:?}");
        let ack = serde_json::to_vec(&CaptureAck {
            ids,
            collector: "forged".into(),
        })
        .unwrap();
        let topic = Topics::default().capture_ack(HONEST);
        let mut conn = Conn::connect(&b.config_as(FLOODER), "forger").unwrap();
        conn.publish_all(vec![(topic, ack, false)], None).unwrap();
        conn.disconnect();
    }
    let log = w.join("collect.log");
    let child = collect_command(&b, &table, 8)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let st = wait_status(
        &b.config(),
        HONEST,
        120,
        "every capture acknowledged",
        |s| {
            let c = captures(s);
            c.acked == HONEST_CAPTURES && c.awaiting_ack == 0 && c.queued == 0
        },
    );
    let out = summary(child, &log);
    eprintln!("{kind:?}: collector {out}\nhonest device {:?}", st.captures);
    let c = captures(&st);
    assert_eq!((c.unacked_dropped, c.evicted), (0, 0), "{c:?}");
    assert!(waiting(&store).is_empty(), "deleted once acknowledged");
    // The flooder is cut at its quota (here its bytes: 12 MiB of 2 MB messages); the honest
    // device is never over quota, and each of its captures is stored once.
    let flood_rows = QUOTA_CAPTURES.min(QUOTA_BYTES / size);
    let rows = rows_by_device(&table);
    assert_eq!(rows.get(FLOODER), Some(&flood_rows), "{rows:?} {out}");
    assert_eq!(rows.get(HONEST), Some(&HONEST_CAPTURES), "{rows:?} {out}");
    let over = out["over_quota_devices"][FLOODER].as_u64().unwrap_or(0);
    assert!(
        over >= 1 && out["over_quota_devices"][HONEST].is_null(),
        "{out}"
    );
    assert_eq!(out["over_quota"].as_u64(), Some(over), "{out}");
    let err = std::fs::read_to_string(&log).unwrap();
    assert_eq!(
        err.matches("is over its quota").count(),
        1,
        "logged once: {err}"
    );
    // A second run stores nothing: every capture was acknowledged to the broker.
    let o = collect_command(&b, &table, 2).output().unwrap();
    let again: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(again["stored"], 0, "{again}");
    drop(agent);
}

#[test]
fn a_capture_flood_is_cut_at_its_quota_and_honest_captures_are_kept_on_mosquitto() {
    flood_is_cut_at_its_quota_and_every_honest_capture_is_stored(BrokerKind::MosquittoAcl);
}

#[test]
fn a_capture_flood_is_cut_at_its_quota_and_honest_captures_are_kept_on_rumqttd() {
    flood_is_cut_at_its_quota_and_every_honest_capture_is_stored(BrokerKind::Rumqttd);
}
