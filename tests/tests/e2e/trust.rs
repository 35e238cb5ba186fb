//! Trust, second round (docs/protocol.md's threat table): the controller acts only on what it
//! can verify, and no single device, message or packet outweighs the fleet. Through the
//! binaries, on Mosquitto with the shipped ACL (a compromised device writes only its own
//! topics) and on the embedded broker:
//! - a device that lies about its quality (one vote, bounded claims) and about its groups;
//! - a planted rollout state (`completed`, or a `failed` device whose rollback the controller
//!   would sign), which the controller refuses to resume;
//! - garbage on a model's chunk topics, which never fails the version;
//! - a password for a broker on another machine over plain MQTT, refused before connecting.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kestrel_fleet::rollout::{Controller, Plan, saved};
use kestrel_fleet::{Bundle, Conn};
use kestrel_shared::mqtt::BrokerConfig;
use kestrel_shared::protocol::{SignedDesired, Status};
use kestrel_shared::quality::{DeviceQuality, ShadowReport};
use kestrel_shared::topics::Topics;
use kestrel_tests::fleet::{
    Broker, BrokerKind, agent_config_on, desired, fixture, publish_ok, publish_raw,
    rollout_command, start_agent_with, wait_fleet, wait_status,
};
use kestrel_tests::{Scratch, run, s, stderr, stdout};
use serde_json::Value;

use super::adversary::{EVIL, INTRUDER, SIM, broker, plan, put, sim_fleet};
use super::quality::{candidates, gate, held_out};
use kestrel_shared::wire::ShadowState;

/// The device's latest retained status, as the fleet reads it.
fn status_of(cfg: &BrokerConfig, device: &str) -> Status {
    kestrel_fleet::statuses(cfg, None)
        .unwrap()
        .into_iter()
        .find(|s| s.device == device)
        .unwrap_or_else(|| panic!("{device} has no status"))
}

/// A rollout run to its end with `--json`: (succeeded, the controller's JSON, stderr).
fn rollout_json(b: &Broker, art: &Path, plan: &str) -> (bool, Value, String) {
    let o = rollout_command(b, art, plan)
        .arg("--json")
        .output()
        .unwrap();
    let err = stderr(&o);
    let c = serde_json::from_str(stdout(&o).trim()).unwrap_or(Value::Null);
    (o.status.success(), c, err)
}

/// The compromised device: it says (on its own topics, the only ones it may write) that it is
/// in the `canary` group, runs every shadow it is sent, and that the shadow agrees with its
/// model on every one of an implausible number of requests, then on a plausible one. Returns
/// the number of forged reports when `stop` is set.
fn liar(cfg: BrokerConfig, honest: Status, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let topics = Topics::default();
        let mut c = Conn::connect(&cfg, "liar").unwrap();
        c.subscribe(&topics.desired(&kestrel_shared::protocol::Target::Device(EVIL.into())))
            .unwrap();
        let mut me = honest;
        me.device = EVIL.into();
        me.groups = vec!["canary".into(), "all".into()];
        let (mut forged, mut shadow) = (0u64, None);
        let mut claims = [1_000_000_000_000u64, 50].into_iter().cycle();
        while !stop.load(Ordering::Relaxed) {
            if let Some((t, p)) = c.recv(Duration::from_millis(500)).unwrap()
                && t.ends_with("/desired")
                && let Ok(signed) = serde_json::from_slice::<SignedDesired>(&p)
                && let Ok(d) =
                    serde_json::from_str::<kestrel_shared::protocol::Desired>(&signed.body)
            {
                shadow = d.shadow;
            }
            me.seq += 1;
            me.shadow = shadow
                .as_ref()
                .map(|m| kestrel_shared::protocol::ShadowStatus {
                    name: m.name.clone(),
                    version: m.version,
                    state: ShadowState::Running,
                    error: None,
                });
            let mut msgs = vec![(topics.status(EVIL), serde_json::to_vec(&me).unwrap(), true)];
            if let Some(m) = &shadow {
                let q = DeviceQuality {
                    device: EVIL.into(),
                    model: me.model.clone().unwrap(),
                    version: me.active.unwrap(),
                    window: None,
                    note: None,
                    shadow: Some(ShadowReport {
                        name: m.name.clone(),
                        version: m.version,
                        compared: claims.next().unwrap(),
                        agreement: 1.0,
                        active_mean_confidence: 0.9,
                        shadow_mean_confidence: 0.9,
                        disagreements: vec![0, 0],
                        active_latency_p50_ms: 1.0,
                        shadow_latency_p50_ms: 1.0,
                        skipped: 0,
                    }),
                    updated: kestrel_shared::now_rfc3339(),
                };
                msgs.push((topics.quality(EVIL), serde_json::to_vec(&q).unwrap(), true));
                forged += 1;
            }
            c.publish_all(msgs, None).unwrap();
        }
        c.disconnect();
        forged
    })
}

