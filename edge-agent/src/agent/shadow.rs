//! A shadow model: the candidate a desired state names beside the active model. It is fetched
//! from the same retained artifact topics and passes the same checks as an update (signed offer,
//! chunk hashes, signature and file hashes once assembled, golden samples), in a store of its
//! own (`<store>/shadow`); then the inference workers run it on the same live requests after the
//! active model has answered ([`crate::models::ShadowModel`]), and its agreement with the active
//! model goes into the quality report. It never answers a request and never becomes active.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use anyhow::Result;
use kestrel_runtime::artifact::{self, LoadedModel};
use kestrel_shared::fsutil::write_atomic;
use kestrel_shared::manifest::Manifest;
use kestrel_shared::protocol::{ArtifactOffer, ModelRef, ShadowStatus, Topics, parse, sha256_hex};
use kestrel_shared::quality::{ShadowReport, ShadowTally};
use rumqttc::QoS;
use serde::{Deserialize, Serialize};

use super::{Agent, Done, ShadowRun};
use crate::desired::Verdict;
use crate::models::{ModelSlot, ShadowModel};
use crate::store::Store;
use crate::update::{Action, Event, Offer, Phase, Report, Updater};

/// The shadow's journal in its store: what is wanted and how far its updater got.
#[derive(Debug, Default, Serialize, Deserialize)]
struct ShadowJournal {
    want: Option<ModelRef>,
    updater: Option<Updater>,
}

pub(super) struct ShadowSlot {
    store: Store,
    want: Option<ModelRef>,
    /// The shadow's delivery: an [`Updater`] of role shadow (journaled with `want`).
    updater: Updater,
    /// The accepted offer of the version being downloaded.
    offer: Option<(ArtifactOffer, Manifest)>,
    /// Why no shadow can run here at all (quality telemetry off).
    blocked: Option<String>,
    /// The health-checked model, until it runs.
    candidate: Option<(u64, Arc<LoadedModel>)>,
    last_progress: Instant,
    tally: Option<ShadowTally>,
    /// What the inference workers run.
    pub(super) shared: ModelSlot<ShadowModel>,
    /// Comparisons came in since the last quality report.
    pub(super) dirty: bool,
}

impl ShadowSlot {
    /// The slot over the shadow store, continuing what its journal says (the offer of a
    /// download in progress read back from the store).
    pub(super) fn open(store: Store, shared: ModelSlot<ShadowModel>, max_bytes: u64) -> Self {
        let journal: ShadowJournal = std::fs::read(journal_path(&store))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        let updater = journal
            .updater
            .filter(|_| journal.want.is_some())
            .unwrap_or_else(|| Updater::shadow(max_bytes));
        let offer = super::lifecycle::saved_offer(&store, &updater);
        Self {
            store,
            want: journal.want,
            updater,
            offer,
            blocked: None,
            candidate: None,
            last_progress: Instant::now(),
            tally: None,
            shared,
            dirty: false,
        }
    }

    pub(super) fn status(&self) -> Option<ShadowStatus> {
        let w = self.want.as_ref()?;
        let u = &self.updater;
        let failed = self.blocked.clone().or_else(|| {
            (u.phase == Phase::Idle && u.last_failed == Some(w.version))
                .then(|| u.last_error.clone().unwrap_or_default())
        });
        let loaded = self.shared.read().expect("lock").is_some();
        let state = match (&failed, &u.phase) {
            (Some(_), _) => "failed",
            // Checked and running beside the active model (loading again after a restart:
            // still "verifying").
            (None, Phase::Idle) if u.active == Some(w.version) && loaded => "running",
            (None, Phase::Idle) if u.active == Some(w.version) => "verifying",
            (None, Phase::Idle | Phase::Downloading { .. }) => "downloading",
            (None, _) => "verifying",
        };
        Some(ShadowStatus {
            name: w.name.clone(),
            version: w.version,
            state: state.into(),
            error: failed,
        })
    }

