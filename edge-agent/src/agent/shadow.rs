//! A shadow model: the candidate a desired state names beside the active model. It is fetched
//! from the same retained artifact topics and passes the same checks as an update (signed offer,
//! chunk hashes, signature and file hashes once assembled, golden samples), in a store of its
//! own (`<store>/shadow`); then the inference workers run it on the same live requests after the
//! active model has answered ([`crate::models::ShadowModel`]), and its agreement with the active
//! model goes into the quality report. It never answers a request and never becomes active.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use anyhow::Result;
use kestrel_runtime::artifact::{self, LoadedModel};
use kestrel_shared::manifest::Manifest;
use kestrel_shared::protocol::{ArtifactOffer, ModelRef, ShadowStatus, Topics, parse, sha256_hex};
use kestrel_shared::quality::{ShadowReport, ShadowTally};
use rumqttc::QoS;

use super::{Agent, Done, ShadowRun};
use crate::desired::Verdict;
use crate::models::{ModelSlot, ShadowModel};
use crate::store::Store;

#[derive(Debug, Clone, PartialEq)]
enum SlotState {
    /// Waiting for the offer or its chunks.
    Downloading,
    Verifying,
    Running,
    Failed(String),
}

pub(super) struct ShadowSlot {
    store: Store,
    want: Option<ModelRef>,
    state: SlotState,
    offer: Option<(ArtifactOffer, Manifest)>,
    have: BTreeSet<u32>,
    tally: Option<ShadowTally>,
    /// What the inference workers run.
    pub(super) shared: ModelSlot<ShadowModel>,
    /// Comparisons came in since the last quality report.
    pub(super) dirty: bool,
}

impl ShadowSlot {
    pub(super) fn new(store: Store, shared: ModelSlot<ShadowModel>) -> Self {
        Self {
            store,
            want: None,
            state: SlotState::Downloading,
            offer: None,
            have: BTreeSet::new(),
            tally: None,
            shared,
            dirty: false,
        }
    }

    pub(super) fn status(&self) -> Option<ShadowStatus> {
        let w = self.want.as_ref()?;
        let (state, error) = match &self.state {
            SlotState::Downloading => ("downloading", None),
            SlotState::Verifying => ("verifying", None),
            SlotState::Running => ("running", None),
            SlotState::Failed(e) => ("failed", Some(e.clone())),
        };
        Some(ShadowStatus {
            name: w.name.clone(),
            version: w.version,
            state: state.into(),
            error,
        })
    }

    pub(super) fn report(&self) -> Option<ShadowReport> {
        self.tally.as_ref().map(ShadowTally::report)
    }