/// A shadow-gated rollout of a model trained on shuffled labels (agreement with the active
/// model about one half on LFW's two classes), with a lying device in the fleet that reports a
/// perfect agreement on a trillion requests (then on 50): the gate stays the honest devices'
/// verdict, the rollout aborts, and the liar is excluded and named. Request-weighted, as
/// before, its one report read 1.0 and passed the phase. A canary by group takes the plan's
/// members only, not the liar that says it is in the canary.
fn a_lying_device_does_not_outweigh_the_fleet(kind: BrokerKind) {
    let f = fixture();
    let (bad, _) = candidates();
    let w = Scratch::new();
    let b = broker(kind, &w.join("broker"));
    held_out(&w.join("held"));
    let conf = agent_config_on(&w.join("sim"), "q", &b, SIM, "");
    let mut text = std::fs::read_to_string(&conf).unwrap();
    text.push_str("[quality]\nwindow = 50\nperiod_s = 2\n");
    std::fs::write(&conf, text).unwrap();
    let feed = format!("held={}", s(&w.join("held")));
    let _fleet = start_agent_with(
        &conf,
        &[],
        &["--simulate", "4", "--feed", &feed, "--feed-rate", "4"],
    );
    wait_fleet(&b.config(), 4);
    let all = "[[phases]]\nname = \"all\"\npercent = 100\n";
    let (ok, c, err) = rollout_json(&b, &f.v1, &plan(w.tmp.path(), "v1", all));
    assert!(ok, "{c} {err}");

    let stop = Arc::new(AtomicBool::new(false));
    let honest = status_of(&b.config(), "q-000");
    let lies = liar(b.config_as(EVIL), honest, stop.clone());
    wait_fleet(&b.config(), 5);
    // Every device, the liar too, runs the candidate in shadow in a gated phase.
    let gated = "[[phases]]\nname = \"shadow\"\npercent = 100\nmode = \"shadow\"\n\
                 min_requests = 40\nmin_shadow_agreement = 0.9\ntimeout_s = 240\n\
                 [[phases]]\nname = \"all\"\npercent = 100\n";
    let (ok, c, err) = rollout_json(&b, &bad, &plan(w.tmp.path(), "bad", gated));
    assert!(!ok, "the bad model must not pass: {c}\n{err}");
    assert_eq!(c["state"]["state"], "aborted", "{c}");
    let reason = c["state"]["reason"].as_str().unwrap();
    assert!(
        reason.contains("phase 0 `shadow`: quality gate min_shadow_agreement"),
        "{reason}"
    );
    let agreement = gate(&c, "min_shadow_agreement");
    assert!(
        agreement < 0.9,
        "the liar moved the gate to {agreement}: {c}"
    );
    // Its trillion requests excluded it, named in the JSON and the log.
    let why = c["devices"][EVIL]["quality"]["excluded"]
        .as_str()
        .unwrap_or_default();
    assert!(why.contains("requests"), "{c}");
    assert!(
        err.contains(&format!("{EVIL}: excluded from the quality gates")),
        "{err}"
    );

    // A canary by group: the liar says it is in `canary`, the plan says who is.
    let canary = "[groups]\ncanary = [\"q-000\", \"q-001\"]\n\
                  [[phases]]\nname = \"canary\"\ngroup = \"canary\"\nmode = \"shadow\"\n\
                  min_requests = 40\nmin_shadow_agreement = 0.9\ntimeout_s = 240\n\
                  [[phases]]\nname = \"all\"\npercent = 100\n";
    let (ok, c, err) = rollout_json(&b, &bad, &plan(w.tmp.path(), "bad-canary", canary));
    stop.store(true, Ordering::Relaxed);
    let forged = lies.join().unwrap();
    assert!(forged > 0);
    assert!(!ok, "{c}\n{err}");
    assert_eq!(c["devices"][EVIL]["phase"], 1, "{c}");
    assert_eq!(c["devices"][EVIL]["state"]["state"], "waiting", "{c}");
    for id in ["q-000", "q-001"] {
        assert_eq!(c["devices"][id]["phase"], 0, "{c}");
    }
    for id in ["q-000", "q-001", "q-002", "q-003"] {
        assert_eq!(status_of(&b.config(), id).active, Some(1), "{id}");
    }
    eprintln!("{kind:?}: honest agreement {agreement:.3}, liar excluded: {why}");
}

