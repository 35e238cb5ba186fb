//! Crash loops, load and faults with the real binaries: the agent SIGKILLed at random moments of
//! its updates, `trainer fit` SIGKILLed at random moments, a paced inference load
//! (`trainer infer --rate`), and a store that fills up during a download. Bounded here (a few
//! kills, a few seconds of load); `scripts/chaos.sh` runs them at full size (100 kills, 200
//! requests/s for 60 s) through these same tests and prints the figures the README records.
//! The broker restart in the middle of a rollout is in rollout.rs.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use kestrel_shared::time::now_ms;
use kestrel_shared::wire::DeviceState;
use kestrel_tests::fleet::{
    Broker, BrokerKind, Proc, agent_config, fixture, start_agent, wait_status,
};
use kestrel_tests::{Scratch, bin, lfw, photo, run, run_ok, s, stderr, stdout};
use serde_json::Value;

/// A size knob of these tests: the environment variable `name`, else `default`.
fn knob(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// xorshift64*: the random kill moments, seeded from `KESTREL_CHAOS_SEED` or the clock (the
/// seed is printed, so a failing sequence can be run again).
struct Rng(u64);

impl Rng {
    fn new(what: &str) -> Self {
        let clock = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        let seed = knob("KESTREL_CHAOS_SEED", clock) | 1;
        eprintln!("{what}: KESTREL_CHAOS_SEED={seed}");
        Self(seed)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Files under `dir` (recursively) whose name marks an unfinished write.
fn temp_files(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if e.file_type().unwrap().is_dir() {
            out.extend(temp_files(&p));
        } else if p.file_name().unwrap().to_string_lossy().contains(".tmp") {
            out.push(s(&p));
        }
    }
    out
}

fn entries(dir: &Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |d| d.count())
}

/// The update machine's phase in the agent's journal (what it was doing when killed).
fn journal_phase(store: &Path, version: u64) -> String {
    let j: Value = std::fs::read(store.join("state.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(Value::Null);
    let phase = &j["updater"]["phase"];
    match phase.as_str() {
        Some("Idle") if j["updater"]["active"] == version => "idle, activated".into(),
        Some("Idle") => "idle, before the offer".into(),
        Some(p) => p.to_lowercase(),
        None => phase
            .as_object()
            .and_then(|o| o.keys().next().cloned())
            .map_or("no journal yet".into(), |k| k.to_lowercase()),
    }
}

/// The update machine's phases, in order, as [`journal_phase`] names them.
const PHASES: [&str; 6] = [
    "downloading",
    "verifying",
    "staging",
    "checking",
    "activating",
    "idle, activated",
];

/// Polls the agent's journal (every 0.2 ms) until the update to `version` is in phase `aim` or
/// past it.
fn reach_phase(store: &Path, version: u64, aim: &str) {
    let rank = |p: &str| PHASES.iter().position(|q| *q == p);
    let deadline = Instant::now() + Duration::from_secs(120);
    while rank(&journal_phase(store, version)) < rank(aim) {
        assert!(
            Instant::now() < deadline,
            "the update to v{version} never reached {aim}"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// After a restart: `version` is active, complete and verified (`edge-agent check` on the store's
/// `active` model: files, signature, golden samples), and nothing is left half-done.
fn check_store(store: &Path, keys: &Path, version: u64) {
    let link = std::fs::read_link(store.join("active")).unwrap();
    assert_eq!(link, Path::new("versions").join(version.to_string()));
    let pubkey = s(&keys.join("kestrel.pub"));
    let active = s(&store.join("active"));
    run_ok(
        "edge-agent",
        &["check", "--model", &active, "--trusted-key", &pubkey],
    );
    assert_eq!(entries(&store.join("downloads")), 0, "downloads left");
    assert_eq!(entries(&store.join("staging")), 0, "staging left");
    assert!(
        entries(&store.join("versions")) <= 2,
        "more than 2 versions"
    );
    assert_eq!(
        temp_files(store),
        Vec::<String>::new(),
        "temporary files left"
    );
}

/// `trainer publish` of `art` to `target` in a thread of its own (it runs on while the agent is
/// killed).
fn publish_in_background(
    url: String,
    art: &Path,
    key: &Path,
    target: String,
) -> std::thread::JoinHandle<std::process::Output> {
    let (art, key) = (s(art), s(key));
    std::thread::spawn(move || {
        let args = [
            "publish",
            "--broker",
            &url,
            "--artifact",
            &art,
            "--key",
            &key,
            "--target",
            &target,
        ];
        run("trainer", &args)
    })
}

/// The agent SIGKILLed at a random moment of each of `KESTREL_CHAOS_KILLS` updates (in a phase
/// chosen at random: download, verification, staging, health check, activation, just after) and
/// started again: every time the new version ends up active, complete and verified, with no
/// download, staging directory or temporary file left over.
#[test]
fn agent_killed_at_random_moments_restarts_onto_a_complete_model() {
    let kills = knob("KESTREL_CHAOS_KILLS", 4);
    let mut rng = Rng::new("agent crash loop");
    let w = Scratch::new();
    let f = fixture();
    let b = Broker::start(BrokerKind::Mosquitto, &w.join("broker"));
    let device = "pi-chaos";
    let cfg = agent_config(&w.join(device), device, &b.url(), &f.keys, "");
    let store = w.join(device).join("store");
    let mut agent = start_agent(&cfg, &[]);
    let target = format!("device/{device}");
    let p = publish_in_background(b.url(), &f.v1, &f.key(), target.clone()).join();
    assert!(p.unwrap().status.success());
    wait_status(&b.config(), device, 120, "v1 active", |st| {
        st.active == Some(1) && st.state == DeviceState::Idle
    });
    let mut moments: BTreeMap<String, u64> = BTreeMap::new();
    for i in 0..kills {
        let version = i + 2;
        let art = f.variant(&f.v1, version, |_| {});
        let publisher = publish_in_background(b.url(), &art, &f.key(), target.clone());
        // A phase chosen at random, and a random moment (0-20 ms) once the journal shows it;
        // a phase too short to be seen is passed, and the kill lands where the update is then.
        let aim = PHASES[(rng.unit() * PHASES.len() as f64) as usize];
        reach_phase(&store, version, aim);
        std::thread::sleep(Duration::from_micros((rng.unit() * 20_000.0) as u64));
        agent.kill();
        // The killed agent started before now, the next one starts after.
        let killed_at = now_ms();
        *moments.entry(journal_phase(&store, version)).or_default() += 1;
        let o = publisher.join().unwrap();
        assert!(o.status.success(), "publish v{version}: {}", stderr(&o));
        agent = start_agent(&cfg, &[]);
        wait_status(&b.config(), device, 120, "the new version active", |st| {
            st.started >= killed_at && st.active == Some(version) && st.state == DeviceState::Idle
        });
        check_store(&store, &f.keys, version);
    }
    eprintln!("agent crash loop: {kills}/{kills} kills survived; killed while: {moments:?}");
}

/// `trainer fit` SIGKILLed `KESTREL_CHAOS_FIT_KILLS` times at random moments of its epoch loop
/// (after 1 to 3 more epochs and a random fraction of the next; a checkpoint is written every
/// epoch) and resumed each time ends with the same bytes as a run never killed, and leaves no
/// temporary file.
#[test]
fn fit_killed_at_random_moments_ends_with_identical_weights() {
    let kills = knob("KESTREL_CHAOS_FIT_KILLS", 4);
    let mut rng = Rng::new("fit crash loop");
    let w = Scratch::new();
    let epochs = kills * 4 + 10;
    let (data, cache, epochs_arg) = (lfw(), w.cache_arg(), epochs.to_string());
    let args = [
        "--data",
        &data,
        "--cache",
        &cache,
        "--optimizer",
        "sgd",
        "--epochs",
        &epochs_arg,
        "--batch-size",
        "4",
        "--seed",
        "7",
    ];
    let whole = w.join("whole");
    let whole_arg = s(&whole);
    let mut a = vec!["fit", "--out", &whole_arg];
    a.extend(args);
    run_ok("trainer", &a);

    let killed = w.join("killed");
    let lines =
        || std::fs::read_to_string(killed.join("metrics.jsonl")).map_or(0, |s| s.lines().count());
    let mut cmd = Command::new(bin("trainer"));
    cmd.args(["fit", "--out", &s(&killed)]).args(args);
    let mut done = 0;
    while done < kills {
        let mut p = Proc::spawn(&mut cmd, &w.join(&format!("fit-{done}.log")));
        let (before, more) = (lines(), 1 + (rng.unit() * 3.0) as usize);
        let deadline = Instant::now() + Duration::from_secs(300);
        while lines() < before + more && p.is_running() {
            assert!(Instant::now() < deadline, "no progress: {}", p.output());
            std::thread::sleep(Duration::from_micros(200));
        }
        std::thread::sleep(Duration::from_micros((rng.unit() * 3000.0) as u64));
        if !p.is_running() {
            break; // finished first: the remaining kills cannot happen
        }
        p.kill();
        done += 1;
        cmd = Command::new(bin("trainer"));
        cmd.args(["fit", "--resume", &s(&killed)]);
    }
    assert!(
        done * 2 >= kills,
        "only {done} of {kills} kills before the run ended"
    );
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    for file in ["last.safetensors", "best.safetensors"] {
        assert!(
            std::fs::read(whole.join(file)).unwrap() == std::fs::read(killed.join(file)).unwrap(),
            "{file} differs after {done} kills"
        );
    }
    assert_eq!(lines() as u64, epochs);
    assert_eq!(temp_files(&killed), Vec::<String>::new());
    eprintln!(
        "fit crash loop: {done}/{done} kills survived ({epochs} epochs), final weights byte-identical"
    );
}

/// Peak and current resident memory of a process, in MB (Linux /proc).
fn rss_mb(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kb = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (kb("VmHWM:") / 1024.0, kb("VmRSS:") / 1024.0)
}

/// `trainer infer --rate R --duration S` at one agent (`KESTREL_LOAD_RATE`, default 50/s, for
/// `KESTREL_LOAD_SECONDS`, default 5): every request is answered with a prediction or `busy`,
/// none is lost, some are predictions, and the agent's memory stays bounded; on both brokers.
#[test]
fn agent_under_paced_load_answers_every_request_on_mosquitto() {
    agent_under_paced_load_answers_every_request(BrokerKind::Mosquitto);
}

#[test]
fn agent_under_paced_load_answers_every_request_on_rumqttd() {
    agent_under_paced_load_answers_every_request(BrokerKind::Rumqttd);
}

fn agent_under_paced_load_answers_every_request(kind: BrokerKind) {
    let (rate, secs) = (
        knob("KESTREL_LOAD_RATE", 50),
        knob("KESTREL_LOAD_SECONDS", 5),
    );
    let w = Scratch::new();
    let f = fixture();
    let b = Broker::start(kind, &w.join("broker"));
    let device = "pi-load";
    let cfg = agent_config(&w.join(device), device, &b.url(), &f.keys, "");
    let mut agent = start_agent(&cfg, &[]);
    let p = publish_in_background(b.url(), &f.v1, &f.key(), format!("device/{device}")).join();
    assert!(p.unwrap().status.success());
    wait_status(&b.config(), device, 120, "v1 active", |st| {
        st.active == Some(1) && st.state == DeviceState::Idle
    });
    let (_, rss_before) = rss_mb(agent.child.id());
    let url = b.url();
    let (rate_s, secs_s) = (rate.to_string(), secs.to_string());
    let img = s(&photo("astronaut.png"));
    let args = [
        "infer",
        "--broker",
        &url,
        "--device",
        device,
        "--rate",
        &rate_s,
        "--duration",
        &secs_s,
        "--timeout",
        "30",
        "--json",
        &img,
    ];
    let o = run("trainer", &args);
    let r: Value = serde_json::from_str(stdout(&o).trim())
        .unwrap_or_else(|e| panic!("{e}: {}{}", stdout(&o), stderr(&o)));
    let (peak, rss_after) = rss_mb(agent.child.id());
    assert!(agent.is_running(), "{}", agent.output());
    eprintln!(
        "load ({kind:?}): {r}; agent RSS {rss_before:.0} MB before, {rss_after:.0} MB after, peak {peak:.0} MB"
    );
    assert!(o.status.success(), "{r}");
    let n = |k: &str| r[k].as_u64().unwrap();
    assert_eq!(n("sent"), rate * secs);
    assert_eq!((n("lost"), n("errors")), (0, 0), "{r}");
    assert_eq!(n("answered") + n("busy"), n("sent"), "{r}");
    assert!(n("answered") > 0, "{r}");
    assert!(peak < rss_before + 200.0, "agent memory grew to {peak} MB");
}

/// The store on a small tmpfs that a download fills up: the agent reports the full disk in its
/// status, keeps serving the active model, and once there is room again (the tmpfs grown) it
/// finishes the update with nothing corrupt. Needs permission to mount a tmpfs (root); it says
/// so and stops where there is none.
#[test]
fn a_store_that_fills_up_during_a_download() {
    let w = Scratch::new();
    let f = fixture();
    let device = "pi-full";
    let store = w.join(device).join("store");
    std::fs::create_dir_all(&store).unwrap();
    let mount = |opts: &str| {
        Command::new("mount")
            .args(["-t", "tmpfs", "-o", opts, "tmpfs", &s(&store)])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    };
    // Room for the int8 model (installed twice over while it is assembled), not the f32 one.
    let small = 3 * device_bytes(&f.v1) + (1 << 20);
    assert!(
        small < device_bytes(&f.f32_v6),
        "the f32 model must not fit"
    );
    if !mount(&format!("size={small}")) {
        eprintln!("SKIP: cannot mount a tmpfs here (not root?): the full-store test needs one");
        return;
    }
    struct Unmount(String);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").args(["-l", &self.0]).status();
        }
    }
    let _unmount = Unmount(s(&store));
    let b = Broker::start(BrokerKind::Mosquitto, &w.join("broker"));
    // A stalled download asks again after 3 s (default 20), so the test does not wait 20 s for it.
    let cfg = agent_config(
        &w.join(device),
        device,
        &b.url(),
        &f.keys,
        "download_stall_s = 3",
    );
    let agent = start_agent(&cfg, &[]);
    let target = format!("device/{device}");
    let p = publish_in_background(b.url(), &f.v1, &f.key(), target.clone()).join();
    assert!(p.unwrap().status.success());
    wait_status(&b.config(), device, 120, "v1 active", |st| {
        st.active == Some(1)
    });
    let p = publish_in_background(b.url(), &f.f32_v6, &f.key(), target).join();
    assert!(p.unwrap().status.success());
    let st = wait_status(&b.config(), device, 120, "a full store reported", |st| {
        st.last_error
            .as_deref()
            .is_some_and(|e| e.contains("No space left"))
    });
    assert_eq!(
        (st.active, st.state.as_str()),
        (Some(1), "downloading"),
        "{st:?}"
    );
    // Still serving v1.
    let url = b.url();
    let img = s(&photo("astronaut.png"));
    let o = run_ok(
        "trainer",
        &[
            "infer", "--broker", &url, "--device", device, "--json", &img,
        ],
    );
    let first: Value = serde_json::from_str(stdout(&o).lines().next().unwrap()).unwrap();
    assert_eq!(first["prediction"]["version"], 1, "{first}");
    // Room again: the stalled download asks for its missing chunks and completes.
    assert!(mount_remount(&store, "size=256m"), "remount failed");
    wait_status(
        &b.config(),
        device,
        120,
        "v6 active after space returned",
        |st| st.active == Some(6) && st.state == DeviceState::Idle && st.last_error.is_none(),
    );
    check_store(&store, &f.keys, 6);
    drop(agent);
}

fn mount_remount(dir: &Path, opts: &str) -> bool {
    Command::new("mount")
        .args(["-o", &format!("remount,{opts}"), &s(dir)])
        .status()
        .is_ok_and(|s| s.success())
}

/// What a device stores of an artifact: its ONNX model and golden samples.
fn device_bytes(art: &Path) -> u64 {
    std::fs::metadata(art.join("model.onnx")).unwrap().len() + dir_bytes(&art.join("golden"))
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            let m = e.metadata().unwrap();
            if m.is_dir() {
                dir_bytes(&e.path())
            } else {
                m.len()
            }
        })
        .sum()
}
