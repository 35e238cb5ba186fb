//! Rollouts at a controlled pace and dynamic rollouts, with the real binaries (`trainer rollout`,
//! `edge-agent run --simulate N`) on both brokers: the rate, the exponential ramp and the bound on
//! devices in progress, measured from the devices' own statuses (each stamped by its agent, in
//! whole seconds); a controller killed and resumed mid-phase at a few hundred devices; the abort
//! at a failure rate once enough devices finished; devices that join after the rollout and
//! devices that were offline throughout getting the rollout's model without a new command (a
//! dynamic rollout's controller, and a plain one's retained desired states after it exited); a
//! canary of offline devices holding the rollout.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kestrel_fleet::{Conn, statuses};
use kestrel_shared::mqtt::BrokerConfig;
use kestrel_shared::protocol::Status;
use kestrel_tests::fleet::{
    Broker, BrokerKind, Proc, agent_config, fixture, rollout_command, start_agent_with, wait_fleet,
    write_plan,
};
use kestrel_tests::{run, stderr, stdout};
use serde_json::Value;

fn rollout_json(b: &Broker, art: &Path, plan: &str) -> Command {
    let mut c = rollout_command(b, art, plan);
    c.arg("--json");
    c
}

/// Every status the devices publish while it runs, in the order received.
struct StatusLog {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<Status>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StatusLog {
    fn start(cfg: &BrokerConfig) -> Self {
        let mut conn = Conn::connect(cfg, "test-status-log").unwrap();
        conn.subscribe(&conn.topics.status_filter()).unwrap();
        let (stop, seen) = (Arc::new(AtomicBool::new(false)), Arc::default());
        let (stop2, seen2): (_, Arc<Mutex<Vec<Status>>>) = (stop.clone(), Arc::clone(&seen));
        let thread = std::thread::spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                if let Ok(Some((_, p))) = conn.recv(Duration::from_millis(200))
                    && let Ok(s) = serde_json::from_slice::<Status>(&p)
                {
                    seen2.lock().unwrap().push(s);
                }
            }
            conn.disconnect();
        });
        Self {
            stop,
            seen,
            thread: Some(thread),
        }
    }

    /// Per device: when (its own clock, unix s) it first reported working on `version`, and
    /// when it first reported it active.
    fn spans(mut self, version: u64) -> BTreeMap<String, (u64, Option<u64>)> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap();
        let mut spans: BTreeMap<String, (u64, Option<u64>)> = BTreeMap::new();
        for s in self.seen.lock().unwrap().iter() {
            let t = unix_seconds(&s.updated);
            if s.target == Some(version) || s.active == Some(version) {
                let span = spans.entry(s.device.clone()).or_insert((t, None));
                span.0 = span.0.min(t);
                if s.active == Some(version) {
                    span.1 = Some(span.1.map_or(t, |a: u64| a.min(t)));
                }
            }
        }
        spans
    }
}

/// `2026-11-30T06:07:08Z` as seconds since the Unix epoch (days from civil, Howard Hinnant's).
fn unix_seconds(t: &str) -> u64 {
    let n = |r: std::ops::Range<usize>| -> i64 { t[r].parse().unwrap_or_else(|_| panic!("{t}")) };
    let (y, m, d) = (n(0..4), n(5..7), n(8..10));
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    (days * 86_400 + n(11..13) * 3600 + n(14..16) * 60 + n(17..19)) as u64
}

/// The most start times within any `window` seconds.
fn busiest(starts: &[u64], window: u64) -> usize {
    starts
        .iter()
        .map(|&a| starts.iter().filter(|&&t| t >= a && t < a + window).count())
        .max()
        .unwrap_or(0)
}

/// The rollout's retained state (`trainer rollout status --json`).
fn rollout_state(b: &Broker, name: &str) -> Option<Value> {
    let url = b.url();
    let o = run(
        "trainer",
        &[
            "rollout", "status", "--broker", &url, "--name", name, "--json",
        ],
    );
    serde_json::from_str(stdout(&o).trim()).ok()
}