#[test]
fn a_lying_device_does_not_outweigh_the_fleet_on_mosquitto() {
    a_lying_device_does_not_outweigh_the_fleet(BrokerKind::Mosquitto);
}

#[test]
fn a_lying_device_does_not_outweigh_the_fleet_on_rumqttd() {
    a_lying_device_does_not_outweigh_the_fleet(BrokerKind::Rumqttd);
}

/// A broker-level intruder (any topic, no signing key) plants the state of the rollout an
/// operator is about to run: `completed` (as an old controller saved it, unsigned), then one
/// signed by the intruder's own key with a `failed` device whose "previous" version the
/// controller would sign a rollback to. `trainer rollout` refuses each, naming the topic,
/// signs nothing, and no device moves; with the state cleared, the rollout runs and completes.
fn a_planted_rollout_state_is_refused(kind: BrokerKind) {
    let f = fixture();
    let w = Scratch::new();
    let b = broker(kind, &w.join("broker"));
    let _fleet = sim_fleet(&b, w.tmp.path(), "pl", 6);
    publish_ok(&b, &f.v1, &f.key(), "group/all");
    for i in 0..6 {
        wait_status(&b.config(), &format!("pl-{i:03}"), 120, "v1", |s| {
            s.active == Some(1)
        });
    }
    let fleet: Vec<Status> = kestrel_fleet::statuses(&b.config(), None).unwrap();
    let phases = "[[phases]]\nname = \"all\"\npercent = 100\ntimeout_s = 120\n";
    let plan_path = plan(w.tmp.path(), "lfw-v2", phases);
    let parsed = Plan::parse(&std::fs::read_to_string(&plan_path).unwrap(), "p").unwrap();
    let intruder = b.config_as(INTRUDER);
    let topics = Topics::default();
    let topic = topics.rollout_state("lfw-v2");

    let mut done = Controller::new("lfw-v2", "lfw", 2, parsed.clone(), &fleet).unwrap();
    done.state = kestrel_fleet::rollout::RolloutState::Completed;
    let rogue = ed25519_dalek::SigningKey::from_bytes(&[9; 32]);
    let mut failed = Controller::new("lfw-v2", "lfw", 2, parsed, &fleet).unwrap();
    for d in failed.devices.values_mut() {
        d.state = kestrel_fleet::rollout::DeviceState::Failed("planted".into());
        d.previous = Some(("lfw".into(), 0));
    }
    let planted = [
        (
            "unsigned completed",
            serde_json::to_vec(&done).unwrap(),
            "not a signed rollout state",
        ),
        (
            "rogue-signed failed",
            saved::seal(&rogue, &failed),
            "does not verify with this rollout's key",
        ),
    ];
    for (what, payload, expect) in planted {
        put(&intruder, vec![(topic.clone(), payload, true)]);
        let (ok, _, err) = rollout_json(&b, &f.v2, &plan_path);
        assert!(!ok, "{what}: must be refused: {err}");
        assert!(
            err.contains(&topic) && err.contains(expect),
            "{what}: {err}"
        );
        for s in kestrel_fleet::statuses(&b.config(), None).unwrap() {
            assert_eq!(
                (s.active, s.target),
                (Some(1), None),
                "{what}: {}",
                s.device
            );
        }
        // No desired state for a device was signed: every device follows the group's v1.
        let mut c = Conn::connect(&b.config(), "t").unwrap();
        let desired = c
            .retained(
                &format!("{}/devices/+/desired", topics.prefix()),
                Duration::from_millis(400),
            )
            .unwrap();
        c.disconnect();
        assert!(
            desired.values().all(|p| p.is_empty()),
            "{what}: {desired:?}"
        );
    }
    put(&intruder, vec![(topic.clone(), vec![], true)]);
    let (ok, c, err) = rollout_json(&b, &f.v2, &plan_path);
    assert!(ok, "{c} {err}");
    assert_eq!(c["state"]["state"], "completed", "{c}");
    // What the controller saved verifies with its key.
    let mut conn = Conn::connect(&b.config(), "t").unwrap();
    let payload = conn.retained(&topic, Duration::from_millis(400)).unwrap()[&topic].clone();
    conn.disconnect();
    let key = f.signing().verifying_key();
    let plan = Plan::parse(&std::fs::read_to_string(&plan_path).unwrap(), "p").unwrap();
    saved::open(&topic, &payload, "lfw-v2", &key, &plan).unwrap();
}

