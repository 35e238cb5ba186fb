//! The agent's IO shell around its pure [`Core`] (rumqttc's `eventloop.rs` beside `state.rs`):
//! MQTT (rumqttc, persistent session) in, the core's effects out: subscriptions, publishes (the
//! durable outbox, the in-memory replies, the capture queue), store writes, verification and
//! health checks on blocking threads, the model slots the inference workers read. It decides
//! nothing about what a message means: every message, tick and result goes to the core, and
//! what the core returns is done in order, journal first.
//!
//! Here: the effects and message dispatch; [`lifecycle`]: start, serve, stop, the inference
//! workers and fed traffic; [`publish`]: the outbox and the capture queue on the wire;
//! [`captures`]: the capture queue's files; [`hooks`]: the test hooks of the test build.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::mpsc::TrySendError;

use anyhow::{Context, Result};
use kestrel_runtime::artifact::{self, LoadedModel};
use kestrel_shared::fsutil::write_atomic;
use kestrel_shared::manifest::Manifest;
use kestrel_shared::protocol::ArtifactOffer;
use kestrel_shared::topics::Topics;
use rumqttc::{AsyncClient, Event as MqttEvent, Outgoing, Packet, QoS};
use tokio::sync::mpsc;

use crate::config::Config;
use crate::core::Message;
use crate::core::{Core, Effect, How, Input, Lane, Now};
use crate::models::{ModelCache, ModelSlot, ShadowModel};
use crate::outbox::Outbox;
use crate::replies::Replies;
use crate::store::Store;

mod captures;
mod hooks;
mod lifecycle;
mod sending;

use captures::CaptureQueue;

pub use lifecycle::{Feed, Simulation, run};

/// The newest verified key list, in the store.
const KEYS_FILE: &str = "keys.json";

/// One image to classify (the inference workers' queue; not the trainer's `Job`, a run context).
struct InferJob {
    request: String,
    bytes: Vec<u8>,
    /// Answer over MQTT (a request from `P/devices/<id>/infer/+`), or only observe (fed traffic).
    reply: bool,
}

/// Inputs from other threads (verification, health checks, the inference workers).
type Inputs = mpsc::UnboundedSender<Input<LoadedModel>>;

pub struct Agent {
    cfg: Config,
    topics: Topics,
    core: Core<LoadedModel>,
    /// The install lane's store (`<store>`) and the shadow's (`<store>/shadow`).
    store: Store,
    shadow_store: Store,
    /// What the inference workers run: the active model and the shadow.
    model: ModelSlot<LoadedModel>,
    shadow: ModelSlot<ShadowModel>,
    models: Arc<ModelCache>,
    outbox: Outbox,
    /// Inference replies not yet handed to the MQTT client (QoS 0, memory only).
    replies: Replies,
    captures: Option<CaptureQueue>,
    client: AsyncClient,
    inputs: Inputs,
    jobs: lifecycle::Jobs,
    connected: bool,
    /// Test hook (cargo feature `test-hooks`): stop before activating, still connected, so a
    /// test can kill the process there.
    pause: hooks::Pause,
}

impl Agent {
    /// Hands one input to the core and carries out its effects, and those of the inputs they
    /// produce, to completion.
    async fn apply(&mut self, input: Input<LoadedModel>) -> Result<()> {
        let effects = self.core.handle(input, clock());
        self.carry_out(effects).await
    }

    async fn carry_out(&mut self, effects: Vec<Effect<LoadedModel>>) -> Result<()> {
        let mut inputs = VecDeque::new();
        let mut effects = VecDeque::from(effects);
        loop {
            while let Some(e) = effects.pop_front() {
                self.effect(e, &mut inputs).await?;
            }
            let Some(input) = inputs.pop_front() else {
                return Ok(());
            };
            effects.extend(self.core.handle(input, clock()));
        }
    }

