//! `trainer unpublish` and `trainer prune`: clearing the retained chunks and offers of artifact
//! versions that nothing needs any more, so that the broker's memory and persistence do not grow
//! with every release of the learning loop.
//!
//! A version is *needed* while a retained desired state names it (as the model or the shadow, of
//! a device or a group: a device that has not installed it yet downloads it from there) or while
//! a running rollout may still send a device to it (its own version, and each device's previous
//! model, the target of an abort). [`plan`] decides without IO; [`prune`] and [`unpublish`] read
//! the retained state, decide, and clear: the offer first (no device starts a download of a
//! version being removed), then its chunks (each an empty retained message).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use kestrel_shared::mqtt::BrokerConfig;
use kestrel_shared::protocol::{ArtifactOffer, Desired, SignedDesired, parse};
use kestrel_shared::topics::Route;
use serde::Serialize;

use crate::rollout::RolloutState;
use crate::{Conn, FleetError};

/// A model version: (name, version).
pub type Version = (String, u64);

/// Why a version is kept: who needs it.
pub type Needs = BTreeMap<Version, Vec<String>>;

/// What a prune or unpublish did.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Pruned {
    /// Versions cleared, with the number of chunk messages each had.
    pub removed: Vec<Removed>,
    /// Versions kept, newest first per model, with who needs them (empty: kept by `--keep`).
    pub kept: Vec<Kept>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Removed {
    pub name: String,
    pub version: u64,
    pub chunks: usize,
    /// Its pieces no version kept on the broker lists, cleared with it.
    pub parts: usize,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Kept {
    pub name: String,
    pub version: u64,
    pub needed_by: Vec<String>,
}

/// Which of the `published` versions to clear: per model, all but the `keep` newest, except
/// those `needs` names. Returns (to clear, to keep), newest first per model.
pub fn plan(
    published: &BTreeSet<Version>,
    needs: &Needs,
    keep: usize,
) -> (Vec<Version>, Vec<Version>) {
    let mut by_model: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    for (name, v) in published {
        by_model.entry(name).or_default().push(*v);
    }
    let (mut clear, mut kept) = (Vec::new(), Vec::new());
    for (name, mut versions) in by_model {
        versions.sort_unstable_by(|a, b| b.cmp(a));
        for (i, v) in versions.into_iter().enumerate() {
            let version = (name.to_string(), v);
            if i < keep || needs.contains_key(&version) {
                kept.push(version);
            } else {
                clear.push(version);
            }
        }
    }
    (clear, kept)
}

/// Who needs which version: retained desired states (`topic` -> payload) and rollout
/// controllers. A message that does not parse needs nothing (and is named in the log).
pub fn needs(
    desired: &BTreeMap<String, Vec<u8>>,
    rollouts: &BTreeMap<String, Vec<u8>>,
    log: &mut dyn FnMut(String),
) -> Needs {
    let mut needs = Needs::new();
    let mut add = |v: Version, who: String| needs.entry(v).or_default().push(who);
    for (topic, payload) in desired.iter().filter(|(_, p)| !p.is_empty()) {
        let d = parse::<SignedDesired>(topic, payload)
            .and_then(|s| parse::<Desired>(topic, s.body.as_bytes()));
        match d {
            Ok(d) if d.clear => {}
            Ok(d) => {
                add(
                    (d.name.clone(), d.version),
                    format!("{} desires it", d.target),
                );
                if let Some(s) = d.shadow {
                    add(
                        (s.name, s.version),
                        format!("{} runs it in shadow", d.target),
                    );
                }
            }
            Err(e) => log(format!("skipped: {e}")),
        }
    }
    for (topic, payload) in rollouts.iter().filter(|(_, p)| !p.is_empty()) {
        match crate::rollout::saved::read(topic, payload) {
            Ok(c) if c.state == RolloutState::Running => {
                let who = format!("rollout {} is running", c.name);
                add((c.model.clone(), c.version), who.clone());
                for prev in c.devices.values().filter_map(|d| d.previous.clone()) {
                    add(prev, format!("{who} (an abort sends devices back to it)"));
                }
            }
            Ok(_) => {}
            Err(e) => log(format!("skipped: {e}")),
        }
    }
    for whos in needs.values_mut() {
        whos.sort();
        whos.dedup();
    }
    needs
}

/// The retained state a decision needs: the offers by version, and who needs what.
fn read(
    conn: &mut Conn,
    log: &mut dyn FnMut(String),
) -> Result<(BTreeMap<Version, ArtifactOffer>, Needs), FleetError> {
    let quiet = Duration::from_millis(400);
    let t = conn.topics.clone();
    let mut offers = BTreeMap::new();
    let manifests = format!("{}/artifacts/+/+/manifest", t.prefix());
    for (topic, payload) in conn.retained(&manifests, quiet)? {
        let Some(Route::Offer { name, version }) = t.parse(&topic) else {
            continue;
        };
        if payload.is_empty() {
            continue;
        }
        match parse::<ArtifactOffer>(&topic, &payload) {
            Ok(o) if o.name == name && o.version == version => {
                offers.insert((name.to_string(), version), o);
            }
            Ok(_) => log(format!("skipped: {topic}: names another version")),
            Err(e) => log(format!("skipped: {e}")),
        }
    }
    let mut desired = conn.retained(&format!("{}/devices/+/desired", t.prefix()), quiet)?;
    desired.extend(conn.retained(&format!("{}/groups/+/desired", t.prefix()), quiet)?);
    let rollouts = conn.retained(&t.rollout_states_filter(), quiet)?;
    Ok((offers, needs(&desired, &rollouts, log)))
}

/// The pieces the offers of `versions` list: shared by the versions, cleared with the last.
fn pieces_of<'a>(
    offers: &'a BTreeMap<Version, ArtifactOffer>,
    versions: impl Iterator<Item = &'a Version>,
) -> std::collections::HashSet<&'a str> {
    let listed = versions
        .filter_map(|v| offers.get(v))
        .flat_map(|o| &o.pieces);
    listed.map(|p| p.sha256.as_str()).collect()
}