    pub(super) fn report(&self) -> Option<ShadowReport> {
        self.tally.as_ref().map(ShadowTally::report)
    }

    /// The topics the slot listens on: the wanted shadow's offer and, while downloading, its chunks.
    pub(super) fn filters(&self, topics: &Topics) -> Vec<String> {
        let Some(w) = &self.want else { return vec![] };
        if self.blocked.is_some() {
            return vec![];
        }
        let mut f = vec![topics.artifact_manifest(&w.name, w.version)];
        if matches!(self.updater.phase, Phase::Downloading { .. }) && self.offer.is_some() {
            f.push(topics.chunks_filter(&w.name, w.version));
        }
        f
    }

    /// Whether `name` v`version` is the wanted shadow (its offer and chunks are the shadow's).
    pub(super) fn wants(&self, name: &str, version: u64) -> bool {
        self.want
            .as_ref()
            .is_some_and(|w| w.name == name && w.version == version)
    }

    /// Whether `version` is the wanted shadow's (a result for another is stale).
    fn wants_version(&self, version: u64) -> bool {
        self.want.as_ref().is_some_and(|w| w.version == version)
    }

    /// A comparison (or a skipped turn) from an inference worker.
    pub(super) fn record(&mut self, version: u64, run: Option<ShadowRun>) {
        let Some(t) = self.tally.as_mut().filter(|t| t.version() == version) else {
            return;
        };
        match run {
            Some(r) => t.push((&r.active.0, r.active.1), (&r.shadow.0, r.shadow.1)),
            None => t.skipped += 1,
        }
        self.dirty = true;
    }

    /// The missing chunks of a download that made no progress for `stall`, if any.
    fn stalled(&self, stall: Duration) -> Option<(u64, Vec<u32>)> {
        match &self.updater.phase {
            Phase::Downloading { offer, have, .. } if self.last_progress.elapsed() > stall => {
                let missing = (0..offer.chunks).filter(|i| !have.contains(i)).collect();
                Some((offer.version, missing))
            }
            _ => None,
        }
    }
}

/// Why a shadow cannot run on a device without quality telemetry.
const QUALITY_OFF: &str = "shadow models need quality telemetry ([quality] enabled = false)";

fn journal_path(store: &Store) -> PathBuf {
    store.root().join("state.json")
}

impl Agent {
    /// Writes the shadow's journal; a failure (a full disk) is reported as the install
    /// journal's is, and the shadow goes on from memory.
    fn save_shadow_journal(&mut self) {
        let j = ShadowJournal {
            want: self.shadow.want.clone(),
            updater: Some(self.shadow.updater.clone()),
        };
        let bytes = serde_json::to_vec_pretty(&j).expect("serializable");
        let path = journal_path(&self.shadow.store);
        let r = write_atomic(&path, &bytes);
        self.stored(r, &path);
    }

    /// Follows the shadow model of the desired state being pursued (none: stop any).
    pub(super) async fn set_shadow(&mut self, want: Option<ModelRef>) -> Result<()> {
        // The model being installed or active is not its own shadow.
        let want = want.filter(|s| {
            self.pursued
                .as_ref()
                .is_none_or(|w| w.name != s.name || w.version != s.version)
        });
        if want == self.shadow.want {
            return Ok(());
        }
        for f in self.shadow.filters(&self.topics) {
            self.client.unsubscribe(f).await?;
        }
        if let Some(old) = self.shadow.want.take() {
            tracing::info!("{}: shadow v{} stopped", self.cfg.device_id, old.version);
            let _ = self.shadow.store.discard(old.version);
        }
        *self.shadow.shared.write().expect("lock") = None;
        let max = self.cfg.limits.max_artifact_bytes;
        let s = &mut self.shadow;
        (s.tally, s.offer, s.candidate, s.blocked) = (None, None, None, None);
        s.updater = Updater::shadow(max);
        s.want = want;
        self.save_shadow_journal();
        self.status_dirty = true;
        if self.shadow.want.is_some() && !self.cfg.quality.enabled {
            self.shadow.blocked = Some(QUALITY_OFF.into());
            return Ok(());
        }
        for f in self.shadow.filters(&self.topics) {
            self.client.subscribe(f, QoS::AtLeastOnce).await?;
        }
        Ok(())
    }

