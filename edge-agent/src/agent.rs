//! The agent's IO loop around the sans-IO [`Updater`]: MQTT (rumqttc, persistent session) in,
//! store operations, verification, health checks and inference out. One tokio task owns all
//! state; blocking work (verification, the tract health check, inference) runs on other threads
//! and reports back through a channel. Every updater event is journaled (`state.json`) before
//! its actions run, so a restart continues where the agent stopped.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use ed25519_dalek::VerifyingKey;
use kestrel_models::artifact::{self, LoadedModel};
use kestrel_shared::fsutil::write_atomic;
use kestrel_shared::manifest::Manifest;
use kestrel_shared::now_rfc3339;
use kestrel_shared::protocol::{
    ArtifactOffer, Desired, DeviceEvent, InferReply, LatencyStats, SignedDesired, Status, Target,
    Topics, parse, sha256_hex,
};
use rumqttc::{AsyncClient, Event as MqttEvent, LastWill, Outgoing, Packet, QoS};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::config::Config;
use crate::outbox::{Message, Outbox};
use crate::serve::{ModelCache, Shared};
use crate::store::Store;
use crate::update::{Action, Event, Offer, Phase, Report, Updater};

/// Journal of the update machine and the desired state being pursued.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Journal {
    updater: Option<Updater>,
    wanted: Option<Desired>,
}

/// Results of work done off the event loop.
enum Done {
    Verified(u64, Result<(), String>),
    Health(u64, Result<Arc<LoadedModel>, String>),
    Reply(InferReply, Option<f64>),
}

struct Job {
    request: String,
    bytes: Vec<u8>,
}

pub struct Agent {
    cfg: Config,
    topics: Topics,
    keys: Vec<VerifyingKey>,
    store: Store,
    updater: Updater,
    wanted: Option<Desired>,
    /// Valid desired states by topic (own and groups').
    desired: BTreeMap<String, Desired>,
    /// The accepted offer of the version being downloaded.
    offer: Option<(ArtifactOffer, Manifest)>,
    model: Shared<LoadedModel>,
    candidate: Option<(u64, Arc<LoadedModel>)>,
    models: Arc<ModelCache>,
    outbox: Outbox,
    client: AsyncClient,
    done_tx: mpsc::UnboundedSender<Done>,
    jobs: SyncSender<Job>,
    latencies: VecDeque<f64>,
    served: u64,
    status_dirty: bool,
    connected: bool,
    last_progress: Instant,
    /// Test hook (`KESTREL_AGENT_PAUSE=download|activate`): stop at that point, still connected,
    /// so a test can kill the process there.
    pause: Option<String>,
}

impl Agent {
    fn journal_path(&self) -> PathBuf {
        self.cfg.store.join("state.json")
    }

    fn save_journal(&self) -> Result<()> {
        let j = Journal {
            updater: Some(self.updater.clone()),
            wanted: self.wanted.clone(),
        };
        write_atomic(&self.journal_path(), &serde_json::to_vec_pretty(&j)?)
            .with_context(|| format!("writing {}", self.journal_path().display()))
    }

    fn status(&self) -> Status {
        let progress = match &self.updater.phase {
            Phase::Downloading { offer, have, .. } => Some((have.len() as u32, offer.chunks)),
            _ => None,
        };
        let mut sorted: Vec<f64> = self.latencies.iter().copied().collect();
        sorted.sort_by(f64::total_cmp);
        let pct = |p: f64| {
            sorted
                .get(((sorted.len() as f64 - 1.0) * p).round() as usize)
                .copied()
                .unwrap_or(0.0)
        };
        let model = self.model.read().expect("lock");
        Status {
            device: self.cfg.device_id.clone(),
            groups: self.cfg.groups.clone(),
            state: self.updater.phase.name().to_string(),
            model: model.as_ref().map(|m| m.manifest.name.clone()),
            active: self.updater.active,
            previous: self.updater.previous,
            target: self.updater.phase.target(),
            progress,
            last_error: self.updater.last_error.clone(),
            failed_version: self.updater.last_failed,
            latency: LatencyStats {
                count: self.served,
                mean_ms: if sorted.is_empty() {
                    0.0
                } else {
                    sorted.iter().sum::<f64>() / sorted.len() as f64
                },
                p50_ms: pct(0.5),
                p95_ms: pct(0.95),
            },
            updated: now_rfc3339(),
        }
    }