/// Clears a version's offer, then its chunks, then those of its pieces that no offer in `used`
/// lists.
fn clear(
    conn: &mut Conn,
    offer: &ArtifactOffer,
    used: &std::collections::HashSet<&str>,
) -> Result<Removed, FleetError> {
    let (name, version) = (&offer.name, offer.version);
    let t = conn.topics.clone();
    conn.publish_all(
        vec![(t.artifact_manifest(name, version), vec![], true)],
        None,
    )?;
    let mut chunks: Vec<_> = (0..offer.chunks.len() as u32)
        .map(|i| (t.chunk(name, version, i), vec![], true))
        .collect();
    let mut parts = std::collections::HashSet::new();
    for p in offer
        .pieces
        .iter()
        .filter(|p| !used.contains(p.sha256.as_str()))
    {
        if parts.insert(p.sha256.as_str()) {
            let n = p.chunks.len() as u32;
            let cb = offer.chunk_bytes;
            chunks.extend((0..n).map(|i| (t.part_chunk(&p.sha256, cb, i), vec![], true)));
        }
    }
    let pb = crate::progress(chunks.len() as u64, "clear");
    conn.publish_all(chunks, Some(&pb))?;
    pb.finish_and_clear();
    Ok(Removed {
        name: name.clone(),
        version,
        chunks: offer.chunks.len(),
        parts: parts.len(),
    })
}

fn kept(v: Version, needs: &Needs) -> Kept {
    Kept {
        needed_by: needs.get(&v).cloned().unwrap_or_default(),
        name: v.0,
        version: v.1,
    }
}

