//! Input capture (`[capture]`, off by default): the requests the policy picks keep their image,
//! which goes to `<store>/captures/` (an outbox of its own, within its disk budget) and from
//! there, at most one in flight and within the upload cap, to
//! `P/devices/<id>/captures/<capture-id>` at QoS 1. The counters and the last hour's capture
//! times are in `<store>/captures/state.json`, so the limits hold across restarts.

use std::path::PathBuf;

use anyhow::{Context, Result};
use kestrel_shared::capture::{Capture, CaptureStats};
use kestrel_shared::fsutil::write_atomic;
use kestrel_shared::now_rfc3339;
use kestrel_shared::protocol::sha256_hex;

use super::{Agent, Observed};
use crate::capture::{CaptureState, Capturer};
use crate::config::Config;
use crate::outbox::{Message, Outbox};

/// The capture queue and its rules.
pub(super) struct Captures {
    capturer: Capturer,
    pub outbox: Outbox,
    state_path: PathBuf,
}

impl Captures {
    pub(super) fn open(cfg: &Config) -> Result<Option<Self>> {
        if !cfg.capture.enabled {
            return Ok(None);
        }
        let dir = cfg.store.join("captures");
        let outbox = Outbox::open(&dir).with_context(|| format!("captures {}", dir.display()))?;
        let state_path = dir.join("state.json");
        let state: CaptureState = match std::fs::read(&state_path) {
            Ok(b) => {
                serde_json::from_slice(&b).with_context(|| format!("{}", state_path.display()))?
            }
            Err(_) => CaptureState::default(),
        };
        let seed = sha256_hex(format!("{}{}", cfg.device_id, now_ms()).as_bytes());
        let seed = u64::from_str_radix(&seed[..16], 16).unwrap_or(1);
        Ok(Some(Self {
            capturer: Capturer::new(cfg.capture.clone(), state, seed),
            outbox,
            state_path,
        }))
    }

    pub(super) fn stats(&self) -> CaptureStats {
        CaptureStats {
            queued: self.outbox.len() as u64,
            queued_bytes: self.outbox.disk_bytes(),
            ..self.capturer.state.stats.clone()
        }
    }

    /// Whether the next capture may go out now (the upload cap).
    pub(super) fn may_send(&mut self) -> bool {
        match self.outbox.next_size() {
            Some(n) => self.capturer.may_send(n, now_ms()),
            None => false,
        }
    }

    /// The broker acknowledged the capture in flight.
    pub(super) fn sent(&mut self) -> std::io::Result<()> {
        self.capturer.state.stats.sent += 1;
        self.save()
    }

    fn save(&self) -> std::io::Result<()> {
        let bytes = serde_json::to_vec(&self.capturer.state).expect("serializable");
        write_atomic(&self.state_path, &bytes)
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Agent {
    /// A request the active model answered: kept when the policy picks it and the limits allow.
    pub(super) fn maybe_capture(&mut self, o: &mut Observed) {
        let drifting = self
            .quality
            .as_ref()
            .and_then(|t| t.window.as_ref())
            .is_some_and(|w| w.drifting());
        let Some(c) = self.captures.as_mut() else {
            return;
        };
        let (Some(bytes), Some(reason)) = (o.image.take(), c.capturer.reason(&o.top, drifting))
        else {
            return;
        };
        let admitted = c.capturer.admit(now_ms());
        // Saved before the capture is stored: a crash in between costs a slot, never exceeds the limit.
        save_or_log(c, &self.cfg.device_id);
        self.status_dirty = true;
        let Some(id) = admitted else { return };
        let capture = Capture {
            id: id.clone(),
            device: self.cfg.device_id.clone(),
            request: o.request.clone(),
            model: o.model.clone(),
            version: o.version,
            top: o.top.clone(),
            reason: reason.into(),
            captured_at: now_rfc3339(),
            content: Capture::encode_content(&bytes),
        };
        let topic = self.topics.capture(&self.cfg.device_id, &id);
        let payload = serde_json::to_string(&capture).expect("serializable");
        let max = self.cfg.broker.max_packet_bytes;
        let pushed = if payload.len() + topic.len() + 16 > max {
            Err(std::io::Error::other(format!(
                "{topic}: {} bytes are over the broker's packet limit of {max}",
                payload.len()
            )))
        } else {
            let msg = Message {
                topic,
                retain: false,
                payload,
            };
            c.outbox.push_within(msg, c.capturer.max_disk_bytes())
        };
        match pushed {
            Ok(dropped) => c.capturer.state.stats.evicted += dropped,
            Err(e) => {
                c.capturer.state.stats.evicted += 1;
                tracing::warn!("{}: capture {id} dropped: {e}", self.cfg.device_id);
            }
        }
        save_or_log(c, &self.cfg.device_id);
    }
}

fn save_or_log(c: &Captures, device: &str) {
    if let Err(e) = c.save() {
        tracing::error!(
            "{device}: captures: writing {}: {e}",
            c.state_path.display()
        );
    }
}
