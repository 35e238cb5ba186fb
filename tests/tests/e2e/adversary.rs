//! The fleet against an adversary, on Mosquitto with the shipped ACL (every device logs in as
//! itself and may write only its own topics) and on the embedded broker:
//! - a **compromised device**: its own credentials, its own topics, payloads that lie;
//! - a **broker-level attacker**: write access to any topic (a stolen trainer password, or the
//!   broker itself), but none of the fleet's signing keys.
//!
//! Each test is one attack of docs/protocol.md's threat table and asserts its outcome.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kestrel_fleet::rollout::command::{Action, Command as RolloutCommand};
use kestrel_fleet::{Bundle, Conn};
use kestrel_shared::capture::Capture;
use kestrel_shared::mqtt::BrokerConfig;
use kestrel_shared::protocol::{
    Class, DEFAULT_VALIDITY_S, Desired, LatencyStats, SignedDesired, Status, Target,
};
use kestrel_shared::wire::{CaptureReason, DeviceState};
use kestrel_shared::{issued_now, now_unix};
use kestrel_tests::fleet::{
    Broker, BrokerKind, Proc, agent_config_on, desired, fixture, publish, publish_ok, publish_raw,
    rollout_command, signing_key, start_agent_with, wait_fleet, wait_status,
};
use kestrel_tests::{Scratch, dataset, run, s, stderr, stdout};
use serde_json::Value;

/// The compromised device's id (and broker user).
pub(super) const EVIL: &str = "pi-evil";
/// The simulated honest fleet's broker user: simulated devices share one process and one login,
/// so on the ACL'd broker they log in as a user allowed the whole prefix. The attacker does not.
pub(super) const SIM: &str = "fleet-sim";
/// A broker-level attacker's user: write access to every topic.
pub(super) const INTRUDER: &str = "intruder";

pub(super) fn broker(kind: BrokerKind, dir: &Path) -> Broker {
    let kind = match kind {
        BrokerKind::Mosquitto => BrokerKind::MosquittoAcl,
        k => k,
    };
    Broker::start_with_acl(
        kind,
        dir,
        &[SIM, EVIL, INTRUDER, "pi-new", "pi-upd", "pi-budget"],
        &format!(
            "user {SIM}\ntopic readwrite kestrel/#\nuser {INTRUDER}\ntopic readwrite kestrel/#\n\
             user pi-new\ntopic read kestrel/groups/late/desired\n"
        ),
    )
}

/// A status of `device` as an agent would publish it.
fn status(device: &str, active: Option<u64>, failed: Option<u64>) -> Vec<u8> {
    serde_json::to_vec(&Status {
        device: device.into(),
        groups: vec!["all".into()],
        state: DeviceState::Idle,
        model: active.map(|_| "lfw".into()),
        active,
        previous: None,
        target: None,
        manifest_sha256: None,
        progress: None,
        last_error: None,
        failed_version: failed,
        latency: LatencyStats::default(),
        updated: "2026-12-04T00:00:00Z".into(),
        started: 0,
        seq: 0,
        source: None,
        refused: None,
        keys_version: None,
        shadow: None,
        captures: None,
        counters: Default::default(),
    })
    .unwrap()
}

/// Publishes messages as `user` (on its own connection, closed after).
pub(super) fn put(cfg: &BrokerConfig, msgs: Vec<(String, Vec<u8>, bool)>) {
    let mut c = Conn::connect(cfg, "attacker").unwrap();
    c.publish_all(msgs, None).unwrap();
    c.disconnect();
}

pub(super) fn plan(dir: &Path, name: &str, body: &str) -> String {
    std::fs::create_dir_all(dir).unwrap();
    let p = dir.join(format!("{name}.toml"));
    std::fs::write(&p, format!("name = \"{name}\"\n{body}")).unwrap();
    s(&p)
}

/// A fleet of `n` simulated devices (`<prefix>-000`...) on `b`, all reported.
pub(super) fn sim_fleet(b: &Broker, dir: &Path, prefix: &str, n: usize) -> Proc {
    let conf = agent_config_on(&dir.join("sim"), prefix, b, SIM, "");
    let p = start_agent_with(&conf, &[], &["--simulate", &n.to_string()]);
    wait_fleet(&b.config(), n);
    p
}

