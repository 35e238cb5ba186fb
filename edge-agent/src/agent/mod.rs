//! The agent's IO loop around the sans-IO [`Updater`]: MQTT (rumqttc, persistent session) in,
//! store operations, verification, health checks and inference out. One tokio task owns all
//! state; blocking work (verification, the tract health check, inference) runs on other threads
//! and reports back through a channel. Every updater event is journaled (`state.json`) before
//! its actions run, so a restart continues where the agent stopped.
//!
//! Here: the journal, status, actions and message dispatch; [`pursue`]: desired states and key
//! lists; [`download`]: offers and chunks; [`lifecycle`]: start, serve, stop, the inference
//! workers and fed traffic; [`quality`]: telemetry over live requests; [`shadow`]: a candidate
//! model run beside the active one; [`capture`]: inputs kept for training; [`publish`]: the
//! outbox and the capture queue on the wire.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::TrySendError;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kestrel_runtime::artifact::{self, LoadedModel};
use kestrel_shared::fsutil::write_atomic;
use kestrel_shared::manifest::Manifest;
use kestrel_shared::now_rfc3339;
use kestrel_shared::protocol::{
    ArtifactOffer, Desired, DeviceCounters, DeviceEvent, InferReply, LatencyHistogram,
    LatencyStats, Status, Target, Topics,
};
use kestrel_shared::stats::quantile;
use kestrel_shared::topics::{DeviceTopic, Route};
use rumqttc::{AsyncClient, Event as MqttEvent, Outgoing, Packet, QoS};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::config::Config;
use crate::desired::DesiredStates;
use crate::models::{ModelCache, ModelSlot};
use crate::outbox::{Message, Outbox};
use crate::replies::Replies;
use crate::store::Store;
use crate::trust::Trust;
use crate::update::{Action, Event, Phase, Report, Updater};

mod capture;
mod download;
mod hooks;
mod lifecycle;
mod publish;
mod pursue;
mod quality;
mod shadow;

pub use lifecycle::{Feed, run};

/// Journal of the update machine, the desired state being pursued and the newest desired state
/// accepted per topic (replay protection).
#[derive(Debug, Default, Serialize, Deserialize)]
struct Journal {
    updater: Option<Updater>,
    /// The desired state being pursued (`wanted` in journals before 2026-12-05).
    #[serde(alias = "wanted")]
    pursued: Option<Desired>,
    #[serde(default)]
    desired: DesiredStates,
}

/// The newest verified key list, in the store.
const KEYS_FILE: &str = "keys.json";

/// Results of work done off the event loop.
enum Done {
    Verified(u64, Result<(), String>),
    Health(u64, Result<Arc<LoadedModel>, String>),
    /// An answered request: the reply to publish (none for fed traffic, which no one asked
    /// over MQTT) and, when the active model answered, what telemetry records.
    Reply(Option<InferReply>, Option<Observed>),
    /// The shadow model's turn on a request the active model answered (`None`: skipped).
    Shadow(u64, Option<ShadowRun>),
    ShadowVerified(u64, Result<(), String>),
    ShadowLoaded(u64, Result<Arc<LoadedModel>, String>),
}

/// What the active model did on one request.
struct Observed {
    request: String,
    model: String,
    version: u64,
    top: Vec<kestrel_shared::protocol::Class>,
    /// The request's image, when `[capture]` may keep it.
    image: Option<Vec<u8>>,
    logits: Vec<f32>,
    features: Option<Vec<f32>>,
    latency_ms: f64,
}

/// Both models on one request: (logits, latency) of the active model and of the shadow.
struct ShadowRun {
    active: (Vec<f32>, f64),
    shadow: (Vec<f32>, f64),
}

/// One image to classify (the inference workers' queue; not the trainer's `Job`, a run context).
struct InferJob {
    request: String,
    bytes: Vec<u8>,
    /// Answer over MQTT (a request from `P/devices/<id>/infer/+`), or only observe (fed traffic).
    reply: bool,
}

