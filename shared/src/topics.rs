//! The MQTT topic layout: [`Topics`] builds every topic under one prefix, and [`Topics::parse`]
//! is their one inverse, a [`Route`] that every consumer (agent, rollout controller, console,
//! collector) dispatches on. A device is known by the topic it wrote to (the broker's ACL lets a
//! device write only under `P/devices/<its id>/`), never by what its payload says.

use crate::protocol::{ProtocolError, Target, check_name};

pub const DEFAULT_PREFIX: &str = "kestrel";

/// Builds every topic of the protocol under one prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topics {
    prefix: String,
}

impl Default for Topics {
    fn default() -> Self {
        Self::new(DEFAULT_PREFIX)
    }
}

/// What a topic under the prefix is: the inverse of the [`Topics`] builders. Names are checked
/// ([`check_name`]) and numbers parsed, so a route's fields are what a builder would accept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route<'a> {
    /// `P/artifacts/<name>/<version>/manifest`
    Offer { name: &'a str, version: u64 },
    /// `P/artifacts/<name>/<version>/chunks/<index>`
    Chunk {
        name: &'a str,
        version: u64,
        index: u32,
    },
    /// `P/parts/<sha256>/<chunk_bytes>/<index>`: a chunk of a content-addressed piece
    /// ([`crate::protocol::Piece`]) cut in chunks of `chunk_bytes` (publishes cut differently
    /// never share a topic).
    PartChunk {
        sha256: &'a str,
        chunk_bytes: u64,
        index: u32,
    },
    /// `P/devices/<id>/desired` or `P/groups/<name>/desired`
    Desired(Target),
    /// `P/keys`
    Keys,
    /// `P/devices/<id>/...`: what a device publishes (or is sent, for `Infer`).
    Device {
        device: &'a str,
        kind: DeviceTopic<'a>,
    },
    /// `P/rollouts/<name>/state`
    RolloutState { name: &'a str },
    /// `P/rollouts/<name>/command`
    RolloutCommand { name: &'a str },
}

/// The topics under `P/devices/<id>/` (`capture-ack`: written by the collector only, read by the
/// device).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceTopic<'a> {
    Status,
    Quality,
    Online,
    Events,
    Capture { id: &'a str },
    CaptureAck,
    Infer { request: &'a str },
    Result { request: &'a str },
}

impl Topics {
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.trim_end_matches('/').to_string(),
        }
    }
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
    pub fn artifact_manifest(&self, name: &str, version: u64) -> String {
        format!("{}/artifacts/{name}/{version}/manifest", self.prefix)
    }
    pub fn chunk(&self, name: &str, version: u64, index: u32) -> String {
        format!("{}/artifacts/{name}/{version}/chunks/{index}", self.prefix)
    }
    pub fn chunks_filter(&self, name: &str, version: u64) -> String {
        format!("{}/artifacts/{name}/{version}/chunks/+", self.prefix)
    }
    pub fn part_chunk(&self, sha256: &str, chunk_bytes: u64, index: u32) -> String {
        format!("{}/parts/{sha256}/{chunk_bytes}/{index}", self.prefix)
    }
    pub fn part_chunks_filter(&self, sha256: &str, chunk_bytes: u64) -> String {
        format!("{}/parts/{sha256}/{chunk_bytes}/+", self.prefix)
    }
    pub fn desired(&self, target: &Target) -> String {
        match target {
            Target::Device(d) => format!("{}/devices/{d}/desired", self.prefix),
            Target::Group(g) => format!("{}/groups/{g}/desired", self.prefix),
        }
    }
    /// The root-signed list of publishing keys (retained).
    pub fn keys(&self) -> String {
        format!("{}/keys", self.prefix)
    }
    pub fn status(&self, device: &str) -> String {
        format!("{}/devices/{device}/status", self.prefix)
    }
    pub fn status_filter(&self) -> String {
        format!("{}/devices/+/status", self.prefix)
    }
    /// The device's quality telemetry (retained; [`crate::quality::DeviceQuality`]).
    pub fn quality(&self, device: &str) -> String {
        format!("{}/devices/{device}/quality", self.prefix)
    }
    pub fn quality_filter(&self) -> String {
        format!("{}/devices/+/quality", self.prefix)
    }
    /// An input the device captured for training ([`crate::capture::Capture`], QoS 1, not retained).
    pub fn capture(&self, device: &str, id: &str) -> String {
        format!("{}/devices/{device}/captures/{id}", self.prefix)
    }
    pub fn captures_filter(&self) -> String {
        format!("{}/devices/+/captures/+", self.prefix)
    }
    /// The collector's acknowledgement of the device's captures it stored
    /// ([`crate::capture::CaptureAck`], QoS 1, not retained; the broker's ACL lets only the
    /// collector write it).
    pub fn capture_ack(&self, device: &str) -> String {
        format!("{}/devices/{device}/capture-ack", self.prefix)
    }
    pub fn online(&self, device: &str) -> String {
        format!("{}/devices/{device}/online", self.prefix)
    }
    pub fn online_filter(&self) -> String {
        format!("{}/devices/+/online", self.prefix)
    }
    pub fn events(&self, device: &str) -> String {
        format!("{}/devices/{device}/events", self.prefix)
    }
    pub fn events_filter(&self) -> String {
        format!("{}/devices/+/events", self.prefix)
    }
    pub fn infer(&self, device: &str, request: &str) -> String {
        format!("{}/devices/{device}/infer/{request}", self.prefix)
    }
    pub fn infer_filter(&self, device: &str) -> String {
        format!("{}/devices/{device}/infer/+", self.prefix)
    }
    pub fn result(&self, device: &str, request: &str) -> String {
        format!("{}/devices/{device}/result/{request}", self.prefix)
    }
    pub fn result_filter(&self, device: &str) -> String {
        format!("{}/devices/{device}/result/+", self.prefix)
    }
    /// A rollout's controller, retained so that a restarted controller resumes it.
    pub fn rollout_state(&self, name: &str) -> String {
        format!("{}/rollouts/{name}/state", self.prefix)
    }
    pub fn rollout_states_filter(&self) -> String {
        format!("{}/rollouts/+/state", self.prefix)
    }
    /// Where operators' signed commands to rollout `name` arrive.
    pub fn rollout_command(&self, name: &str) -> String {
        format!("{}/rollouts/{name}/command", self.prefix)
    }

    /// What `topic` is, or `None` for a topic outside the protocol (another prefix, an unknown
    /// layout, a name or number that does not parse).
    pub fn parse<'a>(&self, topic: &'a str) -> Option<Route<'a>> {
        let rest = topic
            .strip_prefix(self.prefix.as_str())?
            .strip_prefix('/')?;
        let parts: Vec<&'a str> = rest.split('/').collect();
        let name = |s: &'a str| check_name(s).ok();
        let number = |s: &str| -> Option<u64> {
            (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                .then(|| s.parse().ok())
                .flatten()
        };
        Some(match parts.as_slice() {
            ["artifacts", n, v, "manifest"] => Route::Offer {
                name: name(n)?,
                version: number(v)?,
            },
            ["artifacts", n, v, "chunks", i] => Route::Chunk {
                name: name(n)?,
                version: number(v)?,
                index: u32::try_from(number(i)?).ok()?,
            },
            ["parts", sha, c, i] if crate::protocol::is_sha256(sha) => Route::PartChunk {
                sha256: sha,
                chunk_bytes: number(c)?,
                index: u32::try_from(number(i)?).ok()?,
            },
            ["devices", d, "desired"] => Route::Desired(Target::Device(name(d)?.to_string())),
            ["groups", g, "desired"] => Route::Desired(Target::Group(name(g)?.to_string())),
            ["keys"] => Route::Keys,
            ["rollouts", n, "state"] => Route::RolloutState { name: name(n)? },
            ["rollouts", n, "command"] => Route::RolloutCommand { name: name(n)? },
            ["devices", d, kind @ ..] => Route::Device {
                device: name(d)?,
                kind: match kind {
                    ["status"] => DeviceTopic::Status,
                    ["quality"] => DeviceTopic::Quality,
                    ["online"] => DeviceTopic::Online,
                    ["events"] => DeviceTopic::Events,
                    ["captures", id] => DeviceTopic::Capture { id: name(id)? },
                    ["capture-ack"] => DeviceTopic::CaptureAck,
                    ["infer", r] => DeviceTopic::Infer { request: name(r)? },
                    ["result", r] => DeviceTopic::Result { request: name(r)? },
                    _ => return None,
                },
            },
            _ => return None,
        })
    }

    /// The device that wrote `topic` when it is a `kind` topic of one (`P/devices/<id>/<kind>`).
    pub fn device_of<'a>(&self, topic: &'a str, kind: DeviceTopic<'_>) -> Option<&'a str> {
        match self.parse(topic)? {
            Route::Device { device, kind: k }
                if std::mem::discriminant(&k) == std::mem::discriminant(&kind) =>
            {
                Some(device)
            }
            _ => None,
        }
    }
}

/// A message a device publishes about itself: the device it names must be the one its topic
/// names.
pub trait FromDevice: serde::de::DeserializeOwned {
    /// The device the payload says it is from.
    fn claimed_device(&self) -> &str;
}

macro_rules! from_device {
    ($($t:ty),*) => {$(
        impl FromDevice for $t {
            fn claimed_device(&self) -> &str {
                &self.device
            }
        }
    )*};
}
from_device!(
    crate::protocol::Status,
    crate::protocol::DeviceEvent,
    crate::protocol::InferReply,
    crate::quality::DeviceQuality,
    crate::capture::Capture
);

/// Why a device's message was not taken.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DeviceMessageError {
    #[error("{topic}: not a device topic of this kind")]
    NotADeviceTopic { topic: String },
    #[error(
        "{topic}: the payload says it is from device `{claimed}`; dropped (a device speaks only for itself)"
    )]
    Impersonation { topic: String, claimed: String },
    #[error(transparent)]
    Payload(#[from] ProtocolError),
}

