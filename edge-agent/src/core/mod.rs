//! The agent's decisions without IO, as rumqttc's `state.rs` beside its `eventloop.rs`: the
//! [`Core`] is fed typed [`Input`]s (a message on a topic, the clock's tick, the result of work
//! the shell did) with the time, and returns the [`Effect`]s the shell ([`crate::agent`]) carries
//! out: subscribe, publish, write to the store, verify, load, activate, run a model beside the
//! active one, queue a request. Work whose outcome matters comes back as another input (a chunk
//! written, files staged, a model loaded). Nothing here touches the network, the disk or the
//! clock, so every path (install, rollback, shadow, refusal, capture, busy) is unit-tested
//! without a broker (`core/tests.rs`).
//!
//! Here: the state, routing and status; [`io`]: the inputs and effects; the machines the core
//! drives: [`update`] (one download, verification, health check and activation), [`desired`]
//! (replay, expiry and signed clears), [`trust`] (root-signed key lists), [`capture`] (the capture
//! policy and its limits); [`settings`]: the settings as plain values (the shell reads the files);
//! [`delivery`]: the two lanes of downloads (the update of the active model and the shadow), each an
//! [`Updater`];
//! [`pursue`]: desired states and key lists; [`shadow`]: the shadow model's choice and its
//! comparison; [`requests`]: inference requests, telemetry and capture; [`acks`]: captures kept
//! until a collector acknowledges them.

use std::path::{Path, PathBuf};
use std::time::Instant;

use kestrel_runtime::artifact::LoadedModel;
use kestrel_shared::manifest::Manifest;
use kestrel_shared::protocol::{ArtifactOffer, Desired, DeviceEvent, ModelRef, Status, Target};
use kestrel_shared::topics::{DeviceTopic, Route, Topics};
use kestrel_shared::wire::EventKind;
use serde::{Deserialize, Serialize};

use crate::core::capture::CaptureState;
use crate::core::desired::DesiredStates;
use crate::core::settings::Config;
use crate::core::trust::Trust;
use crate::core::update::{Event, Phase, Updater};

mod acks;
pub mod capture;
mod delivery;
pub mod desired;
mod io;
mod pieces;
mod pursue;
mod requests;
pub mod settings;
mod shadow;
#[cfg(test)]
mod tests;
pub mod trust;
pub mod update;

use delivery::Delivery;
pub use io::{Effect, How, Input, Message, Observed, ShadowRun};
use requests::Requests;
use shadow::Shadow;
pub use shadow::runs_on as shadow_runs_on;

/// A model as the core sees it: an opaque handle (the shell's loaded engine) with its manifest.
pub trait Model: Send + Sync + 'static {
    fn manifest(&self) -> &Manifest;
}

impl Model for LoadedModel {
    fn manifest(&self) -> &Manifest {
        &self.manifest
    }
}

/// Which delivery a piece of work belongs to: the update of the model that answers, or the
/// shadow model run beside it. Each has its own store (`<store>`, `<store>/shadow`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    Install,
    Shadow,
}

/// The clock as the shell read it for an input.
#[derive(Debug, Clone, Copy)]
pub struct Now {
    pub mono: Instant,
    /// Milliseconds since the Unix epoch.
    pub unix_ms: u64,
}

impl Now {
    fn unix_s(&self) -> u64 {
        self.unix_ms / 1000
    }

    fn rfc3339(&self) -> String {
        kestrel_shared::manifest::rfc3339(self.unix_s())
    }
}

/// The install lane's journal (`<store>/state.json`): the update machine, the desired state being
/// pursued and the newest desired state accepted per topic (replay protection).
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Journal {
    pub updater: Option<Updater>,
    /// The desired state being pursued (`wanted` in journals before 2026-12-05).
    #[serde(alias = "wanted")]
    pub pursued: Option<Desired>,
    #[serde(default)]
    pub desired: DesiredStates,
}

/// The shadow lane's journal (`<store>/shadow/state.json`): what is wanted and how far its
/// updater got.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct ShadowJournal {
    pub want: Option<ModelRef>,
    pub updater: Option<Updater>,
}

/// What the core starts from: the journals and what the store holds beside them.
pub struct Saved {
    pub trust: Trust,
    pub journal: Journal,
    /// The accepted offer of the update in progress.
    pub offer: Option<(ArtifactOffer, Manifest)>,
    /// The store's `active` and `previous` links (the truth about what is installed).
    pub installed: (Option<u64>, Option<u64>),
    /// sha256 of the active version's `manifest.json` in the store, when it has one.
    pub active_manifest: Option<String>,
    pub shadow: ShadowJournal,
    pub shadow_offer: Option<(ArtifactOffer, Manifest)>,
    /// The capture state and a seed for the random policy, when `[capture]` is on.
    pub capture: Option<(CaptureState, u64)>,
}