pub struct Agent {
    cfg: Config,
    topics: Topics,
    /// Whose signatures are accepted (configured keys, or the root-signed key list).
    trust: Trust,
    store: Store,
    updater: Updater,
    /// The desired state being pursued: the one [`pursue`] chose of `desired`.
    pursued: Option<Desired>,
    /// Valid desired states by topic (own and groups'), with the replay and expiry rules.
    desired: DesiredStates,
    /// The last desired state or key list refused by the replay, expiry and trust rules, and
    /// why (in the status).
    refused: Option<String>,
    /// The accepted offer of the version being downloaded.
    offer: Option<(ArtifactOffer, Manifest)>,
    model: ModelSlot<LoadedModel>,
    candidate: Option<(u64, Arc<LoadedModel>)>,
    models: Arc<ModelCache>,
    outbox: Outbox,
    /// Inference replies not yet handed to the MQTT client (QoS 0, memory only).
    replies: Replies,
    client: AsyncClient,
    done_tx: mpsc::UnboundedSender<Done>,
    jobs: lifecycle::Jobs,
    /// The active model's window over live requests.
    quality: Option<quality::Telemetry>,
    last_quality: Instant,
    shadow: shadow::ShadowSlot,
    /// Input capture, when `[capture]` is enabled.
    captures: Option<capture::Captures>,
    latencies: VecDeque<f64>,
    /// Every answered request's latency since the process started.
    histogram: LatencyHistogram,
    counters: DeviceCounters,
    status_dirty: bool,
    /// Statuses published by this process so far (the next status's `seq`).
    status_seq: u64,
    connected: bool,
    last_progress: Instant,
    /// The last failed write to the store (a full disk) and the directory it failed in: shown
    /// as the status's `last_error` until a write in or below that directory succeeds; the agent keeps
    /// serving and retries meanwhile.
    store_error: Option<(PathBuf, String)>,
    /// Test hook (cargo feature `test-hooks`): stop before activating, still connected, so a
    /// test can kill the process there.
    pause: hooks::Pause,
}

impl Agent {
    fn journal_path(&self) -> PathBuf {
        self.cfg.store.join("state.json")
    }

    /// Writes the journal. A failure (a full disk) is reported, not fatal: the agent goes on
    /// from memory and the next change writes it again; a crash meanwhile resumes from the
    /// last journal written, whose actions are all safe to repeat.
    fn save_journal(&mut self) {
        let j = Journal {
            updater: Some(self.updater.clone()),
            pursued: self.pursued.clone(),
            desired: self.desired.clone(),
        };
        let bytes = serde_json::to_vec_pretty(&j).expect("serializable");
        let path = self.journal_path();
        let r = write_atomic(&path, &bytes);
        self.stored(r, &path);
    }

    /// Records the outcome of a store write: a failure is logged and shown in the status until
    /// a later write in or below the same directory succeeds. Returns whether it succeeded.
    fn stored(&mut self, r: std::io::Result<()>, path: &Path) -> bool {
        let dir = path.parent().unwrap_or(path).to_path_buf();
        match r {
            Ok(()) => {
                if self
                    .store_error
                    .as_ref()
                    .is_some_and(|(d, _)| dir.starts_with(d))
                {
                    self.store_error = None;
                    self.status_dirty = true;
                }
                true
            }
            Err(e) => {
                let msg = format!("store: writing {}: {e}; retrying", path.display());
                tracing::error!("{}: {msg}", self.cfg.device_id);
                self.store_error = Some((dir, msg));
                self.status_dirty = true;
                false
            }
        }
    }

    fn status(&self) -> Status {
        let progress = match &self.updater.phase {
            Phase::Downloading { offer, have, .. } => Some((have.len() as u32, offer.chunks)),
            _ => None,
        };
        let mut sorted: Vec<f64> = self.latencies.iter().copied().collect();
        sorted.sort_by(f64::total_cmp);
        let pct = |p: f64| quantile(&sorted, p);
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
            last_error: self
                .store_error
                .as_ref()
                .map(|(_, e)| e.clone())
                .or_else(|| self.updater.last_error.clone()),
            failed_version: self.updater.last_failed,
            latency: LatencyStats {
                count: self.counters.requests_answered,
                mean_ms: if sorted.is_empty() {
                    0.0
                } else {
                    sorted.iter().sum::<f64>() / sorted.len() as f64
                },
                p50_ms: pct(0.5),
                p95_ms: pct(0.95),
                histogram: self.histogram.clone(),
            },
            updated: now_rfc3339(),
            started: kestrel_shared::time::process_started_ms(),
            seq: self.status_seq,
            source: model.as_ref().and_then(|m| m.manifest.registry.clone()),
            refused: self.refused.clone(),
            keys_version: self.trust.version(),
            shadow: self.shadow.status(),
            captures: self.captures.as_ref().map(capture::Captures::stats),
            counters: self.counters.clone(),
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
        self.status_seq += 1;
    }