    fn publish_status(&mut self) {
        let payload = serde_json::to_string(&self.status()).expect("serializable");
        self.outbox.push_latest(Message {
            topic: self.topics.status(&self.cfg.device_id),
            retain: true,
            payload,
        });
        self.status_dirty = false;
    }

    fn publish_durable(&mut self, topic: String, payload: String) {
        if let Err(e) = self.outbox.push_durable(Message {
            topic: topic.clone(),
            retain: false,
            payload,
        }) {
            eprintln!("error: outbox: {topic}: {e}");
        }
    }

    fn report(&mut self, r: Report) {
        let (kind, version, reason) = match r {
            Report::Downloading { version } => ("downloading", version, None),
            Report::Rejected { version, reason } => ("rejected", version, Some(reason)),
            Report::RolledBack {
                version, reason, ..
            } => ("rolled-back", version, Some(reason)),
            Report::Active { version, .. } => ("active", version, None),
        };
        eprintln!(
            "{}: v{version} {kind}{}",
            self.cfg.device_id,
            reason
                .as_deref()
                .map(|r| format!(": {r}"))
                .unwrap_or_default()
        );
        let ev = DeviceEvent {
            device: self.cfg.device_id.clone(),
            kind: kind.into(),
            version,
            reason,
            time: now_rfc3339(),
        };
        let topic = self.topics.events(&self.cfg.device_id);
        self.publish_durable(topic, serde_json::to_string(&ev).expect("serializable"));
        self.publish_status();
    }

    /// Subscriptions that follow from the state; sent again after every (re)connect.
    async fn subscribe_all(&self) -> Result<()> {
        let id = &self.cfg.device_id;
        let mut filters = vec![
            self.topics.desired(&Target::Device(id.clone())),
            self.topics.infer_filter(id),
        ];
        for g in &self.cfg.groups {
            filters.push(self.topics.desired(&Target::Group(g.clone())));
        }
        if let Some(w) = &self.wanted {
            filters.push(self.topics.artifact_manifest(&w.name, w.version));
        }
        if let Phase::Downloading { offer, .. } = &self.updater.phase
            && let Some((o, _)) = &self.offer
            && o.version == offer.version
        {
            filters.push(self.topics.chunks_filter(&o.name, o.version));
        }
        for f in filters {
            self.client.subscribe(f, QoS::AtLeastOnce).await?;
        }
        Ok(())
    }

    /// Feeds one event and runs the resulting actions (and the events they cause) to completion.
    async fn feed(&mut self, ev: Event) -> Result<()> {
        let mut events = VecDeque::from([ev]);
        while let Some(ev) = events.pop_front() {
            let before = self.updater.phase.name();
            let actions = self.updater.handle(ev);
            self.save_journal()?;
            if self.updater.phase.name() != before {
                self.status_dirty = true;
            }
            for a in actions {
                if let Some(next) = self.act(a).await? {
                    events.push_back(next);
                }
            }
        }
        if self.status_dirty {
            self.publish_status();
        }
        Ok(())
    }