/// The agent's state and decisions.
pub struct Core<M> {
    cfg: Config,
    topics: Topics,
    /// Whose signatures are accepted (configured keys, or the root-signed key list).
    trust: Trust,
    /// Valid desired states by topic (own and groups'), with the replay and expiry rules.
    desired: DesiredStates,
    /// The desired state being pursued: the one [`Core::choose`] picked of `desired`.
    pursued: Option<Desired>,
    /// The last desired state, key list or offer refused, and why (in the status).
    refused: Option<String>,
    /// sha256 of the active model's signed manifest: with its name and version, which model
    /// is installed (an offer of the same version with another manifest is a conflict).
    active_manifest: Option<String>,
    install: Delivery<M>,
    shadow: Shadow<M>,
    requests: Requests<M>,
    /// The last failed write to the store and the directory it failed in: shown as the status's
    /// `last_error` until a write in or below that directory succeeds.
    store_error: Option<(PathBuf, String)>,
    status_dirty: bool,
    /// The offer to ask for again on the next connection (the topic), after the active model
    /// was found damaged: a broker resends a retained message on a new subscription, but not
    /// always (rumqttd) to a session it resumes with the subscription in it.
    refetch_offer: Option<String>,
    /// Statuses built so far (the next status's `seq`).
    status_seq: u64,
    /// The effects of the input being handled, and the lanes whose journal changed.
    out: Vec<Effect<M>>,
    journal_dirty: [bool; 2],
    now: Now,
}

impl<M: Model> Core<M> {
    pub fn new(cfg: Config, saved: Saved, now: Now) -> Self {
        let max = cfg.limits.max_artifact_bytes;
        let mut updater = saved.journal.updater.unwrap_or_else(|| Updater::new(max));
        updater.max_bytes = max;
        (updater.active, updater.previous) = saved.installed;
        let topics = Topics::new(&cfg.broker.prefix);
        Self {
            install: Delivery::new(Lane::Install, updater, saved.offer, now),
            shadow: Shadow::new(saved.shadow, saved.shadow_offer, max, now),
            requests: Requests::new(&cfg, saved.capture, now),
            topics,
            trust: saved.trust,
            desired: saved.journal.desired,
            pursued: saved.journal.pursued,
            refused: None,
            active_manifest: saved.active_manifest,
            store_error: None,
            status_dirty: true,
            refetch_offer: None,
            status_seq: 0,
            out: Vec::new(),
            journal_dirty: [false; 2],
            now,
            cfg,
        }
    }

    /// Handles one input; returns what to do, journals first.
    pub fn handle(&mut self, input: Input<M>, now: Now) -> Vec<Effect<M>> {
        self.now = now;
        self.expire_keys();
        match input {
            Input::Connected => self.connected(),
            Input::Message { topic, payload } => self.route(&topic, payload),
            Input::Tick => self.tick(),
            Input::ChunkWritten {
                lane,
                version,
                index,
                ok,
            } => self.chunk_written(lane, version, index, ok),
            Input::PartsHeld {
                lane,
                version,
                held,
            } => self.parts_held(lane, version, &held),
            Input::Verified {
                lane,
                version,
                result,
            } => self.verified(lane, version, result),
            Input::Staged {
                lane,
                version,
                result,
            } => self.staged(lane, version, result),
            Input::Loaded {
                lane: Lane::Install,
                version,
                result,
            } => self.install_loaded(version, result),
            Input::Loaded {
                lane: Lane::Shadow,
                version,
                result,
            } => self.shadow_loaded(version, result),
            Input::Activated { version } => {
                self.active_manifest = self.install.manifest_sha256(version);
                self.step(
                    Lane::Install,
                    crate::core::update::Event::Activated { version },
                )
            }
            Input::ActiveLoadFailed { version, reason } => {
                self.active_load_failed(version, &reason)
            }
            Input::Answered { reply, observed } => self.answered(reply, observed),
            Input::NotQueued { request, busy } => self.not_queued(request, busy),
            Input::ShadowRan { version, run } => self.shadow.record(version, run),
            Input::CaptureQueued { id, result } => self.capture_queued(&id, result),
            Input::CaptureDelivered { id, bytes, first } => {
                self.capture_delivered(&id, bytes, first)
            }
            Input::CaptureGone { id } => self.capture_gone(&id),
        }
        self.take_effects()
    }

    /// After a start: load the active model, continue the journaled shadow and update.
    pub fn resume(&mut self, now: Now) -> Vec<Effect<M>> {
        self.now = now;
        self.expire_keys();
        if let Some(version) = self.install.updater.active {
            tracing::info!("{}: loading active v{version}", self.id());
            self.out.push(Effect::LoadActive { version });
        }
        let want = self.pursued.as_ref().and_then(|p| p.shadow.clone());
        self.set_shadow(want);
        self.resume_shadow();
        let actions = self.install.updater.resume();
        self.journal_dirty[0] = true;
        self.act_all(Lane::Install, actions);
        self.take_effects()
    }