fn wait_rollout(b: &Broker, name: &str, ctl: &Proc, secs: u64, done: impl Fn(&Value) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !rollout_state(b, name).is_some_and(|c| done(&c)) {
        assert!(
            Instant::now() < deadline,
            "rollout {name}: not there within {secs} s: {}",
            ctl.output()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

const PACED: &str = r#"
[[phases]]
name = "canary"
percent = 3
[[phases]]
name = "everyone"
percent = 100
max_per_minute = 150
max_in_progress = 25
ramp = { start_per_minute = 50, factor = 3, every = 20 }
timeout_s = 240
"#;

#[test]
fn paced_rollout_to_200_devices_on_mosquitto() {
    paced_rollout(BrokerKind::Mosquitto);
}

#[test]
fn paced_rollout_to_200_devices_on_rumqttd() {
    paced_rollout(BrokerKind::Rumqttd);
}

/// 200 devices, the second phase at a ramped rate with at most 25 in progress; the controller
/// is killed mid-phase and started again.
fn paced_rollout(kind: BrokerKind) {
    let f = fixture();
    let dir = f.dir.join(format!("paced-{kind:?}"));
    let b = Broker::start(kind, &dir.join("broker"));
    let cfg = b.config();
    let conf = agent_config(&dir.join("sim"), "pc", &b.url(), &f.keys, "");
    let mut fleet = start_agent_with(&conf, &[], &["--simulate", "200"]);
    wait_fleet(&cfg, 200);
    let log = StatusLog::start(&cfg);
    let plan = write_plan(&dir, "paced", PACED);
    let ctl = Proc::spawn(&mut rollout_json(&b, &f.v1, &plan), &dir.join("ctl-1.log"));
    let active = |c: &Value| {
        c["devices"]
            .as_object()
            .unwrap()
            .values()
            .filter(|d| d["state"]["state"] == "active")
            .count()
    };
    wait_rollout(&b, "paced", &ctl, 180, |c| {
        c["phase"] == 1 && active(c) >= 60
    });
    ctl.kill();
    let o = rollout_json(&b, &f.v1, &plan).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("resuming rollout paced at phase 1"),
        "{}",
        stderr(&o)
    );
    let c: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(c["state"]["state"], "completed", "{c}");
    let all = statuses(&cfg, None).unwrap();
    assert_eq!(all.len(), 200);
    assert!(all.iter().all(|s| s.active == Some(1)), "{all:?}");

    let spans = log.spans(1);
    let phase_1: Vec<&(u64, Option<u64>)> = c["devices"]
        .as_object()
        .unwrap()
        .values()
        .filter(|d| d["phase"] == 1)
        .map(|d| &spans[d["id"].as_str().unwrap()])
        .collect();
    assert_eq!(phase_1.len(), 194);
    let mut starts: Vec<u64> = phase_1.iter().map(|s| s.0).collect();
    starts.sort();
    // The rate: at most 150 a minute. A device stamps its status in whole seconds after the
    // controller's tick, so one tick's share (2.5 devices) may fall on either side of a minute.
    let peak = busiest(&starts, 60);
    assert!(peak <= 153, "{peak} devices started within a minute");
    assert!(
        peak >= 120,
        "the rate is reached: {peak} in the busiest minute"
    );
    // The ramp: the first 20 at 50 a minute (at least 20 s), later ones at up to 150.
    let first = starts[19] - starts[0];
    assert!(first >= 18, "the first 20 started within {first} s");
    let later = starts[starts.len() - 1] - starts[starts.len() - 100];
    assert!(later <= 50, "the last 100 took {later} s");
    // At most 25 in progress at any moment (a device's span ends at its own `active`).
    let most = starts
        .iter()
        .map(|&t| {
            phase_1
                .iter()
                .filter(|(a, done)| *a <= t && done.is_none_or(|d| d > t))
                .count()
        })
        .max()
        .unwrap();
    assert!(most <= 25, "{most} devices in progress at once");
    eprintln!(
        "{kind:?}: busiest minute {peak} devices; first 20 in {first} s, last 100 in {later} s; \
         at most {most} in progress"
    );
    assert!(fleet.is_running());
}

#[test]
fn failure_rate_aborts_after_the_minimum_on_mosquitto() {
    failure_rate_aborts_after_the_minimum(BrokerKind::Mosquitto);
}

#[test]
fn failure_rate_aborts_after_the_minimum_on_rumqttd() {
    failure_rate_aborts_after_the_minimum(BrokerKind::Rumqttd);
}

/// A model every device fails on, to 40 devices at most 8 at a time: the rollout aborts when
/// the 10th device has finished (not at the first failure), and the devices never given the
/// model never see it.
fn failure_rate_aborts_after_the_minimum(kind: BrokerKind) {
    let f = fixture();
    let dir = f.dir.join(format!("abort-rate-{kind:?}"));
    let b = Broker::start(kind, &dir.join("broker"));
    let cfg = b.config();
    let conf = agent_config(&dir.join("sim"), "fr", &b.url(), &f.keys, "");
    let _fleet = start_agent_with(&conf, &[], &["--simulate", "40"]);
    wait_fleet(&cfg, 40);
    let bad = f.failing(9);
    let plan = write_plan(
        &dir,
        "rate",
        "[[phases]]\nname = \"all\"\npercent = 100\nsuccess = 0.9\nmax_in_progress = 8\n\
         abort_failure_rate = 0.5\nabort_min_finished = 10\n",
    );
    let o = rollout_json(&b, &bad, &plan).output().unwrap();
    assert!(!o.status.success(), "must abort: {}", stderr(&o));
    let c: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    let reason = c["state"]["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("10 of 10 finished devices failed, over the abort rate 0.5"),
        "{c}"
    );
    let given: Vec<&str> = c["devices"]
        .as_object()
        .unwrap()
        .values()
        .filter(|d| d["state"]["state"] != "waiting")
        .map(|d| d["id"].as_str().unwrap())
        .collect();
    assert!(
        (10..=18).contains(&given.len()),
        "{} devices given the model: 10 finished and at most 8 in progress",
        given.len()
    );
    for s in statuses(&cfg, None).unwrap() {
        let store = dir.join("sim/store").join(&s.device);
        let journal = std::fs::read_to_string(store.join("state.json")).unwrap_or_default();
        if !given.contains(&s.device.as_str()) {
            assert_eq!(s.failed_version, None, "{}", s.device);
            assert!(
                !journal.contains("\"version\": 9"),
                "{}: {journal}",
                s.device
            );
        }
    }
}

#[test]
fn late_and_offline_devices_get_the_model_on_mosquitto() {
    late_and_offline_devices_get_the_model(BrokerKind::Mosquitto);
}

#[test]
fn late_and_offline_devices_get_the_model_on_rumqttd() {
    late_and_offline_devices_get_the_model(BrokerKind::Rumqttd);
}

/// A dynamic rollout to 12 devices while two others are offline: it completes without them;
/// then three new devices appear (one of them in the plan's canary group) and the two come
/// back, and all five get the model without a new command.
fn late_and_offline_devices_get_the_model(kind: BrokerKind) {
    let f = fixture();
    let dir = f.dir.join(format!("dynamic-{kind:?}"));
    let b = Broker::start(kind, &dir.join("broker"));
    let cfg = b.config();
    let sim = |name: &str, n: usize| {
        let conf = agent_config(&dir.join(name), name, &b.url(), &f.keys, "");
        start_agent_with(&conf, &[], &["--simulate", &n.to_string()])
    };
    let away = sim("away", 2);
    let fleet = sim("dy", 12);
    wait_fleet(&cfg, 14);
    assert!(away.terminate().success());
    let plan = write_plan(
        &dir,
        "dynamic",
        "dynamic = true\n[groups]\ncanary = [\"dy-000\", \"dy-001\", \"late-000\"]\n\
         [[phases]]\nname = \"canary\"\ngroup = \"canary\"\n\
         [[phases]]\nname = \"everyone\"\npercent = 100\n",
    );
    let mut ctl = Proc::spawn(&mut rollout_json(&b, &f.v1, &plan), &dir.join("ctl.log"));
    wait_rollout(&b, "dynamic", &ctl, 120, |c| {
        c["state"]["state"] == "completed"
    });
    let c = rollout_state(&b, "dynamic").unwrap();
    for id in ["away-000", "away-001"] {
        assert_eq!(c["devices"][id]["offline"], true, "{c}");
    }
    assert!(
        ctl.is_running(),
        "a dynamic rollout goes on: {}",
        ctl.output()
    );

    let _late = sim("late", 3);
    let _back = sim("away", 2);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let all = statuses(&cfg, None).unwrap();
        if all.len() == 17 && all.iter().all(|s| s.active == Some(1)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not every device on v1: {:?}\n{}",
            all.iter()
                .map(|s| (&s.device, s.active))
                .collect::<Vec<_>>(),
            ctl.output()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    wait_rollout(&b, "dynamic", &ctl, 30, |c| {
        c["devices"].as_object().unwrap().len() == 17
            && c["devices"]
                .as_object()
                .unwrap()
                .values()
                .all(|d| d["state"]["state"] == "active")
    });
    let c = rollout_state(&b, "dynamic").unwrap();
    for (id, d) in c["devices"].as_object().unwrap() {
        let late = id.starts_with("late-");
        assert_eq!(d["late"].as_bool().unwrap_or(false), late, "{id}: {d}");
        assert_eq!(d["offline"].as_bool().unwrap_or(false), false, "{id}: {d}");
    }
    let table = run(
        "trainer",
        &[
            "rollout",
            "status",
            "--broker",
            &b.url(),
            "--name",
            "dynamic",
        ],
    );
    assert!(
        stdout(&table).contains("joined late: 3 devices (first: late-000)"),
        "{}",
        stdout(&table)
    );
    assert!(ctl.is_running());
    ctl.terminate();
    drop(fleet);
}

#[test]
fn a_plain_rollout_holds_for_an_offline_canary_and_serves_late_and_returning_devices_on_mosquitto()
{
    plain_rollout_with_late_and_returning_devices(BrokerKind::Mosquitto);
}

#[test]
fn a_plain_rollout_holds_for_an_offline_canary_and_serves_late_and_returning_devices_on_rumqttd() {
    plain_rollout_with_late_and_returning_devices(BrokerKind::Rumqttd);
}

/// A plain rollout (not dynamic) whose canary's one device is offline: it holds in the canary (no
/// device of the fleet is given the model on no evidence); a device that appears meanwhile joins
/// the last phase; the canary device comes back, passes, and everyone gets the model, the late
/// device with them; the controller exits, and a device that was offline throughout then comes
/// back and gets the final target from its retained desired state, with no controller running.
fn plain_rollout_with_late_and_returning_devices(kind: BrokerKind) {
    let f = fixture();
    let dir = f.dir.join(format!("plain-{kind:?}"));
    let b = Broker::start(kind, &dir.join("broker"));
    let cfg = b.config();
    let sim = |name: &str, n: usize| {
        let conf = agent_config(&dir.join(name), name, &b.url(), &f.keys, "");
        start_agent_with(&conf, &[], &["--simulate", &n.to_string()])
    };
    let (away, gone) = (sim("away", 1), sim("gone", 1));
    let _fleet = sim("pl", 4);
    wait_fleet(&cfg, 6);
    assert!(away.terminate().success());
    assert!(gone.terminate().success());
    let plan = write_plan(
        &dir,
        "plain",
        "[groups]\ncanary = [\"away-000\"]\n\
         [[phases]]\nname = \"canary\"\ngroup = \"canary\"\ntimeout_s = 240\n\
         [[phases]]\nname = \"everyone\"\npercent = 100\n",
    );
    let mut ctl = Proc::spawn(&mut rollout_json(&b, &f.v1, &plan), &dir.join("ctl.log"));
    wait_rollout(&b, "plain", &ctl, 60, |c| {
        c["devices"]["away-000"]["offline"] == true && c["devices"]["gone-000"]["offline"] == true
    });
    // While the canary holds: a new device appears, and joins the last phase.
    let _late = sim("late", 1);
    wait_rollout(&b, "plain", &ctl, 60, |c| {
        c["devices"]["late-000"]["late"] == true
    });
    let c = rollout_state(&b, "plain").unwrap();
    assert_eq!(
        (
            c["phase"].as_u64(),
            c["devices"]["late-000"]["phase"].as_u64()
        ),
        (Some(0), Some(1)),
        "{c}"
    );
    let given: Vec<&String> = c["devices"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, d)| d["state"]["state"] != "waiting")
        .map(|(id, _)| id)
        .collect();
    assert!(
        given.is_empty(),
        "a canary of offline devices gives nobody the model: {given:?}"
    );
    // The canary device is back: it passes, everyone follows, the plain controller exits.
    let _away = sim("away", 1);
    let deadline = Instant::now() + Duration::from_secs(180);
    while ctl.is_running() {
        assert!(
            Instant::now() < deadline,
            "the rollout did not end: {}",
            ctl.output()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    let c = rollout_state(&b, "plain").unwrap();
    assert_eq!(c["state"]["state"], "completed", "{c}");
    assert_eq!(c["devices"]["gone-000"]["offline"], true, "{c}");
    let on_v1: Vec<String> = statuses(&cfg, None)
        .unwrap()
        .into_iter()
        .filter(|s| s.active == Some(1))
        .map(|s| s.device)
        .collect();
    assert_eq!(
        on_v1,
        [
            "away-000", "late-000", "pl-000", "pl-001", "pl-002", "pl-003"
        ],
        "{}",
        ctl.output()
    );
    // Back after the controller exited: the retained desired state was waiting for it.
    let _gone = sim("gone", 1);
    kestrel_tests::fleet::wait_status(&cfg, "gone-000", 120, "the final target", |s| {
        s.active == Some(1)
    });
}

#[test]
fn status_times_parse() {
    for t in [0, 951_782_400, 1_796_022_428, 4_102_444_799] {
        assert_eq!(unix_seconds(&kestrel_shared::manifest::rfc3339(t)), t);
    }
}
