//! `trainer keys`: the root-signed list of publishing keys, retained on `P/keys`. Devices that
//! trust the root follow the newest list (rotation and revocation without touching them) and
//! refuse a lower version, so each list gets the next version. Each list expires (30 days by
//! default, [`kestrel_shared::protocol::DEFAULT_KEYS_VALIDITY_S`]): devices stop trusting its
//! keys then, so publish the list again (the next version) before it does.

use std::time::Duration;

use ed25519_dalek::{SigningKey, VerifyingKey};
use kestrel_shared::issued_now;
use kestrel_shared::mqtt::BrokerConfig;
use kestrel_shared::protocol::{KeyList, SignedKeyList, parse};
use kestrel_shared::signing::key_id;
use serde::Serialize;

use crate::{Conn, FleetError};

#[derive(Debug, Clone, Serialize)]
pub struct KeysPublished {
    pub version: u64,
    /// Key ids of the publishing keys now in force.
    pub keys: Vec<String>,
    /// The version it replaces, if a list was retained.
    pub replaced: Option<u64>,
    /// Unix seconds after which devices no longer trust these keys.
    pub expires: u64,
}

/// Publishes `keys` as the fleet's key list, signed by `root`: version `version`, or the
/// retained list's version + 1. A version not above the retained one is refused (devices would
/// refuse it too), as is a retained list the root does not verify. The list expires
/// `validity_s` seconds from now (at least 1: devices refuse a list without expiry).
pub fn publish_keys(
    cfg: &BrokerConfig,
    root: &SigningKey,
    keys: &[VerifyingKey],
    version: Option<u64>,
    validity_s: u64,
) -> Result<KeysPublished, FleetError> {
    if keys.is_empty() {
        return Err(FleetError::Refused(
            "a key list needs at least one publishing key (--publisher)".into(),
        ));
    }
    if validity_s == 0 {
        return Err(FleetError::Refused(
            "a key list needs a validity of at least 1 s (--expires-in): devices refuse one \
             without expiry"
                .into(),
        ));
    }
    let mut conn = Conn::connect(cfg, "keys")?;
    let topic = conn.topics.keys();
    let current = retained_version(&mut conn, &topic, root)?;
    let version = version.unwrap_or_else(|| current.map_or(1, |v| v + 1));
    if let Some(c) = current
        && version <= c
    {
        return Err(FleetError::Refused(format!(
            "{topic} holds key list v{c}: a new list needs a higher version than that (devices refuse \
             v{version})"
        )));
    }
    let list = KeyList {
        version,
        keys: keys.iter().map(|k| hex::encode(k.as_bytes())).collect(),
        issued: issued_now(),
        expires: Some(kestrel_shared::now_unix().saturating_add(validity_s)),
    };
    let payload = serde_json::to_vec(&SignedKeyList::new(root, &list)).expect("serializable");
    conn.publish_all(vec![(topic, payload, true)], None)?;
    conn.disconnect();
    Ok(KeysPublished {
        version,
        keys: keys.iter().map(key_id).collect(),
        replaced: current,
        expires: list.expires.unwrap_or_default(),
    })
}

/// The version of the list retained on `topic`, if any (verified by the root; expired or not).
fn retained_version(
    conn: &mut Conn,
    topic: &str,
    root: &SigningKey,
) -> Result<Option<u64>, FleetError> {
    let retained = conn.retained(topic, Duration::from_millis(400))?;
    let Some(p) = retained.get(topic).filter(|p| !p.is_empty()) else {
        return Ok(None);
    };
    let signed: SignedKeyList = parse(topic, p)?;
    Ok(Some(signed.open(&root.verifying_key(), topic)?.0.version))
}
