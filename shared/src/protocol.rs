//! The MQTT protocol between the trainer (publisher, rollout controller) and edge agents: topic
//! layout and message types. `docs/protocol.md` describes the same thing for people; the two must
//! agree. No IO here: both sides build topics and payloads with these functions and types.
//!
//! Topics ([`crate::topics`]), under a configurable prefix (default `kestrel`):
//!
//! | topic | payload | retained | publisher |
//! |---|---|---|---|
//! | `P/artifacts/<name>/<version>/manifest` | [`ArtifactOffer`] JSON | yes | trainer publish |
//! | `P/artifacts/<name>/<version>/chunks/<i>` | raw bytes of chunk `i` | yes | trainer publish |
//! | `P/parts/<sha256>/<chunk_bytes>/<i>` | raw bytes of chunk `i` of a [`Piece`] | yes | trainer publish |
//! | `P/devices/<id>/desired` | [`SignedDesired`] JSON | yes | trainer publish / rollout |
//! | `P/groups/<group>/desired` | [`SignedDesired`] JSON | yes | trainer publish / rollout |
//! | `P/keys` | [`SignedKeyList`] JSON | yes | trainer keys publish (root key) |
//! | `P/devices/<id>/status` | [`Status`] JSON | yes | agent |
//! | `P/devices/<id>/online` | `1` or `0` (last will) | yes | agent / broker |
//! | `P/devices/<id>/events` | [`DeviceEvent`] JSON | no | agent |
//! | `P/devices/<id>/infer/<request>` | encoded image bytes | no | any client |
//! | `P/devices/<id>/result/<request>` | [`InferReply`] JSON | no | agent |

use serde::{Deserialize, Serialize};

use crate::manifest::{FileEntry, Manifest};
use crate::signing::{PayloadType, SignError, SignatureFile, sign, verify};
pub use crate::wire::{Class, DeviceState, EventKind, ShadowState, sha256_hex};

/// How long a desired state is valid by default (`trainer publish --expires-in`, rollouts, which
/// renew theirs while they run): 7 days. A device refuses an expired state, so a state withheld
/// by the broker, or recorded and shown to a device later, stops being followed by then.
pub const DEFAULT_VALIDITY_S: u64 = 7 * 24 * 3600;

/// How long a key list is valid by default (`trainer keys --expires-in`): 30 days. A device
/// stops trusting the publishing keys of a list once it expires (only its root remains), so a
/// device whose key-list updates are withheld does not trust a revoked key forever; publish the
/// list again (a new version) before then.
pub const DEFAULT_KEYS_VALIDITY_S: u64 = 30 * 24 * 3600;

/// Default chunk size of artifact delivery (AWS IoT streams use ≤ 128 KB blocks).
pub const DEFAULT_CHUNK_BYTES: usize = 128 * 1024;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ProtocolError {
    #[error("{topic}: {reason}")]
    Payload { topic: String, reason: String },
    #[error("{0}: not a valid name (1-64 of a-z A-Z 0-9 . _ -)")]
    BadName(String),
    #[error(transparent)]
    Signature(#[from] SignError),
}

/// Device ids, group names and model names become topic levels: keep them plain.
pub fn check_name(name: &str) -> Result<&str, ProtocolError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(name)
    } else {
        Err(ProtocolError::BadName(name.to_string()))
    }
}

/// Who a desired state is for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    Device(String),
    Group(String),
}

impl std::str::FromStr for Target {
    type Err = ProtocolError;
    /// `device/<id>` or `group/<name>`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once('/') {
            Some(("device", id)) => Ok(Target::Device(check_name(id)?.to_string())),
            Some(("group", g)) => Ok(Target::Group(check_name(g)?.to_string())),
            _ => Err(ProtocolError::BadName(format!(
                "{s} (expected device/<id> or group/<name>)"
            ))),
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Device(d) => write!(f, "device/{d}"),
            Target::Group(g) => write!(f, "group/{g}"),
        }
    }
}

