//! Captured inputs: what a device sends back for the next training round
//! (`P/devices/<id>/captures/<capture-id>`, QoS 1, not retained), and the counters its status
//! carries. The image travels as it arrived (the original encoded bytes, base64 in the JSON).
//! A collector that has stored captures durably says so on `P/devices/<id>/capture-ack`
//! ([`CaptureAck`]); the device keeps each capture until then.

use base64::Engine as _;
use serde::{Deserialize, Serialize};

use crate::wire::{CaptureReason, Class};

/// One captured input.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Capture {
    /// Unique on its device: `<unix ms>-<sequence>`; a topic level.
    pub id: String,
    pub device: String,
    /// The inference request it answered (`feed-<n>` for fed traffic).
    pub request: String,
    pub model: String,
    pub version: u64,
    /// The model's top-k classes and scores.
    pub top: Vec<Class>,
    /// Why it was kept.
    pub reason: CaptureReason,
    /// RFC 3339 UTC.
    pub captured_at: String,
    /// The original image bytes, base64 (standard alphabet, padded).
    pub content: String,
}

#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    #[error("capture: not JSON of a capture: {0}")]
    Json(#[from] serde_json::Error),
    #[error("capture {id}: content is not base64")]
    Content {
        id: String,
        #[source]
        source: base64::DecodeError,
    },
}

impl Capture {
    pub fn encode_content(bytes: &[u8]) -> String {
        base64::engine::general_purpose::STANDARD.encode(bytes)
    }

    /// Parses a capture message and decodes its image bytes.
    pub fn parse(payload: &[u8]) -> Result<(Capture, Vec<u8>), CaptureError> {
        let c: Capture = serde_json::from_slice(payload)?;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(&c.content)
            .map_err(|source| CaptureError::Content {
                id: c.id.clone(),
                source,
            })?;
        Ok((c, bytes))
    }

    /// The `path` column of a capture table: `<device>/<capture-id>`, unique in a fleet.
    pub fn path(&self) -> String {
        format!("{}/{}", self.device, self.id)
    }
}

/// The most capture ids one [`CaptureAck`] names (a collector sends more in several messages).
pub const MAX_ACK_IDS: usize = 256;

/// A collector's acknowledgement, on `P/devices/<id>/capture-ack`, of the captures of device
/// `<id>` (the topic's; the payload names no device) that it has stored durably: the device
/// may delete them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CaptureAck {
    /// Capture ids (at most [`MAX_ACK_IDS`]).
    pub ids: Vec<String>,
    /// The collector's client id (for the logs).
    #[serde(default)]
    pub collector: String,
}

/// A device's capture counters since it started capturing (kept across restarts).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaptureStats {
    /// Inputs kept (written to the capture queue).
    pub taken: u64,
    /// Inputs the policy chose but the hourly rate limit refused.
    pub rate_limited: u64,
    /// Queued captures dropped, oldest first, to stay within the disk budget.
    pub evicted: u64,
    /// Captures the broker acknowledged (the first time each was sent).
    pub sent: u64,
    /// Captures waiting to be sent, and their bytes on disk.
    pub queued: u64,
    pub queued_bytes: u64,
    /// Captures a collector acknowledged having stored (deleted from the device then).
    #[serde(default)]
    pub acked: u64,
    /// Sends again of captures no collector had acknowledged.
    #[serde(default)]
    pub resent: u64,
    /// Captures sent but deleted without a collector's acknowledgement: after
    /// `[capture] max_resends`, or the oldest, to stay within the disk budget.
    #[serde(default)]
    pub unacked_dropped: u64,
    /// Captures sent and waiting for a collector's acknowledgement, and their bytes on disk.
    #[serde(default)]
    pub awaiting_ack: u64,
    #[serde(default)]
    pub awaiting_ack_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capture_round_trips_its_bytes_and_names_bad_content() {
        let c = Capture {
            id: "1700000000000-000001".into(),
            device: "cam-1".into(),
            request: "r1".into(),
            model: "m".into(),
            version: 3,
            top: vec![],
            reason: CaptureReason::Random,
            captured_at: "2026-12-02T00:00:00Z".into(),
            content: Capture::encode_content(&[0, 1, 2, 255]),
        };
        let json = serde_json::to_vec(&c).unwrap();
        let (back, bytes) = Capture::parse(&json).unwrap();
        assert_eq!(
            (back.path(), bytes),
            ("cam-1/1700000000000-000001".into(), vec![0, 1, 2, 255])
        );
        let bad = serde_json::to_vec(&Capture {
            content: "%%%".into(),
            ..c
        })
        .unwrap();
        let e = Capture::parse(&bad).unwrap_err().to_string();
        assert!(
            e.contains("1700000000000-000001") && e.contains("base64"),
            "{e}"
        );
    }
}
