//! The update path against someone who can write the broker's topics but holds no signing key:
//! replayed, expired and unsigned (empty) desired states are refused and reported, on the
//! embedded broker and on Mosquitto, and the refusal survives an agent restart.

use std::path::Path;
use std::time::Duration;

use kestrel_fleet::Conn;
use kestrel_shared::protocol::{KeyList, SignedKeyList, Status};
use kestrel_shared::wire::DeviceState;
use kestrel_tests::fleet::{
    Broker, BrokerKind, Proc, agent_config, desired, fixture, publish, publish_ok, publish_raw,
    start_agent, wait_status,
};
use kestrel_tests::{Scratch, lfw, run_ok, s, stdout, trainer_ok};
use serde_json::Value;

#[test]
fn replayed_expired_and_unsigned_desired_states_are_refused_on_rumqttd() {
    refused_desired_states(BrokerKind::Rumqttd);
}

#[test]
fn replayed_expired_and_unsigned_desired_states_are_refused_on_mosquitto() {
    refused_desired_states(BrokerKind::Mosquitto);
}

/// Publish v1, v2, then v1 with `--rollback`; capture that retained, signed rollback state;
/// publish v2 again; put the captured bytes back (retained) as an attacker with broker access
/// would. The device stays on v2 and says why, also after a restart (the broker still holds
/// the replayed state), then refuses an unsigned clear and an expired state, and keeps answering.
fn refused_desired_states(kind: BrokerKind) {
    let w = Scratch::new();
    let f = fixture();
    let b = Broker::start(kind, &w.join("broker"));
    let device = "pi-replay";
    let cfg = agent_config(&w.join(device), device, &b.url(), &f.keys, "");
    let agent = start_agent(&cfg, &[]);
    let target = format!("device/{device}");
    let on = |v: u64, what: &str| {
        wait_status(&b.config(), device, 90, what, |st| {
            st.active == Some(v) && st.state == DeviceState::Idle
        })
    };
    publish_ok(&b, &f.v1, &f.key(), &target);
    on(1, "v1 active");
    publish_ok(&b, &f.v2, &f.key(), &target);
    on(2, "v2 active");
    let o = publish(&b, &f.v1, &f.key(), &target, &["--rollback"]);
    assert!(o.status.success(), "{}", kestrel_tests::stderr(&o));
    on(1, "rolled back to v1");
    let topic = format!("kestrel/devices/{device}/desired");
    let captured = Conn::connect(&b.config(), "attacker")
        .unwrap()
        .retained(&topic, Duration::from_millis(700))
        .unwrap()
        .remove(&topic)
        .expect("the retained rollback state");
    publish_ok(&b, &f.v2, &f.key(), &target);
    on(2, "v2 active again");

    put(&b, &topic, captured.clone(), true);
    let refused = |what: &str, needle: &'static str| {
        wait_status(&b.config(), device, 30, what, move |st: &Status| {
            st.refused.as_deref().is_some_and(|r| r.contains(needle))
        })
    };
    let st = refused("the replay refused", "replayed");
    assert_eq!((st.active, st.failed_version), (Some(2), None), "{st:?}");

    // Restarted (its journal holds the newest `issued`), the device is sent the replayed state
    // again: still refused.
    let agent = restarted(agent, &cfg, &b, device, &st);
    put(&b, &topic, captured, true);
    let st = refused("the replay refused after a restart", "replayed");
    assert_eq!(st.active, Some(2), "{st:?}");

    put(&b, &topic, Vec::new(), false);
    refused("the unsigned clear refused", "unsigned clear");

    let mut late = desired(device, 1, true);
    late.expires = Some(kestrel_shared::now_unix() - 1);
    publish_raw(&b, Vec::new(), late);
    refused("the expired state refused", "expired");

    // The device, as `trainer status` shows it, and the active model still answering.
    let url = b.url();
    let line = trainer_ok(&["status", "--broker", &url, "--device", device, "--json"]);
    let row: Value = serde_json::from_str(line.lines().next().unwrap()).unwrap();
    assert_eq!(row["active"], 2, "{row}");
    assert!(
        row["refused"]
            .as_str()
            .is_some_and(|r| r.contains("expired")),
        "{row}"
    );
    let faces = std::path::Path::new(&lfw()).join("face");
    let mut images: Vec<_> = std::fs::read_dir(&faces)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    images.sort();
    let o = run_ok(
        "trainer",
        &[
            "infer",
            "--broker",
            &url,
            "--device",
            device,
            "--json",
            &s(&images[0]),
        ],
    );
    let first: Value = serde_json::from_str(stdout(&o).lines().next().unwrap()).unwrap();
    assert_eq!(first["prediction"]["version"], 2, "{first}");
    drop(agent);
}

/// SIGKILLs `agent` and starts it again; returns once the new process has published a status of
/// its own (its `started` after the kill), so the retained status of the killed one (`last`)
/// cannot answer for it.
fn restarted(agent: Proc, cfg: &Path, b: &Broker, device: &str, last: &Status) -> Proc {
    agent.kill();
    // The killed agent started before now, the next one starts after.
    let killed_at = kestrel_shared::time::now_ms();
    assert!(last.started < killed_at);
    let agent = start_agent(cfg, &[]);
    wait_status(
        &b.config(),
        device,
        60,
        "the restarted agent's status",
        |st| st.started >= killed_at,
    );
    agent
}