/// The retained description of a published artifact: the exact signed manifest, and how its
/// device files are cut into chunks. The bundle is the concatenation of [`device_files`] in
/// order; chunk `i` is bytes `[i*chunk_bytes, (i+1)*chunk_bytes)` of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArtifactOffer {
    pub name: String,
    pub version: u64,
    /// The exact bytes of `manifest.json` (signed).
    pub manifest: String,
    pub signature: SignatureFile,
    pub chunk_bytes: u64,
    /// sha256 (hex) of every chunk.
    pub chunks: Vec<String>,
    pub total_bytes: u64,
    /// The same bundle as content-addressed pieces ([`pieces`]), each cut into `chunk_bytes`
    /// chunks of its own on `P/parts/<sha256>/<chunk_bytes>/<i>`: a device fetches only the pieces it
    /// does not hold. Empty in offers from before parts; an agent from before parts ignores it
    /// and fetches the whole bundle's chunks above, which are published too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pieces: Vec<Piece>,
}

/// A content-addressed piece of a bundle: a part of the composed model ([`Composition`]), or a
/// whole device file. Its name is its sha256, so versions that share it share its topics, and a
/// device that holds it does not fetch it again.
///
/// [`Composition`]: crate::manifest::Composition
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Piece {
    pub sha256: String,
    pub size: u64,
    /// sha256 (hex) of every chunk of the piece.
    pub chunks: Vec<String>,
}

/// The pieces of a manifest's bundle, in bundle order, as (sha256, size): each device file,
/// with the composed file (`model.onnx`) as its parts. Together they are the bundle.
pub fn pieces(m: &Manifest) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for f in device_files(m) {
        match &m.composition {
            Some(c) if c.file == f.path => {
                out.extend(c.parts.iter().map(|p| (p.sha256.clone(), p.size)));
            }
            _ => out.push((f.sha256.clone(), f.size)),
        }
    }
    out
}

