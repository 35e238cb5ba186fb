//! The retained messages, kept on disk so that they survive a restart of the broker.
//!
//! rumqttd 0.20 keeps them in its router only (`DataLog::retained_publishes`, private) and tells
//! nobody which publish was retained: it clears RETAIN on every message it forwards
//! (`src/router/routing.rs`, `append_to_commitlog`), to a local link as to a client. What a link
//! does see with RETAIN set is the retained messages themselves, sent to a new subscription. So
//! the [`Persister`] holds a local link (`Broker::link`) subscribed to `#` and reads the broker's
//! retained messages in rounds: a round subscribes to `#` afresh (the retained messages come
//! first, RETAIN set) and publishes a marker with a random nonce on [`MARKER_TOPIC`], which
//! arrives after them; at the marker, the [`Store`] is made to match what came: new and changed
//! messages written, messages no longer retained (an empty retained payload, for one) removed.
//! Any other message the link sees may have changed a retained one, and starts a round (at most
//! one every [`MIN_GAP`]). Topics starting with `$` are not kept: rumqttd 0.20 delivers them to
//! no subscriber at all.
//!
//! On disk: `DIR/retained/<sha256 of the topic>.msg`, one file per message, each written whole
//! (a temporary file, fsync, rename; the directory synced once per round), so a crash leaves
//! every topic either as it was or as it is now; `DIR/lock` is held by the one broker that uses
//! `DIR`. At most `--persist-max-messages` messages and `--persist-max-bytes` bytes: beyond them
//! a message is refused (logged, and an older copy on disk removed, so that a restart never
//! brings back an outdated message).

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, TryLockError};
use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use kestrel_shared::fsutil::remove_temp_files;
use kestrel_shared::protocol::sha256_hex;
use rumqttd::Notification;
use rumqttd::local::{LinkError, LinkRx, LinkTx};
use rumqttd::protocol::{Packet, Publish};

/// The most retained messages kept: what rumqttd 0.20 sends a new QoS 0 subscription
/// (`max_outgoing_packet_count` in the broker's configuration), so a round can read them all.
pub const MAX_MESSAGES: u32 = 20_000;
/// The most bytes kept by default (topics and payloads).
pub const MAX_BYTES: u64 = 1 << 30;
/// The name of the thread that runs the [`Persister`].
pub const THREAD: &str = "kestrel-persist";
/// The topic of a round's marker. Non-retained, outside Kestrel's topics; a client subscribed to
/// `#` sees it (a short random payload) each round.
pub const MARKER_TOPIC: &str = "kestrel-broker/snapshot";
/// Each file starts with this line.
const MAGIC: &[u8] = b"kestrel retained message 1\n";
/// The shortest time between the starts of two rounds.
const MIN_GAP: Duration = Duration::from_millis(250);
/// The time between rounds after a write failed (a full disk): the writes are tried again then.
const ERROR_GAP: Duration = Duration::from_secs(10);
/// A round with no marker after this long is started again (its marker was lost).
const ROUND_TIMEOUT: Duration = Duration::from_secs(60);
/// How often the persister looks up from its link when nothing arrives.
const TICK: Duration = Duration::from_millis(100);

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the retained-message store {} (--persist)", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "the retained-message store {} (--persist) is in use by another kestrel-broker{}: give \
         each broker a directory of its own (--persist DIR), or none (--no-persist)",
        dir.display(),
        pid.as_ref().map(|p| format!(" (PID {p})")).unwrap_or_default()
    )]
    Locked { dir: PathBuf, pid: Option<String> },
}