    /// Runs one action; returns the event it produced right away, if any.
    async fn act(&mut self, a: Action) -> Result<Option<Event>> {
        match a {
            Action::Fetch { version, chunks } => {
                let Some((o, _)) = &self.offer else {
                    return Ok(Some(Event::Refused {
                        version,
                        reason: "no offer journaled for this download".into(),
                    }));
                };
                if o.version == version {
                    let (name, all) = (o.name.clone(), chunks.len() == o.chunks.len());
                    if all {
                        let f = self.topics.chunks_filter(&name, version);
                        self.client.subscribe(f, QoS::AtLeastOnce).await?;
                    } else {
                        // Re-subscribing to a chunk's own topic makes the broker resend it.
                        for i in chunks {
                            let t = self.topics.chunk(&name, version, i);
                            self.client.unsubscribe(t.clone()).await?;
                            self.client.subscribe(t, QoS::AtLeastOnce).await?;
                        }
                    }
                }
                self.last_progress = Instant::now();
                Ok(None)
            }
            Action::Verify { version } => {
                if let Some((o, _)) = &self.offer {
                    let f = self.topics.chunks_filter(&o.name, version);
                    self.client.unsubscribe(f).await?;
                }
                let (store, offer) = (self.store.clone(), self.offer.clone());
                let (keys, max) = (self.keys.clone(), self.cfg.limits.max_artifact_bytes);
                let tx = self.done_tx.clone();
                tokio::task::spawn_blocking(move || {
                    let r = match offer {
                        Some((o, m)) if o.version == version => {
                            store.assemble(&o, &m).and_then(|dir| {
                                artifact::verify_signature(&dir, &keys)
                                    .and_then(|_| artifact::verify_device_files(&dir, &m, max))
                                    .map_err(|e| e.to_string())
                            })
                        }
                        _ => Err("the offer of this version is gone".into()),
                    };
                    let _ = tx.send(Done::Verified(version, r));
                });
                Ok(None)
            }
            Action::Stage { version } => {
                self.store
                    .stage(version)
                    .with_context(|| format!("staging v{version}"))?;
                Ok(Some(Event::Staged { version }))
            }
            Action::HealthCheck { version } => {
                self.spawn_health_check(version);
                Ok(None)
            }
            Action::Activate { version } => {
                if self.pause.as_deref() == Some("activate") {
                    eprintln!(
                        "{}: paused before activating v{version} (KESTREL_AGENT_PAUSE)",
                        self.cfg.device_id
                    );
                    return Ok(None);
                }
                self.store
                    .activate(version)
                    .with_context(|| format!("activating v{version}"))?;
                match self.candidate.take() {
                    Some((v, m)) if v == version => {
                        *self.model.write().expect("lock") = Some(m);
                    }
                    _ => self.load_active(version), // after a restart: load it again
                }
                Ok(Some(Event::Activated { version }))
            }
            Action::Discard { version } => {
                self.store.discard(version)?;
                if self
                    .offer
                    .as_ref()
                    .is_some_and(|(o, _)| o.version == version)
                {
                    self.offer = None;
                }
                Ok(None)
            }
            Action::Report(r) => {
                self.report(r);
                Ok(None)
            }
        }
    }

    /// Health check: loads `versions/<v>` (verifies files, runs the golden samples) on a
    /// blocking thread.
    fn spawn_health_check(&self, version: u64) {
        let dir = self.store.version_dir(version);
        let (models, tx) = (self.models.clone(), self.done_tx.clone());
        tokio::task::spawn_blocking(move || {
            let _ = tx.send(Done::Health(version, models.load(&dir)));
        });
    }

    /// Loads the active model for serving (at start-up, or to finish an activation after a
    /// restart), so no request is answered "no active model" while one is installed.
    fn load_active(&mut self, version: u64) {
        eprintln!("{}: loading active v{version}", self.cfg.device_id);
        match self.models.load(&self.store.version_dir(version)) {
            Ok(m) => *self.model.write().expect("lock") = Some(m),
            Err(e) => {
                eprintln!(
                    "error: {}: active v{version} does not load: {e}",
                    self.cfg.device_id
                );
                self.updater.last_error = Some(format!("active v{version} does not load: {e}"));
            }
        }
    }