    /// After a restart: the journaled shadow (the one still wanted) continues where it was:
    /// running again, or its download or checks resumed.
    pub(super) async fn resume_shadow(&mut self) -> Result<()> {
        let Some(w) = self.shadow.want.clone() else {
            return Ok(());
        };
        if self.shadow.blocked.is_some() {
            return Ok(());
        }
        if !self.cfg.quality.enabled {
            self.shadow.blocked = Some(QUALITY_OFF.into());
            return Ok(());
        }
        if self.shadow.updater.active == Some(w.version) {
            self.spawn_load(&self.shadow.store, w.version, Done::ShadowLoaded);
            return Ok(());
        }
        let actions = self.shadow.updater.resume();
        self.save_shadow_journal();
        for a in actions {
            if let Some(ev) = self.shadow_act(a).await? {
                self.feed_shadow(ev).await?;
            }
        }
        Ok(())
    }

    /// Feeds one event to the shadow's updater and runs the actions (and the events they
    /// cause) to completion, as [`Agent::feed`] does for the update.
    pub(super) async fn feed_shadow(&mut self, ev: Event) -> Result<()> {
        let mut events = std::collections::VecDeque::from([ev]);
        while let Some(ev) = events.pop_front() {
            let actions = self.shadow.updater.handle(ev);
            self.save_shadow_journal();
            self.status_dirty = true;
            for a in actions {
                if let Some(next) = self.shadow_act(a).await? {
                    events.push_back(next);
                }
            }
        }
        Ok(())
    }

    /// Runs one of the shadow updater's actions in the shadow store; returns the event it
    /// produced right away, if any. Reports go to the status (the shadow's state and error),
    /// not to the device's update events.
    async fn shadow_act(&mut self, a: Action) -> Result<Option<Event>> {
        let Some(w) = self.shadow.want.clone() else {
            return Ok(None);
        };
        match a {
            Action::Fetch { version, chunks } => {
                let offered = self.shadow.offer.as_ref();
                let total = offered.filter(|(o, _)| o.version == version);
                if let Some(total) = total.map(|(o, _)| o.chunks.len()) {
                    if chunks.len() == total {
                        let f = self.topics.chunks_filter(&w.name, version);
                        self.client.subscribe(f, QoS::AtLeastOnce).await?;
                    } else {
                        // Re-subscribing to a chunk's own topic makes the broker resend it.
                        for i in chunks {
                            let t = self.topics.chunk(&w.name, version, i);
                            self.client.unsubscribe(t.clone()).await?;
                            self.client.subscribe(t, QoS::AtLeastOnce).await?;
                        }
                    }
                }
                self.shadow.last_progress = Instant::now();
                Ok(None)
            }
            Action::Verify { version } => {
                let f = self.topics.chunks_filter(&w.name, version);
                self.client.unsubscribe(f).await?;
                self.spawn_verify(
                    &self.shadow.store,
                    self.shadow.offer.clone(),
                    version,
                    Done::ShadowVerified,
                );
                Ok(None)
            }
            Action::Stage { version } => Ok(Some(match self.shadow.store.stage(version) {
                Ok(_) => Event::Staged { version },
                Err(e) => Event::Refused {
                    version,
                    reason: format!("staging the shadow: {e}"),
                },
            })),
            Action::HealthCheck { version } => {
                self.spawn_load(&self.shadow.store, version, Done::ShadowLoaded);
                Ok(None)
            }
            Action::RunBeside { version } => {
                match self.shadow.candidate.take() {
                    Some((v, model)) if v == version => self.run_beside(version, model),
                    _ => self.spawn_load(&self.shadow.store, version, Done::ShadowLoaded),
                }
                Ok(None)
            }
            // A shadow is never activated.
            Action::Activate { .. } => Ok(None),
            Action::Discard { version } => {
                let _ = self.shadow.store.discard(version);
                if self.shadow.offer.as_ref().map(|(o, _)| o.version) == Some(version) {
                    self.shadow.offer = None;
                }
                Ok(None)
            }
            Action::Report(r) => {
                let device = &self.cfg.device_id;
                match r {
                    Report::Rejected { version, reason }
                    | Report::RolledBack {
                        version, reason, ..
                    } => {
                        *self.shadow.shared.write().expect("lock") = None;
                        tracing::warn!("{device}: shadow v{version} failed: {reason}");
                    }
                    Report::Downloading { version } => {
                        tracing::info!("{device}: shadow v{version} downloading")
                    }
                    Report::Active { .. } => {}
                }
                self.status_dirty = true;
                Ok(None)
            }
        }
    }