#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error("the broker's local link for the retained-message store")]
    Link(#[source] LinkError),
    #[error("the broker did not hand back the retained messages in {0:?}")]
    TimedOut(Duration),
    #[error("starting the retained-message store's thread")]
    Thread(#[source] io::Error),
}

fn io_at(path: &Path) -> impl FnOnce(io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_messages: usize,
    pub max_bytes: u64,
}

/// What a round changed on disk.
#[derive(Debug, Default, PartialEq)]
pub struct Outcome {
    pub wrote: usize,
    pub removed: usize,
    pub refused: usize,
    pub failed: usize,
}

/// The retained messages on disk, and a copy of each in memory (sharing the broker's bytes) to
/// tell what changed.
pub struct Store {
    dir: PathBuf,
    files: PathBuf,
    _lock: File,
    limits: Limits,
    kept: HashMap<String, Publish>,
    bytes: u64,
    /// Messages refused for the limits, logged once each: topic -> (payload address, length).
    refused: HashMap<String, (usize, usize)>,
}

fn size(topic: &str, p: &Publish) -> u64 {
    (topic.len() + p.payload.len()) as u64
}

/// Two retained messages of one topic are the same: the same bytes (a message the broker still
/// holds is shared, not copied), or equal ones.
fn same(a: &Publish, b: &Publish) -> bool {
    identity(a) == identity(b) || a.payload[..] == b.payload[..]
}

fn identity(p: &Publish) -> (usize, usize) {
    (p.payload.as_ptr() as usize, p.payload.len())
}

impl Store {
    /// Opens (creating) `dir`, takes its lock (waiting a few seconds for a broker that is
    /// stopping), and reads the messages kept there, within `limits` (those beyond are removed).
    pub fn open(dir: &Path, limits: Limits) -> Result<Store, StoreError> {
        let files = dir.join("retained");
        fs::create_dir_all(&files).map_err(io_at(&files))?;
        let lock = lock(dir)?;
        remove_temp_files(&files).map_err(io_at(&files))?;
        let mut found = Vec::new();
        for e in fs::read_dir(&files).map_err(io_at(&files))? {
            let path = e.map_err(io_at(&files))?.path();
            if path.extension().is_none_or(|x| x != "msg") {
                continue;
            }
            match read_message(&path) {
                Ok((topic, payload)) if path == message_path(&files, &topic) => {
                    found.push((topic, payload, path))
                }
                Ok((topic, _)) => {
                    tracing::warn!(
                        "{}: holds topic {topic:?} under another name: removed",
                        path.display()
                    );
                    let _ = fs::remove_file(&path);
                }
                Err(e) => {
                    tracing::warn!("{}: unreadable ({e}): removed", path.display());
                    let _ = fs::remove_file(&path);
                }
            }
        }
        found.sort_by(|a, b| a.0.cmp(&b.0));
        let mut store = Store {
            dir: dir.to_path_buf(),
            files,
            _lock: lock,
            limits,
            kept: HashMap::new(),
            bytes: 0,
            refused: HashMap::new(),
        };
        let mut over = 0;
        for (topic, payload, path) in found {
            let p = Publish::new(topic.clone().into_bytes(), payload, true);
            let n = size(&topic, &p);
            if store.kept.len() >= limits.max_messages || store.bytes + n > limits.max_bytes {
                over += 1;
                let _ = fs::remove_file(&path);
                continue;
            }
            store.bytes += n;
            store.kept.insert(topic, p);
        }
        if over > 0 {
            tracing::warn!(
                "{} holds {over} retained messages beyond --persist-max-messages {} or \
                 --persist-max-bytes {}: removed, not restored",
                store.dir.display(),
                limits.max_messages,
                limits.max_bytes
            );
        }
        Ok(store)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The messages kept (`(count, bytes)`).
    pub fn len(&self) -> (usize, u64) {
        (self.kept.len(), self.bytes)
    }

    /// Makes the files match `retained`, the broker's retained messages at one instant. With
    /// `complete` false (the broker may hold more than were read) nothing is removed for being
    /// absent. Unchanged messages keep their place within the limits; changed and new ones take
    /// what is left, in topic order.
    pub fn apply(&mut self, retained: &BTreeMap<String, Publish>, complete: bool) -> Outcome {
        let mut out = Outcome::default();
        let mut removed_any = false;
        if complete {
            let gone: Vec<String> = self
                .kept
                .keys()
                .filter(|t| !retained.contains_key(*t))
                .cloned()
                .collect();
            for t in gone {
                match self.remove(&t) {
                    Ok(()) => out.removed += 1,
                    Err(e) => {
                        tracing::error!("{}", kestrel_shared::Chain(&e));
                        out.failed += 1;
                    }
                }
                removed_any = true;
            }
        }
        self.refused.retain(|t, _| retained.contains_key(t));
        for (t, p) in retained {
            if self.kept.get(t).is_some_and(|k| same(k, p)) {
                continue;
            }
            let n = size(t, p);
            let old = self.kept.get(t).map_or(0, |k| size(t, k));
            let count = self.kept.len() + usize::from(!self.kept.contains_key(t));
            if count > self.limits.max_messages || self.bytes - old + n > self.limits.max_bytes {
                out.refused += 1;
                if self.refused.insert(t.clone(), identity(p)) != Some(identity(p)) {
                    tracing::warn!(
                        "retained message on {t:?} ({} bytes) not kept on disk: beyond \
                         --persist-max-messages {} or --persist-max-bytes {} ({} messages, {} \
                         bytes kept); it is lost if the broker restarts (a fleet of more than \
                         about 4,000 devices wants Mosquitto: docs/fleet.md, Fleet size and \
                         brokers)",
                        p.payload.len(),
                        self.limits.max_messages,
                        self.limits.max_bytes,
                        self.kept.len(),
                        self.bytes
                    );
                }
                // No outdated copy comes back after a restart.
                if self.kept.contains_key(t) {
                    if let Err(e) = self.remove(t) {
                        tracing::error!("{}", kestrel_shared::Chain(&e));
                    }
                    removed_any = true;
                }
                continue;
            }
            match self.write(t, p) {
                Ok(()) => {
                    self.bytes = self.bytes - old + n;
                    self.kept.insert(t.clone(), p.clone());
                    self.refused.remove(t);
                    out.wrote += 1;
                }
                Err(e) => {
                    tracing::error!(
                        "retained message on {t:?} not kept on disk: {}",
                        kestrel_shared::Chain(&e)
                    );
                    out.failed += 1;
                    // Not an outdated copy either; written when a later round succeeds.
                    if self.kept.contains_key(t) {
                        let _ = self.remove(t);
                        removed_any = true;
                    }
                }
            }
        }
        // The renames and removals of this round, durable.
        if (removed_any || out.wrote > 0)
            && let Ok(d) = File::open(&self.files)
        {
            let _ = d.sync_all();
        }
        out
    }

    /// Writes one message whole: a temporary file beside it (named as
    /// `kestrel_shared::fsutil` names them, so a torn one is removed at the next start), fsync,
    /// rename. The directory is synced once per round ([`Store::apply`]), not once per file.
    fn write(&self, topic: &str, p: &Publish) -> Result<(), StoreError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path = message_path(&self.files, topic);
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let tmp = self
            .files
            .join(format!(".{name}.tmp.{}.{n}", std::process::id()));
        let mut head = MAGIC.to_vec();
        head.extend((topic.len() as u32).to_le_bytes());
        head.extend(topic.as_bytes());
        head.extend((p.payload.len() as u64).to_le_bytes());
        let written = (|| {
            let mut f = File::create_new(&tmp)?;
            f.write_all(&head)?;
            f.write_all(&p.payload)?;
            f.sync_all()?;
            drop(f);
            fs::rename(&tmp, &path)
        })();
        if written.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        written.map_err(io_at(&path))
    }

    fn remove(&mut self, topic: &str) -> Result<(), StoreError> {
        if let Some(k) = self.kept.remove(topic) {
            self.bytes -= size(topic, &k);
        }
        let path = message_path(&self.files, topic);
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_at(&path)(e)),
        }
    }
}

