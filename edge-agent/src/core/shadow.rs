//! A shadow model: the candidate a desired state names beside the active model. It is fetched
//! from the same retained artifact topics and passes the same checks as an update (the shadow
//! lane of [`super::delivery`]: signed offer, chunk hashes and the corrupt-chunk limit,
//! signature and file hashes once assembled, golden samples, journal and resume), in a store of
//! its own; then the inference workers run it on the same live requests after the active model
//! has answered, and its agreement with the active model goes into the quality report. It never
//! answers a request and never becomes active.

use std::sync::Arc;

use kestrel_shared::manifest::Manifest;
use kestrel_shared::protocol::{ArtifactOffer, ModelRef, ShadowStatus};
use kestrel_shared::quality::{ShadowReport, ShadowTally};
use kestrel_shared::topics::Topics;
use kestrel_shared::wire::ShadowState;

use super::delivery::Delivery;
use super::{Core, Effect, Lane, Model, Now, ShadowJournal, ShadowRun};
use crate::core::update::{Event, Phase, Report, Updater};

/// Why a shadow cannot run on a device without quality telemetry.
const QUALITY_OFF: &str = "shadow models need quality telemetry ([quality] enabled = false)";

pub(super) struct Shadow<M> {
    want: Option<ModelRef>,
    /// The shadow's delivery: an [`Updater`] of role shadow (journaled with `want`).
    pub(super) delivery: Delivery<M>,
    /// Why the wanted shadow cannot run here (quality telemetry off, or it no longer loads).
    blocked: Option<String>,
    /// The comparison with the active model, while the shadow runs.
    tally: Option<ShadowTally>,
    /// Comparisons came in since the last quality report.
    pub(super) dirty: bool,
}

/// Whether the shadow model runs on a request: the `turn`-th (from 0) the inference workers
/// answered since it started, when it is one of every `every` and no request waits for a worker
/// (the shadow never delays an answer; under load it samples fewer). The workers count the turns
/// and ask; the rule is the core's.
pub fn runs_on(turn: u64, every: u64, waiting: usize) -> bool {
    every > 0 && turn % every == 0 && waiting == 0
}

impl<M> Shadow<M> {
    pub(super) fn new(
        journal: ShadowJournal,
        offer: Option<(ArtifactOffer, Manifest)>,
        max_bytes: u64,
        now: Now,
    ) -> Self {
        let updater = journal
            .updater
            .filter(|_| journal.want.is_some())
            .unwrap_or_else(|| Updater::shadow(max_bytes));
        Self {
            want: journal.want,
            delivery: Delivery::new(Lane::Shadow, updater, offer, now),
            blocked: None,
            tally: None,
            dirty: false,
        }
    }

    pub(super) fn journal(&self) -> ShadowJournal {
        ShadowJournal {
            want: self.want.clone(),
            updater: Some(self.delivery.updater.clone()),
        }
    }

    pub(super) fn status(&self) -> Option<ShadowStatus> {
        let w = self.want.as_ref()?;
        let u = &self.delivery.updater;
        let failed = self.blocked.clone().or_else(|| {
            (u.phase == Phase::Idle && u.last_failed == Some(w.version))
                .then(|| u.last_error.clone().unwrap_or_default())
        });
        let state = match (&failed, &u.phase) {
            (Some(_), _) => ShadowState::Failed,
            // Checked and running beside the active model (loading again after a restart:
            // still verifying).
            (None, Phase::Idle) if u.active == Some(w.version) && self.tally.is_some() => {
                ShadowState::Running
            }
            (None, Phase::Idle) if u.active == Some(w.version) => ShadowState::Verifying,
            (None, Phase::Idle | Phase::Downloading { .. }) => ShadowState::Downloading,
            (None, _) => ShadowState::Verifying,
        };
        Some(ShadowStatus {
            name: w.name.clone(),
            version: w.version,
            state,
            error: failed,
        })
    }

    pub(super) fn report(&self) -> Option<ShadowReport> {
        self.tally.as_ref().map(ShadowTally::report)
    }

    /// The topics the shadow listens on: its offer and, while downloading, its chunks.
    pub(super) fn filters(&self, topics: &Topics) -> Vec<String> {
        let Some(w) = self.fetchable() else {
            return vec![];
        };
        let mut f = vec![topics.artifact_manifest(&w.name, w.version)];
        f.extend(self.delivery.chunk_filters(topics));
        f
    }

    /// The wanted shadow, unless it cannot run here.
    pub(super) fn fetchable(&self) -> Option<&ModelRef> {
        self.want.as_ref().filter(|_| self.blocked.is_none())
    }