/// `trainer prune --keep N`: clears every published version but the `keep` newest of each model
/// and those still needed.
pub fn prune(
    cfg: &BrokerConfig,
    keep: usize,
    log: &mut dyn FnMut(String),
) -> Result<Pruned, FleetError> {
    let mut conn = Conn::connect(cfg, "prune")?;
    let (offers, needs) = read(&mut conn, log)?;
    let published = offers.keys().cloned().collect();
    let (to_clear, to_keep) = plan(&published, &needs, keep);
    let used = pieces_of(&offers, to_keep.iter());
    let mut removed = Vec::new();
    for v in &to_clear {
        removed.push(clear(&mut conn, &offers[v], &used)?);
    }
    conn.disconnect();
    Ok(Pruned {
        removed,
        kept: to_keep.into_iter().map(|v| kept(v, &needs)).collect(),
    })
}

/// `trainer unpublish NAME VERSION`: clears one version, refused while something needs it.
pub fn unpublish(
    cfg: &BrokerConfig,
    name: &str,
    version: u64,
    log: &mut dyn FnMut(String),
) -> Result<Removed, FleetError> {
    let mut conn = Conn::connect(cfg, "unpublish")?;
    let (offers, needs) = read(&mut conn, log)?;
    let v = (name.to_string(), version);
    if let Some(who) = needs.get(&v) {
        return Err(FleetError::Refused(format!(
            "{name} v{version} is still needed: {}",
            who.join("; ")
        )));
    }
    let Some(offer) = offers.get(&v) else {
        return Err(FleetError::Refused(format!(
            "{name} v{version} is not published on {}",
            cfg.url
        )));
    };
    let used = pieces_of(&offers, offers.keys().filter(|k| **k != v));
    let removed = clear(&mut conn, offer, &used)?;
    conn.disconnect();
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(name: &str, version: u64) -> Version {
        (name.to_string(), version)
    }

    #[test]
    fn keeps_the_newest_and_what_is_needed() {
        let published: BTreeSet<Version> = [1, 2, 3, 4, 5]
            .into_iter()
            .map(|n| v("lfw", n))
            .chain([v("cam", 7)])
            .collect();
        let needs = Needs::from([(v("lfw", 1), vec!["device/pi-1 desires it".into()])]);
        let (clear, keep) = plan(&published, &needs, 2);
        assert_eq!(clear, [v("lfw", 3), v("lfw", 2)]);
        assert_eq!(keep, [v("cam", 7), v("lfw", 5), v("lfw", 4), v("lfw", 1)]);
        // --keep 0 clears everything nothing needs.
        let (clear, keep) = plan(&published, &needs, 0);
        assert_eq!(clear.len(), 5);
        assert_eq!(keep, [v("lfw", 1)]);
    }

    #[test]
    fn desired_states_and_running_rollouts_need_versions() {
        let key = ed25519_dalek::SigningKey::from_bytes(&[7; 32]);
        let d = |target: &str, version: u64, clear: bool, shadow: Option<u64>| {
            let desired = Desired {
                target: target.parse().unwrap(),
                name: "lfw".into(),
                version,
                rollback: false,
                issued: 1,
                expires: None,
                clear,
                rollout: None,
                source: None,
                shadow: shadow.map(|v| kestrel_shared::protocol::ModelRef {
                    name: "lfw".into(),
                    version: v,
                }),
            };
            serde_json::to_vec(&SignedDesired::new(&key, &desired)).unwrap()
        };
        let desired = BTreeMap::from([
            (
                "k/devices/a/desired".to_string(),
                d("device/a", 3, false, Some(4)),
            ),
            (
                "k/groups/g/desired".to_string(),
                d("group/g", 2, false, None),
            ),
            (
                "k/devices/b/desired".to_string(),
                d("device/b", 9, true, None),
            ),
            ("k/devices/c/desired".to_string(), b"{garbage".to_vec()),
            ("k/devices/e/desired".to_string(), vec![]),
        ]);
        let mut said = Vec::new();
        let n = needs(&desired, &BTreeMap::new(), &mut |l| said.push(l));
        let keys: Vec<_> = n.keys().cloned().collect();
        assert_eq!(keys, [v("lfw", 2), v("lfw", 3), v("lfw", 4)]);
        assert_eq!(n[&v("lfw", 4)], ["device/a runs it in shadow"]);
        assert!(said[0].contains("k/devices/c/desired"), "{said:?}");
    }
}
