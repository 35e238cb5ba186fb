//! A shadow model's delivery keeps every rule of an update (it is a second `Updater` in the
//! agent): a chunk that fails its hash three times fails the shadow and nothing of it runs; a
//! checked shadow runs beside the active model, and after the agent is killed it runs again from
//! its journal without downloading anything. `edge-agent run` as a user starts it, on both brokers.

use std::path::Path;

use kestrel_fleet::{Bundle, Conn};
use kestrel_shared::protocol::{Desired, ModelRef, Status};
use kestrel_shared::wire::{DeviceState, ShadowState};
use kestrel_tests::fleet::{
    Broker, BrokerKind, agent_config, desired, fixture, publish_ok, publish_raw, start_agent,
    wait_status,
};
use serde_json::Value;

#[test]
fn a_shadow_keeps_an_updates_rules_and_its_journal_on_rumqttd() {
    shadow_keeps_the_rules(BrokerKind::Rumqttd);
}

#[test]
fn a_shadow_keeps_an_updates_rules_and_its_journal_on_mosquitto() {
    shadow_keeps_the_rules(BrokerKind::Mosquitto);
}

/// The device's desired state: v2 active, `shadow` beside it.
fn with_shadow(device: &str, shadow: u64) -> Desired {
    Desired {
        shadow: Some(ModelRef {
            name: "lfw".into(),
            version: shadow,
        }),
        ..desired(device, 2, false)
    }
}

fn shadow_is(s: &Status, version: u64, state: ShadowState) -> bool {
    s.shadow
        .as_ref()
        .is_some_and(|sh| sh.version == version && sh.state == state)
}

fn shadow_keeps_the_rules(kind: BrokerKind) {
    let f = fixture();
    let dir = f.dir.join(format!("shadow-rules-{kind:?}"));
    let _ = std::fs::remove_dir_all(&dir);
    let b = Broker::start(kind, &dir.join("broker"));
    let device = "pi-sh";
    let conf = agent_config(
        &dir.join(device),
        device,
        &b.url(),
        &f.keys,
        "download_stall_s = 2",
    );
    let agent = start_agent(&conf, &[]);
    publish_ok(&b, &f.v2, &f.key(), &format!("device/{device}"));
    wait_status(&b.config(), device, 120, "v2 active", |s| {
        s.active == Some(2) && s.state == DeviceState::Idle
    });
    let topics = Conn::connect(&b.config(), "t").unwrap().topics.clone();

    // A shadow whose chunk 1 was altered in the broker: dropped and asked for again (every
    // stall), never failed for it; the genuine chunk published again completes it.
    let v4 = Bundle::from_dir(&f.variant(&f.v2, 4, |_| {}), &f.signing(), 128 * 1024)
        .unwrap()
        .without_pieces(); // whole-bundle chunks: v4 shares every piece with v2
    let mut msgs = v4.messages(&topics);
    let genuine = msgs
        .iter()
        .find(|(t, ..)| *t == topics.chunk("lfw", 4, 1))
        .cloned()
        .unwrap();
    msgs.push((topics.chunk("lfw", 4, 1), b"tampered".to_vec(), true));
    publish_raw(&b, msgs, with_shadow(device, 4));
    let store = dir.join(device).join("store");
    let st = wait_status(&b.config(), device, 120, "shadow v4 downloading", |s| {
        shadow_is(s, 4, ShadowState::Downloading) && s.counters.chunks_corrupt >= 2
    });
    assert_eq!(st.shadow.unwrap().error, None, "not failed for garbage");
    assert_eq!(
        (st.active, st.state.as_str()),
        (Some(2), "idle"),
        "the update is untouched"
    );
    let mut publisher = Conn::connect(&b.config(), "t").unwrap();
    publisher.publish_all(vec![genuine], None).unwrap();
    publisher.disconnect();
    wait_status(&b.config(), device, 120, "shadow v4 running", |s| {
        shadow_is(s, 4, ShadowState::Running)
    });

    // A good shadow runs beside v2.
    let v5 = Bundle::from_dir(&f.variant(&f.v2, 5, |_| {}), &f.signing(), 128 * 1024).unwrap();
    publish_raw(&b, v5.messages(&topics), with_shadow(device, 5));
    let st = wait_status(&b.config(), device, 120, "shadow v5 running", |s| {
        shadow_is(s, 5, ShadowState::Running)
    });
    assert_eq!(st.active, Some(2));
    assert!(store.join("shadow/versions/5/manifest.json").is_file());
    let journal: Value =
        serde_json::from_slice(&std::fs::read(store.join("shadow/state.json")).unwrap()).unwrap();
    assert_eq!(journal["updater"]["role"], "shadow", "{journal}");
    assert_eq!(journal["updater"]["active"], 5, "{journal}");
    assert_eq!(journal["want"]["version"], 5, "{journal}");

    // Killed and started again: the shadow runs from its journal, nothing downloaded again.
    agent.kill();
    remove_chunks(&store.join("shadow/downloads/5/chunks"));
    let agent = start_agent(&conf, &[]);
    let st = wait_status(&b.config(), device, 120, "shadow v5 running again", |s| {
        shadow_is(s, 5, ShadowState::Running) && s.started != st.started
    });
    assert_eq!(st.active, Some(2));
    let log = agent.output();
    assert!(log.contains("shadow v5 running"), "{log}");
    assert!(!log.contains("shadow v5 downloading"), "{log}");
    assert!(
        !store.join("shadow/downloads/5/chunks").join("0").exists(),
        "no chunk fetched again"
    );
    agent.kill();
}

/// Deletes the chunk files a download left (so a new download would show).
fn remove_chunks(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let _ = std::fs::remove_file(e.path());
        }
    }
}