/// `DIR/lock`, held while the broker runs (the kernel lets go of it when the process ends, however
/// it ends). Another broker waits a few seconds (one stopping), then gives up naming the holder.
fn lock(dir: &Path) -> Result<File, StoreError> {
    let path = dir.join("lock");
    let mut f = File::options()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&path)
        .map_err(io_at(&path))?;
    let deadline = Instant::now() + crate::FREE_WAIT;
    loop {
        match f.try_lock() {
            Ok(()) => break,
            Err(TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(TryLockError::WouldBlock) => {
                let mut pid = String::new();
                let _ = f.read_to_string(&mut pid);
                let pid = pid.trim();
                return Err(StoreError::Locked {
                    dir: dir.to_path_buf(),
                    pid: (!pid.is_empty()).then(|| pid.to_string()),
                });
            }
            Err(TryLockError::Error(e)) => return Err(io_at(&path)(e)),
        }
    }
    // The holder's PID, for the message another broker gives.
    let _ = f.set_len(0).and_then(|()| {
        let mut w = &f;
        w.write_all(format!("{}\n", std::process::id()).as_bytes())
    });
    Ok(f)
}

fn message_path(files: &Path, topic: &str) -> PathBuf {
    files.join(format!("{}.msg", sha256_hex(topic.as_bytes())))
}

