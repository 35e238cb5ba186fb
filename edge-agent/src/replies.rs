//! Inference replies waiting to be published: in memory, bounded in bytes, the oldest dropped
//! first. Without IO.
//!
//! A reply is published at QoS 0, straight from this queue to the MQTT client: it is worth
//! something only to the client waiting for it (which times out, and may ask again), and it is
//! lost only with the connection. So no reply is written to disk or waits for an acknowledgement;
//! events, status and captures, which must not be lost, keep the durable outbox and QoS 1.

use std::collections::VecDeque;

use crate::core::Message;

/// Inference replies waiting for the MQTT client, bounded in bytes (the oldest go first).
#[derive(Debug, Default)]
pub struct Replies {
    queue: VecDeque<Message>,
    bytes: usize,
}

impl Replies {
    /// Queues `m`, dropping the oldest queued replies while more than `max_bytes` wait; returns
    /// how many were dropped (`m` itself when it alone is over).
    pub fn push(&mut self, m: Message, max_bytes: usize) -> usize {
        let size = m.payload.len() + m.topic.len();
        if size > max_bytes {
            return 1;
        }
        let mut dropped = 0;
        while self.bytes + size > max_bytes {
            let old = self
                .queue
                .pop_front()
                .expect("bytes > 0 means a queued reply");
            self.bytes -= old.payload.len() + old.topic.len();
            dropped += 1;
        }
        self.bytes += size;
        self.queue.push_back(m);
        dropped
    }

    /// The oldest queued reply.
    pub fn pop(&mut self) -> Option<Message> {
        let m = self.queue.pop_front()?;
        self.bytes -= m.payload.len() + m.topic.len();
        Some(m)
    }

    /// Puts back a reply the client could not take yet (its queue was full).
    pub fn push_front(&mut self, m: Message) {
        self.bytes += m.payload.len() + m.topic.len();
        self.queue.push_front(m);
    }

    pub fn len(&self) -> usize {
        self.queue.len()
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(topic: &str, payload: &str) -> Message {
        Message {
            topic: topic.into(),
            retain: false,
            payload: payload.into(),
        }
    }

    #[test]
    fn the_budget_drops_the_oldest() {
        let mut r = Replies::default();
        let size = "t".len() + "aaaa".len();
        for p in ["aaaa", "bbbb", "cccc"] {
            assert_eq!(r.push(m("t", p), 3 * size), 0);
        }
        assert_eq!(r.push(m("t", "dddd"), 3 * size), 1, "aaaa dropped");
        assert_eq!(
            r.push(m("t", &"e".repeat(3 * size)), 3 * size),
            1,
            "alone over"
        );
        let b = r.pop().unwrap();
        r.push_front(b);
        let sent: Vec<String> = std::iter::from_fn(|| r.pop().map(|m| m.payload)).collect();
        assert_eq!(sent, ["bbbb", "cccc", "dddd"]);
        assert!(r.is_empty());
        assert_eq!(r.bytes, 0);
    }
}