/// A sha256 as a topic level: 64 lowercase hex digits.
pub fn is_sha256(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The files a device needs: the model and the golden samples of its health check, in manifest
/// order. The trainer-side files (full weights, head) stay in the artifact directory.
pub fn device_files(m: &Manifest) -> Vec<&FileEntry> {
    m.files
        .iter()
        .filter(|f| f.path == "model.onnx" || m.golden.iter().any(|g| g.file == f.path))
        .collect()
}

/// A byte count as people read it: `512 B`, `11.0 KB`, `13.5 MB` (powers of 1000).
pub fn human_bytes(n: u64) -> String {
    match n {
        0..1_000 => format!("{n} B"),
        1_000..1_000_000 => format!("{:.1} KB", n as f64 / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1} MB", n as f64 / 1e6),
        _ => format!("{:.2} GB", n as f64 / 1e9),
    }
}

impl ArtifactOffer {
    /// Describes `bundle` (the device files concatenated) cut into `chunk_bytes` chunks.
    pub fn new(
        manifest: &Manifest,
        manifest_text: String,
        signature: SignatureFile,
        bundle: &[u8],
        chunk_bytes: usize,
    ) -> Self {
        let mut at = 0usize;
        let mut cut = Vec::new();
        for (sha256, size) in pieces(manifest) {
            let end = at.checked_add(usize::try_from(size).unwrap_or(usize::MAX));
            let Some(bytes) = end.and_then(|end| bundle.get(at..end)) else {
                cut.clear(); // the manifest does not describe this bundle: no pieces
                break;
            };
            at += bytes.len();
            cut.push(Piece {
                sha256,
                size,
                chunks: bytes.chunks(chunk_bytes).map(sha256_hex).collect(),
            });
        }
        if at != bundle.len() {
            cut.clear();
        }
        Self {
            name: manifest.name.clone(),
            version: manifest.version,
            manifest: manifest_text,
            signature,
            chunk_bytes: chunk_bytes as u64,
            chunks: bundle.chunks(chunk_bytes).map(sha256_hex).collect(),
            total_bytes: bundle.len() as u64,
            pieces: cut,
        }
    }

    /// The bundle chunk indexes of the pieces, one range per piece: a device's download counts
    /// the pieces' chunks one after another.
    pub fn piece_ranges(&self) -> Vec<std::ops::Range<u32>> {
        let mut at = 0u32;
        self.pieces
            .iter()
            .map(|p| {
                let r = at..at + p.chunks.len() as u32;
                at = r.end;
                r
            })
            .collect()
    }

    /// The chunks a device downloads: the pieces' (when the offer has them), else the bundle's.
    pub fn download_chunks(&self) -> Vec<&str> {
        if self.pieces.is_empty() {
            self.chunks.iter().map(String::as_str).collect()
        } else {
            let all = self.pieces.iter().flat_map(|p| &p.chunks);
            all.map(String::as_str).collect()
        }
    }

    /// Checks the signature with `trusted` keys, parses the manifest and checks that it agrees
    /// with the offer (name, version, chunk count and total size of the device files).
    pub fn open(&self, trusted: &[ed25519_dalek::VerifyingKey]) -> Result<Manifest, ProtocolError> {
        verify(
            trusted,
            PayloadType::Manifest,
            self.manifest.as_bytes(),
            &self.signature,
        )?;
        let bad = |reason: String| ProtocolError::Payload {
            topic: format!("artifact {} v{}", self.name, self.version),
            reason,
        };
        let m: Manifest = serde_json::from_str(&self.manifest)
            .map_err(|e| bad(format!("invalid manifest: {e}")))?;
        if m.name != self.name || m.version != self.version {
            return Err(bad(format!(
                "the signed manifest is {} v{}",
                m.name, m.version
            )));
        }
        let total: u64 = device_files(&m).iter().map(|f| f.size).sum();
        let expect_chunks = total.div_ceil(self.chunk_bytes.max(1));
        if total != self.total_bytes || expect_chunks != self.chunks.len() as u64 {
            return Err(bad(format!(
                "offer says {} bytes in {} chunks, the manifest's device files are {total} bytes",
                self.total_bytes,
                self.chunks.len()
            )));
        }
        self.check_pieces(&m).map_err(bad)?;
        Ok(m)
    }

    /// The offer's pieces, if any, are the signed manifest's ([`pieces`]), each in as many
    /// chunks as its size needs.
    fn check_pieces(&self, m: &Manifest) -> Result<(), String> {
        if self.pieces.is_empty() {
            return Ok(());
        }
        let want = pieces(m);
        if want.len() != self.pieces.len() {
            return Err(format!(
                "offer has {} pieces, the manifest's device files are {}",
                self.pieces.len(),
                want.len()
            ));
        }
        for (i, (p, (sha256, size))) in self.pieces.iter().zip(&want).enumerate() {
            let chunks = size.div_ceil(self.chunk_bytes.max(1));
            if !is_sha256(&p.sha256) || p.sha256 != *sha256 || p.size != *size {
                return Err(format!(
                    "piece {i} is {} ({} bytes), the manifest's is {sha256} ({size} bytes)",
                    p.sha256, p.size
                ));
            }
            if p.chunks.len() as u64 != chunks {
                return Err(format!(
                    "piece {i} ({sha256}) has {} chunks, {size} bytes need {chunks}",
                    p.chunks.len()
                ));
            }
        }
        Ok(())
    }
}

/// What a device (or every device of a group) should run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Desired {
    pub target: Target,
    pub name: String,
    pub version: u64,
    /// Explicitly allowed to go below the device's active version.
    #[serde(default)]
    pub rollback: bool,
    /// Milliseconds since the Unix epoch when this was issued ([`crate::issued_now`]): the
    /// newest group state wins, and a device refuses one older than the newest it accepted on
    /// the same topic (replay protection; see docs/protocol.md).
    pub issued: u64,
    /// Seconds since the Unix epoch after which a device refuses this state (freeze protection:
    /// a state withheld and delivered late is reported, not followed). None: it never expires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires: Option<u64>,
    /// A signed clear: the target has no desired state any more (`name` and `version` are not
    /// used). Devices ignore an unsigned clear (an empty retained payload).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub clear: bool,
    /// Rollout that issued it, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<String>,
    /// The MLflow registry version of the model (`models:/NAME/VERSION`), when it came from one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// A candidate to run in shadow beside `name`/`version`: downloaded and verified by the same
    /// rules, run on the same live inputs, never answering; its agreement with the active model
    /// is reported in the device's quality telemetry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shadow: Option<ModelRef>,
}

/// A model by name and version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelRef {
    pub name: String,
    pub version: u64,
}