    async fn on_done(&mut self, d: Done) -> Result<()> {
        match d {
            Done::Verified(version, Ok(())) => self.feed(Event::Verified { version }).await,
            Done::Verified(version, Err(reason)) => {
                self.feed(Event::VerifyFailed { version, reason }).await
            }
            Done::Health(version, Ok(m)) => {
                self.candidate = Some((version, m));
                self.feed(Event::HealthPassed { version }).await
            }
            Done::Health(version, Err(reason)) => {
                self.feed(Event::HealthFailed { version, reason }).await
            }
            Done::Reply(reply, latency) => {
                if let Some(ms) = latency {
                    self.served += 1;
                    self.latencies.push_back(ms);
                    if self.latencies.len() > 1000 {
                        self.latencies.pop_front();
                    }
                    self.status_dirty = true;
                }
                let topic = self.topics.result(&self.cfg.device_id, &reply.request);
                self.publish_durable(topic, serde_json::to_string(&reply)?);
                Ok(())
            }
        }
    }

    /// A desired state arrived on one of our desired topics (empty payload: cleared).
    async fn on_desired(&mut self, topic: &str, payload: &[u8]) -> Result<()> {
        if payload.is_empty() {
            self.desired.remove(topic);
            return Ok(());
        }
        let d = parse::<SignedDesired>(topic, payload)
            .and_then(|s| s.open(&self.keys, topic))
            .map_err(|e| e.to_string())
            .and_then(|d| {
                if self.topics.desired(&d.target) == topic {
                    Ok(d)
                } else {
                    Err(format!(
                        "{topic}: desired state for {} on the wrong topic",
                        d.target
                    ))
                }
            });
        match d {
            Ok(d) => {
                self.desired.insert(topic.to_string(), d);
                self.choose().await
            }
            Err(reason) => {
                // The version, if readable, only labels the report.
                let version = parse::<SignedDesired>(topic, payload)
                    .ok()
                    .and_then(|s| serde_json::from_str::<Desired>(&s.body).ok())
                    .map_or(0, |d| d.version);
                let reason = format!("desired state refused: {reason}");
                self.feed(Event::Refused { version, reason }).await
            }
        }
    }

    /// Pursues the device's own desired state, else the newest of its groups'.
    async fn choose(&mut self) -> Result<()> {
        let own = self
            .topics
            .desired(&Target::Device(self.cfg.device_id.clone()));
        let pick = self
            .desired
            .get(&own)
            .or_else(|| self.desired.values().max_by_key(|d| d.issued))
            .cloned();
        let Some(d) = pick else { return Ok(()) };
        let same = self.wanted.as_ref().is_some_and(|w| {
            w.name == d.name && w.version == d.version && w.rollback == d.rollback
        });
        if same && self.updater.phase != Phase::Idle {
            return Ok(());
        }
        if let Some(old) = &self.wanted
            && (old.name != d.name || old.version != d.version)
        {
            let t = self.topics.artifact_manifest(&old.name, old.version);
            self.client.unsubscribe(t).await?;
        }
        let t = self.topics.artifact_manifest(&d.name, d.version);
        self.wanted = Some(d);
        self.save_journal()?;
        self.client.subscribe(t, QoS::AtLeastOnce).await?;
        Ok(())
    }

