//! Publishing: the outbox (events, status) and the capture queue, each with one message in flight
//! at QoS 1, share one MQTT client; only one of their publishes waits for its packet id at a
//! time, so every `Outgoing::Publish(pkid)` and PUBACK is matched to its queue. Inference replies
//! go beside them at QoS 0 ([`crate::replies`]: no packet id, nothing to match).

use anyhow::Result;
use rumqttc::QoS;

use super::Agent;
use crate::core::Input;
use crate::core::Message;

impl Agent {
    /// Publishes the next message of the outbox and of the capture queue (within its upload
    /// cap), each with one in flight, and hands the waiting inference replies to the client.
    /// Only one QoS 1 publish at a time waits for its packet id, so the client's
    /// `Outgoing::Publish(pkid)` belongs to it.
    pub(super) async fn flush(&mut self) {
        if !self.connected {
            return;
        }
        let capture_waits = self
            .captures
            .as_ref()
            .is_some_and(|c| c.outbox.awaits_pkid());
        if !capture_waits && let Some(m) = self.outbox.next().cloned() {
            self.publish(m).await;
        }
        if let Some(c) = self.captures.as_mut()
            && !self.outbox.awaits_pkid()
            && let Some(size) = c.outbox.next_size()
            && self
                .core
                .may_send_capture(size, kestrel_shared::time::now_ms())
            && let Some(m) = c.outbox.next().cloned()
        {
            self.publish(m).await;
        }
        while let Some(m) = self.replies.pop() {
            let (topic, payload) = (m.topic.clone(), m.payload.clone());
            if self
                .client
                .try_publish(topic, QoS::AtMostOnce, false, payload)
                .is_err()
            {
                self.replies.push_front(m); // the client's queue is full: the next turn
                break;
            }
        }
    }

    async fn publish(&self, m: Message) {
        if let Err(e) = self
            .client
            .publish(m.topic, QoS::AtLeastOnce, m.retain, m.payload)
            .await
        {
            tracing::error!("publish: {e}");
        }
    }

    /// The packet id of a publish (a resent one keeps its id: never given to the other queue).
    pub(super) fn on_sent(&mut self, pkid: u16) {
        let captures = self.captures.as_mut().map(|c| &mut c.outbox);
        let capture_id = captures.as_ref().and_then(|o| o.in_flight_pkid());
        if self.outbox.awaits_pkid() && capture_id != Some(pkid) {
            self.outbox.sent(pkid);
        } else if let Some(o) = captures
            && o.awaits_pkid()
            && self.outbox.in_flight_pkid() != Some(pkid)
        {
            o.sent(pkid);
        }
    }

    pub(super) async fn on_acked(&mut self, pkid: u16) -> Result<()> {
        if self.outbox.acked(pkid)? {
            return Ok(());
        }
        if let Some(c) = self.captures.as_mut()
            && let Some(d) = c.acked(pkid, &self.topics)
        {
            let (id, bytes, first) = (d.id, d.bytes, d.first);
            self.apply(Input::CaptureDelivered { id, bytes, first })
                .await?;
        }
        Ok(())
    }
}