/// A desired state as published: the exact JSON of [`Desired`] and its signature.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SignedDesired {
    pub body: String,
    pub signature: SignatureFile,
}

impl SignedDesired {
    pub fn new(key: &ed25519_dalek::SigningKey, d: &Desired) -> Self {
        let body = serde_json::to_string(d).expect("serializable");
        Self {
            signature: sign(key, PayloadType::Desired, body.as_bytes()),
            body,
        }
    }

    /// Verifies the signature and returns the desired state.
    pub fn open(
        &self,
        trusted: &[ed25519_dalek::VerifyingKey],
        topic: &str,
    ) -> Result<Desired, ProtocolError> {
        verify(
            trusted,
            PayloadType::Desired,
            self.body.as_bytes(),
            &self.signature,
        )?;
        serde_json::from_str(&self.body).map_err(|e| ProtocolError::Payload {
            topic: topic.to_string(),
            reason: e.to_string(),
        })
    }
}

/// The publishing keys devices accept (signers of manifests and desired states), versioned and
/// signed by the fleet's root key, which stays offline (`trainer keygen --root`). A device that
/// trusts the root follows the newest list it has verified and refuses a lower version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyList {
    /// Strictly increasing: a device refuses a list whose version is below the one it holds.
    pub version: u64,
    /// The accepted publishing keys, ed25519 public keys in hex.
    pub keys: Vec<String>,
    /// Milliseconds since the Unix epoch when this was issued.
    pub issued: u64,
    /// Seconds since the Unix epoch after which a device no longer trusts these keys (freeze
    /// protection, as for desired states). Devices refuse a list without it; it is optional here
    /// only so that a list saved by an older agent still parses (and keeps its version as the
    /// floor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires: Option<u64>,
}

/// A key list as published: the exact JSON of [`KeyList`] and the root key's signature.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SignedKeyList {
    pub body: String,
    pub signature: SignatureFile,
}

impl SignedKeyList {
    pub fn new(root: &ed25519_dalek::SigningKey, list: &KeyList) -> Self {
        let body = serde_json::to_string(list).expect("serializable");
        Self {
            signature: sign(root, PayloadType::KeyList, body.as_bytes()),
            body,
        }
    }

    /// Verifies the root's signature; returns the list and its keys, parsed.
    pub fn open(
        &self,
        root: &ed25519_dalek::VerifyingKey,
        topic: &str,
    ) -> Result<(KeyList, Vec<ed25519_dalek::VerifyingKey>), ProtocolError> {
        verify(
            std::slice::from_ref(root),
            PayloadType::KeyList,
            self.body.as_bytes(),
            &self.signature,
        )?;
        let list: KeyList =
            serde_json::from_str(&self.body).map_err(|e| ProtocolError::Payload {
                topic: topic.to_string(),
                reason: e.to_string(),
            })?;
        let keys = list
            .keys
            .iter()
            .map(|k| crate::signing::public_key(k, &format!("{topic}: key list v{}", list.version)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((list, keys))
    }
}

/// Parses a JSON payload, naming the topic on failure.
pub fn parse<T: serde::de::DeserializeOwned>(
    topic: &str,
    payload: &[u8],
) -> Result<T, ProtocolError> {
    serde_json::from_slice(payload).map_err(|e| ProtocolError::Payload {
        topic: topic.to_string(),
        reason: e.to_string(),
    })
}

/// Inference latency: percentiles over the device's recent requests, and a histogram of every
/// request since the agent process started.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencyStats {
    pub count: u64,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p95_ms: f64,
    /// Requests by latency, over [`LATENCY_BUCKETS_S`] (empty from agents that predate it).
    #[serde(default, skip_serializing_if = "LatencyHistogram::is_empty")]
    pub histogram: LatencyHistogram,
}

/// Upper bounds (seconds) of the latency histogram's buckets: 1 ms to 10 s, the range of a
/// model on a Pi; a last bucket holds what is slower.
pub const LATENCY_BUCKETS_S: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

/// Requests per latency bucket (not cumulative): `counts[i]` took at most
/// `LATENCY_BUCKETS_S[i]` and more than the bound before it; the last count, more than 10 s.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencyHistogram {
    pub counts: Vec<u64>,
    /// Total latency of the requests counted, in seconds.
    pub sum_s: f64,
}

