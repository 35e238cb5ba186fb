//! Fleet rollouts with the real binaries: `trainer rollout` against simulated devices
//! (`edge-agent run --simulate N`, each with its own connection, store and update machine) on
//! both brokers (the embedded rumqttd and Mosquitto), a killed controller and a restarted broker.
//! TLS, passwords and the ACL are in secure_broker.rs.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use kestrel_fleet::statuses;
use kestrel_tests::fleet::{
    Broker, BrokerKind, Proc, agent_config, fixture, rollout_command, start_agent_with, wait_fleet,
    write_plan,
};
use kestrel_tests::{run, stderr, stdout};
use serde_json::Value;

fn rollout_cmd(b: &Broker, art: &Path, plan: &str) -> Command {
    let mut c = rollout_command(b, art, plan);
    c.arg("--json");
    c
}

const THREE_PHASES: &str = r#"
[[phases]]
name = "canary"
percent = 5
timeout_s = 120
[[phases]]
name = "half"
percent = 50
failure = 0.05
timeout_s = 120
[[phases]]
name = "all"
percent = 100
failure = 0.05
timeout_s = 120
"#;

#[test]
fn hundred_simulated_devices_three_phases_on_mosquitto() {
    hundred_simulated_devices_three_phases(BrokerKind::Mosquitto);
}

#[test]
fn hundred_simulated_devices_three_phases_on_rumqttd() {
    hundred_simulated_devices_three_phases(BrokerKind::Rumqttd);
}

fn hundred_simulated_devices_three_phases(kind: BrokerKind) {
    let f = fixture();
    let dir = f.dir.join(format!("hundred-{kind:?}"));
    let b = Broker::start(kind, &dir.join("broker"));
    let cfg = b.config();
    let conf = agent_config(&dir.join("sim"), "sim", &b.url(), &f.keys, "");
    let mut fleet = start_agent_with(&conf, &[], &["--simulate", "100"]);
    wait_fleet(&cfg, 100);
    let plan = write_plan(&dir, "hundred", THREE_PHASES);
    let start = Instant::now();
    let o = rollout_cmd(&b, &f.v1, &plan).output().unwrap();
    let secs = start.elapsed().as_secs_f64();
    assert!(o.status.success(), "{}", stderr(&o));
    let c: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(c["state"]["state"], "completed");
    let all = statuses(&cfg, None).unwrap();
    assert_eq!(all.len(), 100);
    assert!(
        all.iter()
            .all(|s| s.active == Some(1) && s.model.as_deref() == Some("lfw")),
        "{all:?}"
    );
    // Phases were 5, 45 and 50 devices.
    let mut per_phase = [0; 3];
    for d in c["devices"].as_object().unwrap().values() {
        per_phase[d["phase"].as_u64().unwrap() as usize] += 1;
    }
    assert_eq!(per_phase, [5, 45, 50]);
    // Bytes moved, per device: every distinct piece of v1 (the devices held none).
    let m: kestrel_shared::manifest::Manifest =
        serde_json::from_value(kestrel_tests::read_json(&f.v1.join("manifest.json"))).unwrap();
    let mut pieces = kestrel_shared::protocol::pieces(&m);
    pieces.sort();
    pieces.dedup();
    let need: u64 = pieces.iter().map(|(_, size)| size).sum();
    assert_eq!(
        c["artifact_bytes"].as_u64(),
        Some(need),
        "{}",
        c["artifact_bytes"]
    );
    for d in c["devices"].as_object().unwrap().values() {
        let got = d["bytes_fetched"].as_u64().unwrap();
        assert!((need..=need + need / 2).contains(&got), "{d}: needs {need}");
    }
    eprintln!("100-device rollout took {secs:.1} s");
    assert!(fleet.is_running());
}

#[test]
fn failing_canary_aborts_on_mosquitto() {
    failing_canary_aborts_and_only_the_canary_ever_sees_the_bad_model(BrokerKind::Mosquitto);
}

/// The embedded broker does not resend retained statuses to an existing subscription: the
/// controller once waited 60 s there for a canary that had never left v1, then failed.
#[test]
fn failing_canary_aborts_on_rumqttd() {
    failing_canary_aborts_and_only_the_canary_ever_sees_the_bad_model(BrokerKind::Rumqttd);
}