/// One compromised device, logged in as itself, claims for every other device of the fleet
/// (on its own status and quality topics, the only ones it may write) that the failing model is
/// active, while that model is rolled out: the canary's failure aborts the rollout all the
/// same, and no device outside the canary ever sees the model.
fn a_compromised_device_cannot_promote_a_failing_model(kind: BrokerKind) {
    let f = fixture();
    let w = Scratch::new();
    let b = broker(kind, &w.join("broker"));
    let _fleet = sim_fleet(&b, w.tmp.path(), "ab", 10);
    let o = rollout_command(
        &b,
        &f.v1,
        &plan(
            w.tmp.path(),
            "good",
            "[[phases]]\nname = \"all\"\npercent = 100\n",
        ),
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));

    let others: Vec<String> = (0..10).map(|i| format!("ab-{i:03}")).collect();
    let evil = b.config_as(EVIL);
    let topics = kestrel_shared::topics::Topics::default();
    put(
        &evil,
        vec![(topics.status(EVIL), status(EVIL, Some(1), None), true)],
    );
    let stop = Arc::new(AtomicBool::new(false));
    let liar = {
        let (stop, evil, others) = (stop.clone(), evil.clone(), others.clone());
        std::thread::spawn(move || {
            let mut c = Conn::connect(&evil, "liar").unwrap();
            let (mine, quality) = (topics.status(EVIL), topics.quality(EVIL));
            let mut sent = 0;
            while !stop.load(Ordering::Relaxed) {
                let mut msgs = Vec::new();
                for d in &others {
                    msgs.push((mine.clone(), status(d, Some(9), None), false));
                    let q = serde_json::json!({"device": d, "model": "lfw", "version": 9,
                        "window": null, "updated": "2026-12-04T00:00:00Z"});
                    msgs.push((quality.clone(), q.to_string().into_bytes(), false));
                }
                sent += msgs.len();
                c.publish_all(msgs, None).unwrap();
                std::thread::sleep(Duration::from_millis(50));
            }
            c.disconnect();
            sent
        })
    };
    let bad = f.failing(9);
    let phases = "[[phases]]\nname = \"canary\"\npercent = 10\ntimeout_s = 120\n\
                  [[phases]]\nname = \"rest\"\npercent = 100\ntimeout_s = 120\n";
    let o = rollout_command(&b, &bad, &plan(w.tmp.path(), "bad", phases))
        .arg("--json")
        .output()
        .unwrap();
    stop.store(true, Ordering::Relaxed);
    let lies = liar.join().unwrap();
    assert!(lies > 0);
    assert!(
        !o.status.success(),
        "the rollout must abort: {}",
        stderr(&o)
    );
    let c: Value =
        serde_json::from_str(stdout(&o).trim()).unwrap_or_else(|e| panic!("{e}: {}", stderr(&o)));
    assert_eq!(c["state"]["state"], "aborted", "{c}");
    let reason = c["state"]["reason"].as_str().unwrap();
    assert!(reason.contains("phase 0 `canary`"), "{reason}");
    assert!(
        stderr(&o).contains(&format!("skipped a message from device {EVIL}")),
        "the forgeries are named: {}",
        stderr(&o)
    );
    for d in c["devices"].as_object().unwrap().values() {
        let id = d["id"].as_str().unwrap();
        if d["phase"] != 0 {
            assert_eq!(d["state"]["state"], "waiting", "{id}: {d}");
            let store = w.join("sim/store").join(id);
            let journal = std::fs::read_to_string(store.join("state.json")).unwrap_or_default();
            assert!(
                !journal.contains("\"version\": 9"),
                "{id} saw v9: {journal}"
            );
            assert!(!store.join("versions/9").exists() && !store.join("downloads/9").exists());
        } else {
            assert_ne!(d["state"]["state"], "active", "{id}: {d}");
        }
    }
}