/// A file written by [`Store::write`]: `(topic, payload)`.
fn read_message(path: &Path) -> io::Result<(String, Vec<u8>)> {
    let bytes = fs::read(path)?;
    decode(&bytes).ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "not a kept message"))
}

fn decode(bytes: &[u8]) -> Option<(String, Vec<u8>)> {
    let rest = bytes.strip_prefix(MAGIC)?;
    let (n, rest) = rest.split_first_chunk::<4>()?;
    let n = u32::from_le_bytes(*n) as usize;
    if rest.len() < n {
        return None;
    }
    let (topic, rest) = rest.split_at(n);
    let (m, payload) = rest.split_first_chunk::<8>()?;
    let topic = String::from_utf8(topic.to_vec()).ok()?;
    // Only what rumqttd would deliver again: a topic, not `$...`, and a payload (an empty one
    // deletes).
    if u64::from_le_bytes(*m) != payload.len() as u64
        || topic.is_empty()
        || topic.starts_with('$')
        || payload.is_empty()
    {
        return None;
    }
    Some((topic, payload.to_vec()))
}

/// A round: the retained messages received since it began, until its marker.
struct Round {
    nonce: Vec<u8>,
    started: Instant,
    retained: BTreeMap<String, Publish>,
}

/// Keeps the [`Store`] in step with the broker's retained messages through a local link.
pub struct Persister {
    tx: LinkTx,
    rx: LinkRx,
    store: Store,
    stopping: Arc<AtomicBool>,
    round: Option<Round>,
    /// A message arrived since the current round began: another round is due.
    dirty: bool,
    /// No round starts before this.
    next_round: Instant,
    /// The round started after the supervisor went away.
    last_started: bool,
    /// The first round, which reads back the messages restored from disk: it removes nothing.
    first: bool,
}

impl Persister {
    /// Links to `broker`'s router, publishes the kept messages again (retained), and reads them
    /// back in a first round: when this returns, the broker holds them.
    pub fn start(
        broker: &rumqttd::Broker,
        store: Store,
        stopping: Arc<AtomicBool>,
    ) -> Result<Persister, PersistError> {
        // A client that connects with the link's client id takes its place in rumqttd (and ends
        // the link): the id is not guessable.
        let (tx, rx) = broker.link(&client_id()).map_err(PersistError::Link)?;
        let mut p = Persister {
            tx,
            rx,
            store,
            stopping,
            round: None,
            dirty: false,
            next_round: Instant::now(),
            last_started: false,
            first: true,
        };
        let kept: Vec<Publish> = p.store.kept.values().cloned().collect();
        let (count, bytes) = p.store.len();
        for m in kept {
            send(&mut p.tx, Packet::Publish(m, None)).map_err(PersistError::Link)?;
        }
        p.start_round().map_err(PersistError::Link)?;
        let deadline = Instant::now() + ROUND_TIMEOUT;
        while p.round.is_some() {
            if Instant::now() >= deadline {
                return Err(PersistError::TimedOut(ROUND_TIMEOUT));
            }
            p.step().map_err(PersistError::Link)?;
        }
        tracing::info!(
            "restored {count} retained messages ({bytes} bytes) from {}",
            p.store.dir().display()
        );
        Ok(p)
    }