impl DeviceMessageError {
    /// The device whose topic carried the message, when the topic is a device's.
    pub fn device<'a>(&self, topics: &Topics, topic: &'a str) -> Option<&'a str> {
        match topics.parse(topic)? {
            Route::Device { device, .. } => Some(device),
            _ => None,
        }
    }
}

/// Parses the `kind` message of the device `topic` names; refused when the topic is not such a
/// topic, the payload does not parse, or it claims to be from another device.
pub fn from_device<T: FromDevice>(
    topics: &Topics,
    kind: DeviceTopic<'_>,
    topic: &str,
    payload: &[u8],
) -> Result<T, DeviceMessageError> {
    let device =
        topics
            .device_of(topic, kind)
            .ok_or_else(|| DeviceMessageError::NotADeviceTopic {
                topic: topic.to_string(),
            })?;
    let msg: T = crate::protocol::parse(topic, payload)?;
    if msg.claimed_device() != device {
        return Err(DeviceMessageError::Impersonation {
            topic: topic.to_string(),
            claimed: msg.claimed_device().chars().take(80).collect(),
        });
    }
    Ok(msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builder_parses_back() {
        let t = Topics::new("kestrel/");
        let cases = [
            (
                t.artifact_manifest("m", 3),
                Route::Offer {
                    name: "m",
                    version: 3,
                },
            ),
            (
                t.chunk("m", 3, 7),
                Route::Chunk {
                    name: "m",
                    version: 3,
                    index: 7,
                },
            ),
            (
                t.desired(&Target::Group("canary".into())),
                Route::Desired(Target::Group("canary".into())),
            ),
            (
                t.desired(&Target::Device("pi".into())),
                Route::Desired(Target::Device("pi".into())),
            ),
            (t.keys(), Route::Keys),
            (t.rollout_state("r"), Route::RolloutState { name: "r" }),
            (t.rollout_command("r"), Route::RolloutCommand { name: "r" }),
        ];
        for (topic, route) in &cases {
            assert_eq!(t.parse(topic).as_ref(), Some(route), "{topic}");
        }
        let device = |kind| {
            Some(Route::Device {
                device: "pi-1",
                kind,
            })
        };
        assert_eq!(t.parse(&t.status("pi-1")), device(DeviceTopic::Status));
        assert_eq!(t.parse(&t.quality("pi-1")), device(DeviceTopic::Quality));
        assert_eq!(t.parse(&t.online("pi-1")), device(DeviceTopic::Online));
        assert_eq!(t.parse(&t.events("pi-1")), device(DeviceTopic::Events));
        assert_eq!(
            t.parse(&t.capture("pi-1", "c1")),
            device(DeviceTopic::Capture { id: "c1" })
        );
        assert_eq!(
            t.parse(&t.capture_ack("pi-1")),
            device(DeviceTopic::CaptureAck)
        );
        assert_eq!(
            t.parse(&t.infer("pi-1", "r1")),
            device(DeviceTopic::Infer { request: "r1" })
        );
        assert_eq!(
            t.parse(&t.result("pi-1", "r1")),
            device(DeviceTopic::Result { request: "r1" })
        );
    }

    #[test]
    fn what_is_not_a_protocol_topic_is_none() {
        let t = Topics::default();
        for topic in [
            "other/devices/pi/status",
            "kestrelx/devices/pi/status",
            "kestrel/devices/pi/status/extra",
            "kestrel/devices/../status",
            "kestrel/devices/a+b/status",
            "kestrel/devices//status",
            "kestrel/artifacts/m/-1/manifest",
            "kestrel/artifacts/m/3/chunks/99999999999",
            "kestrel/artifacts/m/+3/chunks/1",
            "kestrel/devices/pi/infer/r/x",
            "kestrel",
            "",
        ] {
            assert_eq!(t.parse(topic), None, "{topic}");
        }
    }

    #[derive(serde::Deserialize)]
    struct Said {
        device: String,
    }
    impl FromDevice for Said {
        fn claimed_device(&self) -> &str {
            &self.device
        }
    }

    #[test]
    fn a_device_speaks_only_for_itself() {
        let t = Topics::default();
        let topic = t.status("pi-1");
        let ok: Said =
            from_device(&t, DeviceTopic::Status, &topic, br#"{"device":"pi-1"}"#).unwrap();
        assert_eq!(ok.device, "pi-1");
        let forged = from_device::<Said>(&t, DeviceTopic::Status, &topic, br#"{"device":"pi-2"}"#);
        assert!(matches!(
            forged,
            Err(DeviceMessageError::Impersonation { ref claimed, .. }) if claimed == "pi-2"
        ));
        let elsewhere =
            from_device::<Said>(&t, DeviceTopic::Quality, &topic, br#"{"device":"pi-1"}"#);
        assert!(matches!(
            elsewhere,
            Err(DeviceMessageError::NotADeviceTopic { .. })
        ));
        let garbage = from_device::<Said>(&t, DeviceTopic::Status, &topic, b"{\"x\":1}");
        assert!(matches!(garbage, Err(DeviceMessageError::Payload(_))));
    }
}