    /// Does one effect; an input it produces goes to `then`.
    async fn effect(
        &mut self,
        e: Effect<LoadedModel>,
        then: &mut VecDeque<Input<LoadedModel>>,
    ) -> Result<()> {
        match e {
            Effect::Subscribe(f) => self.client.subscribe(f, QoS::AtLeastOnce).await?,
            Effect::Unsubscribe(f) => self.client.unsubscribe(f).await?,
            Effect::Resubscribe(t) => {
                self.client.unsubscribe(t.clone()).await?;
                self.client.subscribe(t, QoS::AtLeastOnce).await?;
            }
            Effect::Publish(how, m) => self.publish_later(how, m),
            Effect::Status => self.publish_status(),
            Effect::Journal(lane) => {
                let path = self.lane_store(lane).root().join("state.json");
                self.write(&path, &self.core.journal(lane));
            }
            Effect::SaveKeys(bytes) => self.write(&self.cfg.store.join(KEYS_FILE), &bytes),
            Effect::SaveCaptureState(bytes) => {
                if let Some(c) = &self.captures
                    && let Err(e) = write_atomic(&c.state_path, &bytes)
                {
                    let path = c.state_path.display();
                    tracing::error!("{}: captures: writing {path}: {e}", self.cfg.device_id);
                }
            }
            Effect::WriteOffer {
                lane,
                version,
                payload,
            } => {
                let store = self.lane_store(lane);
                let r = store.write_offer(version, &payload);
                self.stored(r, &store.offer_path(version));
            }
            Effect::WriteChunk {
                lane,
                version,
                index,
                payload,
            } => {
                let store = self.lane_store(lane);
                let r = store.write_chunk(version, index, &payload);
                let ok = self.stored(r, &store.chunk_path(version, index));
                then.push_back(Input::ChunkWritten {
                    lane,
                    version,
                    index,
                    ok,
                });
            }
            Effect::RemoveDownload { lane, version } => {
                let _ = std::fs::remove_dir_all(self.lane_store(lane).download_dir(version));
            }
            Effect::Verify {
                lane,
                version,
                offer,
                keys,
            } => self.spawn_verify(lane, version, offer, keys),
            Effect::Stage { lane, version } => {
                let result = self.lane_store(lane).stage(version).map(|_| ());
                let result = result.map_err(|e| e.to_string());
                then.push_back(Input::Staged {
                    lane,
                    version,
                    result,
                });
            }
            Effect::Load { lane, version } => self.spawn_load(lane, version),
            Effect::Activate { version, model } => self.activate(version, model, then)?,
            Effect::LoadActive { version } => then.extend(self.load_active(version)),
            Effect::Discard { lane, version } => self.discard(lane, version),
            Effect::CheckParts {
                lane,
                version,
                pieces,
            } => self.spawn_check_parts(lane, version, pieces),
            Effect::RunShadow(run) => {
                *self.shadow.write().expect("lock") = run.map(|(model, every)| {
                    Arc::new(ShadowModel {
                        model,
                        every,
                        turn: AtomicU64::new(0),
                    })
                });
            }
            Effect::Infer { request, bytes } => then.extend(self.queue(request, bytes)),
            Effect::Capture {
                id,
                message,
                max_disk_bytes,
            } => {
                if let Some(c) = self.captures.as_mut() {
                    let result = c.outbox.push_within(message, max_disk_bytes);
                    let result = result.map_err(|e| e.to_string());
                    then.push_back(Input::CaptureQueued { id, result });
                }
            }
            Effect::ResendCapture { id } => {
                if let Some(c) = self.captures.as_mut()
                    && !c.resend(&id)
                {
                    then.push_back(Input::CaptureGone { id });
                }
            }
            Effect::ForgetCapture { id } => {
                let topic = self.topics.capture(&self.cfg.device_id, &id);
                if let Some(c) = self.captures.as_mut() {
                    c.forget(&id, &topic);
                }
            }
        }
        Ok(())
    }