    /// The checked model runs beside the active one from now on.
    fn run_beside(&mut self, version: u64, model: Arc<LoadedModel>) {
        tracing::info!("{}: shadow v{version} running", self.cfg.device_id);
        let classes = model.manifest.labels.len();
        self.shadow.tally = Some(ShadowTally::new(&model.manifest.name, version, classes));
        *self.shadow.shared.write().expect("lock") = Some(Arc::new(ShadowModel {
            model,
            every: self.cfg.quality.shadow_every,
            turn: AtomicU64::new(0),
        }));
        self.status_dirty = true;
    }

    /// The shadow's offer (its topic is the wanted shadow's).
    pub(super) async fn on_shadow_offer(&mut self, topic: &str, payload: &[u8]) -> Result<()> {
        let Some(w) = self.shadow.want.clone() else {
            return Ok(());
        };
        let u = &self.shadow.updater;
        let redelivery = u.phase.target() == Some(w.version) || u.active == Some(w.version);
        if payload.is_empty() || redelivery || self.shadow.blocked.is_some() {
            return Ok(());
        }
        let (o, m) = match self.check_offer(topic, payload, &w.name, w.version) {
            Ok(x) => x,
            // Unverified bytes change nothing: reported, and the shadow waits for the
            // publisher's offer.
            Err(OfferError::Unverified(reason)) => {
                return self
                    .on_verdict(
                        Verdict::Refused(format!("shadow offer refused: {reason}")),
                        0,
                    )
                    .await;
            }
            Err(OfferError::Invalid(reason)) => {
                let reason = format!("shadow artifact refused: {reason}");
                let version = w.version;
                return self.feed_shadow(Event::Refused { version, reason }).await;
            }
        };
        let r = self.shadow.store.write_offer(o.version, payload);
        self.stored(r, &self.shadow.store.offer_path(o.version));
        let offer = Offer {
            version: o.version,
            chunks: o.chunks.len() as u32,
            total_bytes: o.total_bytes,
            rollback: false,
        };
        self.shadow.offer = Some((o, m));
        self.feed_shadow(Event::Offered(offer)).await?;
        if self.shadow.updater.phase.target() != Some(w.version) {
            // Refused (too large): nothing of it stays on disk.
            let _ = std::fs::remove_dir_all(self.shadow.store.download_dir(w.version));
            self.shadow.offer = None;
        }
        Ok(())
    }

