//! Broker hygiene as an operator types it: `trainer prune --keep 2` clears the retained chunks and
//! offers of every version but the two newest, keeps what a desired state still needs, and a
//! device that arrives afterwards still installs the newest; `trainer unpublish` refuses a
//! version a desired state names and clears one nothing needs. On both brokers.

use std::time::Duration;

use kestrel_fleet::Conn;
use kestrel_shared::wire::DeviceState;
use kestrel_tests::fleet::{
    Broker, BrokerKind, agent_config, fixture, publish_ok, start_agent, wait_status,
};
use kestrel_tests::{run, stderr, stdout};
use serde_json::Value;

/// Retained messages of `name` `version` on the broker: (offers, chunks).
fn retained(b: &Broker, name: &str, version: u64) -> (usize, usize) {
    let mut c = Conn::connect(&b.config(), "prune-check").unwrap();
    let filter = format!("{}/artifacts/{name}/{version}/#", c.topics.prefix());
    let got = c.retained(&filter, Duration::from_millis(500)).unwrap();
    c.disconnect();
    let offers = got.keys().filter(|t| t.ends_with("/manifest")).count();
    (offers, got.len() - offers)
}

fn trainer(b: &Broker, args: &[&str]) -> std::process::Output {
    let mut all: Vec<String> = vec![args[0].to_string()];
    all.extend(b.cli_args());
    all.extend(args[1..].iter().map(|a| a.to_string()));
    run("trainer", &all)
}

fn prune_keeps_what_the_fleet_needs(kind: BrokerKind) {
    let f = fixture();
    let dir = f.dir.join(format!("prune-{kind:?}").to_lowercase());
    let _ = std::fs::remove_dir_all(&dir);
    let b = Broker::start(kind, &dir.join("broker"));
    let v3 = f.variant(&f.v2, 3, |_| {});
    let device = "pi-prune";
    let target = format!("device/{device}");
    let mut chunks = Vec::new();
    let mut name = String::new();
    for art in [&f.v1, &f.v2, &v3] {
        let p = publish_ok(&b, art, &f.key(), &target);
        name = p["name"].as_str().unwrap().to_string();
        chunks.push(p["chunks"].as_u64().unwrap() as usize);
    }
    for (v, n) in (1..=3).zip(&chunks) {
        assert_eq!(retained(&b, &name, v), (1, *n), "v{v} published");
    }

    let o = trainer(&b, &["prune", "--keep", "2", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let p: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(p["removed"][0]["version"], 1, "{p}");
    assert_eq!(p["removed"].as_array().unwrap().len(), 1, "{p}");
    let needed: Vec<&Value> = p["kept"].as_array().unwrap().iter().collect();
    assert_eq!(needed[0]["version"], 3, "{p}");
    assert_eq!(
        needed[0]["needed_by"][0],
        format!("{target} desires it"),
        "{p}"
    );
    assert_eq!(retained(&b, &name, 1), (0, 0), "v1 cleared");
    assert_eq!(retained(&b, &name, 2), (1, chunks[1]), "v2 kept");
    assert_eq!(retained(&b, &name, 3), (1, chunks[2]), "v3 kept");

    // A device that arrives after the prune installs the newest from what is left.
    let conf = agent_config(&dir.join(device), device, &b.url(), &f.keys, "");
    let agent = start_agent(&conf, &[]);
    wait_status(&b.config(), device, 120, "v3 active after the prune", |s| {
        s.active == Some(3) && s.state == DeviceState::Idle
    });
    agent.kill();

    unpublish(&b, &name, &target, &chunks);
}

/// `trainer unpublish`: refused for the desired version (exit 1, naming who needs it), done for
/// one nothing needs; a second prune then has nothing to clear.
fn unpublish(b: &Broker, name: &str, target: &str, chunks: &[usize]) {
    let o = trainer(b, &["unpublish", name, "3"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&format!("{target} desires it")),
        "{}",
        stderr(&o)
    );
    assert_eq!(
        retained(b, name, 3),
        (1, chunks[2]),
        "a refused unpublish clears nothing"
    );
    let o = trainer(b, &["unpublish", name, "2", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(
        (r["version"].as_u64(), r["chunks"].as_u64()),
        (Some(2), Some(chunks[1] as u64))
    );
    assert_eq!(retained(b, name, 2), (0, 0), "v2 cleared");
    let o = trainer(b, &["unpublish", name, "2"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("not published"), "{}", stderr(&o));
    let o = trainer(b, &["prune", "--keep", "0", "--json"]);
    let p: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(p["removed"].as_array().map(Vec::len), Some(0), "{p}");
}

#[test]
fn prune_and_unpublish_on_the_embedded_broker() {
    prune_keeps_what_the_fleet_needs(BrokerKind::Rumqttd);
}

#[test]
fn prune_and_unpublish_on_mosquitto() {
    prune_keeps_what_the_fleet_needs(BrokerKind::Mosquitto);
}