impl LatencyHistogram {
    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    /// Counts one request that took `seconds`.
    pub fn observe(&mut self, seconds: f64) {
        if self.counts.len() != LATENCY_BUCKETS_S.len() + 1 {
            self.counts = vec![0; LATENCY_BUCKETS_S.len() + 1];
        }
        let i = LATENCY_BUCKETS_S.partition_point(|b| *b < seconds);
        self.counts[i] += 1;
        self.sum_s += seconds;
    }

    /// Cumulative counts per bound, the `+Inf` bucket last (Prometheus' `_bucket{le}`), when the
    /// histogram is well formed: one count per bucket and a finite, non-negative sum.
    pub fn cumulative(&self) -> Option<Vec<u64>> {
        if self.counts.len() != LATENCY_BUCKETS_S.len() + 1
            || !self.sum_s.is_finite()
            || self.sum_s < 0.0
        {
            return None;
        }
        let mut total = 0u64;
        Some(
            self.counts
                .iter()
                .map(|c| {
                    total = total.saturating_add(*c);
                    total
                })
                .collect(),
        )
    }
}

/// What a device has done since its agent process started (they start from 0 again with a new
/// process, which the status's `started` shows): Prometheus counters on the console.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DeviceCounters {
    /// Inference requests the active model answered.
    pub requests_answered: u64,
    /// Requests that got an error: an image that does not decode, no active model.
    pub requests_failed: u64,
    /// Requests refused before inference: over the size limit, or the queue was full.
    pub requests_refused: u64,
    /// Updates by outcome: made active, rejected (verification or health check), rolled back.
    pub updates_active: u64,
    pub updates_rejected: u64,
    pub updates_rolled_back: u64,
    /// Chunk deliveries that failed their sha256 (dropped and asked for again).
    pub chunks_corrupt: u64,
    /// Artifact bytes downloaded (chunks that matched their sha256 and were kept).
    pub bytes_fetched: u64,
    /// Artifact bytes not downloaded because the device held them: pieces of an offer already in
    /// its part store (checked against their sha256 first).
    pub bytes_reused: u64,
}

/// A device's retained status.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Status {
    pub device: String,
    pub groups: Vec<String>,
    pub state: DeviceState,
    pub model: Option<String>,
    pub active: Option<u64>,
    pub previous: Option<u64>,
    /// Version being installed.
    pub target: Option<u64>,
    /// sha256 of the active model's signed manifest (`manifest.json`): with `model` and `active`,
    /// which model this is (a different model at the same version has another). None from
    /// agents before it, or when the agent does not know it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest_sha256: Option<String>,
    /// Chunks received of the version being installed, and how many there are.
    #[serde(default)]
    pub progress: Option<(u32, u32)>,
    pub last_error: Option<String>,
    /// The version whose installation failed last (rejected or rolled back), if any.
    #[serde(default)]
    pub failed_version: Option<u64>,
    pub latency: LatencyStats,
    /// RFC 3339 UTC.
    pub updated: String,
    /// When the agent process that published this status started (milliseconds since the Unix
    /// epoch): an agent restart shows as a later value. 0 from agents that predate the field.
    #[serde(default)]
    pub started: u64,
    /// Statuses this agent process published before this one: `(started, seq)` orders a
    /// device's statuses exactly (a status re-published after a reconnect has a higher `seq`).
    #[serde(default)]
    pub seq: u64,
    /// The registry version of the active model (`models:/NAME/VERSION`), from its manifest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// The last desired state or key list this device refused by the replay, expiry, clear and
    /// key-list rules, and why (the model it runs is unaffected).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
    /// The version of the root-signed key list in force, when the device follows one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys_version: Option<u64>,
    /// The shadow model the desired state names, if any, and how far the device got with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shadow: Option<ShadowStatus>,
    /// Input capture counters (`[capture]` enabled only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub captures: Option<crate::capture::CaptureStats>,
    /// Requests and updates since the agent process started.
    #[serde(default)]
    pub counters: DeviceCounters,
}