    async fn on_offer(&mut self, topic: &str, payload: &[u8]) -> Result<()> {
        let Some(w) = self.wanted.clone() else {
            return Ok(());
        };
        if topic != self.topics.artifact_manifest(&w.name, w.version) || payload.is_empty() {
            return Ok(());
        }
        if self.updater.phase.target() == Some(w.version)
            || (self.updater.active == Some(w.version) && self.updater.phase == Phase::Idle)
        {
            return Ok(()); // redelivery
        }
        let checked = parse::<ArtifactOffer>(topic, payload)
            .map_err(|e| e.to_string())
            .and_then(|o| {
                let m = o.open(&self.keys).map_err(|e| e.to_string())?;
                artifact::check_names(&m).map_err(|e| e.to_string())?;
                if m.name != w.name || m.version != w.version {
                    return Err(format!(
                        "offer is {} v{}, wanted {} v{}",
                        m.name, m.version, w.name, w.version
                    ));
                }
                Ok((o, m))
            });
        let (o, m) = match checked {
            Ok(x) => x,
            Err(reason) => {
                let reason = format!("artifact refused: {reason}");
                return self
                    .feed(Event::Refused {
                        version: w.version,
                        reason,
                    })
                    .await;
            }
        };
        let dl = self.store.download_dir(o.version);
        std::fs::create_dir_all(dl.join("chunks"))?;
        write_atomic(&dl.join("offer.json"), payload)?;
        let offer = Offer {
            version: o.version,
            chunks: o.chunks.len() as u32,
            total_bytes: o.total_bytes,
            rollback: w.rollback,
        };
        let version = o.version;
        self.offer = Some((o, m));
        self.feed(Event::Offered(offer)).await?;
        if self.updater.phase.target() != Some(version) {
            // Refused (too large, a downgrade): nothing of it stays on disk.
            let _ = std::fs::remove_dir_all(self.store.download_dir(version));
            self.offer = None;
        }
        Ok(())
    }

    async fn on_chunk(&mut self, topic: &str, payload: &[u8]) -> Result<()> {
        let Some((o, _)) = &self.offer else {
            return Ok(());
        };
        let Some(index) = self.topics.parse_chunk(topic, &o.name, o.version) else {
            return Ok(());
        };
        let version = o.version;
        let Phase::Downloading { offer, have, .. } = &self.updater.phase else {
            return Ok(());
        };
        if offer.version != version || have.contains(&index) || index >= offer.chunks {
            return Ok(());
        }
        if self.pause.as_deref() == Some("download") && have.len() >= 2 {
            return Ok(());
        }
        let ev = if sha256_hex(payload) == o.chunks[index as usize] {
            let path = self
                .store
                .download_dir(version)
                .join("chunks")
                .join(index.to_string());
            write_atomic(&path, payload).with_context(|| format!("writing {}", path.display()))?;
            self.last_progress = Instant::now();
            self.status_dirty = true;
            Event::ChunkStored { version, index }
        } else {
            eprintln!("{}: {topic}: sha256 mismatch", self.cfg.device_id);
            Event::ChunkCorrupt { version, index }
        };
        self.feed(ev).await
    }

    fn on_infer(&mut self, topic: &str, payload: Vec<u8>) {
        let filter = self.topics.infer_filter(&self.cfg.device_id);
        let Some(request) = Topics::last_level(topic, &filter).map(str::to_string) else {
            return;
        };
        let error = |e: String| {
            Done::Reply(
                InferReply {
                    request: request.clone(),
                    device: self.cfg.device_id.clone(),
                    prediction: None,
                    error: Some(e),
                },
                None,
            )
        };
        let max = self.cfg.limits.max_image_bytes;
        let reply = if payload.len() > max {
            Some(error(format!(
                "{topic}: image of {} bytes is over the limit of {max}",
                payload.len()
            )))
        } else {
            match self.jobs.try_send(Job {
                request: request.clone(),
                bytes: payload,
            }) {
                Ok(()) => None,
                Err(TrySendError::Full(_)) => Some(error(format!(
                    "busy: {} requests queued, try again later",
                    self.cfg.limits.queue
                ))),
                Err(TrySendError::Disconnected(_)) => {
                    Some(error("inference worker stopped".into()))
                }
            }
        };
        if let Some(r) = reply {
            let _ = self.done_tx.send(r);
        }
    }

    async fn on_publish(&mut self, topic: &str, payload: Vec<u8>) -> Result<()> {
        let p = format!("{}/", self.topics.prefix());
        let Some(rest) = topic.strip_prefix(&p) else {
            return Ok(());
        };
        if rest.starts_with("artifacts/") {
            if rest.ends_with("/manifest") {
                self.on_offer(topic, &payload).await
            } else {
                self.on_chunk(topic, &payload).await
            }
        } else if rest.ends_with("/desired") {
            self.on_desired(topic, &payload).await
        } else if rest.starts_with("devices/") && rest.contains("/infer/") {
            self.on_infer(topic, payload);
            Ok(())
        } else {
            Ok(())
        }
    }