#[test]
fn a_compromised_device_cannot_promote_a_failing_model_on_mosquitto() {
    a_compromised_device_cannot_promote_a_failing_model(BrokerKind::Mosquitto);
}

#[test]
fn a_compromised_device_cannot_promote_a_failing_model_on_rumqttd() {
    a_compromised_device_cannot_promote_a_failing_model(BrokerKind::Rumqttd);
}

/// A retained status that is valid JSON but no status (`{"device":"x"}`), another that is no
/// JSON, and a quality report of garbage, all on the compromised device's own topics: `trainer
/// status` lists the rest of the fleet and names what it skipped, and a rollout completes.
fn garbage_on_the_broker_is_skipped(kind: BrokerKind) {
    let f = fixture();
    let w = Scratch::new();
    let b = broker(kind, &w.join("broker"));
    let _fleet = sim_fleet(&b, w.tmp.path(), "gs", 3);
    let topics = kestrel_shared::topics::Topics::default();
    put(
        &b.config_as(EVIL),
        vec![
            (topics.status(EVIL), br#"{"device":"x"}"#.to_vec(), true),
            (topics.quality(EVIL), b"\xff\x00 not json".to_vec(), true),
        ],
    );
    let mut args = vec!["status".to_string()];
    args.extend(b.cli_args());
    args.push("--json".into());
    let o = run("trainer", &args);
    assert!(o.status.success(), "{}", stderr(&o));
    let ids: Vec<String> = stdout(&o)
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["device"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(ids, ["gs-000", "gs-001", "gs-002"]);
    assert!(stderr(&o).contains(&topics.status(EVIL)), "{}", stderr(&o));

    let o = rollout_command(
        &b,
        &f.v1,
        &plan(
            w.tmp.path(),
            "g",
            "[[phases]]\nname = \"all\"\npercent = 100\n",
        ),
    )
    .arg("--json")
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let c: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(c["state"]["state"], "completed", "{c}");
    assert_eq!(c["devices"].as_object().unwrap().len(), 3);
}

#[test]
fn garbage_on_the_broker_is_skipped_on_mosquitto() {
    garbage_on_the_broker_is_skipped(BrokerKind::Mosquitto);
}

#[test]
fn garbage_on_the_broker_is_skipped_on_rumqttd() {
    garbage_on_the_broker_is_skipped(BrokerKind::Rumqttd);
}

/// The device's events (`P/devices/<id>/events`), collected by a thread until one of kind `until`.
fn watch_events(
    cfg: BrokerConfig,
    device: &str,
    until: &'static str,
    within: Duration,
) -> std::thread::JoinHandle<Vec<Value>> {
    let mut c = Conn::connect(&cfg, "events").unwrap();
    let topic = c.topics.events(device);
    c.subscribe(&topic).unwrap();
    std::thread::spawn(move || {
        let deadline = Instant::now() + within;
        let mut seen: Vec<Value> = Vec::new();
        // Until the event the test waits for has arrived (the status that shows its outcome can
        // come first: the two are separate messages).
        while Instant::now() < deadline && !seen.iter().any(|e| e["kind"] == until) {
            if let Some((t, p)) = c.recv(Duration::from_millis(100)).unwrap()
                && t == topic
            {
                seen.push(serde_json::from_slice(&p).unwrap());
            }
        }
        c.disconnect();
        seen
    })
}

/// A broker-level attacker replaces the device's desired state with one signed by a key the
/// device does not trust while a signed update downloads: the forgery is reported and changes
/// nothing, and the update completes.
fn a_forged_desired_state_does_not_cancel_an_update(kind: BrokerKind) {
    let f = fixture();
    let w = Scratch::new();
    let b = broker(kind, &w.join("broker"));
    let device = "pi-upd";
    let conf = agent_config_on(&w.join(device), device, &b, device, "");
    let _agent = start_agent_with(&conf, &[], &[]);
    publish_ok(&b, &f.v1, &f.key(), &format!("device/{device}"));
    wait_status(&b.config(), device, 120, "v1 active", |s| {
        s.active == Some(1) && s.state == DeviceState::Idle
    });

    let events = watch_events(b.config(), device, "active", Duration::from_secs(240));
    // The signed update: its desired state and offer now, its chunks once the forgery is in.
    let topics = kestrel_shared::topics::Topics::default();
    let bundle = Bundle::from_dir(&f.f32_v6, &f.signing(), 128 * 1024).unwrap();
    let (offer, chunks): (Vec<_>, Vec<_>) = bundle
        .messages(&topics)
        .into_iter()
        .partition(|(t, _, _)| t.ends_with("/manifest"));
    publish_raw(&b, offer, desired(device, 6, false));
    wait_status(&b.config(), device, 60, "downloading v6", |s| {
        s.state == DeviceState::Downloading && s.target == Some(6)
    });
    let rogue = signing_key(&f.rogue_keys);
    let payload =
        serde_json::to_vec(&SignedDesired::new(&rogue, &desired(device, 99, false))).unwrap();
    put(
        &b.config_as(INTRUDER),
        vec![(
            topics.desired(&Target::Device(device.into())),
            payload,
            true,
        )],
    );
    wait_status(&b.config(), device, 60, "the forgery refused", |s| {
        s.refused
            .as_deref()
            .is_some_and(|r| r.contains("unknown key"))
    });
    put(&b.config(), chunks);
    let st = wait_status(&b.config(), device, 180, "v6 active", |s| {
        s.active == Some(6) && s.state == DeviceState::Idle
    });
    let events = events.join().unwrap();
    let kinds: Vec<&str> = events.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    let at = |k: &str| {
        kinds
            .iter()
            .position(|x| *x == k)
            .unwrap_or_else(|| panic!("no {k}: {kinds:?}"))
    };
    assert!(
        at("downloading") < at("refused") && at("refused") < at("active"),
        "the forgery came during the download: {kinds:?}"
    );
    assert!(
        st.refused.as_deref().unwrap().contains("unknown key"),
        "{st:?}"
    );
    assert_eq!((st.previous, st.failed_version), (Some(1), None), "{st:?}");
    assert!(!kinds.contains(&"rejected"), "{kinds:?}");
}

#[test]
fn a_forged_desired_state_does_not_cancel_an_update_on_mosquitto() {
    a_forged_desired_state_does_not_cancel_an_update(BrokerKind::Mosquitto);
}

#[test]
fn a_forged_desired_state_does_not_cancel_an_update_on_rumqttd() {
    a_forged_desired_state_does_not_cancel_an_update(BrokerKind::Rumqttd);
}

/// `trainer publish` signs a 7-day expiry by default; a state recorded by a broker-level
/// attacker and shown again to a device that joins after it expired is refused, and the device
/// installs nothing (without the expiry it would install the superseded model).
fn a_new_device_refuses_a_recorded_old_state(kind: BrokerKind) {
    let f = fixture();
    let w = Scratch::new();
    let b = broker(kind, &w.join("broker"));
    let topic = kestrel_shared::topics::Topics::default().desired(&Target::Group("late".into()));
    let o = publish(&b, &f.v1, &f.key(), "group/late", &["--expires-in", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mut c = Conn::connect(&b.config_as(INTRUDER), "recorder").unwrap();
    let recorded = c.retained(&topic, Duration::from_millis(400)).unwrap()[&topic].clone();
    c.disconnect();
    let old: Desired = serde_json::from_str(
        &serde_json::from_slice::<SignedDesired>(&recorded)
            .unwrap()
            .body,
    )
    .unwrap();
    publish_ok(&b, &f.v2, &f.key(), "group/late");
    // The default: 7 days from now.
    let mut c = Conn::connect(&b.config(), "reader").unwrap();
    let current = c.retained(&topic, Duration::from_millis(400)).unwrap()[&topic].clone();
    c.disconnect();
    let v2: Desired = serde_json::from_str(
        &serde_json::from_slice::<SignedDesired>(&current)
            .unwrap()
            .body,
    )
    .unwrap();
    let expires = v2.expires.expect("an expiry by default");
    assert!(
        expires.abs_diff(now_unix() + DEFAULT_VALIDITY_S) < 120,
        "{v2:?}"
    );

    put(&b.config_as(INTRUDER), vec![(topic, recorded, true)]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while now_unix() < old.expires.unwrap() {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(100));
    }
    let device = "pi-new";
    let conf = agent_config_on(&w.join(device), device, &b, device, "");
    let text = std::fs::read_to_string(&conf)
        .unwrap()
        .replace("groups = [\"all\"]", "groups = [\"late\"]");
    std::fs::write(&conf, text).unwrap();
    let _agent = start_agent_with(&conf, &[], &[]);
    let st = wait_status(&b.config(), device, 60, "the recorded state refused", |s| {
        s.refused.as_deref().is_some_and(|r| r.contains("expired"))
    });
    assert_eq!((st.active, st.target), (None, None), "{st:?}");
    assert!(!w.join(device).join("store/versions/1").exists());
}

#[test]
fn a_new_device_refuses_a_recorded_old_state_on_mosquitto() {
    a_new_device_refuses_a_recorded_old_state(BrokerKind::Mosquitto);
}

#[test]
fn a_new_device_refuses_a_recorded_old_state_on_rumqttd() {
    a_new_device_refuses_a_recorded_old_state(BrokerKind::Rumqttd);
}

/// An operator's signed pause, recorded and replayed (within its freshness window) after a
/// resume, changes nothing: the controller refuses it by its nonce.
#[test]
fn a_replayed_command_changes_nothing() {
    let f = fixture();
    let w = Scratch::new();
    let b = broker(BrokerKind::Mosquitto, &w.join("broker"));
    let _fleet = sim_fleet(&b, w.tmp.path(), "cm", 2);
    let phases = "[[phases]]\nname = \"all\"\npercent = 100\nsoak_s = 3600\n";
    let mut rollout = rollout_command(&b, &f.v1, &plan(w.tmp.path(), "cmd", phases))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let log = Arc::new(std::sync::Mutex::new(String::new()));
    let reader = {
        let (log, err) = (log.clone(), rollout.stderr.take().unwrap());
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
                log.lock().unwrap().push_str(&(line + "\n"));
            }
        })
    };
    let status = |b: &Broker| -> Value {
        let mut a = vec!["rollout".to_string(), "status".into()];
        a.extend(b.cli_args());
        a.extend(["--name".into(), "cmd".into(), "--json".into()]);
        let o = run("trainer", &a);
        serde_json::from_str(stdout(&o).trim()).unwrap_or(Value::Null)
    };
    let wait = |what: &str, done: &dyn Fn(&Value) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let c = status(&b);
            if done(&c) {
                return c;
            }
            assert!(Instant::now() < deadline, "{what}: {c}");
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    wait("the rollout running", &|c| c["state"]["state"] == "running");
    let key = f.signing();
    let send = |action: Action| {
        let cmd = RolloutCommand {
            rollout: "cmd".into(),
            action,
            reason: "test".into(),
            by: "adversary-test".into(),
            issued: issued_now(),
            nonce: RolloutCommand::new_nonce(),
        };
        let payload = serde_json::to_vec(&cmd.sign(&key)).unwrap();
        let topic = kestrel_shared::topics::Topics::default().rollout_command("cmd");
        put(&b.config(), vec![(topic.clone(), payload.clone(), false)]);
        (topic, payload)
    };
    let (topic, recorded_pause) = send(Action::Pause);
    wait("paused", &|c| c["paused"] == true);
    send(Action::Resume);
    wait("resumed", &|c| {
        c["state"]["state"] == "running" && c.get("paused").is_none_or(|p| p == false)
    });
    put(&b.config_as(INTRUDER), vec![(topic, recorded_pause, false)]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !log.lock().unwrap().contains("command refused: replayed") {
        assert!(Instant::now() < deadline, "{}", log.lock().unwrap());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(status(&b).get("paused").is_none_or(|p| p == false));
    send(Action::Abort);
    assert!(!rollout.wait().unwrap().success());
    reader.join().unwrap();
    let log = log.lock().unwrap().clone();
    let c = status(&b);
    assert!(
        c["state"]["reason"]
            .as_str()
            .unwrap()
            .contains("aborted by adversary-test"),
        "{c}"
    );
    assert_eq!(log.matches("Pause requested").count(), 1, "{log}");
}

/// The agent's budgets: a message over the broker's limit never reaches it (it stays
/// connected: one connection in its log), a request image of 4096x4096 16-bit RGB (a
/// decompression bomb of ~100 KB) is refused within the device's decode limits (peak RSS under
/// 200 MB), request ids that are not names get no reply, and a flood of requests keeps the
/// outbox under its disk budget.
fn the_agent_keeps_its_budgets(kind: BrokerKind) {
    let f = fixture();
    let w = Scratch::new();
    let b = broker(kind, &w.join("broker"));
    let device = "pi-budget";
    let conf = agent_config_on(
        &w.join(device),
        device,
        &b,
        device,
        "max_outbox_bytes = 20000",
    );
    let mut agent = start_agent_with(&conf, &[], &[]);
    publish_ok(&b, &f.v1, &f.key(), &format!("device/{device}"));
    wait_status(&b.config(), device, 120, "v1 active", |s| {
        s.active == Some(1) && s.state == DeviceState::Idle
    });
    let topics = kestrel_shared::topics::Topics::default();
    let intruder = b.config_as(INTRUDER);

    // Over the broker's payload limit (2 MiB): refused at the publisher, never delivered (the
    // publisher's own client is told to allow it).
    let mut big = intruder.clone();
    big.max_packet_bytes = 8 << 20;
    if let Ok(mut c) = Conn::connect(&big, "big") {
        let _ = c.publish_all(
            vec![(topics.infer(device, "big"), vec![0u8; 3 << 20], false)],
            None,
        );
    }
    // A decompression bomb, and a request id that is no name.
    let mut bomb = Vec::new();
    image::ImageBuffer::<image::Rgb<u16>, Vec<u16>>::new(4096, 4096)
        .write_to(
            &mut std::io::Cursor::new(&mut bomb),
            image::ImageFormat::Png,
        )
        .unwrap();
    assert!(bomb.len() < 1 << 20, "{}", bomb.len());
    let face =
        std::fs::read(Path::new(&dataset("lfw", "imagefolder")).join("face/000.png")).unwrap();
    let mut c = Conn::connect(&intruder, "flood").unwrap();
    c.subscribe(&topics.result_filter(device)).unwrap();
    let long_id = format!("kestrel/devices/{device}/infer/{}", "x".repeat(300));
    c.publish_all(
        vec![
            (long_id, face.clone(), false),
            (topics.infer(device, "bomb"), bomb, false),
        ],
        None,
    )
    .unwrap();
    let mut replies = std::collections::BTreeMap::new();
    let take = |c: &mut Conn, replies: &mut std::collections::BTreeMap<String, Value>| {
        if let Some((t, p)) = c.recv(Duration::from_millis(20)).unwrap() {
            let r: Value = serde_json::from_slice(&p).unwrap();
            replies.insert(t.rsplit('/').next().unwrap().to_string(), r);
        }
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !replies.contains_key("bomb") {
        assert!(Instant::now() < deadline, "no reply to the bomb");
        take(&mut c, &mut replies);
    }
    let bomb_error = replies["bomb"]["error"].as_str().unwrap().to_lowercase();
    assert!(bomb_error.contains("limit"), "{bomb_error}");
    // 300 requests at once: most are answered "busy" at once, and the replies wait in the outbox.
    let flood: Vec<_> = (0..300)
        .map(|i| (topics.infer(device, &format!("f{i}")), face.clone(), false))
        .collect();
    c.publish_all(flood, None).unwrap();
    let outbox = w.join(device).join("store/outbox");
    let mut most = 0u64;
    let deadline = Instant::now() + Duration::from_secs(120);
    while replies.len() < 51 {
        assert!(Instant::now() < deadline, "{} replies", replies.len());
        most = most.max(dir_bytes(&outbox));
        take(&mut c, &mut replies);
    }
    c.disconnect();
    assert!(
        most <= 20000 + 4096,
        "outbox held {most} bytes, budget 20000"
    );
    assert!(!replies.contains_key("big") && !replies.keys().any(|k| k.len() > 64));
    let hwm = peak_rss_mb(agent.child.id());
    assert!(hwm < 200.0, "agent peak RSS {hwm} MB");
    assert!(agent.is_running());
    let log = agent.output();
    assert_eq!(log.matches("connected to").count(), 1, "reconnected: {log}");
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok()?.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

fn peak_rss_mb(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: f64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb / 1024.0
}

#[test]
fn the_agent_keeps_its_budgets_on_mosquitto() {
    the_agent_keeps_its_budgets(BrokerKind::Mosquitto);
}

#[test]
fn the_agent_keeps_its_budgets_on_rumqttd() {
    the_agent_keeps_its_budgets(BrokerKind::Rumqttd);
}

/// Captures from the compromised device that say they are another device's, or take another
/// capture's id, are refused by `trainer collect`; its own captures are stored under its own
/// name, and `trainer label --export` writes one file per row.
fn collect_takes_the_device_from_the_topic(kind: BrokerKind) {
    let w = Scratch::new();
    let b = broker(kind, &w.join("broker"));
    let table = w.join("captures");
    // A session first, so that the broker keeps what is published while collect is away.
    let collect = |idle: &str| {
        let mut a = vec!["collect".to_string()];
        a.extend(b.cli_args());
        a.extend([
            "--out".into(),
            s(&table),
            "--client-id".into(),
            "col".into(),
        ]);
        a.extend(["--until-idle".into(), idle.into(), "--json".into()]);
        run("trainer", &a)
    };
    let o = collect("1");
    assert!(o.status.success(), "{}", stderr(&o));
    let face =
        std::fs::read(Path::new(&dataset("lfw", "imagefolder")).join("face/000.png")).unwrap();
    let capture = |device: &str, id: &str| {
        serde_json::to_vec(&Capture {
            id: id.into(),
            device: device.into(),
            request: "r".into(),
            model: "lfw".into(),
            version: 1,
            top: vec![Class {
                class: 0,
                label: "face".into(),
                score: 0.9,
            }],
            reason: CaptureReason::Random,
            captured_at: "2026-12-04T00:00:00Z".into(),
            content: Capture::encode_content(&face),
        })
        .unwrap()
    };
    let topics = kestrel_shared::topics::Topics::default();
    put(
        &b.config_as(EVIL),
        vec![
            (
                topics.capture(EVIL, "1-1"),
                capture("pi-good", "1-1"),
                false,
            ),
            (topics.capture(EVIL, "1-2"), capture(EVIL, "9-9"), false),
            (topics.capture(EVIL, "1-3"), capture(EVIL, "1-3"), false),
            (
                topics.capture(EVIL, "1-4"),
                capture(&"d".repeat(300), "1-4"),
                false,
            ),
        ],
    );
    let o = collect("2");
    assert!(o.status.success(), "{}", stderr(&o));
    let out: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(out["stored"], 1, "{out}: {}", stderr(&o));
    assert_eq!(
        stderr(&o).matches("speaks only for itself").count(),
        3,
        "{}",
        stderr(&o)
    );
    let todo = w.join("todo.csv");
    let o = run(
        "trainer",
        &["label", "--table", &s(&table), "--export", &s(&todo)],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&todo).unwrap();
    let rows: Vec<&str> = text.lines().skip(1).collect();
    assert_eq!(rows.len(), 1, "{text}");
    assert!(rows[0].starts_with(&format!("{EVIL}/1-3,")), "{text}");
    assert!(
        w.join(&format!("todo-images/{EVIL}/1-3.png")).is_file(),
        "{text}"
    );
}

#[test]
fn collect_takes_the_device_from_the_topic_on_mosquitto() {
    collect_takes_the_device_from_the_topic(BrokerKind::Mosquitto);
}

#[test]
fn collect_takes_the_device_from_the_topic_on_rumqttd() {
    collect_takes_the_device_from_the_topic(BrokerKind::Rumqttd);
}