    fn publish_durable(&mut self, topic: String, payload: String) {
        if let Err(e) = self.outbox.push_durable(Message {
            topic: topic.clone(),
            retain: false,
            payload,
        }) {
            tracing::error!("outbox: {topic}: {e}");
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
        let why = reason
            .as_deref()
            .map(|r| format!(": {r}"))
            .unwrap_or_default();
        match kind {
            "active" => self.counters.updates_active += 1,
            "rejected" => self.counters.updates_rejected += 1,
            "rolled-back" => self.counters.updates_rolled_back += 1,
            _ => {}
        }
        match kind {
            "rejected" | "rolled-back" => {
                tracing::warn!("{}: v{version} {kind}{why}", self.cfg.device_id)
            }
            _ => tracing::info!("{}: v{version} {kind}{why}", self.cfg.device_id),
        }
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

    /// Subscriptions that follow from the state; sent again after every (re)connect. The key
    /// list first, so a rotated key list is in force before the states it signs arrive.
    async fn subscribe_all(&self) -> Result<()> {
        let id = &self.cfg.device_id;
        if self.trust.has_root() {
            self.client
                .subscribe(self.topics.keys(), QoS::AtLeastOnce)
                .await?;
        }
        let mut filters = vec![
            self.topics.desired(&Target::Device(id.clone())),
            self.topics.infer_filter(id),
        ];
        for g in &self.cfg.groups {
            filters.push(self.topics.desired(&Target::Group(g.clone())));
        }
        if let Some(w) = &self.pursued {
            filters.push(self.topics.artifact_manifest(&w.name, w.version));
        }
        if let Phase::Downloading { offer, .. } = &self.updater.phase
            && let Some((o, _)) = &self.offer
            && o.version == offer.version
        {
            filters.push(self.topics.chunks_filter(&o.name, o.version));
        }
        filters.extend(self.shadow.filters(&self.topics));
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
            self.save_journal();
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
                self.spawn_verify(&self.store, self.offer.clone(), version, Done::Verified);
                Ok(None)
            }
            Action::Stage { version } => {
                self.store
                    .stage(version)
                    .with_context(|| format!("staging v{version}"))?;
                Ok(Some(Event::Staged { version }))
            }
            Action::HealthCheck { version } => {
                self.spawn_load(&self.store, version, Done::Health);
                Ok(None)
            }
            Action::Activate { version } => {
                if self.pause.before_activating() {
                    tracing::info!(
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
            // Only a shadow's updater runs a model beside the active one (agent/shadow.rs).
            Action::RunBeside { .. } => Ok(None),
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

    /// Assembles `offer`'s chunks in `store` and verifies the manifest's signature and the
    /// files' hashes (an update's check, and a shadow's) on a blocking thread; `done` carries
    /// the result back.
    fn spawn_verify(
        &self,
        store: &Store,
        offer: Option<(ArtifactOffer, Manifest)>,
        version: u64,
        done: fn(u64, Result<(), String>) -> Done,
    ) {
        let (store, tx) = (store.clone(), self.done_tx.clone());
        let (keys, max) = (
            self.trust.keys().to_vec(),
            self.cfg.limits.max_artifact_bytes,
        );
        tokio::task::spawn_blocking(move || {
            let r = match offer {
                Some((o, m)) if o.version == version => store.assemble(&o, &m).and_then(|dir| {
                    artifact::verify_signature(&dir, &keys)
                        .and_then(|_| artifact::verify_device_files(&dir, &m, max))
                        .map_err(|e| e.to_string())
                }),
                _ => Err("the offer of this version is gone".into()),
            };
            let _ = tx.send(done(version, r));
        });
    }

    /// Health check: loads `versions/<v>` of `store` (verifies files, runs the golden samples)
    /// on a blocking thread; `done` carries the result back.
    fn spawn_load(
        &self,
        store: &Store,
        version: u64,
        done: fn(u64, Result<Arc<LoadedModel>, String>) -> Done,
    ) {
        let dir = store.version_dir(version);
        let (models, tx) = (self.models.clone(), self.done_tx.clone());
        tokio::task::spawn_blocking(move || {
            let _ = tx.send(done(version, models.load(&dir)));
        });
    }

    /// Loads the active model for serving (at start-up, or to finish an activation after a
    /// restart), so no request is answered "no active model" while one is installed.
    fn load_active(&mut self, version: u64) {
        tracing::info!("{}: loading active v{version}", self.cfg.device_id);
        match self.models.load(&self.store.version_dir(version)) {
            Ok(m) => *self.model.write().expect("lock") = Some(m),
            Err(e) => {
                tracing::error!(
                    "{}: active v{version} does not load: {e}",
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
            Done::Reply(reply, observed) => {
                match observed {
                    Some(o) => self.on_observed(o),
                    None => {
                        self.counters.requests_failed += 1;
                        self.status_dirty = true;
                    }
                }
                if let Some(reply) = reply {
                    self.send_reply(&reply)?;
                }
                Ok(())
            }
            Done::Shadow(version, run) => {
                self.shadow.record(version, run);
                Ok(())
            }
            Done::ShadowVerified(version, r) => self.shadow_verified(version, r).await,
            Done::ShadowLoaded(version, r) => self.shadow_loaded(version, r).await,
        }
    }

    /// An inference reply, queued in memory for the MQTT client ([`crate::replies`]).
    fn send_reply(&mut self, reply: &InferReply) -> Result<()> {
        let msg = Message {
            topic: self.topics.result(&self.cfg.device_id, &reply.request),
            retain: false,
            payload: serde_json::to_string(reply)?,
        };
        let max = usize::try_from(self.cfg.limits.max_outbox_bytes).unwrap_or(usize::MAX);
        let dropped = self.replies.push(msg, max);
        if dropped > 0 {
            tracing::warn!("inference replies over {max} bytes waiting: {dropped} dropped");
        }
        Ok(())
    }

    fn on_infer(&mut self, topic: &str, request: String, payload: Vec<u8>) -> Result<()> {
        let max = self.cfg.limits.max_image_bytes;
        let refused = if payload.len() > max {
            format!(
                "{topic}: image of {} bytes is over the limit of {max}",
                payload.len()
            )
        } else {
            match self.jobs.try_send(InferJob {
                request: request.clone(),
                bytes: payload,
                reply: true,
            }) {
                Ok(()) => return Ok(()),
                Err(TrySendError::Full(_)) => format!(
                    "busy: {} requests queued, try again later",
                    self.cfg.limits.queue
                ),
                Err(TrySendError::Disconnected(_)) => "inference worker stopped".into(),
            }
        };
        self.counters.requests_refused += 1;
        self.status_dirty = true;
        self.send_reply(&InferReply {
            request,
            device: self.cfg.device_id.clone(),
            prediction: None,
            error: Some(refused),
        })
    }

    async fn on_publish(&mut self, topic: &str, payload: Vec<u8>) -> Result<()> {
        let topics = self.topics.clone();
        match topics.parse(topic) {
            Some(Route::Offer { name, version }) if self.shadow.wants(name, version) => {
                self.on_shadow_offer(topic, &payload).await
            }
            Some(Route::Chunk {
                name,
                version,
                index,
            }) if self.shadow.wants(name, version) => {
                self.on_shadow_chunk(topic, index, &payload).await
            }
            Some(Route::Offer { name, version }) => {
                self.on_offer(topic, (name, version), &payload).await
            }
            Some(Route::Chunk {
                name,
                version,
                index,
            }) => self.on_chunk((name, version, index), &payload).await,
            Some(Route::Desired(target)) => self.on_desired(topic, &target, &payload).await,
            Some(Route::Keys) => self.on_keys(topic, &payload).await,
            Some(Route::Device {
                device,
                kind: DeviceTopic::Infer { request },
            }) if device == self.cfg.device_id => {
                self.on_infer(topic, request.to_string(), payload)
            }
            _ => Ok(()),
        }
    }

    async fn on_mqtt(&mut self, ev: MqttEvent) -> Result<()> {
        match ev {
            MqttEvent::Incoming(Packet::ConnAck(ack)) => {
                tracing::info!(
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
                    if let Some(c) = self.captures.as_mut() {
                        c.outbox.requeue_in_flight();
                    }
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
            MqttEvent::Incoming(Packet::PubAck(a)) => self.on_acked(a.pkid)?,
            MqttEvent::Outgoing(Outgoing::Publish(pkid)) if pkid != 0 => self.on_sent(pkid),
            _ => {}
        }
        Ok(())
    }

    /// Re-requests missing chunks when a download has not progressed for
    /// `[limits] download_stall_s` (chunks lost or not yet published, or a full store).
    async fn on_tick(&mut self) -> Result<()> {
        if let Phase::Downloading { offer, have, .. } = &self.updater.phase
            && self.last_progress.elapsed() > Duration::from_secs(self.cfg.limits.download_stall_s)
        {
            let missing = (0..offer.chunks).filter(|i| !have.contains(i)).collect();
            let version = offer.version;
            self.act(Action::Fetch {
                version,
                chunks: missing,
            })
            .await?;
        }
        self.shadow_tick().await?;
        self.publish_quality_when_due();
        if self.status_dirty {
            self.publish_status();
        }
        Ok(())
    }
}
