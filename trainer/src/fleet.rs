//! The trainer's side of the MQTT protocol ([`kestrel_shared::protocol`]): publishing signed
//! artifacts and desired states, reading device status, and sending inference requests. A small
//! blocking client ([`Conn`]) around rumqttc's sync API: every publish is QoS 1 and waits for
//! the broker's acknowledgement before the command reports success.

use std::collections::{BTreeMap, VecDeque};
use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ed25519_dalek::SigningKey;
use kestrel_models::artifact::{self, read_manifest};
use kestrel_shared::manifest::{MANIFEST_FILE, Manifest};
use kestrel_shared::mqtt::BrokerConfig;
use kestrel_shared::protocol::{
    ArtifactOffer, Desired, InferReply, SignedDesired, Status, Target, Topics, device_files, parse,
};
use kestrel_shared::signing::sign;
use std::sync::mpsc::{Receiver, RecvTimeoutError};

use rumqttc::{Client, Event, Outgoing, Packet, QoS};
use serde::Serialize;

#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error("broker {url}: {reason}")]
    Broker { url: String, reason: String },
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Artifact(#[from] artifact::ArtifactError),
    #[error(transparent)]
    Protocol(#[from] kestrel_shared::protocol::ProtocolError),
    #[error(transparent)]
    Config(#[from] kestrel_shared::mqtt::BrokerError),
    #[error("{path}: {reason}")]
    Io { path: String, reason: String },
}

/// A connected blocking MQTT client. Its connection is driven by a thread of its own that
/// forwards every event: polling is never cut short by a timeout (a cancelled poll can lose an
/// acknowledgement, and rumqttd drops clients whose acknowledgements arrive out of order).
pub struct Conn {
    client: Client,
    events: Receiver<Result<Event, rumqttc::ConnectionError>>,
    url: String,
    pub topics: Topics,
    /// Publishes received while waiting for something else.
    backlog: VecDeque<(String, Vec<u8>)>,
}

impl Conn {
    /// Connects with a clean session; fails with the broker's URL when it cannot be reached.
    pub fn connect(cfg: &BrokerConfig, role: &str) -> Result<Self, FleetError> {
        // Unique per connection: a broker drops the older of two sessions with one client id.
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = format!(
            "kestrel-{role}-{}-{}-{n}",
            std::process::id(),
            now_unix() % 100_000
        );
        let opts = cfg.options(&id, true)?;
        let (client, mut conn) = Client::new(opts, 512);
        let (tx, events) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for ev in conn.iter() {
                let failed = ev.is_err();
                if tx.send(ev).is_err() || failed {
                    break; // the Conn is gone, or the connection failed (reported, not retried)
                }
            }
        });
        let c = Self {
            client,
            events,
            url: cfg.url.clone(),
            topics: Topics::new(&cfg.prefix),
            backlog: VecDeque::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match c
                .events
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(Ok(Event::Incoming(Packet::ConnAck(_)))) => return Ok(c),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(c.err(e.to_string())),
                Err(_) => return Err(c.err("no answer within 10 s".into())),
            }
        }
    }

    fn err(&self, reason: String) -> FleetError {
        FleetError::Broker {
            url: self.url.clone(),
            reason,
        }
    }

    fn client_err(&self, e: rumqttc::ClientError) -> FleetError {
        self.err(e.to_string())
    }

    /// Next event within `timeout` (None on timeout); connection errors end the command.
    fn next(&mut self, timeout: Duration) -> Result<Option<Event>, FleetError> {
        match self.events.recv_timeout(timeout) {
            Ok(Ok(ev)) => {
                // Publishes are kept for `recv`, whatever the caller is waiting for.
                if let Event::Incoming(Packet::Publish(p)) = &ev {
                    self.backlog
                        .push_back((p.topic.clone(), p.payload.to_vec()));
                }
                Ok(Some(ev))
            }
            Ok(Err(e)) => Err(self.err(format!("connection lost: {e}"))),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(self.err("client stopped".into())),
        }
    }

    /// Publishes every message at QoS 1 (up to 32 in flight) and waits for all acknowledgements.
    pub fn publish_all(
        &mut self,
        msgs: Vec<(String, Vec<u8>, bool)>,
        progress: Option<&indicatif::ProgressBar>,
    ) -> Result<(), FleetError> {
        let total = msgs.len();
        let mut queue: VecDeque<_> = msgs.into();
        let (mut in_flight, mut acked) = (0usize, 0usize);
        while acked < total {
            while in_flight < 32
                && let Some((topic, payload, retain)) = queue.pop_front()
            {
                self.client
                    .publish(topic, QoS::AtLeastOnce, retain, payload)
                    .map_err(|e| self.client_err(e))?;
                in_flight += 1;
            }
            match self.next(Duration::from_secs(30))? {
                Some(Event::Incoming(Packet::PubAck(_))) => {
                    in_flight -= 1;
                    acked += 1;
                    if let Some(p) = progress {
                        p.inc(1);
                    }
                }
                Some(_) => {}
                None => {
                    return Err(self.err(format!(
                        "{} of {total} publishes unacknowledged after 30 s",
                        total - acked
                    )));
                }
            }
        }
        Ok(())
    }

    pub fn subscribe(&mut self, filter: &str) -> Result<(), FleetError> {
        self.client
            .subscribe(filter, QoS::AtLeastOnce)
            .map_err(|e| self.client_err(e))?;
        // Wait for the SubAck: retained messages follow it.
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(Event::Incoming(Packet::SubAck(_))) =
                self.next(Duration::from_millis(200))?
            {
                return Ok(());
            }
        }
        Err(self.err(format!("no SubAck for {filter}")))
    }

    /// The next publish received within `timeout`.
    pub fn recv(&mut self, timeout: Duration) -> Result<Option<(String, Vec<u8>)>, FleetError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(m) = self.backlog.pop_front() {
                return Ok(Some(m));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            self.next(left.min(Duration::from_millis(200)))?;
        }
    }

    /// Retained messages under `filter`: everything that arrives until `quiet` passes without one.
    pub fn retained(
        &mut self,
        filter: &str,
        quiet: Duration,
    ) -> Result<BTreeMap<String, Vec<u8>>, FleetError> {
        self.subscribe(filter)?;
        let mut out = BTreeMap::new();
        while let Some((t, p)) = self.recv(quiet)? {
            out.insert(t, p);
        }
        self.client
            .unsubscribe(filter)
            .map_err(|e| self.client_err(e))?;
        Ok(out)
    }

    pub fn disconnect(self) {
        let _ = self.client.disconnect();
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            match self.events.recv_timeout(Duration::from_millis(200)) {
                Ok(Ok(Event::Outgoing(Outgoing::Disconnect))) | Ok(Err(_)) | Err(_) => break,
                _ => {}
            }
        }
    }
}

