//! Captures kept until a collector acknowledges them: the broker's acknowledgement of a capture
//! only means the broker has it (a broker whose queue for the collector is full, or that
//! restarts without persistence, may still drop it), so the capture's file stays on the device
//! until a collector that has stored it says so on `P/devices/<id>/capture-ack`. Until then it
//! is sent again after `resend_after_s`, the wait doubling up to `resend_max_s`, one resend on
//! its way at a time, and given up after `max_resends` (or, oldest first, to keep new captures
//! within `max_disk_bytes`). `collector_acks = false`: deleted on the broker's acknowledgement.

use kestrel_shared::capture::{CaptureAck, MAX_ACK_IDS};

use super::requests::capture_state_bytes;
use super::{Core, Effect, Model};
use crate::core::capture::Due;

impl<M: Model> Core<M> {
    /// A collector's acknowledgement on our own `capture-ack` topic: what it names and we hold is
    /// deleted.
    pub(super) fn on_capture_ack(&mut self, topic: &str, payload: &[u8]) {
        let ack: CaptureAck = match serde_json::from_slice(payload) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!("{}: {topic}: not a capture acknowledgement: {e}", self.id());
                return;
            }
        };
        let ids = &ack.ids[..ack.ids.len().min(MAX_ACK_IDS)];
        let Some(c) = self.requests.capturer.as_mut() else {
            return;
        };
        let done = c.acked(ids);
        if done.is_empty() {
            return;
        }
        tracing::debug!(
            "{}: {} captures stored by collector `{}`",
            self.cfg.device_id,
            done.len(),
            ack.collector
        );
        self.forget_captures(done);
    }

    /// The broker has a capture: its first send now waits for a collector's acknowledgement (or
    /// is done, without them); a resend lets the next one go.
    pub(super) fn capture_delivered(&mut self, id: &str, bytes: u64, first: bool) {
        let now = self.now.unix_ms;
        let Some(c) = self.requests.capturer.as_mut() else {
            return;
        };
        if !first {
            c.redelivered(id);
            return;
        }
        let done = c.delivered(id, bytes, now);
        self.forget_captures(done);
    }

    /// A capture to resend has no file: forgotten.
    pub(super) fn capture_gone(&mut self, id: &str) {
        if let Some(c) = self.requests.capturer.as_mut() {
            tracing::warn!("{}: capture {id}: its file is gone", self.cfg.device_id);
            c.gone(id);
            self.forget_captures(vec![]);
        }
    }

    /// On the tick: the captures whose wait for an acknowledgement is over are sent again, or
    /// given up.
    pub(super) fn resend_due_captures(&mut self) {
        let now = self.now.unix_ms;
        let device = self.cfg.device_id.clone();
        let Some(c) = self.requests.capturer.as_mut() else {
            return;
        };
        let (mut given_up, mut changed) = (Vec::new(), false);
        while let Some(due) = c.next_due(now) {
            changed = true;
            match due {
                Due::Resend(id) => self.out.push(Effect::ResendCapture { id }),
                Due::GiveUp(id) => {
                    tracing::warn!("{device}: capture {id}: no collector acknowledged it; deleted");
                    given_up.push(id);
                }
            }
        }
        if changed {
            self.forget_captures(given_up);
        }
    }

    /// Deletes `ids` and saves the capture state (its counters and what still waits).
    fn forget_captures(&mut self, ids: Vec<String>) {
        let Some(c) = self.requests.capturer.as_ref() else {
            return;
        };
        self.out
            .push(Effect::SaveCaptureState(capture_state_bytes(c)));
        self.out
            .extend(ids.into_iter().map(|id| Effect::ForgetCapture { id }));
        self.status_dirty = true;
    }
}
