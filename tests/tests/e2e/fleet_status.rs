//! `trainer status` run as a user types it, against a simulated fleet (`edge-agent run
//! --simulate N`, a thousand devices on the embedded broker): with no `--device` it lists every
//! device that has a retained status. (It once
//! listed none: the global ONNX Runtime `--device` flag, default `cpu`, filled the status
//! command's device filter.) Also how `trainer broker` runs the `kestrel-broker` binary.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kestrel_fleet::statuses;
use kestrel_shared::mqtt::BrokerConfig;
use kestrel_tests::fleet::{Broker, BrokerKind, agent_config, start_agent_with, trainer_ok};
use kestrel_tests::{bin, stderr};
use serde_json::Value;

/// `target/tmp/fleet-status-<name>`, emptied (kept after the test for its logs).
fn workdir(name: &str) -> PathBuf {
    let target = bin("trainer")
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .to_path_buf();
    let dir = target.join("tmp").join(format!("fleet-status-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Waits until every device in `ids` has a retained status on the broker.
fn wait_reported(cfg: &BrokerConfig, ids: &BTreeSet<String>) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let seen: BTreeSet<String> = statuses(cfg, None)
            .unwrap()
            .into_iter()
            .map(|s| s.device)
            .collect();
        if ids.is_subset(&seen) {
            return;
        }
        let missing: Vec<_> = ids.difference(&seen).collect();
        assert!(
            Instant::now() < deadline,
            "no status within 60 s from {missing:?}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// The device ids of `trainer status`'s table (a header, then one line per device).
fn table_ids(table: &str) -> BTreeSet<String> {
    table
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .map(String::from)
        .collect()
}

/// The device ids of `trainer status --json` (one status object per line).
fn json_ids(json: &str) -> BTreeSet<String> {
    json.lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"));
            v["device"].as_str().expect("device").to_string()
        })
        .collect()
}

/// A broker of `kind` and `devices` simulated devices; `trainer status` must list them all.
fn status_lists_every_device(kind: BrokerKind, devices: usize) -> Broker {
    let dir = workdir(&format!("{kind:?}").to_lowercase());
    let keys = dir.join("keys");
    trainer_ok(&["keygen", "--out", keys.to_str().unwrap()]);
    let b = Broker::start(kind, &dir.join("broker"));
    let conf = agent_config(&dir.join("sim"), "st", &b.url(), &keys, "");
    let mut fleet = start_agent_with(&conf, &[], &["--simulate", &devices.to_string()]);
    let ids: BTreeSet<String> = (0..devices).map(|i| format!("st-{i:03}")).collect();
    wait_reported(&b.config(), &ids);

    let url = b.url();
    let table = trainer_ok(&["status", "--broker", &url]);
    assert_eq!(table_ids(&table), ids, "trainer status:\n{table}");
    let json = trainer_ok(&["status", "--broker", &url, "--json"]);
    assert_eq!(json_ids(&json), ids, "trainer status --json:\n{json}");
    // --device still selects one device.
    let one = trainer_ok(&["status", "--broker", &url, "--device", "st-002", "--json"]);
    assert_eq!(
        json_ids(&one),
        BTreeSet::from(["st-002".to_string()]),
        "{one}"
    );
    assert!(fleet.is_running(), "{}", fleet.output());
    b
}

/// A thousand devices: rumqttd sends a late QoS 1 subscriber only 100 retained messages, so
/// fleet-wide reads subscribe at QoS 0, of which `kestrel-broker` sends up to 20,000.
#[test]
fn status_without_device_lists_the_fleet_on_the_embedded_broker() {
    let mut b = status_lists_every_device(BrokerKind::Rumqttd, 1000);
    // `trainer broker` replaced itself with kestrel-broker: the PID the test holds is the broker's.
    let p = b.proc.as_mut().unwrap();
    let exe = std::fs::read_link(format!("/proc/{}/exe", p.child.id())).unwrap();
    assert_eq!(
        exe.file_name().unwrap(),
        "kestrel-broker",
        "{}",
        exe.display()
    );
    assert!(p.is_running(), "{}", p.output());
}

#[test]
fn status_without_device_lists_the_fleet_on_mosquitto() {
    status_lists_every_device(BrokerKind::Mosquitto, 5);
}

/// Without `kestrel-broker` beside it, `trainer broker` fails naming the path it looked for.
#[test]
fn trainer_broker_names_the_missing_broker_binary() {
    let dir = workdir("no-broker");
    let trainer = dir.join("trainer");
    std::fs::hard_link(bin("trainer"), &trainer)
        .or_else(|_| std::fs::copy(bin("trainer"), &trainer).map(|_| ()))
        .unwrap();
    let o = std::process::Command::new(&trainer)
        .args(["broker", "--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let e = stderr(&o);
    let expected = dir.join("kestrel-broker");
    assert!(e.contains(&expected.display().to_string()), "{e}");
}

/// The embedded broker's connection ceiling (`trainer broker --max-clients`, 2,000 by
/// default): beyond it a client is refused, and the broker's log names the limit and the advice.
#[test]
fn the_embedded_broker_refuses_clients_beyond_its_ceiling() {
    let dir = workdir("ceiling");
    let keys = dir.join("keys");
    trainer_ok(&["keygen", "--out", keys.to_str().unwrap()]);
    let port = kestrel_tests::fleet::free_port();
    let log = dir.join("broker.log");
    let mut cmd = std::process::Command::new(bin("trainer"));
    cmd.args(["-v", "broker", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--no-persist", "--max-clients", "6"]);
    let broker = kestrel_tests::fleet::Proc::spawn(&mut cmd, &log);
    let url = format!("mqtt://127.0.0.1:{port}");
    let conf = agent_config(&dir.join("sim"), "cap", &url, &keys, "");
    let _fleet = start_agent_with(&conf, &[], &["--simulate", "10"]);
    // Some devices connect and report; the others are refused, and the log says why.
    let deadline = Instant::now() + Duration::from_secs(60);
    let cfg = BrokerConfig::new(&url);
    loop {
        let out = broker.output();
        let seen = statuses(&cfg, None).map(|s| s.len()).unwrap_or(0);
        if out.contains("no space for new connection") && seen > 0 {
            assert!(seen < 10, "{seen} devices connected past a cap of 6");
            assert!(
                out.contains("at most 6 clients at once (--max-clients)")
                    && out.contains("wants Mosquitto"),
                "{out}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "no refusal within 60 s: {out}");
        std::thread::sleep(Duration::from_millis(300));
    }
}