    async fn flush(&mut self) {
        if !self.connected {
            return;
        }
        if let Some(m) = self.outbox.next() {
            let m = m.clone();
            if let Err(e) = self
                .client
                .publish(m.topic, QoS::AtLeastOnce, m.retain, m.payload)
                .await
            {
                eprintln!("error: publish: {e}");
            }
        }
    }

    async fn on_mqtt(&mut self, ev: MqttEvent) -> Result<()> {
        match ev {
            MqttEvent::Incoming(Packet::ConnAck(ack)) => {
                eprintln!(
                    "{}: connected to {} (session {})",
                    self.cfg.device_id,
                    self.cfg.broker.url,
                    if ack.session_present {
                        "resumed"
                    } else {
                        "new"
                    }
                );
                self.connected = true;
                if !ack.session_present {
                    self.outbox.requeue_in_flight();
                }
                self.subscribe_all().await?;
                self.outbox.push_latest(Message {
                    topic: self.topics.online(&self.cfg.device_id),
                    retain: true,
                    payload: "1".into(),
                });
                self.publish_status();
            }
            MqttEvent::Incoming(Packet::Publish(p)) => {
                let topic = p.topic.clone();
                self.on_publish(&topic, p.payload.to_vec()).await?;
            }
            MqttEvent::Incoming(Packet::PubAck(a)) => {
                self.outbox.acked(a.pkid)?;
            }
            MqttEvent::Outgoing(Outgoing::Publish(pkid)) if pkid != 0 => self.outbox.sent(pkid),
            _ => {}
        }
        Ok(())
    }

    /// Re-requests missing chunks when a download has not progressed for a while (chunks lost
    /// or not yet published).
    async fn on_tick(&mut self) -> Result<()> {
        if let Phase::Downloading { offer, have, .. } = &self.updater.phase
            && self.last_progress.elapsed() > Duration::from_secs(20)
            && self.pause.is_none()
        {
            let missing = (0..offer.chunks).filter(|i| !have.contains(i)).collect();
            let version = offer.version;
            self.act(Action::Fetch {
                version,
                chunks: missing,
            })
            .await?;
        }
        if self.status_dirty {
            self.publish_status();
        }
        Ok(())
    }
}

/// The inference worker: takes jobs from the bounded queue, answers through `done`.
fn inference_worker(
    rx: std::sync::mpsc::Receiver<Job>,
    model: Shared<LoadedModel>,
    done: mpsc::UnboundedSender<Done>,
    device: String,
    top_k: usize,
) {
    for job in rx {
        let current = model.read().expect("lock").clone();
        let (prediction, error) = match current {
            None => (None, Some("no active model".to_string())),
            Some(m) => match m.predict(&job.bytes, &format!("request {}", job.request), top_k) {
                Ok(p) => (Some(p), None),
                Err(e) => (None, Some(e.to_string())),
            },
        };
        let latency = prediction.as_ref().map(|p| p.latency_ms);
        let reply = InferReply {
            request: job.request,
            device: device.clone(),
            prediction,
            error,
        };
        if done.send(Done::Reply(reply, latency)).is_err() {
            return;
        }
    }
}

/// `edge-agent run`: connects, resumes any journaled update and serves until SIGINT/SIGTERM.
/// With `simulate = Some(n)`, runs `n` virtual devices `<device_id>-000`... in this process
/// (each with its own connection, store `<store>/<id>` and update machine; one model cache).
pub fn run(cfg: Config, watch: Option<PathBuf>, simulate: Option<usize>) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let models = Arc::new(ModelCache::new(
        cfg.limits.max_artifact_bytes,
        cfg.inference.threads,
    ));
    rt.block_on(async move {
        let Some(n) = simulate else {
            return run_device(cfg, watch, models).await;
        };
        let mut tasks = Vec::new();
        for i in 0..n {
            let mut c = cfg.clone();
            c.device_id = format!("{}-{i:03}", cfg.device_id);
            kestrel_shared::protocol::check_name(&c.device_id)?;
            c.store = cfg.store.join(&c.device_id);
            tasks.push(tokio::spawn(run_device(c, None, models.clone())));
        }
        for t in tasks {
            t.await??;
        }
        Ok(())
    })
}