#[test]
fn a_planted_rollout_state_is_refused_on_mosquitto() {
    a_planted_rollout_state_is_refused(BrokerKind::Mosquitto);
}

#[test]
fn a_planted_rollout_state_is_refused_on_rumqttd() {
    a_planted_rollout_state_is_refused(BrokerKind::Rumqttd);
}

/// Garbage on a model's chunk topics: a retained chunk overwritten with garbage, and a flood
/// of garbage on every chunk topic while the device downloads. The device drops each corrupt
/// chunk and asks again; the version is never marked failed, and once the genuine chunk is
/// published again it installs and answers with it.
fn garbage_on_chunk_topics_changes_nothing(kind: BrokerKind) {
    let f = fixture();
    let w = Scratch::new();
    let b = broker(kind, &w.join("broker"));
    let device = "pl-000";
    let conf = agent_config_on(&w.join("sim"), "pl", &b, SIM, "download_stall_s = 2");
    let _agent = start_agent_with(&conf, &[], &["--simulate", "1"]);
    wait_fleet(&b.config(), 1);
    publish_ok(&b, &f.v1, &f.key(), &format!("device/{device}"));
    wait_status(&b.config(), device, 120, "v1", |s| s.active == Some(1));

    let topics = Topics::default();
    let v2 = Bundle::from_dir(&f.v2, &f.signing(), 128 * 1024)
        .unwrap()
        .without_pieces(); // the whole-bundle chunk topics (pieces: parts.rs)
    let mut msgs = v2.messages(&topics);
    let genuine = topics.chunk("lfw", 2, 1);
    let good = msgs.iter().find(|(t, ..)| *t == genuine).cloned().unwrap();
    msgs.retain(|(t, ..)| *t != genuine);
    msgs.push((genuine.clone(), b"garbage".to_vec(), true));
    let intruder = b.config_as(INTRUDER);
    let stop = Arc::new(AtomicBool::new(false));
    let flood = {
        let (stop, intruder, n) = (stop.clone(), intruder.clone(), v2.chunks.len() as u32);
        std::thread::spawn(move || {
            let mut c = Conn::connect(&intruder, "flood").unwrap();
            let deadline = Instant::now() + Duration::from_secs(120);
            let mut sent = 0u64;
            while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                let garbage: Vec<_> = (0..n)
                    .map(|i| (topics.chunk("lfw", 2, i), vec![i as u8; 64], false))
                    .collect();
                sent += garbage.len() as u64;
                c.publish_all(garbage, None).unwrap();
                std::thread::sleep(Duration::from_millis(20));
            }
            c.disconnect();
            sent
        })
    };
    publish_raw(&b, msgs, desired(device, 2, false));
    let st = wait_status(&b.config(), device, 120, "garbage dropped", |s| {
        s.target == Some(2) && s.counters.chunks_corrupt >= 1
    });
    assert_eq!(
        (st.state.as_str(), st.active),
        ("downloading", Some(1)),
        "{st:?}"
    );
    assert_ne!(st.failed_version, Some(2), "{st:?}");
    // The genuine chunk, published again by the publisher: the download completes.
    put(&b.config(), vec![good]);
    let st = wait_status(&b.config(), device, 180, "v2 active", |s| {
        s.active == Some(2)
    });
    stop.store(true, Ordering::Relaxed);
    let sent = flood.join().unwrap();
    assert!(sent > 0);
    assert_ne!(st.failed_version, Some(2), "{st:?}");
    eprintln!(
        "{kind:?}: {sent} garbage chunks, {} dropped by the device",
        st.counters.chunks_corrupt
    );
}

