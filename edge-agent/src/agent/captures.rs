//! The capture queue on disk: `<store>/captures/` (an outbox of its own: captures waiting to be
//! sent, one in flight) and `<store>/captures/unacked/<id>.json` (captures the broker has, waiting
//! for a collector's acknowledgement). The core decides when one is sent again and when it is
//! deleted ([`crate::core::acks`]); here are only the files and the queue.

use std::collections::HashSet;
use std::io;
use std::path::{Path, PathBuf};

use kestrel_shared::fsutil::write_atomic;
use kestrel_shared::topics::{DeviceTopic, Route, Topics};

use crate::core::Message;
use crate::outbox::Outbox;

/// The capture queue and where its state is kept.
pub(super) struct CaptureQueue {
    pub(super) outbox: Outbox,
    pub(super) state_path: PathBuf,
    /// `<store>/captures/unacked/`.
    unacked: PathBuf,
    /// Topics of the copies queued to be sent again (in memory; their file stays in `unacked`).
    copies: HashSet<String>,
}

/// A capture the broker acknowledged: its id, its file's size, whether it was its first send.
pub(super) struct Delivered {
    pub(super) id: String,
    pub(super) bytes: u64,
    pub(super) first: bool,
}

impl CaptureQueue {
    /// Opens `dir` (the queue left by a previous run, in its order, and the waiting files).
    pub(super) fn open(dir: &Path) -> io::Result<Self> {
        let outbox = Outbox::open(dir)?;
        let unacked = dir.join("unacked");
        std::fs::create_dir_all(&unacked)?;
        kestrel_shared::fsutil::remove_temp_files(&unacked)?;
        Ok(Self {
            outbox,
            state_path: dir.join("state.json"),
            unacked,
            copies: HashSet::new(),
        })
    }

    fn file(&self, id: &str) -> PathBuf {
        self.unacked.join(format!("{id}.json"))
    }

    /// The broker acknowledged `pkid`: the capture it completes, its file (first send) moved to
    /// `unacked/` to wait for a collector's acknowledgement (a failed move is logged: a resend
    /// then finds no file, and the core forgets the capture).
    pub(super) fn acked(&mut self, pkid: u16, topics: &Topics) -> Option<Delivered> {
        let (msg, file) = self.outbox.take_acked(pkid)?;
        let Some(Route::Device {
            kind: DeviceTopic::Capture { id },
            ..
        }) = topics.parse(&msg.topic)
        else {
            tracing::warn!("captures: {}: not a capture topic; dropped", msg.topic);
            let _ = remove(file);
            return None;
        };
        let id = id.to_string();
        if self.copies.remove(&msg.topic) {
            let (bytes, first) = (0, false);
            return Some(Delivered { id, bytes, first });
        }
        let bytes = self.keep(&id, &msg, file).unwrap_or_else(|e| {
            tracing::error!("captures: keeping {}: {e}", self.file(&id).display());
            msg.payload.len() as u64
        });
        let first = true;
        Some(Delivered { id, bytes, first })
    }

    /// Moves (or, a message kept in memory only, writes) capture `id` to `unacked/`; its size.
    fn keep(&self, id: &str, msg: &Message, file: Option<PathBuf>) -> io::Result<u64> {
        let to = self.file(id);
        match file {
            Some(f) => std::fs::rename(f, &to)?,
            None => write_atomic(&to, &serde_json::to_vec(msg).map_err(io::Error::other)?)?,
        }
        Ok(std::fs::metadata(&to)?.len())
    }

    /// Queues capture `id` to be sent again from its file; false if it has none.
    pub(super) fn resend(&mut self, id: &str) -> bool {
        let msg: Option<Message> = std::fs::read(self.file(id))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        let Some(msg) = msg else {
            return false;
        };
        self.copies.insert(msg.topic.clone());
        self.outbox.push_latest(msg);
        true
    }

    /// Deletes capture `id` (its file and any copy queued to be sent again).
    pub(super) fn forget(&mut self, id: &str, topic: &str) {
        self.outbox.remove_memory(topic);
        if self.outbox.in_flight_topic() != Some(topic) {
            self.copies.remove(topic);
        }
        if let Err(e) = remove(Some(self.file(id))) {
            tracing::error!("captures: deleting {}: {e}", self.file(id).display());
        }
    }
}

fn remove(file: Option<PathBuf>) -> io::Result<()> {
    match file.map(std::fs::remove_file) {
        Some(Err(e)) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The captures waiting for a collector's acknowledgement in `<dir>/unacked/`: id and size.
pub(super) fn unacked_on_disk(dir: &Path) -> Vec<(String, u64)> {
    let Ok(entries) = std::fs::read_dir(dir.join("unacked")) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let p = e.path();
            let id = p.file_stem()?.to_str()?;
            if p.extension()? != "json" || id.starts_with('.') {
                return None;
            }
            Some((id.to_string(), e.metadata().ok()?.len()))
        })
        .collect()
}