/// A shadow model on a device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShadowStatus {
    pub name: String,
    pub version: u64,
    pub state: ShadowState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A transition, published as it happens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceEvent {
    pub device: String,
    pub kind: EventKind,
    pub version: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub time: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    pub image: String,
    pub top: Vec<Class>,
    pub model: String,
    pub version: u64,
    pub latency_ms: f64,
}

/// The answer to an inference request: a prediction or an error.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InferReply {
    pub request: String,
    pub device: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prediction: Option<Prediction>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::signing::{keypair_hex, public_key, secret_key};
    use crate::topics::Topics;

    #[test]
    fn targets_and_names() {
        let t = Topics::new("kestrel/");
        assert_eq!(
            "group/canary".parse::<Target>().map(|g| t.desired(&g)),
            Ok("kestrel/groups/canary/desired".to_string())
        );
        assert!("device/../x".parse::<Target>().is_err());
        assert!("device/a+b".parse::<Target>().is_err());
        assert!("devices/a".parse::<Target>().is_err());
    }

    #[test]
    fn key_lists_verify_with_the_root_only() {
        let (root_sk, root_pk) = keypair_hex([3; 32]);
        let (_, publisher) = keypair_hex([4; 32]);
        let root_sk = secret_key(&root_sk, "root").unwrap();
        let root_pk = public_key(&root_pk, "root").unwrap();
        let list = KeyList {
            version: 2,
            keys: vec![publisher.clone()],
            issued: 7,
            expires: Some(1_800_000_000),
        };
        let signed = SignedKeyList::new(&root_sk, &list);
        assert!(
            signed.body.contains("\"expires\":1800000000"),
            "{}",
            signed.body
        );
        let (back, keys) = signed.open(&root_pk, "k/keys").unwrap();
        assert_eq!(back, list);
        assert_eq!(keys, vec![public_key(&publisher, "p").unwrap()]);
        // Signed by a publishing key instead of the root: refused.
        let (pub_sk, _) = keypair_hex([4; 32]);
        let by_publisher = SignedKeyList::new(&secret_key(&pub_sk, "p").unwrap(), &list);
        assert!(matches!(
            by_publisher.open(&root_pk, "k/keys"),
            Err(ProtocolError::Signature(SignError::UnknownKey(_)))
        ));
    }

    /// A list signed before key lists expired still parses (a device keeps its version as the
    /// floor); that it is then not trusted is the agent's rule (`edge-agent/src/trust.rs`).
    #[test]
    fn a_key_list_without_expiry_still_parses() {
        let (root_sk, root_pk) = keypair_hex([3; 32]);
        let (_, publisher) = keypair_hex([4; 32]);
        let root_sk = secret_key(&root_sk, "root").unwrap();
        let old = format!(r#"{{"version":1,"keys":["{publisher}"],"issued":7}}"#);
        let signed = SignedKeyList {
            signature: sign(&root_sk, PayloadType::KeyList, old.as_bytes()),
            body: old,
        };
        let (list, _) = signed
            .open(&public_key(&root_pk, "root").unwrap(), "k/keys")
            .unwrap();
        assert_eq!((list.version, list.expires), (1, None));
    }

    #[test]
    fn signed_desired_round_trip_and_rejections() {
        let (sk, pk) = keypair_hex([1; 32]);
        let (_, other) = keypair_hex([2; 32]);
        let sk = secret_key(&sk, "k").unwrap();
        let pk = public_key(&pk, "p").unwrap();
        let other = public_key(&other, "o").unwrap();
        let d = Desired {
            target: Target::Device("pi".into()),
            name: "m".into(),
            version: 2,
            rollback: false,
            issued: 5,
            expires: None,
            clear: false,
            rollout: None,
            source: None,
            shadow: None,
        };
        let s = SignedDesired::new(&sk, &d);
        assert_eq!(s.open(&[pk], "t"), Ok(d));
        assert!(matches!(
            s.open(&[other], "t"),
            Err(ProtocolError::Signature(SignError::UnknownKey(_)))
        ));
        let mut forged = s.clone();
        forged.body = forged.body.replace("\"version\":2", "\"version\":9");
        assert!(matches!(
            forged.open(&[pk], "t"),
            Err(ProtocolError::Signature(SignError::BadSignature(_)))
        ));
    }
}