    /// The topics the slot listens on: the wanted shadow's offer and, while downloading, its chunks.
    pub(super) fn filters(&self, topics: &Topics) -> Vec<String> {
        let Some(w) = &self.want else { return vec![] };
        let mut f = vec![topics.artifact_manifest(&w.name, w.version)];
        if self.state == SlotState::Downloading && self.offer.is_some() {
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

    fn fail(&mut self, reason: String) {
        *self.shared.write().expect("lock") = None;
        self.state = SlotState::Failed(reason);
    }
}

impl Agent {
    /// Follows the shadow model of the desired state being pursued (none: stop any).
    pub(super) async fn set_shadow(&mut self, want: Option<ModelRef>) -> Result<()> {
        // The model being installed or active is not its own shadow.
        let want = want.filter(|s| {
            self.wanted
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
        self.shadow.tally = None;
        self.shadow.offer = None;
        self.shadow.have.clear();
        self.shadow.state = SlotState::Downloading;
        self.shadow.want = want;
        self.status_dirty = true;
        if self.shadow.want.is_some() && !self.cfg.quality.enabled {
            self.shadow
                .fail("shadow models need quality telemetry ([quality] enabled = false)".into());
            return Ok(());
        }
        for f in self.shadow.filters(&self.topics) {
            self.client.subscribe(f, QoS::AtLeastOnce).await?;
        }
        Ok(())
    }

    /// The shadow's offer (its topic is the wanted shadow's).
    pub(super) async fn on_shadow_offer(&mut self, topic: &str, payload: &[u8]) -> Result<()> {
        let Some(w) = self.shadow.want.clone() else {
            return Ok(());
        };
        if self.shadow.state != SlotState::Downloading
            || payload.is_empty()
            || self.shadow.offer.is_some()
        {
            return Ok(()); // not downloading, or a redelivery
        }
        match self.check_offer(topic, payload, &w.name, w.version) {
            Ok((o, m)) if o.total_bytes <= self.cfg.limits.max_artifact_bytes => {
                self.shadow.offer = Some((o, m));
                let f = self.topics.chunks_filter(&w.name, w.version);
                self.client.subscribe(f, QoS::AtLeastOnce).await?;
            }
            Ok((o, _)) => self.shadow.fail(format!(
                "shadow v{}: {} bytes, over the limit of {}",
                w.version, o.total_bytes, self.cfg.limits.max_artifact_bytes
            )),
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
            Err(OfferError::Invalid(e)) => {
                self.shadow.fail(format!("shadow artifact refused: {e}"))
            }
        }
        self.status_dirty = true;
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
        if self.shadow.state != SlotState::Downloading || payload.is_empty() {
            return Ok(());
        }
        let Some(chunks) = self.shadow.offer.as_ref().map(|(o, _)| o.chunks.clone()) else {
            return Ok(());
        };
        if index as usize >= chunks.len() || self.shadow.have.contains(&index) {
            return Ok(());
        }
        if sha256_hex(payload) != chunks[index as usize] {
            tracing::warn!("{}: {topic}: sha256 mismatch (shadow)", self.cfg.device_id);
            return Ok(()); // a retained chunk is sent again on the next subscription
        }
        let r = self.shadow.store.write_chunk(w.version, index, payload);
        if !self.stored(r, &self.shadow.store.chunk_path(w.version, index)) {
            return Ok(());
        }
        self.shadow.have.insert(index);
        if self.shadow.have.len() == chunks.len() {
            self.client
                .unsubscribe(self.topics.chunks_filter(&w.name, w.version))
                .await?;
            self.shadow.state = SlotState::Verifying;
            self.status_dirty = true;
            self.spawn_shadow_check(w.version);
        }
        Ok(())
    }

    /// Assembles the shadow's files, verifies signature and hashes and runs its golden samples
    /// (the update's checks), on a blocking thread.
    fn spawn_shadow_check(&self, version: u64) {
        let Some((o, m)) = self.shadow.offer.clone() else {
            return;
        };
        let (store, models, tx) = (
            self.shadow.store.clone(),
            self.models.clone(),
            self.done_tx.clone(),
        );
        let (keys, max) = (
            self.trust.keys().to_vec(),
            self.cfg.limits.max_artifact_bytes,
        );
        tokio::task::spawn_blocking(move || {
            let r = store.assemble(&o, &m).and_then(|dir| {
                artifact::verify_signature(&dir, &keys)
                    .and_then(|_| artifact::verify_device_files(&dir, &m, max))
                    .map_err(|e| e.to_string())?;
                models.load(&dir)
            });
            let _ = tx.send(Done::ShadowLoaded(version, r));
        });
    }

    pub(super) fn shadow_loaded(&mut self, version: u64, r: Result<Arc<LoadedModel>, String>) {
        if self.shadow.want.as_ref().map(|w| w.version) != Some(version) {
            return;
        }
        self.status_dirty = true;
        match r {
            Ok(model) => {
                tracing::info!("{}: shadow v{version} running", self.cfg.device_id);
                let classes = model.manifest.labels.len();
                self.shadow.tally = Some(ShadowTally::new(&model.manifest.name, version, classes));
                *self.shadow.shared.write().expect("lock") = Some(Arc::new(ShadowModel {
                    model,
                    every: self.cfg.quality.shadow_every,
                    turn: AtomicU64::new(0),
                }));
                self.shadow.state = SlotState::Running;
            }
            Err(e) => {
                tracing::warn!("{}: shadow v{version} failed: {e}", self.cfg.device_id);
                self.shadow.fail(format!("shadow v{version}: {e}"));
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