    /// Chunk `index` of the shadow (its topic is the wanted shadow's).
    pub(super) async fn on_shadow_chunk(
        &mut self,
        topic: &str,
        index: u32,
        payload: &[u8],
    ) -> Result<()> {
        let Some(w) = self.shadow.want.clone() else {
            return Ok(());
        };
        let Some(chunks) = self.shadow.offer.as_ref().map(|(o, _)| o.chunks.clone()) else {
            return Ok(());
        };
        let Phase::Downloading { offer, have, .. } = &self.shadow.updater.phase else {
            return Ok(());
        };
        if payload.is_empty()
            || offer.version != w.version
            || index >= offer.chunks
            || have.contains(&index)
        {
            return Ok(());
        }
        let version = w.version;
        let ev = if sha256_hex(payload) == chunks[index as usize] {
            let r = self.shadow.store.write_chunk(version, index, payload);
            if !self.stored(r, &self.shadow.store.chunk_path(version, index)) {
                return Ok(()); // asked for again when the download stalls
            }
            self.shadow.last_progress = Instant::now();
            Event::ChunkStored { version, index }
        } else {
            tracing::warn!("{}: {topic}: sha256 mismatch (shadow)", self.cfg.device_id);
            Event::ChunkCorrupt { version, index }
        };
        self.feed_shadow(ev).await
    }

    /// Re-requests the shadow's missing chunks when its download has stalled (as the update's).
    pub(super) async fn shadow_tick(&mut self) -> Result<()> {
        let stall = Duration::from_secs(self.cfg.limits.download_stall_s);
        if let Some((version, chunks)) = self.shadow.stalled(stall) {
            self.shadow_act(Action::Fetch { version, chunks }).await?;
        }
        Ok(())
    }

    pub(super) async fn shadow_verified(
        &mut self,
        version: u64,
        r: Result<(), String>,
    ) -> Result<()> {
        if !self.shadow.wants_version(version) {
            return Ok(());
        }
        self.feed_shadow(match r {
            Ok(()) => Event::Verified { version },
            Err(reason) => Event::VerifyFailed { version, reason },
        })
        .await
    }

    pub(super) async fn shadow_loaded(
        &mut self,
        version: u64,
        r: Result<Arc<LoadedModel>, String>,
    ) -> Result<()> {
        let Some(want) = self.shadow.want.clone().filter(|w| w.version == version) else {
            return Ok(());
        };
        // A result for an earlier shadow of the same version number is not this one's.
        let r = r.and_then(|m| match m.manifest.name == want.name {
            true => Ok(m),
            false => Err(format!(
                "the model is {}, not {}",
                m.manifest.name, want.name
            )),
        });
        match r {
            // Running already (after a restart): the model again.
            Ok(model) if self.shadow.updater.active == Some(version) => {
                self.run_beside(version, model);
                Ok(())
            }
            Ok(model) => {
                self.shadow.candidate = Some((version, model));
                self.feed_shadow(Event::HealthPassed { version }).await
            }
            Err(reason) if self.shadow.updater.active == Some(version) => {
                self.shadow.blocked = Some(format!("shadow v{version} does not load: {reason}"));
                self.status_dirty = true;
                Ok(())
            }
            Err(reason) => {
                self.feed_shadow(Event::HealthFailed { version, reason })
                    .await
            }
        }
    }

    /// A signed offer checked as an update's is: signature, file names, name and version.
    pub(super) fn check_offer(
        &self,
        topic: &str,
        payload: &[u8],
        name: &str,
        version: u64,
    ) -> Result<(ArtifactOffer, Manifest), OfferError> {
        let unverified =
            |e: kestrel_shared::protocol::ProtocolError| OfferError::Unverified(e.to_string());
        let o = parse::<ArtifactOffer>(topic, payload).map_err(unverified)?;
        let m = o.open(self.trust.keys()).map_err(unverified)?;
        artifact::check_names(&m).map_err(|e| OfferError::Invalid(e.to_string()))?;
        if m.name != name || m.version != version {
            return Err(OfferError::Invalid(format!(
                "offer is {} v{}, wanted {name} v{version}",
                m.name, m.version
            )));
        }
        Ok((o, m))
    }
}

/// Why an offer was not taken.
pub(super) enum OfferError {
    /// It does not parse or its signature does not verify: nothing in it is acted on.
    Unverified(String),
    /// Signed by a trusted key, but not an artifact this device can install.
    Invalid(String),
}