pub fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// An artifact ready to publish: its signed offer and the chunks of its device files.
pub struct Bundle {
    pub manifest: Manifest,
    pub offer: ArtifactOffer,
    pub chunks: Vec<Vec<u8>>,
}

impl Bundle {
    /// Reads `dir`, checks every file against the manifest, signs the manifest with `key` and cuts
    /// the device files into `chunk_bytes` chunks.
    pub fn from_dir(dir: &Path, key: &SigningKey, chunk_bytes: usize) -> Result<Self, FleetError> {
        let manifest = read_manifest(dir)?;
        artifact::verify_files(dir, &manifest, u64::MAX)?;
        let mpath = dir.join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&mpath).map_err(|e| FleetError::Io {
            path: mpath.display().to_string(),
            reason: e.to_string(),
        })?;
        let mut bundle = Vec::new();
        for f in device_files(&manifest) {
            let p = dir.join(artifact::safe_relative(&f.path)?);
            bundle.extend(std::fs::read(&p).map_err(|e| FleetError::Io {
                path: p.display().to_string(),
                reason: e.to_string(),
            })?);
        }
        let chunk_bytes = chunk_bytes.max(1);
        let signature = sign(key, text.as_bytes());
        let offer = ArtifactOffer::new(&manifest, text, signature, &bundle, chunk_bytes);
        let chunks = bundle.chunks(chunk_bytes).map(<[u8]>::to_vec).collect();
        Ok(Self {
            manifest,
            offer,
            chunks,
        })
    }

    /// The retained messages of the artifact: every chunk, then the offer.
    pub fn messages(&self, topics: &Topics) -> Vec<(String, Vec<u8>, bool)> {
        let (name, v) = (&self.offer.name, self.offer.version);
        let mut out: Vec<_> = self
            .chunks
            .iter()
            .enumerate()
            .map(|(i, c)| (topics.chunk(name, v, i as u32), c.clone(), true))
            .collect();
        out.push((
            topics.artifact_manifest(name, v),
            serde_json::to_vec(&self.offer).expect("serializable"),
            true,
        ));
        out
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Published {
    pub name: String,
    pub version: u64,
    pub target: String,
    pub chunks: usize,
    pub bytes: u64,
    /// The target's desired version before this publish, if any.
    pub replaced: Option<u64>,
    pub seconds: f64,
}

/// The desired state currently retained for `target`, if any (signature not checked: this is
/// the publisher's own record).
pub fn current_desired(conn: &mut Conn, target: &Target) -> Result<Option<Desired>, FleetError> {
    let topic = conn.topics.desired(target);
    let retained = conn.retained(&topic, Duration::from_millis(400))?;
    Ok(match retained.get(&topic) {
        Some(p) if !p.is_empty() => {
            let s: SignedDesired = parse(&topic, p)?;
            Some(parse(&topic, s.body.as_bytes())?)
        }
        _ => None,
    })
}

/// `trainer publish`: the artifact's chunks and signed offer (retained), then the signed desired
/// state of `target`. Versions only go up unless `rollback`; a version, once published, cannot
/// be published again with other content.
pub fn publish(
    cfg: &BrokerConfig,
    bundle: &Bundle,
    key: &SigningKey,
    target: &Target,
    rollback: bool,
    rollout: Option<String>,
) -> Result<Published, FleetError> {
    let start = Instant::now();
    let mut conn = Conn::connect(cfg, "publish")?;
    let (name, version) = (bundle.offer.name.clone(), bundle.offer.version);
    let current = current_desired(&mut conn, target)?;
    if let Some(c) = &current
        && version < c.version
        && !rollback
    {
        return Err(FleetError::Refused(format!(
            "{target} is at v{} ({}); publishing the older v{version} needs --rollback",
            c.version, c.name
        )));
    }
    let offer_topic = conn.topics.artifact_manifest(&name, version);
    if let Some(p) = conn
        .retained(&offer_topic, Duration::from_millis(300))?
        .get(&offer_topic)
        && !p.is_empty()
    {
        let old: ArtifactOffer = parse(&offer_topic, p)?;
        if old.manifest != bundle.offer.manifest {
            return Err(FleetError::Refused(format!(
                "{name} v{version} is already published with other content; versions are immutable (export with a new --model-version)"
            )));
        }
    }
    let msgs = bundle.messages(&conn.topics);
    let pb = crate::report::progress(msgs.len() as u64 + 1, "publish");
    conn.publish_all(msgs, Some(&pb))?;
    let desired = Desired {
        target: target.clone(),
        name: name.clone(),
        version,
        rollback,
        issued: now_unix(),
        rollout,
    };
    let d = serde_json::to_vec(&SignedDesired::new(key, &desired)).expect("serializable");
    conn.publish_all(vec![(conn.topics.desired(target), d, true)], Some(&pb))?;
    pb.finish_and_clear();
    conn.disconnect();
    Ok(Published {
        name,
        version,
        target: target.to_string(),
        chunks: bundle.chunks.len(),
        bytes: bundle.offer.total_bytes,
        replaced: current.map(|c| c.version),
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Retained status of every device (or of one).
pub fn statuses(cfg: &BrokerConfig, device: Option<&str>) -> Result<Vec<Status>, FleetError> {
    let mut conn = Conn::connect(cfg, "status")?;
    let filter = match device {
        Some(d) => conn.topics.status(d),
        None => conn.topics.status_filter(),
    };
    let out = conn
        .retained(&filter, Duration::from_millis(400))?
        .iter()
        .filter(|(_, p)| !p.is_empty())
        .map(|(t, p)| parse(t, p))
        .collect::<Result<Vec<Status>, _>>()?;
    conn.disconnect();
    Ok(out)
}

/// Waits until `device`'s status satisfies `done` (or `timeout`); returns the last status seen.
pub fn wait_status(
    cfg: &BrokerConfig,
    device: &str,
    timeout: Duration,
    done: impl Fn(&Status) -> bool,
) -> Result<Status, FleetError> {
    let deadline = Instant::now() + timeout;
    let mut last: Option<Status> = None;
    // A dropped connection is re-established: the retained status is delivered again on
    // subscribing.
    let mut first = true;
    while Instant::now() < deadline {
        let mut conn = match Conn::connect(cfg, "wait") {
            Ok(c) => c,
            Err(e) if first => return Err(e),
            Err(_) => {
                std::thread::sleep(Duration::from_millis(200));
                continue;
            }
        };
        first = false;
        let topic = conn.topics.status(device);
        if let Err(e) = conn.subscribe(&topic) {
            eprintln!("{e}; reconnecting");
            continue;
        }
        loop {
            match conn.recv(deadline.saturating_duration_since(Instant::now())) {
                Ok(Some((t, p))) if t == topic && !p.is_empty() => {
                    let s: Status = parse(&t, &p)?;
                    if done(&s) {
                        conn.disconnect();
                        return Ok(s);
                    }
                    last = Some(s);
                }
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(FleetError::Broker { reason, .. }) => {
                    eprintln!("{}: {reason}; reconnecting", cfg.url);
                    break;
                }
                Err(e) => return Err(e),
            }
        }
    }
    Err(FleetError::Refused(format!(
        "device {device}: condition not met within {timeout:?}; last status: {}",
        last.map_or("none".into(), |s| serde_json::to_string(&s)
            .unwrap_or_default())
    )))
}

/// Sends images to `device` as inference requests (at most `window` outstanding) and collects
/// the replies in request order; a request without a reply within `timeout` is an error reply.
pub fn infer(
    cfg: &BrokerConfig,
    device: &str,
    images: &[(String, Vec<u8>)],
    window: usize,
    timeout: Duration,
) -> Result<Vec<InferReply>, FleetError> {
    let mut conn = Conn::connect(cfg, "infer")?;
    conn.subscribe(&conn.topics.result_filter(device))?;
    let tag = format!("{}-{}", std::process::id(), now_unix() % 100_000);
    let ids: Vec<String> = (0..images.len()).map(|i| format!("{tag}-{i}")).collect();
    let mut replies: BTreeMap<String, InferReply> = BTreeMap::new();
    let pb = crate::report::progress(images.len() as u64, "infer");
    let mut next = 0;
    let mut last_reply = Instant::now();
    while replies.len() < images.len() {
        while next < images.len() && next - replies.len() < window.max(1) {
            let topic = conn.topics.infer(device, &ids[next]);
            if images[next].1.len() + topic.len() + 16 > cfg.max_packet_bytes {
                // rumqttc would drop the whole connection on an oversize packet.
                let error = format!(
                    "{}: {} bytes do not fit the broker packet limit of {} bytes",
                    images[next].0,
                    images[next].1.len(),
                    cfg.max_packet_bytes
                );
                let r = InferReply {
                    request: ids[next].clone(),
                    device: device.to_string(),
                    prediction: None,
                    error: Some(error),
                };
                replies.insert(ids[next].clone(), r);
                pb.inc(1);
                next += 1;
                continue;
            }
            conn.client
                .publish(topic, QoS::AtLeastOnce, false, images[next].1.clone())
                .map_err(|e| conn.client_err(e))?;
            next += 1;
        }
        match conn.recv(Duration::from_millis(200))? {
            Some((t, p)) => {
                let r: InferReply = parse(&t, &p)?;
                if ids.contains(&r.request) && replies.insert(r.request.clone(), r).is_none() {
                    pb.inc(1);
                    last_reply = Instant::now();
                }
            }
            None if last_reply.elapsed() > timeout => break,
            None => {}
        }
    }
    pb.finish_and_clear();
    conn.disconnect();
    Ok(ids
        .iter()
        .zip(images)
        .map(|(id, (name, _))| {
            replies.remove(id).unwrap_or_else(|| InferReply {
                request: id.clone(),
                device: device.to_string(),
                prediction: None,
                error: Some(format!("{name}: no reply within {timeout:?}")),
            })
        })
        .collect())
}