    /// Runs until the supervisor goes away (then writes a last round and exits the process);
    /// exits the process (for a restart) if the link to the router breaks.
    pub fn run(mut self) {
        loop {
            let stopping = self.stopping.load(Ordering::SeqCst);
            match &self.round {
                None if stopping && (!self.dirty || self.last_started) => {
                    tracing::info!("retained messages written: stopping");
                    std::process::exit(0);
                }
                None if self.dirty && (stopping || Instant::now() >= self.next_round) => {
                    self.last_started = stopping;
                    if let Err(e) = self.start_round() {
                        lost(e);
                    }
                }
                Some(r) if r.started.elapsed() > ROUND_TIMEOUT => {
                    tracing::warn!(
                        "no answer from rumqttd's router in {ROUND_TIMEOUT:?}: reading the \
                         retained messages again"
                    );
                    self.round = None;
                    self.dirty = true;
                }
                _ => {}
            }
            if let Err(e) = self.step() {
                lost(e);
            }
        }
    }

    /// Handles what the link brings within [`TICK`].
    fn step(&mut self) -> Result<(), LinkError> {
        let deadline = Instant::now() + TICK;
        match self.rx.recv_deadline(deadline) {
            Ok(Some(n)) => self.handle(n),
            Ok(None) => Ok(()),
            // A timeout; returning early means the router is gone.
            Err(LinkError::RecvTimeout(_)) if Instant::now() >= deadline => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn handle(&mut self, n: Notification) -> Result<(), LinkError> {
        match n {
            Notification::Forward(f) => {
                let p = f.publish;
                if p.topic[..] == *MARKER_TOPIC.as_bytes() {
                    if self
                        .round
                        .as_ref()
                        .is_some_and(|r| p.payload[..] == r.nonce[..])
                    {
                        self.finish_round();
                    }
                } else if p.retain {
                    // Only the retained messages sent to a new subscription keep RETAIN.
                    if let (Some(r), Ok(t)) = (&mut self.round, std::str::from_utf8(&p.topic)) {
                        r.retained.insert(t.to_string(), p);
                    }
                } else {
                    self.dirty = true;
                }
                Ok(())
            }
            // rumqttd paused the link for a full buffer: this thread has emptied it.
            Notification::Unschedule => self.rx.ready(),
            _ => Ok(()),
        }
    }

    /// Subscribes to `#` afresh (rumqttd sends a new subscription the retained messages) and
    /// publishes the round's marker, which comes after them.
    fn start_round(&mut self) -> Result<(), LinkError> {
        self.tx.unsubscribe("#")?;
        self.tx.subscribe("#")?;
        let nonce = nonce();
        send(
            &mut self.tx,
            Packet::Publish(
                Publish::new(MARKER_TOPIC.as_bytes().to_vec(), nonce.clone(), false),
                None,
            ),
        )?;
        self.dirty = false;
        self.round = Some(Round {
            nonce,
            started: Instant::now(),
            retained: BTreeMap::new(),
        });
        Ok(())
    }

    fn finish_round(&mut self) {
        let Some(r) = self.round.take() else {
            return;
        };
        // rumqttd sends a subscription at most MAX_MESSAGES retained messages, any of them: with
        // that many, absent ones may still be retained.
        let mut complete = r.retained.len() < MAX_MESSAGES as usize;
        if std::mem::take(&mut self.first) {
            let missing = self
                .store
                .kept
                .keys()
                .filter(|t| !r.retained.contains_key(*t))
                .count();
            if missing > 0 {
                tracing::warn!(
                    "{missing} of the retained messages restored from {} did not come back from \
                     the broker: kept on disk",
                    self.store.dir().display()
                );
            }
            complete = false;
        } else if !complete {
            tracing::warn!(
                "the broker holds {MAX_MESSAGES} or more retained messages, more than one read \
                 returns: only new and changed ones are written, none removed (the embedded \
                 broker's ceiling; a fleet this size wants Mosquitto: docs/fleet.md, Fleet size \
                 and brokers)"
            );
        }
        let kept_before = self.store.kept.len();
        let out = self.store.apply(&r.retained, complete);
        let took = r.started.elapsed();
        if out != Outcome::default() {
            let (count, bytes) = self.store.len();
            tracing::debug!(
                "retained messages on disk: {count} ({bytes} bytes) in {}; {} written, {} \
                 removed, {} refused, {} failed (round of {:.0?}, {kept_before} before)",
                self.store.dir().display(),
                out.wrote,
                out.removed,
                out.refused,
                out.failed,
                took
            );
        }
        let gap = if out.failed > 0 {
            self.dirty = true;
            ERROR_GAP
        } else {
            MIN_GAP.max(took * 4)
        };
        self.next_round = r.started + gap;
    }
}

fn lost(e: LinkError) -> ! {
    tracing::error!(
        "the retained-message store lost its link to rumqttd's router ({e}): exiting, to be \
         started again"
    );
    std::process::exit(crate::EXIT_SOFTWARE.into());
}

/// `LinkTx::send` is async but never waits (it sends on a channel, blocking): polled once.
fn send(tx: &mut LinkTx, packet: Packet) -> Result<(), LinkError> {
    let mut fut = std::pin::pin!(tx.send(packet));
    match fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(r) => r.map(|_| ()),
        Poll::Pending => unreachable!("rumqttd's LinkTx::send does not wait"),
    }
}

/// 16 bytes no client can guess (the standard library's per-process random hash keys).
fn random() -> [u8; 16] {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let a = RandomState::new().hash_one((t, std::process::id(), 1u8));
    let b = RandomState::new().hash_one((t, std::process::id(), 2u8));
    let mut out = [0; 16];
    out[..8].copy_from_slice(&a.to_le_bytes());
    out[8..].copy_from_slice(&b.to_le_bytes());
    out
}

fn nonce() -> Vec<u8> {
    random().to_vec()
}

fn client_id() -> String {
    let r = random();
    let hex: String = r.iter().map(|b| format!("{b:02x}")).collect();
    format!("kestrel-broker-persist-{hex}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(topic: &str, payload: &[u8]) -> (String, Publish) {
        (
            topic.to_string(),
            Publish::new(topic.as_bytes().to_vec(), payload.to_vec(), true),
        )
    }

    fn on_disk(dir: &Path) -> BTreeMap<String, Vec<u8>> {
        fs::read_dir(dir.join("retained"))
            .unwrap()
            .map(|e| read_message(&e.unwrap().path()).unwrap())
            .collect()
    }

    fn limits(max_messages: usize, max_bytes: u64) -> Limits {
        Limits {
            max_messages,
            max_bytes,
        }
    }

    #[test]
    fn files_follow_the_retained_messages_and_come_back() {
        let tmp = std::env::temp_dir().join(format!("kestrel-broker-store-{}", std::process::id()));
        let _ = fs::remove_dir_all(&tmp);
        let mut s = Store::open(&tmp, limits(100, 1 << 20)).unwrap();
        let mut r: BTreeMap<String, Publish> =
            [msg("a/1", b"one"), msg("a/2", &[0, 1, 2]), msg("b/é", b"x")].into();
        assert_eq!(s.apply(&r, true).wrote, 3);
        // Unchanged: nothing written.
        assert_eq!(s.apply(&r, true), Outcome::default());
        // Changed, and one gone (an empty retained payload deleted it).
        r.insert("a/1".into(), msg("a/1", b"uno").1);
        r.remove("a/2");
        let out = s.apply(&r, true);
        assert_eq!((out.wrote, out.removed), (1, 1));
        // An incomplete read removes nothing.
        let out = s.apply(&BTreeMap::new(), false);
        assert_eq!(out, Outcome::default());
        let want: BTreeMap<String, Vec<u8>> = [
            ("a/1".into(), b"uno".to_vec()),
            ("b/é".into(), b"x".to_vec()),
        ]
        .into();
        assert_eq!(on_disk(&tmp), want);
        // A second store on the same directory waits, then names the holder.
        let t = Instant::now();
        let e = Store::open(&tmp, limits(100, 1 << 20)).err().unwrap();
        assert!(t.elapsed() >= crate::FREE_WAIT);
        let text = e.to_string();
        assert!(
            text.contains("in use") && text.contains(&std::process::id().to_string()),
            "{text}"
        );
        drop(s);
        // Reopened: the same messages, and a torn temporary file is gone.
        fs::write(tmp.join("retained/.x.msg.tmp.1.0"), b"torn").unwrap();
        let s = Store::open(&tmp, limits(100, 1 << 20)).unwrap();
        let back: BTreeMap<String, Vec<u8>> = s
            .kept
            .iter()
            .map(|(t, p)| (t.clone(), p.payload.to_vec()))
            .collect();
        assert_eq!(back, want);
        assert_eq!(s.len(), (2, 3 + 3 + 4 + 1));
        assert_eq!(fs::read_dir(tmp.join("retained")).unwrap().count(), 2);
        drop(s);
        fs::remove_dir_all(&tmp).unwrap();
    }

    #[test]
    fn limits_refuse_new_topics_and_drop_outdated_copies() {
        let tmp =
            std::env::temp_dir().join(format!("kestrel-broker-limits-{}", std::process::id()));
        let _ = fs::remove_dir_all(&tmp);
        let mut s = Store::open(&tmp, limits(2, 10)).unwrap();
        let mut r: BTreeMap<String, Publish> =
            [msg("a", b"1111"), msg("b", b"2222"), msg("c", b"3")].into();
        // Two messages at most: "c" is refused.
        let out = s.apply(&r, true);
        assert_eq!((out.wrote, out.refused), (2, 1));
        // "a" grows beyond the byte limit: refused, and its old copy is removed.
        r.insert("a".into(), msg("a", b"111111111").1);
        let out = s.apply(&r, true);
        assert_eq!((out.wrote, out.refused), (1, 1), "{out:?}");
        assert_eq!(
            on_disk(&tmp),
            [
                ("b".to_string(), b"2222".to_vec()),
                ("c".to_string(), b"3".to_vec())
            ]
            .into()
        );
        drop(s);
        // Reopened with lower limits: what is beyond them is removed.
        let s = Store::open(&tmp, limits(1, 10)).unwrap();
        assert_eq!(s.len(), (1, 5));
        assert_eq!(fs::read_dir(tmp.join("retained")).unwrap().count(), 1);
        drop(s);
        fs::remove_dir_all(&tmp).unwrap();
    }

    #[test]
    fn damaged_files_are_not_restored() {
        let mut good = MAGIC.to_vec();
        good.extend(3u32.to_le_bytes());
        good.extend(b"a/b");
        good.extend(2u64.to_le_bytes());
        good.extend(b"hi");
        assert_eq!(decode(&good), Some(("a/b".into(), b"hi".to_vec())));
        assert_eq!(decode(&good[..good.len() - 1]), None);
        let mut long = good.clone();
        long.push(0);
        assert_eq!(decode(&long), None);
        assert_eq!(decode(&good[1..]), None);
        let mut dollar = MAGIC.to_vec();
        dollar.extend(3u32.to_le_bytes());
        dollar.extend(b"$ab");
        dollar.extend(1u64.to_le_bytes());
        dollar.extend(b"x");
        assert_eq!(decode(&dollar), None);
    }
}