/// MQTT events (or connection errors) as the event loop's task reports them.
type MqttRx = mpsc::UnboundedReceiver<Result<MqttEvent, rumqttc::ConnectionError>>;

async fn run_device(cfg: Config, watch: Option<PathBuf>, models: Arc<ModelCache>) -> Result<()> {
    let (mut agent, eventloop, mut done_rx) = Agent::open(cfg, watch, models)?;
    agent.resume().await?;
    let mut mqtt_rx = spawn_event_loop(eventloop);
    agent.serve(&mut mqtt_rx, &mut done_rx).await?;
    agent.stop(&mut mqtt_rx).await
}

/// The journaled update machine (reconciled with the store and the configured limit) and the
/// desired state it pursued.
fn journaled(cfg: &Config, store: &Store) -> Result<(Updater, Option<Desired>)> {
    let journal: Journal = match std::fs::read(cfg.store.join("state.json")) {
        Ok(b) => serde_json::from_slice(&b)
            .with_context(|| format!("{}", cfg.store.join("state.json").display()))?,
        Err(_) => Journal::default(),
    };
    let mut updater = journal
        .updater
        .unwrap_or_else(|| Updater::new(cfg.limits.max_artifact_bytes));
    updater.max_bytes = cfg.limits.max_artifact_bytes;
    // The store's links are the truth about what is installed.
    updater.active = store.active();
    updater.previous = store.previous();
    Ok((updater, journal.wanted))
}

/// The accepted offer of the update in progress, as saved beside its download.
fn saved_offer(store: &Store, updater: &Updater) -> Option<(ArtifactOffer, Manifest)> {
    updater.phase.target().and_then(|v| {
        let p = store.download_dir(v).join("offer.json");
        let o: ArtifactOffer = serde_json::from_slice(&std::fs::read(p).ok()?).ok()?;
        let m = serde_json::from_str(&o.manifest).ok()?;
        Some((o, m))
    })
}

/// The event loop runs in a task of its own and is never cancelled mid-poll (a cancelled poll
/// can lose an acknowledgement; brokers drop clients whose acknowledgements come out of order).
fn spawn_event_loop(mut eventloop: rumqttc::EventLoop) -> MqttRx {
    let (mqtt_tx, mqtt_rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut backoff = Duration::from_millis(200);
        loop {
            let ev = eventloop.poll().await;
            let failed = ev.is_err();
            if mqtt_tx.send(ev).is_err() {
                return;
            }
            if failed {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            } else {
                backoff = Duration::from_millis(200);
            }
        }
    });
    mqtt_rx
}