fn failing_canary_aborts_and_only_the_canary_ever_sees_the_bad_model(kind: BrokerKind) {
    let f = fixture();
    let dir = f.dir.join(format!("abort-{kind:?}"));
    let b = Broker::start(kind, &dir.join("broker"));
    let cfg = b.config();
    let conf = agent_config(&dir.join("sim"), "ab", &b.url(), &f.keys, "");
    let _fleet = start_agent_with(&conf, &[], &["--simulate", "20"]);
    wait_fleet(&cfg, 20);
    // Everyone on v1 first.
    let plan = write_plan(&dir, "good", "[[phases]]\nname = \"all\"\npercent = 100\n");
    let o = rollout_cmd(&b, &f.v1, &plan).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));

    // v9: golden outputs that this model does not produce.
    let bad = f.failing(9);
    let plan = write_plan(
        &dir,
        "bad",
        THREE_PHASES
            .replace("percent = 5\n", "percent = 10\n")
            .as_str(),
    );
    let o = rollout_cmd(&b, &bad, &plan).output().unwrap();
    assert!(
        !o.status.success(),
        "the rollout must abort: {}",
        stderr(&o)
    );
    let c: Value =
        serde_json::from_str(stdout(&o).trim()).unwrap_or_else(|e| panic!("{e}: {}", stderr(&o)));
    assert_eq!(c["state"]["state"], "aborted", "{c}");
    assert!(
        c["state"]["reason"]
            .as_str()
            .unwrap()
            .contains("phase 0 `canary`")
    );
    let canary: Vec<String> = c["devices"]
        .as_object()
        .unwrap()
        .values()
        .filter(|d| d["phase"] == 0)
        .map(|d| d["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(canary.len(), 2);
    let failed = canary
        .iter()
        .filter(|d| c["devices"][d.as_str()]["state"]["state"] == "failed")
        .count();
    assert!(failed >= 1, "{c}");
    for s in statuses(&cfg, None).unwrap() {
        assert_eq!(s.active, Some(1), "{} must be on v1", s.device);
        let store = dir.join("sim/store").join(&s.device);
        let journal = std::fs::read_to_string(store.join("state.json")).unwrap();
        if canary.contains(&s.device) {
            // The first failure aborts: a canary device still installing then is sent back,
            // and may fail its own health check before or after the controller's wait for it
            // (its v1 status from before it began v9 can end that wait).
            let state = &c["devices"][&s.device]["state"]["state"];
            if s.failed_version == Some(9) {
                assert!(
                    state == "failed" || state == "rolled-back",
                    "{}: {state}",
                    s.device
                );
                assert!(
                    s.last_error
                        .as_deref()
                        .unwrap()
                        .contains("health check failed")
                );
            } else {
                assert_eq!(state, "rolled-back", "{}", s.device);
            }
        } else {
            assert_eq!(s.failed_version, None, "{}", s.device);
            assert!(
                !journal.contains("\"version\": 9"),
                "{} saw v9: {journal}",
                s.device
            );
            assert!(!store.join("versions/9").exists() && !store.join("downloads/9").exists());
        }
    }
    // The abort is visible in `trainer rollout status`.
    let o = run(
        "trainer",
        &["rollout", "status", "--broker", &b.url(), "--name", "bad"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("aborted: phase 0 `canary`"),
        "{}",
        stdout(&o)
    );
}

#[test]
fn controller_killed_mid_rollout_resumes_on_mosquitto() {
    controller_killed_mid_rollout_resumes_and_completes(BrokerKind::Mosquitto);
}

#[test]
fn controller_killed_mid_rollout_resumes_on_rumqttd() {
    controller_killed_mid_rollout_resumes_and_completes(BrokerKind::Rumqttd);
}

fn controller_killed_mid_rollout_resumes_and_completes(kind: BrokerKind) {
    let f = fixture();
    let dir = f.dir.join(format!("resume-{kind:?}"));
    let b = Broker::start(kind, &dir.join("broker"));
    let cfg = b.config();
    let conf = agent_config(&dir.join("sim"), "rs", &b.url(), &f.keys, "");
    let _fleet = start_agent_with(&conf, &[], &["--simulate", "10"]);
    wait_fleet(&cfg, 10);
    // Soak time between phases keeps the rollout mid-way long enough to kill it there.
    let plan = write_plan(
        &dir,
        "resume",
        "[[phases]]\nname = \"first\"\npercent = 30\nsoak_s = 2\n[[phases]]\nname = \"second\"\npercent = 60\nsoak_s = 30\n[[phases]]\nname = \"rest\"\npercent = 100\n",
    );
    let ctl = Proc::spawn(
        &mut rollout_cmd(&b, &f.v1, &plan),
        &dir.join("controller-1.log"),
    );
    // Wait until the second phase has started (retained controller state), then SIGKILL.
    wait_phase(&b, "resume", 1, &ctl);
    ctl.kill();
    let active_before = statuses(&cfg, None)
        .unwrap()
        .iter()
        .filter(|s| s.active == Some(1))
        .count();
    assert!(active_before < 10, "killed mid-way, not at the end");
    let o = rollout_cmd(&b, &f.v1, &plan).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("resuming rollout resume at phase 1"),
        "{}",
        stderr(&o)
    );
    let c: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(c["state"]["state"], "completed");
    assert!(
        statuses(&cfg, None)
            .unwrap()
            .iter()
            .all(|s| s.active == Some(1))
    );
}

/// Mosquitto restarted in the middle of a rollout: the controller and the devices reconnect
/// (Mosquitto keeps the retained and session state it persisted) and the rollout completes.
#[test]
fn broker_restarted_mid_rollout_and_the_rollout_completes() {
    let f = fixture();
    let dir = f.dir.join("broker-restart");
    let mut b = Broker::start(BrokerKind::Mosquitto, &dir.join("broker"));
    let cfg = b.config();
    let conf = agent_config(&dir.join("sim"), "br", &b.url(), &f.keys, "");
    let _fleet = start_agent_with(&conf, &[], &["--simulate", "10"]);
    wait_fleet(&cfg, 10);
    let plan = write_plan(
        &dir,
        "restart",
        "[[phases]]\nname = \"first\"\npercent = 30\nsoak_s = 2\n[[phases]]\nname = \"second\"\npercent = 60\nsoak_s = 8\n[[phases]]\nname = \"rest\"\npercent = 100\n",
    );
    let ctl = Proc::spawn(
        &mut rollout_cmd(&b, &f.v1, &plan),
        &dir.join("controller.log"),
    );
    wait_phase(&b, "restart", 1, &ctl);
    b.restart();
    let mut ctl = ctl;
    let deadline = Instant::now() + Duration::from_secs(240);
    while ctl.is_running() {
        assert!(
            Instant::now() < deadline,
            "rollout still running: {}",
            ctl.output()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    let status = ctl.child.wait().unwrap();
    let out = ctl.output();
    assert!(status.success(), "{out}");
    assert!(
        out.contains("reconnecting"),
        "the broker was not lost: {out}"
    );
    let last = out.lines().rev().find(|l| l.starts_with('{')).unwrap();
    let c: Value = serde_json::from_str(last).unwrap();
    assert_eq!(c["state"]["state"], "completed", "{out}");
    let all = statuses(&cfg, None).unwrap();
    assert!(all.iter().all(|s| s.active == Some(1)), "{all:?}");
}

/// Polls `trainer rollout status` until the rollout `name` is in `phase`.
fn wait_phase(b: &Broker, name: &str, phase: u64, ctl: &Proc) {
    let deadline = Instant::now() + Duration::from_secs(120);
    let url = b.url();
    loop {
        let args = [
            "rollout", "status", "--broker", &url, "--name", name, "--json",
        ];
        let o = run("trainer", &args);
        let now = serde_json::from_str::<Value>(stdout(&o).trim())
            .ok()
            .and_then(|c| c["phase"].as_u64());
        if now == Some(phase) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the rollout never reached phase {phase}: {}",
            ctl.output()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}
