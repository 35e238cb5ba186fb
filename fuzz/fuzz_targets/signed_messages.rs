//! Desired states and key lists as they arrive on their topics: parse, verify, and the agent's
//! replay / expiry / clear and key-list rules. The fuzzer cannot forge signatures, so the input
//! is also signed here as a body: that reaches the JSON of `Desired` and `KeyList` and the rules.
#![no_main]

use ed25519_dalek::SigningKey;
use edge_agent::core::desired::DesiredStates;
use edge_agent::core::trust::Trust;
use kestrel_shared::protocol::{SignedDesired, SignedKeyList, parse};
use kestrel_shared::signing::{PayloadType, sign};
use libfuzzer_sys::fuzz_target;

const TOPIC: &str = "kestrel/devices/pi/desired";

fuzz_target!(|data: &[u8]| {
    let key = SigningKey::from_bytes(&[7; 32]);
    let root = SigningKey::from_bytes(&[9; 32]);
    let trusted = [key.verifying_key()];
    let mut states = DesiredStates::default();
    let mut trust = Trust::new(Some(root.verifying_key()), trusted.to_vec(), None).unwrap();

    // As published bytes: signatures fail, nothing may panic.
    if let Ok(s) = parse::<SignedDesired>(TOPIC, data)
        && let Ok(d) = s.open(&trusted, TOPIC)
    {
        states.receive(TOPIC, d, 0);
    }
    if let Ok(s) = parse::<SignedKeyList>("kestrel/keys", data) {
        trust.receive(s, "kestrel/keys", 0);
    }

    // As a signed body.
    let body = String::from_utf8_lossy(data).into_owned();
    let signed = SignedDesired {
        signature: sign(&key, PayloadType::Desired, body.as_bytes()),
        body: body.clone(),
    };
    if let Ok(d) = signed.open(&trusted, TOPIC) {
        let now = d.issued / 1000;
        states.receive(TOPIC, d.clone(), now);
        states.receive(TOPIC, d, now);
        let _ = states.pick(TOPIC, now);
        let journaled = serde_json::to_vec(&states).unwrap();
        let _: DesiredStates = serde_json::from_slice(&journaled).unwrap();
    }
    let list = SignedKeyList {
        signature: sign(&root, PayloadType::KeyList, body.as_bytes()),
        body,
    };
    trust.receive(list.clone(), "kestrel/keys", 0);
    trust.receive(list, "kestrel/keys", 0);
    let _ = trust.keys();
    let _ = trust.lapse(u64::MAX);
    let _ = (trust.keys(), trust.lapsed(), trust.in_force());
});