    /// The atomic switch to `version`, then `model` serves (none: loaded again, after a restart).
    fn activate(
        &mut self,
        version: u64,
        model: Option<Arc<LoadedModel>>,
        then: &mut VecDeque<Input<LoadedModel>>,
    ) -> Result<()> {
        if self.pause.before_activating() {
            let id = &self.cfg.device_id;
            tracing::info!("{id}: paused before activating v{version} (KESTREL_AGENT_PAUSE)");
            return Ok(());
        }
        self.store
            .activate(version)
            .with_context(|| format!("activating v{version}"))?;
        self.prune_parts();
        match model {
            Some(m) => *self.model.write().expect("lock") = Some(m),
            None => then.extend(self.load_active(version)),
        }
        then.push_back(Input::Activated { version });
        Ok(())
    }

    /// Queues a request for the inference workers; what to tell its sender when it is not taken.
    fn queue(&self, request: String, bytes: Vec<u8>) -> Option<Input<LoadedModel>> {
        let job = InferJob {
            request,
            bytes,
            reply: true,
        };
        let (job, busy) = match self.jobs.try_send(job) {
            Ok(()) => return None,
            Err(TrySendError::Full(job)) => (job, true),
            Err(TrySendError::Disconnected(job)) => (job, false),
        };
        let request = job.request;
        Some(Input::NotQueued { request, busy })
    }

    /// Deletes what was downloaded or staged of `version` in the lane, then the parts nothing
    /// lists any more.
    fn discard(&self, lane: Lane, version: u64) {
        if let Err(e) = self.lane_store(lane).discard(version) {
            tracing::warn!("{}: discarding v{version}: {e}", self.cfg.device_id);
        }
        self.prune_parts();
    }

    /// Removes the parts no version, staging slot or download of either lane lists.
    fn prune_parts(&self) {
        if let Err(e) = Store::prune_parts(&[&self.store, &self.shadow_store]) {
            let parts = self.store.parts_dir().display();
            tracing::warn!("{}: pruning {parts}: {e}", self.cfg.device_id);
        }
    }

    fn lane_store(&self, lane: Lane) -> &Store {
        match lane {
            Lane::Install => &self.store,
            Lane::Shadow => &self.shadow_store,
        }
    }

    /// Writes `bytes` to `path` atomically; a failure (a full disk) is the core's to report.
    fn write(&mut self, path: &std::path::Path, bytes: &[u8]) {
        let r = write_atomic(path, bytes);
        self.stored(r, path);
    }

    fn stored(&mut self, r: std::io::Result<()>, path: &std::path::Path) -> bool {
        self.core.stored(path, r.map_err(|e| e.to_string()))
    }

    fn publish_later(&mut self, how: How, m: Message) {
        match how {
            How::Durable => {
                let topic = m.topic.clone();
                if let Err(e) = self.outbox.push_durable(m) {
                    tracing::error!("outbox: {topic}: {e}");
                }
            }
            How::Latest => self.outbox.push_latest(m),
            How::Reply => {
                let max = usize::try_from(self.cfg.limits.max_outbox_bytes).unwrap_or(usize::MAX);
                let dropped = self.replies.push(m, max);
                if dropped > 0 {
                    tracing::warn!("inference replies over {max} bytes waiting: {dropped} dropped");
                }
            }
        }
    }

    fn publish_status(&mut self) {
        let model = self.model.read().expect("lock").clone();
        let queued = self
            .captures
            .as_ref()
            .map_or((0, 0), |c| (c.outbox.len() as u64, c.outbox.disk_bytes()));
        let status = self
            .core
            .status(model.as_ref().map(|m| &m.manifest), queued);
        self.outbox.push_latest(Message {
            topic: self.topics.status(&self.cfg.device_id),
            retain: true,
            payload: serde_json::to_string(&status).expect("serializable"),
        });
    }

