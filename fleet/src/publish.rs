//! `trainer publish`: an artifact's retained chunks and signed offer, then a signed desired state.

use std::time::{Duration, Instant};

use ed25519_dalek::SigningKey;
use kestrel_shared::issued_now;
use kestrel_shared::mqtt::BrokerConfig;
use kestrel_shared::protocol::{ArtifactOffer, Desired, SignedDesired, Target, parse};
use serde::Serialize;

use crate::{Bundle, Conn, FleetError};

#[derive(Debug, Clone, Serialize)]
pub struct Published {
    pub name: String,
    pub version: u64,
    pub target: String,
    pub chunks: usize,
    /// The whole artifact's device files: what a device without any of its parts fetches (and
    /// what an agent from before parts fetches).
    pub bytes: u64,
    /// What a device at the replaced version fetches: the pieces of this version it does not
    /// hold (a new head on the same backbone: the head and the golden samples).
    pub bytes_update: u64,
    /// The target's desired version before this publish, if any.
    pub replaced: Option<u64>,
    pub seconds: f64,
}

/// The desired state currently retained for `target`, if any (signature not checked: this is
/// the publisher's own record).
pub fn current_desired(conn: &mut Conn, target: &Target) -> Result<Option<Desired>, FleetError> {
    let topic = conn.topics.desired(target);
    let retained = conn.retained(&topic, Duration::from_millis(400))?;
    Ok(match retained.get(&topic) {
        Some(p) if !p.is_empty() => {
            let s: SignedDesired = parse(&topic, p)?;
            Some(parse(&topic, s.body.as_bytes())?)
        }
        _ => None,
    })
}

/// The retained offer of `name` v`version`, if any.
pub fn retained_offer(
    conn: &mut Conn,
    name: &str,
    version: u64,
) -> Result<Option<ArtifactOffer>, FleetError> {
    let topic = conn.topics.artifact_manifest(name, version);
    match conn
        .retained(&topic, Duration::from_millis(300))?
        .get(&topic)
    {
        Some(p) if !p.is_empty() => Ok(Some(parse(&topic, p)?)),
        _ => Ok(None),
    }
}

/// How [`publish`] states the desired state.
#[derive(Debug, Clone, Default)]
pub struct PublishOptions {
    /// Allow a version below the target's current desired one.
    pub rollback: bool,
    /// The rollout that issues it, if any.
    pub rollout: Option<String>,
    /// Unix seconds after which devices refuse the desired state (freeze protection).
    pub expires: Option<u64>,
}

/// `trainer publish`: the artifact's chunks and signed offer (retained), then the signed desired
/// state of `target`. Versions only go up unless `rollback`; a version, once published, cannot
/// be published again with other content.
pub fn publish(
    cfg: &BrokerConfig,
    bundle: &Bundle,
    key: &SigningKey,
    target: &Target,
    options: PublishOptions,
) -> Result<Published, FleetError> {
    let PublishOptions {
        rollback,
        rollout,
        expires,
    } = options;
    let start = Instant::now();
    let mut conn = Conn::connect(cfg, "publish")?;
    let (name, version) = (bundle.offer.name.clone(), bundle.offer.version);
    let current = current_desired(&mut conn, target)?;
    if let Some(c) = &current
        && version < c.version
        && !rollback
    {
        return Err(FleetError::Refused(format!(
            "{target} is at v{} ({}); publishing the older v{version} needs --rollback",
            c.version, c.name
        )));
    }
    if let Some(old) = retained_offer(&mut conn, &name, version)? {
        if old.manifest != bundle.offer.manifest {
            return Err(FleetError::Refused(format!(
                "{name} v{version} is already published with other content; versions are immutable (export with a new --model-version)"
            )));
        }
    }
    let held = match &current {
        Some(c) => retained_offer(&mut conn, &c.name, c.version)?,
        None => None,
    };
    let bytes_update = bundle.bytes_beside(held.as_ref());
    let msgs = bundle.messages(&conn.topics);
    let pb = crate::progress(msgs.len() as u64 + 1, "publish");
    conn.publish_all(msgs, Some(&pb))?;
    let desired = Desired {
        target: target.clone(),
        name: name.clone(),
        version,
        rollback,
        issued: issued_now(),
        expires,
        clear: false,
        rollout,
        source: bundle.manifest.registry.clone(),
        shadow: None,
    };
    let d = serde_json::to_vec(&SignedDesired::new(key, &desired)).expect("serializable");
    conn.publish_all(vec![(conn.topics.desired(target), d, true)], Some(&pb))?;
    pb.finish_and_clear();
    conn.disconnect();
    Ok(Published {
        name,
        version,
        target: target.to_string(),
        chunks: bundle.chunks.len(),
        bytes: bundle.offer.total_bytes,
        bytes_update,
        replaced: current.map(|c| c.version),
        seconds: start.elapsed().as_secs_f64(),
    })
}