/// One message on the broker from a client of its own (connected for it alone, so no idle
/// connection outlives the broker's keep-alive), as an attacker with write access would send it.
fn put(b: &Broker, topic: &str, payload: Vec<u8>, retain: bool) {
    let mut c = Conn::connect(&b.config(), "attacker").unwrap();
    c.publish_all(vec![(topic.to_string(), payload, retain)], None)
        .unwrap();
    c.disconnect();
}

/// A device that trusts the fleet's root key follows the root-signed key lists `trainer keys`
/// publishes: rotated from key A to key B it accepts B's signatures and refuses A's, a lower
/// list version is refused, and the list in force survives a restart.
#[test]
fn root_signed_key_lists_rotate_and_revoke_publishing_keys() {
    let w = Scratch::new();
    let f = fixture();
    let b = Broker::start(BrokerKind::Mosquitto, &w.join("broker"));
    let url = b.url();
    let (root_dir, b_dir) = (w.join("root"), w.join("key-b"));
    trainer_ok(&["keygen", "--root", "--out", &s(&root_dir)]);
    trainer_ok(&["keygen", "--out", &s(&b_dir)]);
    let root = s(&root_dir.join("root.key"));
    let (pub_a, pub_b) = (
        s(&f.keys.join("kestrel.pub")),
        s(&b_dir.join("kestrel.pub")),
    );
    let device = "pi-keys";
    let cfg = agent_config(&w.join(device), device, &url, &f.keys, "");
    trust_root(&cfg, &root_dir.join("root.pub"));
    let agent = start_agent(&cfg, &[]);
    let keys = |args: &[&str]| {
        let mut all = vec!["keys", "--broker", &url, "--root-key", &root, "--json"];
        all.extend_from_slice(args);
        kestrel_tests::run("trainer", &all)
    };
    let o = keys(&["--publisher", &pub_a]);
    assert!(o.status.success(), "{}", kestrel_tests::stderr(&o));
    assert_eq!(kestrel_tests::json(&o)["version"], 1);
    wait_status(&b.config(), device, 60, "key list v1", |st| {
        st.keys_version == Some(1)
    });
    let target = format!("device/{device}");
    publish_ok(&b, &f.v1, &f.key(), &target);
    let wait = |flag: &str, v: &str| {
        let args = ["status", "--broker", &url, "--device", device, flag, v];
        trainer_ok(&[&args[..], &["--timeout", "90"]].concat())
    };
    wait("--wait-active", "1");

    // Rotation: B in, A out (the next version by default).
    let o = keys(&["--publisher", &pub_b]);
    assert!(o.status.success(), "{}", kestrel_tests::stderr(&o));
    let p = kestrel_tests::json(&o);
    assert_eq!(
        (p["version"].as_u64(), p["replaced"].as_u64()),
        (Some(2), Some(1))
    );
    wait_status(&b.config(), device, 60, "key list v2", |st| {
        st.keys_version == Some(2)
    });
    publish_ok(&b, &f.v2, &f.key(), &target);
    wait("--wait-error", "unknown key");
    let b_key = s(&b_dir.join("kestrel.key"));
    let o = publish(&b, &f.v2, std::path::Path::new(&b_key), &target, &[]);
    assert!(o.status.success(), "{}", kestrel_tests::stderr(&o));
    wait("--wait-active", "2");

    // A lower version: `trainer keys` refuses it, and so does the device when it is put on the
    // broker anyway.
    let o = keys(&["--publisher", &pub_a, "--list-version", "1"]);
    assert!(!o.status.success());
    assert!(
        kestrel_tests::stderr(&o).contains("v2"),
        "{}",
        kestrel_tests::stderr(&o)
    );
    downgrades_are_refused(&b, device, agent, &cfg, &root_dir, &pub_a);
}

/// A key list of a lower version put on the broker anyway: the device refuses it, before and
/// after a restart (the list in force is kept in keys.json).
fn downgrades_are_refused(
    b: &Broker,
    device: &str,
    agent: Proc,
    cfg: &Path,
    root_dir: &Path,
    pub_a: &str,
) {
    let old = SignedKeyList::new(
        &kestrel_tests::fleet::signing_key_file(&root_dir.join("root.key")),
        &KeyList {
            version: 1,
            keys: vec![std::fs::read_to_string(pub_a).unwrap().trim().to_string()],
            issued: kestrel_shared::issued_now(),
            expires: Some(kestrel_shared::now_unix() + 3600),
        },
    );
    let old = serde_json::to_vec(&old).unwrap();
    put(b, "kestrel/keys", old.clone(), true);
    let st = wait_status(&b.config(), device, 30, "downgrade refused", |st| {
        st.refused
            .as_deref()
            .is_some_and(|r| r.contains("downgrade"))
    });
    assert_eq!((st.keys_version, st.active), (Some(2), Some(2)), "{st:?}");

    // Restarted with the downgraded list still retained: v2 stays in force (keys.json).
    let _agent = restarted(agent, cfg, b, device, &st);
    put(b, "kestrel/keys", old, true);
    let st = wait_status(
        &b.config(),
        device,
        30,
        "downgrade refused after a restart",
        |st| {
            st.refused
                .as_deref()
                .is_some_and(|r| r.contains("downgrade"))
        },
    );
    assert_eq!(st.keys_version, Some(2), "{st:?}");
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