    /// Assembles `offer`'s chunks in the lane's store and verifies the manifest's signature and
    /// the files' hashes on a blocking thread.
    fn spawn_verify(
        &self,
        lane: Lane,
        version: u64,
        offer: Option<(ArtifactOffer, Manifest)>,
        keys: Vec<ed25519_dalek::VerifyingKey>,
    ) {
        let (store, tx) = (self.lane_store(lane).clone(), self.inputs.clone());
        let max = self.cfg.limits.max_artifact_bytes;
        tokio::task::spawn_blocking(move || {
            let result = match offer {
                Some((o, m)) if o.version == version => store.assemble(&o, &m).and_then(|dir| {
                    artifact::verify_signature(&dir, &keys)
                        .and_then(|_| {
                            artifact::device_model(&dir, &m, max, Some(store.parts_dir()))
                        })
                        .map(drop)
                        .map_err(|e| kestrel_shared::chain(&e))
                }),
                _ => Err("the offer of this version is gone".into()),
            };
            let _ = tx.send(Input::Verified {
                lane,
                version,
                result,
            });
        });
    }

    /// Which of `pieces` the part store holds (each hashed; a damaged one deleted), on a
    /// blocking thread like verification.
    fn spawn_check_parts(&self, lane: Lane, version: u64, pieces: Vec<String>) {
        let (store, tx) = (self.lane_store(lane).clone(), self.inputs.clone());
        tokio::task::spawn_blocking(move || {
            let held = store.held_parts(&pieces);
            let _ = tx.send(Input::PartsHeld {
                lane,
                version,
                held,
            });
        });
    }

    /// Health check: loads the lane's `versions/<v>` (verifies files, runs the golden samples)
    /// on a blocking thread.
    fn spawn_load(&self, lane: Lane, version: u64) {
        let store = self.lane_store(lane);
        let (dir, parts) = (store.version_dir(version), store.parts_dir().to_path_buf());
        let (models, tx) = (self.models.clone(), self.inputs.clone());
        tokio::task::spawn_blocking(move || {
            let result = models.load(&dir, &parts);
            let _ = tx.send(Input::Loaded {
                lane,
                version,
                result,
            });
        });
    }

    /// Loads the active model for serving (at start-up, or to finish an activation after a
    /// restart), so no request is answered "no active model" while one is installed.
    fn load_active(&mut self, version: u64) -> Option<Input<LoadedModel>> {
        match (self.models).load(&self.store.version_dir(version), self.store.parts_dir()) {
            Ok(m) => {
                *self.model.write().expect("lock") = Some(m);
                None
            }
            Err(reason) => Some(Input::ActiveLoadFailed { version, reason }),
        }
    }

    async fn on_mqtt(&mut self, ev: MqttEvent) -> Result<()> {
        match ev {
            MqttEvent::Incoming(Packet::ConnAck(ack)) => {
                let session = if ack.session_present {
                    "resumed"
                } else {
                    "new"
                };
                let (id, url) = (&self.cfg.device_id, &self.cfg.broker.url);
                tracing::info!("{id}: connected to {url} (session {session})");
                self.connected = true;
                if !ack.session_present {
                    self.outbox.requeue_in_flight();
                    if let Some(c) = self.captures.as_mut() {
                        c.outbox.requeue_in_flight();
                    }
                }
                self.apply(Input::Connected).await?;
            }
            MqttEvent::Incoming(Packet::Publish(p)) => {
                let topic = p.topic.clone();
                let payload = p.payload.to_vec();
                self.apply(Input::Message { topic, payload }).await?;
            }
            MqttEvent::Incoming(Packet::PubAck(a)) => self.on_acked(a.pkid).await?,
            MqttEvent::Outgoing(Outgoing::Publish(pkid)) if pkid != 0 => self.on_sent(pkid),
            _ => {}
        }
        Ok(())
    }
}

/// The clock, read for one input to the core (the core never reads it).
pub(crate) fn clock() -> Now {
    Now {
        mono: std::time::Instant::now(),
        unix_ms: kestrel_shared::time::now_ms(),
    }
}