    /// Whether `name` v`version` is the wanted shadow (its offer and chunks are the shadow's).
    pub(super) fn wants(&self, name: &str, version: u64) -> bool {
        self.want
            .as_ref()
            .is_some_and(|w| w.name == name && w.version == version)
    }

    /// Whether `version` is the wanted shadow's (a result for another is stale).
    pub(super) fn wants_version(&self, version: u64) -> bool {
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
}

impl<M: Model> Core<M> {
    /// Follows the shadow model of the desired state being pursued (none: stop any).
    pub(super) fn set_shadow(&mut self, want: Option<ModelRef>) {
        // The model being installed or active is not its own shadow.
        let want = want.filter(|s| {
            self.pursued
                .as_ref()
                .is_none_or(|w| w.name != s.name || w.version != s.version)
        });
        if want == self.shadow.want {
            return;
        }
        let old = self.shadow.filters(&self.topics);
        self.out.extend(old.into_iter().map(Effect::Unsubscribe));
        if let Some(old) = self.shadow.want.take() {
            tracing::info!("{}: shadow v{} stopped", self.id(), old.version);
            let version = old.version;
            self.out.push(Effect::Discard {
                lane: Lane::Shadow,
                version,
            });
        }
        self.out.push(Effect::RunShadow(None));
        let max = self.cfg.limits.max_artifact_bytes;
        self.shadow = Shadow::new(ShadowJournal::default(), None, max, self.now);
        self.shadow.want = want;
        self.journal_dirty[Lane::Shadow as usize] = true;
        self.status_dirty = true;
        if self.shadow.want.is_some() && !self.cfg.quality.enabled {
            self.shadow.blocked = Some(QUALITY_OFF.into());
            return;
        }
        let new = self.shadow.filters(&self.topics);
        self.out.extend(new.into_iter().map(Effect::Subscribe));
    }

    /// After a restart: the journaled shadow (the one still wanted) continues where it was:
    /// running again, or its download or checks resumed.
    pub(super) fn resume_shadow(&mut self) {
        let Some(w) = self.shadow.fetchable().cloned() else {
            return;
        };
        if !self.cfg.quality.enabled {
            self.shadow.blocked = Some(QUALITY_OFF.into());
            return;
        }
        if self.shadow.delivery.updater.active == Some(w.version) {
            let version = w.version;
            self.out.push(Effect::Load {
                lane: Lane::Shadow,
                version,
            });
            return;
        }
        let actions = self.shadow.delivery.updater.resume();
        self.journal_dirty[Lane::Shadow as usize] = true;
        self.act_all(Lane::Shadow, actions);
    }

    /// The shadow loaded (health-checked, or loaded again after a restart).
    pub(super) fn shadow_loaded(&mut self, version: u64, r: Result<Arc<M>, String>) {
        let Some(want) = self.shadow.want.clone().filter(|w| w.version == version) else {
            return;
        };
        // A result for an earlier shadow of the same version number is not this one's.
        let r = r.and_then(|m| match m.manifest().name == want.name {
            true => Ok(m),
            false => Err(format!(
                "the model is {}, not {}",
                m.manifest().name,
                want.name
            )),
        });
        let running = self.shadow.delivery.updater.active == Some(version);
        match r {
            // Running already (after a restart): the model again.
            Ok(model) if running => self.run_beside(version, model),
            Ok(model) => {
                self.shadow.delivery.candidate = Some((version, model));
                self.step(Lane::Shadow, Event::HealthPassed { version });
            }
            Err(reason) if running => {
                self.shadow.blocked = Some(format!("shadow v{version} does not load: {reason}"));
                self.status_dirty = true;
            }
            Err(reason) => self.step(Lane::Shadow, Event::HealthFailed { version, reason }),
        }
    }

    /// The checked model runs beside the active one from now on.
    pub(super) fn run_beside(&mut self, version: u64, model: Arc<M>) {
        tracing::info!("{}: shadow v{version} running", self.id());
        let m = model.manifest();
        self.shadow.tally = Some(ShadowTally::new(&m.name, version, m.labels.len()));
        let every = self.cfg.quality.shadow_every;
        self.out.push(Effect::RunShadow(Some((model, every))));
        self.status_dirty = true;
    }

    /// The shadow's transitions go to the status (its state and error), not to the device's
    /// update events.
    pub(super) fn shadow_report(&mut self, r: Report) {
        let device = self.id().to_string();
        match r {
            Report::Rejected { version, reason }
            | Report::RolledBack {
                version, reason, ..
            } => {
                self.out.push(Effect::RunShadow(None));
                self.shadow.tally = None;
                tracing::warn!("{device}: shadow v{version} failed: {reason}");
            }
            Report::Downloading { version } => {
                tracing::info!("{device}: shadow v{version} downloading")
            }
            Report::Active { .. } => {}
        }
        self.status_dirty = true;
    }
}