#[test]
fn garbage_on_chunk_topics_changes_nothing_on_mosquitto() {
    garbage_on_chunk_topics_changes_nothing(BrokerKind::Mosquitto);
}

#[test]
fn garbage_on_chunk_topics_changes_nothing_on_rumqttd() {
    garbage_on_chunk_topics_changes_nothing(BrokerKind::Rumqttd);
}

/// Another model (another signed manifest) published at the version a device has active, as a
/// mistaken or hostile publisher would: the device reports a conflict and keeps the model it
/// has, whose manifest its status names; it never counts the other as installed.
fn another_model_at_an_installed_version_is_a_conflict(kind: BrokerKind) {
    let f = fixture();
    let w = Scratch::new();
    let b = broker(kind, &w.join("broker"));
    let device = "cf-000";
    let conf = agent_config_on(&w.join("sim"), "cf", &b, SIM, "");
    let _agent = start_agent_with(&conf, &[], &["--simulate", "1"]);
    wait_fleet(&b.config(), 1);
    publish_ok(&b, &f.v1, &f.key(), &format!("device/{device}"));
    let st = wait_status(&b.config(), device, 120, "v1", |s| s.active == Some(1));
    let installed = st
        .manifest_sha256
        .clone()
        .expect("the status names the manifest");
    let manifest = std::fs::read(f.v1.join("manifest.json")).unwrap();
    assert_eq!(installed, kestrel_shared::protocol::sha256_hex(&manifest));

    let other = f.variant(&f.v1, 1, |m| m["training"]["note"] = "another model".into());
    let bundle = Bundle::from_dir(&other, &f.signing(), 128 * 1024).unwrap();
    publish_raw(
        &b,
        bundle.messages(&Topics::default()),
        desired(device, 1, false),
    );
    let st = wait_status(&b.config(), device, 120, "the conflict reported", |s| {
        s.refused
            .as_deref()
            .is_some_and(|r| r.contains("conflict: lfw v1"))
    });
    assert_eq!(
        (st.active, st.manifest_sha256.as_deref()),
        (Some(1), Some(installed.as_str())),
        "{st:?}"
    );
}

#[test]
fn another_model_at_an_installed_version_is_a_conflict_on_mosquitto() {
    another_model_at_an_installed_version_is_a_conflict(BrokerKind::Mosquitto);
}

#[test]
fn another_model_at_an_installed_version_is_a_conflict_on_rumqttd() {
    another_model_at_an_installed_version_is_a_conflict(BrokerKind::Rumqttd);
}

/// A password for a broker on another machine over plain MQTT is refused before anything is
/// sent, by the trainer and by the agent, naming the URL and the flag that allows it; the
/// URL's host is reserved (`.invalid`), so nothing is ever looked up or contacted.
#[test]
fn passwords_never_cross_plain_mqtt_to_another_machine() {
    let w = Scratch::new();
    let pw = w.join("pw");
    std::fs::write(&pw, "secret\n").unwrap();
    let url = "mqtt://broker.kestrel-test.invalid:1883";
    let o = run(
        "trainer",
        &[
            "status",
            "--broker",
            url,
            "--username",
            "ops",
            "--password-file",
            &s(&pw),
        ],
    );
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(
        err.contains(url)
            && err.contains("--insecure-plain-password")
            && err.contains("plain MQTT"),
        "{err}"
    );
    let dir = w.join("agent");
    std::fs::create_dir_all(&dir).unwrap();
    let conf: PathBuf = dir.join("agent.toml");
    std::fs::write(
        &conf,
        format!(
            "device_id = \"pi-pw\"\nstore = \"store\"\ntrusted_keys = [\"{}\"]\n[broker]\n\
             url = \"{url}\"\nusername = \"pi-pw\"\npassword_file = \"{}\"\n",
            s(&fixture().keys.join("kestrel.pub")),
            s(&pw)
        ),
    )
    .unwrap();
    let o = run("edge-agent", &["run", "--config", &s(&conf)]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(
        err.contains(url) && err.contains("insecure_plain_password"),
        "{err}"
    );
}