impl Agent {
    /// Opens the store, the journal and the outbox, sets up the MQTT client (its event loop is
    /// returned, not yet polled) and starts the inference worker and the watched directory.
    fn open(
        cfg: Config,
        watch: Option<PathBuf>,
        models: Arc<ModelCache>,
    ) -> Result<(Self, rumqttc::EventLoop, mpsc::UnboundedReceiver<Done>)> {
        let keys = cfg.keys()?;
        let store =
            Store::open(&cfg.store).with_context(|| format!("store {}", cfg.store.display()))?;
        let topics = Topics::new(&cfg.broker.prefix);
        let (updater, wanted) = journaled(&cfg, &store)?;
        let mut opts = cfg
            .broker
            .options(&format!("kestrel-agent-{}", cfg.device_id), false)?;
        opts.set_last_will(LastWill::new(
            topics.online(&cfg.device_id),
            "0",
            QoS::AtLeastOnce,
            true,
        ));
        let (client, eventloop) = AsyncClient::new(opts, 256);
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        let (jobs, jobs_rx) = std::sync::mpsc::sync_channel(cfg.limits.queue.max(1));
        let model: Shared<LoadedModel> = Arc::new(RwLock::new(None));
        {
            let (model, done, device, k) = (
                model.clone(),
                done_tx.clone(),
                cfg.device_id.clone(),
                cfg.inference.top_k,
            );
            std::thread::spawn(move || inference_worker(jobs_rx, model, done, device, k));
        }
        if let Some(dir) = watch {
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("watch dir {}", dir.display()))?;
            let (model, k) = (model.clone(), cfg.inference.top_k);
            std::thread::spawn(move || crate::serve::watch_dir(dir, model, k));
        }
        let outbox = Outbox::open(&cfg.store.join("outbox"))?;
        let offer = saved_offer(&store, &updater);
        let agent = Agent {
            topics,
            keys,
            store,
            updater,
            wanted,
            desired: BTreeMap::new(),
            offer,
            model,
            candidate: None,
            models,
            outbox,
            client,
            done_tx,
            jobs,
            latencies: VecDeque::new(),
            served: 0,
            status_dirty: true,
            connected: false,
            last_progress: Instant::now(),
            pause: std::env::var("KESTREL_AGENT_PAUSE").ok(),
            cfg,
        };
        Ok((agent, eventloop, done_rx))
    }

    /// Loads the active model and continues a journaled update (re-fetch missing chunks,
    /// re-verify, redo activation).
    async fn resume(&mut self) -> Result<()> {
        if let Some(v) = self.updater.active {
            self.load_active(v);
        }
        let resumed = self.updater.resume();
        self.save_journal()?;
        for a in resumed {
            if let Some(ev) = self.act(a).await? {
                self.feed(ev).await?;
            }
        }
        Ok(())
    }

    /// Handles MQTT events, finished work and the clock until SIGINT/SIGTERM.
    async fn serve(
        &mut self,
        mqtt_rx: &mut MqttRx,
        done_rx: &mut mpsc::UnboundedReceiver<Done>,
    ) -> Result<()> {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let mut quiet = false;
        loop {
            self.flush().await;
            tokio::select! {
                Some(ev) = mqtt_rx.recv() => match ev {
                    Ok(ev) => {
                        quiet = false;
                        self.on_mqtt(ev).await?;
                    }
                    Err(e) => {
                        if !quiet {
                            // The first failure after a success (or at start); retries stay quiet.
                            eprintln!(
                                "{}: broker {}: {e}; retrying (up to every 5 s), serving and journaling meanwhile",
                                self.cfg.device_id, self.cfg.broker.url
                            );
                            quiet = true;
                        }
                        self.connected = false;
                    }
                },
                Some(d) = done_rx.recv() => self.on_done(d).await?,
                _ = tick.tick() => self.on_tick().await?,
                _ = tokio::signal::ctrl_c() => break,
                _ = term.recv() => break,
            }
        }
        Ok(())
    }

    /// Marks the device offline (retained), delivers the outbox for up to 3 s and disconnects.
    async fn stop(&mut self, mqtt_rx: &mut MqttRx) -> Result<()> {
        eprintln!("{}: stopping", self.cfg.device_id);
        let deadline = Instant::now() + Duration::from_secs(3);
        self.outbox.push_latest(Message {
            topic: self.topics.online(&self.cfg.device_id),
            retain: true,
            payload: "0".into(),
        });
        while self.connected && !self.outbox.is_idle() && Instant::now() < deadline {
            self.flush().await;
            match tokio::time::timeout(Duration::from_millis(200), mqtt_rx.recv()).await {
                Ok(Some(Ok(ev))) => self.on_mqtt(ev).await?,
                Ok(Some(Err(_)) | None) => break,
                Err(_) => {}
            }
        }
        let _ = self.client.disconnect().await;
        let _ = tokio::time::timeout(Duration::from_millis(500), mqtt_rx.recv()).await;
        Ok(())
    }
}