    /// The journal of `lane` as it stands.
    pub fn journal(&self, lane: Lane) -> Vec<u8> {
        let bytes = match lane {
            Lane::Install => serde_json::to_vec_pretty(&Journal {
                updater: Some(self.install.updater.clone()),
                pursued: self.pursued.clone(),
                desired: self.desired.clone(),
            }),
            Lane::Shadow => serde_json::to_vec_pretty(&self.shadow.journal()),
        };
        bytes.expect("serializable")
    }

    /// Records the outcome of a write to the store at `path`: a failure is logged and shown in
    /// the status until a later write in or below the same directory succeeds (the agent goes on
    /// from memory meanwhile). Returns whether it succeeded.
    pub fn stored(&mut self, path: &Path, r: Result<(), String>) -> bool {
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
                tracing::error!("{}: {msg}", self.id());
                self.store_error = Some((dir, msg));
                self.status_dirty = true;
                false
            }
        }
    }

    /// The status as it stands: `model` is the manifest of the model serving now, `queued` the
    /// capture queue's (messages, bytes). Counts as published (the next one's `seq` follows).
    pub fn status(&mut self, model: Option<&Manifest>, queued: (u64, u64)) -> Status {
        let u = &self.install.updater;
        let progress = match &u.phase {
            Phase::Downloading { offer, have, .. } => Some((have.len() as u32, offer.chunks)),
            _ => None,
        };
        let status = Status {
            device: self.cfg.device_id.clone(),
            groups: self.cfg.groups.clone(),
            state: u.phase.device_state(),
            model: model.map(|m| m.name.clone()),
            active: u.active,
            previous: u.previous,
            target: u.phase.target(),
            manifest_sha256: self.active_manifest.clone(),
            progress,
            last_error: self
                .store_error
                .as_ref()
                .map(|(_, e)| e.clone())
                .or_else(|| u.last_error.clone()),
            failed_version: u.last_failed,
            latency: self.requests.latency(),
            updated: self.now.rfc3339(),
            started: kestrel_shared::time::process_started_ms(),
            seq: self.status_seq,
            source: model.and_then(|m| m.registry.clone()),
            refused: self.refused.clone(),
            keys_version: self.trust.in_force(),
            shadow: self.shadow.status(),
            captures: self.requests.capture_stats(queued),
            counters: self.requests.counters.clone(),
        };
        self.status_dirty = false;
        self.status_seq += 1;
        status
    }

    /// Whether the next capture (of `bytes`) may go out now under the upload cap.
    pub fn may_send_capture(&mut self, bytes: usize, now_ms: u64) -> bool {
        self.requests.may_send_capture(bytes, now_ms)
    }

    /// The install lane's update machine (what is active, what is being installed).
    pub fn updater(&self) -> &Updater {
        &self.install.updater
    }

    fn id(&self) -> &str {
        &self.cfg.device_id
    }

    /// The effects gathered, with the changed journals first (written before anything they
    /// lead to is done) and one status last.
    fn take_effects(&mut self) -> Vec<Effect<M>> {
        let mut out = Vec::with_capacity(self.out.len() + 3);
        for (i, lane) in [Lane::Install, Lane::Shadow].into_iter().enumerate() {
            if std::mem::take(&mut self.journal_dirty[i]) {
                out.push(Effect::Journal(lane));
            }
        }
        let mut status = false;
        for e in self.out.drain(..) {
            match e {
                Effect::Status => status = true,
                e => out.push(e),
            }
        }
        if status {
            out.push(Effect::Status);
        }
        out
    }

    fn publish_status(&mut self) {
        self.out.push(Effect::Status);
    }

    /// A device event (durable), with a log line.
    fn event(&mut self, kind: EventKind, version: u64, reason: Option<String>) {
        let why = reason
            .as_deref()
            .map(|r| format!(": {r}"))
            .unwrap_or_default();
        if kind.is_failure() {
            tracing::warn!("{}: v{version} {kind}{why}", self.id())
        } else {
            tracing::info!("{}: v{version} {kind}{why}", self.id())
        }
        let ev = DeviceEvent {
            device: self.cfg.device_id.clone(),
            kind,
            version,
            reason,
            time: self.now.rfc3339(),
        };
        let topic = self.topics.events(&self.cfg.device_id);
        self.publish(
            How::Durable,
            topic,
            serde_json::to_string(&ev).expect("serializable"),
        );
    }

    /// A message out: retained when only the newest counts ([`How::Latest`]).
    fn publish(&mut self, how: How, topic: String, payload: String) {
        let retain = how == How::Latest;
        let message = Message {
            topic,
            retain,
            payload,
        };
        self.out.push(Effect::Publish(how, message));
    }

    /// After a (re)connect: every subscription, online, the status.
    fn connected(&mut self) {
        self.subscribe_all();
        if let Some(topic) = self.refetch_offer.take() {
            self.out.push(Effect::Resubscribe(topic));
        }
        let topic = self.topics.online(&self.cfg.device_id);
        self.publish(How::Latest, topic, "1".into());
        self.publish_status();
    }

    /// Every subscription the state calls for (the key list first, so a rotated list is in
    /// force before the states it signs arrive).
    fn subscribe_all(&mut self) {
        let id = self.cfg.device_id.clone();
        let mut filters = Vec::new();
        if self.trust.has_root() {
            filters.push(self.topics.keys());
        }
        filters.push(self.topics.desired(&Target::Device(id.clone())));
        filters.push(self.topics.infer_filter(&id));
        if self.cfg.capture.enabled && self.cfg.capture.collector_acks {
            filters.push(self.topics.capture_ack(&id));
        }
        for g in &self.cfg.groups {
            filters.push(self.topics.desired(&Target::Group(g.clone())));
        }
        if let Some(p) = &self.pursued {
            filters.push(self.topics.artifact_manifest(&p.name, p.version));
        }
        filters.extend(self.install.chunk_filters(&self.topics));
        filters.extend(self.shadow.filters(&self.topics));
        self.out.extend(filters.into_iter().map(Effect::Subscribe));
    }

    /// A message, by its topic (the only identity a message has; nothing in a payload says
    /// where it comes from or whom it is for).
    fn route(&mut self, topic: &str, payload: Vec<u8>) {
        let topics = self.topics.clone();
        match topics.parse(topic) {
            Some(Route::Offer { name, version }) => {
                let lane = self.lane_of(name, version);
                self.on_offer(lane, topic, (name, version), &payload)
            }
            Some(Route::Chunk {
                name,
                version,
                index,
            }) => {
                let lane = self.lane_of(name, version);
                self.on_chunk(lane, topic, (name, version, index), payload)
            }
            Some(Route::PartChunk {
                sha256,
                chunk_bytes,
                index,
            }) => {
                for lane in [Lane::Install, Lane::Shadow] {
                    self.on_part_chunk(lane, topic, (sha256, chunk_bytes, index), &payload);
                }
            }
            Some(Route::Desired(target)) => self.on_desired(topic, &target, &payload),
            Some(Route::Keys) => self.on_keys(topic, &payload),
            Some(Route::Device {
                device,
                kind: DeviceTopic::Infer { request },
            }) if device == self.cfg.device_id => self.on_infer(topic, request, payload),
            Some(Route::Device {
                device,
                kind: DeviceTopic::CaptureAck,
            }) if device == self.cfg.device_id => self.on_capture_ack(topic, &payload),
            _ => {}
        }
    }

    /// The active model does not load (a file or part damaged in the store): reported, and when
    /// it is the pursued version, installed again from its offer: the pieces that still match
    /// their hashes are kept, the others fetched again.
    fn active_load_failed(&mut self, version: u64, reason: &str) {
        tracing::error!("{}: active v{version} does not load: {reason}", self.id());
        let error = format!("active v{version} does not load: {reason}");
        let pursued = self.pursued.as_ref().filter(|p| p.version == version);
        let Some(topic) = pursued.map(|p| self.topics.artifact_manifest(&p.name, version)) else {
            self.install.updater.last_error = Some(error);
            self.status_dirty = true;
            return;
        };
        self.step(
            Lane::Install,
            Event::Damaged {
                version,
                reason: error,
            },
        );
        // The retained offer again, now and (in case this runs before the connection is up)
        // once connected: it starts the installation.
        self.out.push(Effect::Resubscribe(topic.clone()));
        self.refetch_offer = Some(topic);
    }

    /// Which lane an artifact's topics belong to: the shadow's when it is the wanted shadow.
    fn lane_of(&self, name: &str, version: u64) -> Lane {
        if self.shadow.wants(name, version) {
            Lane::Shadow
        } else {
            Lane::Install
        }
    }

    fn tick(&mut self) {
        let stall = std::time::Duration::from_secs(self.cfg.limits.download_stall_s);
        for lane in [Lane::Install, Lane::Shadow] {
            if let Some((version, chunks)) = self.delivery(lane).stalled(self.now, stall) {
                let action = crate::core::update::Action::Fetch { version, chunks };
                self.act_all(lane, vec![action]);
            }
        }
        self.publish_quality_when_due();
        self.resend_due_captures();
        if self.status_dirty {
            self.publish_status();
        }
    }
}
