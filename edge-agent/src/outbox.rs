//! Everything the agent publishes at QoS 1 goes through one queue with one message in flight:
//! events are first written to `outbox/<seq>.json` (so they survive a restart and a broker
//! outage) and deleted when the broker acknowledges them; status and
//! presence are kept in memory, latest value only (they are re-sent on every connect).
//! One message in flight at a time makes the acknowledgement unambiguous (its packet id is
//! matched) at a small cost in throughput. Inference replies do not come here
//! ([`crate::replies`]).

use std::collections::VecDeque;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use crate::core::Message;

#[derive(Debug)]
struct Item {
    msg: Message,
    /// On-disk copy, deleted on acknowledgement.
    file: Option<PathBuf>,
    /// The size of that file.
    disk: u64,
}

#[derive(Debug)]
pub struct Outbox {
    dir: PathBuf,
    next_seq: u64,
    queue: VecDeque<Item>,
    in_flight: Option<(Item, Option<u16>)>,
    /// Bytes of the files of queued and in-flight messages.
    disk_bytes: u64,
}

impl Outbox {
    /// Opens `dir`, queueing messages left by a previous run in their order.
    pub fn open(dir: &Path) -> io::Result<Self> {
        fs::create_dir_all(dir)?;
        kestrel_shared::fsutil::remove_temp_files(dir)?; // writes a crash cut short
        let mut files: Vec<(u64, PathBuf)> = fs::read_dir(dir)?
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let p = e.path();
                let seq = p.file_stem()?.to_str()?.parse().ok()?;
                (p.extension()? == "json").then_some((seq, p))
            })
            .collect();
        files.sort();
        let mut queue = VecDeque::new();
        for (_, p) in &files {
            // A torn write (crash mid-write) cannot happen: files are written atomically.
            let bytes = fs::read(p)?;
            let msg: Message = serde_json::from_slice(&bytes)
                .map_err(|e| io::Error::other(format!("{}: {e}", p.display())))?;
            queue.push_back(Item {
                msg,
                file: Some(p.clone()),
                disk: bytes.len() as u64,
            });
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            next_seq: files.last().map_or(0, |(s, _)| s + 1),
            disk_bytes: queue.iter().map(|i| i.disk).sum(),
            queue,
            in_flight: None,
        })
    }

    /// Queues a durable message within a disk budget of `max_bytes` (the outbox's files): the
    /// oldest queued messages (never the one in flight) are dropped until it fits. Returns how many
    /// were dropped; a message larger than the whole budget is refused (an error, nothing dropped).
    pub fn push_within(&mut self, msg: Message, max_bytes: u64) -> io::Result<u64> {
        let size = serde_json::to_vec(&msg).map_err(io::Error::other)?.len() as u64;
        let in_flight = self.in_flight.as_ref().map_or(0, |(i, _)| i.disk);
        if size + in_flight > max_bytes {
            return Err(io::Error::other(format!(
                "{}: {size} bytes do not fit the disk budget of {max_bytes}",
                msg.topic
            )));
        }
        let mut dropped = 0;
        while self.disk_bytes + size > max_bytes {
            let Some(old) = self.queue.pop_front() else {
                break;
            };
            self.forget(old)?;
            dropped += 1;
        }
        self.push_durable(msg)?;
        Ok(dropped)
    }

    /// Deletes an item's file and its bytes from the count.
    fn forget(&mut self, item: Item) -> io::Result<()> {
        self.disk_bytes -= item.disk;
        match item.file {
            Some(f) => fs::remove_file(f),
            None => Ok(()),
        }
    }

    /// Bytes of the outbox's files.
    pub fn disk_bytes(&self) -> u64 {
        self.disk_bytes
    }

    /// The payload size of the next message to send, if one would be sent now.
    pub fn next_size(&self) -> Option<usize> {
        match self.in_flight {
            Some(_) => None,
            None => self.queue.front().map(|i| i.msg.payload.len()),
        }
    }

    /// Whether a message is in flight without its packet id yet.
    pub fn awaits_pkid(&self) -> bool {
        matches!(self.in_flight, Some((_, None)))
    }

    /// The packet id of the in-flight message, once known.
    pub fn in_flight_pkid(&self) -> Option<u16> {
        self.in_flight.as_ref().and_then(|(_, id)| *id)
    }

    /// Queues a message that must not be lost (written to disk first). When the disk write fails
    /// (a full store) the message is still queued, in memory only, and the error returned.
    pub fn push_durable(&mut self, msg: Message) -> io::Result<()> {
        let file = self.dir.join(format!("{:020}.json", self.next_seq));
        self.next_seq += 1;
        let written = serde_json::to_vec(&msg)
            .map_err(io::Error::other)
            .and_then(|b| kestrel_shared::fsutil::write_atomic(&file, &b).map(|()| b.len() as u64));
        let (file, disk, result) = match written {
            Ok(n) => (Some(file), n, Ok(())),
            Err(e) => (None, 0, Err(e)),
        };
        let item = Item { msg, file, disk };
        self.disk_bytes += disk;
        self.queue.push_back(item);
        result
    }

    /// Queues a latest-value message (retained state): replaces a queued one on the same topic.
    pub fn push_latest(&mut self, msg: Message) {
        if let Some(i) = self
            .queue
            .iter_mut()
            .find(|i| i.file.is_none() && i.msg.topic == msg.topic)
        {
            i.msg = msg;
        } else {
            self.queue.push_back(Item {
                msg,
                file: None,
                disk: 0,
            });
        }
    }

    /// The next message to publish, if none is in flight.
    pub fn next(&mut self) -> Option<&Message> {
        if self.in_flight.is_none() {
            let item = self.queue.pop_front()?;
            self.in_flight = Some((item, None));
        } else {
            return None;
        }
        self.in_flight.as_ref().map(|(i, _)| &i.msg)
    }

    /// The client reported the packet id of the in-flight publish.
    pub fn sent(&mut self, pkid: u16) {
        if let Some((_, id @ None)) = &mut self.in_flight {
            *id = Some(pkid);
        }
    }

    /// The broker acknowledged `pkid`: completes the in-flight message if it is that one.
    pub fn acked(&mut self, pkid: u16) -> io::Result<bool> {
        match &self.in_flight {
            Some((_, Some(id))) if *id == pkid => {
                let (item, _) = self.in_flight.take().expect("checked");
                self.forget(item)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// The broker acknowledged `pkid`: takes the in-flight message if it is that one, leaving its
    /// file (if any) for the caller, which now owns it.
    pub fn take_acked(&mut self, pkid: u16) -> Option<(Message, Option<PathBuf>)> {
        match &self.in_flight {
            Some((_, Some(id))) if *id == pkid => {
                let (item, _) = self.in_flight.take().expect("checked");
                self.disk_bytes -= item.disk;
                Some((item.msg, item.file))
            }
            _ => None,
        }
    }

    /// The topic of the message in flight.
    pub fn in_flight_topic(&self) -> Option<&str> {
        self.in_flight.as_ref().map(|(i, _)| i.msg.topic.as_str())
    }

    /// Drops the queued in-memory messages on `topic` (not the one in flight).
    pub fn remove_memory(&mut self, topic: &str) {
        self.queue
            .retain(|i| i.file.is_some() || i.msg.topic != topic);
    }

    /// The connection was re-established without the old session: the in-flight message will
    /// never be acknowledged, send it again.
    pub fn requeue_in_flight(&mut self) {
        if let Some((item, _)) = self.in_flight.take() {
            self.queue.push_front(item);
        }
    }

    pub fn is_idle(&self) -> bool {
        self.in_flight.is_none() && self.queue.is_empty()
    }

    pub fn len(&self) -> usize {
        self.queue.len() + usize::from(self.in_flight.is_some())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// An inference reply (`P/devices/<id>/result/<request>`): what a full outbox gives up first.

#[cfg(test)]
mod tests {
    use super::*;

    fn m(topic: &str, p: &str) -> Message {
        Message {
            topic: topic.into(),
            retain: false,
            payload: p.into(),
        }
    }

    #[test]
    fn durable_messages_survive_a_restart_until_acked() {
        let dir = tempfile::tempdir().unwrap();
        let mut o = Outbox::open(dir.path()).unwrap();
        o.push_durable(m("e", "1")).unwrap();
        o.push_latest(m("status", "a"));
        o.push_latest(m("status", "b")); // replaces "a"
        o.push_durable(m("e", "2")).unwrap();
        assert_eq!(o.len(), 3);
        assert_eq!(o.next().unwrap().payload, "1");
        assert!(o.next().is_none(), "one in flight");
        o.sent(7);
        assert!(!o.acked(8).unwrap(), "another packet's ack");
        // Crash before the ack: both durable messages come back, in order.
        drop(o);
        let mut o = Outbox::open(dir.path()).unwrap();
        assert_eq!(o.len(), 2);
        assert_eq!(o.next().unwrap().payload, "1");
        o.sent(1);
        assert!(o.acked(1).unwrap());
        assert_eq!(o.next().unwrap().payload, "2");
        o.requeue_in_flight(); // new session: send again
        assert_eq!(o.next().unwrap().payload, "2");
        o.sent(2);
        assert!(o.acked(2).unwrap());
        assert!(o.is_idle());
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
        let mut o = Outbox::open(dir.path()).unwrap();
        o.push_latest(m("status", "b"));
        assert_eq!(o.next().unwrap().payload, "b");
    }

    #[test]
    fn a_budget_drops_the_oldest_queued_never_the_one_in_flight() {
        let dir = tempfile::tempdir().unwrap();
        let mut o = Outbox::open(dir.path()).unwrap();
        let size = serde_json::to_vec(&m("c", "aaaa")).unwrap().len() as u64;
        let budget = 3 * size;
        for p in ["aaaa", "bbbb", "cccc"] {
            assert_eq!(o.push_within(m("c", p), budget).unwrap(), 0);
        }
        assert_eq!(o.next().unwrap().payload, "aaaa"); // in flight
        o.sent(1);
        assert_eq!(
            o.push_within(m("c", "dddd"), budget).unwrap(),
            1,
            "bbbb dropped"
        );
        let on_disk: u64 = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum();
        assert_eq!((o.disk_bytes(), on_disk), (budget, budget));
        let big = m("c", &"e".repeat(3 * size as usize));
        assert!(o.push_within(big, budget).is_err(), "over the budget alone");
        assert!(o.acked(1).unwrap());
        let left: Vec<String> = std::iter::from_fn(|| {
            let p = o.next().map(|m| m.payload.clone());
            o.sent(9);
            o.acked(9).unwrap();
            p
        })
        .collect();
        assert_eq!(left, ["cccc", "dddd"]);
        assert_eq!(
            (o.disk_bytes(), fs::read_dir(dir.path()).unwrap().count()),
            (0, 0)
        );
    }

    #[test]
    fn a_failed_disk_write_still_queues_the_message() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("outbox");
        let mut o = Outbox::open(&sub).unwrap();
        fs::remove_dir(&sub).unwrap(); // every write now fails
        assert!(o.push_durable(m("e", "1")).is_err());
        assert_eq!(o.next().unwrap().payload, "1");
        o.sent(3);
        assert!(o.acked(3).unwrap(), "acknowledged with no file to delete");
    }

    #[test]
    fn an_acknowledged_file_can_be_kept_and_copies_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let mut o = Outbox::open(dir.path()).unwrap();
        o.push_durable(m("c/1", "1")).unwrap();
        o.push_latest(m("c/0", "copy"));
        let disk = o.disk_bytes();
        assert_eq!(o.next().unwrap().payload, "1");
        o.sent(4);
        assert_eq!(o.in_flight_topic(), Some("c/1"));
        assert!(o.take_acked(5).is_none(), "another packet's ack");
        let (msg, file) = o.take_acked(4).unwrap();
        let file = file.unwrap();
        assert_eq!(
            (msg.payload.as_str(), fs::metadata(&file).unwrap().len()),
            ("1", disk)
        );
        assert_eq!(o.disk_bytes(), 0, "the caller owns the file now");
        o.remove_memory("c/0");
        assert!(o.is_idle());
    }
}
