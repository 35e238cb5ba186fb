//! The model-update logic as a sans-IO state machine: it is fed [`Event`]s (what the IO layer
//! observed) and returns [`Action`]s (what the IO layer must do next). It never touches the network
//! or the disk, so every transition is unit-tested without a broker.
//!
//! ```text
//! idle ──offer──▶ downloading ──all chunks──▶ verifying ──ok──▶ staged ──▶ checking ──pass──▶ activating ──▶ active
//!                  ▲     │ corrupt chunk              │ fail                       │ fail
//!                  └─────┘ dropped, asked again       ▼                            ▼
//!                                                  rejected                 rolled back (previous stays active)
//! ```
//!
//! Unverified bytes change nothing: a chunk that fails its sha256 is dropped and asked for
//! again (at once for the first [`MAX_CORRUPT_REFETCHES`] of a download, then when the
//! download stalls), and never fails the version. Anyone who can publish to a chunk topic can
//! send garbage; only the signed artifact itself failing its checks (the assembled files'
//! hashes, the health check) marks a version failed.
//!
//! The whole [`Updater`] is serde-serializable: the IO layer journals it after every event, and
//! after a crash [`Updater::resume`] says how to continue from the journaled phase (re-fetch the
//! missing chunks, re-verify staged files, or redo the idempotent atomic activation).
//!
//! A shadow model (a candidate run beside the active one) goes through a second `Updater` of
//! [`Role::Shadow`]: every rule of an update (signed offer, chunk hashes and the corrupt-chunk
//! limit, verification, staging, health check, journal and resume) with its last step "run
//! beside" ([`Action::RunBeside`]) instead of the atomic activation.

use std::collections::BTreeSet;

use kestrel_shared::wire::DeviceState;
use serde::{Deserialize, Serialize};

/// A signed manifest for a new desired version (the IO layer checked the signature).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Offer {
    pub version: u64,
    pub chunks: u32,
    pub total_bytes: u64,
    /// Explicitly allowed to go below the active version.
    pub rollback: bool,
    /// Chunks the device already holds (pieces of the offer in its part store): not fetched.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub held: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Event {
    Offered(Offer),
    /// A desired state or offer for `version` was refused before it became an offer (bad
    /// signature, unsafe file name, inconsistent offer).
    Refused {
        version: u64,
        reason: String,
    },
    /// A chunk arrived, matched its sha256 and is journaled on disk.
    ChunkStored {
        version: u64,
        index: u32,
    },
    /// A chunk arrived but did not match its sha256.
    ChunkCorrupt {
        version: u64,
        index: u32,
    },
    /// The assembled files match the manifest (sizes, hashes, safe names).
    Verified {
        version: u64,
    },
    VerifyFailed {
        version: u64,
        reason: String,
    },
    /// The verified files are in the store's staging slot.
    Staged {
        version: u64,
    },
    HealthPassed {
        version: u64,
    },
    HealthFailed {
        version: u64,
        reason: String,
    },
    /// The atomic swap to the new version is durable.
    Activated {
        version: u64,
    },
    /// The active version does not load (its files or parts damaged in the store): it is no
    /// longer active, and its offer may install it again.
    Damaged {
        version: u64,
        reason: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Action {
    Fetch {
        version: u64,
        chunks: Vec<u32>,
    },
    Verify {
        version: u64,
    },
    Stage {
        version: u64,
    },
    HealthCheck {
        version: u64,
    },
    Activate {
        version: u64,
    },
    /// A shadow's last step: run the checked model beside the active one ([`Role::Shadow`]).
    RunBeside {
        version: u64,
    },
    /// Delete everything downloaded or staged for this version.
    Discard {
        version: u64,
    },
    /// Publish a transition (and the retained status).
    Report(Report),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Report {
    Downloading {
        version: u64,
    },
    Rejected {
        version: u64,
        reason: String,
    },
    RolledBack {
        version: u64,
        active: Option<u64>,
        reason: String,
    },
    Active {
        version: u64,
        previous: Option<u64>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    Idle,
    Downloading {
        offer: Offer,
        have: BTreeSet<u32>,
        corrupt: u32,
    },
    Verifying {
        version: u64,
    },
    Staging {
        version: u64,
    },
    Checking {
        version: u64,
    },
    Activating {
        version: u64,
    },
}

impl Phase {
    /// The phase as a status says it (`Status.state`).
    pub fn device_state(&self) -> DeviceState {
        match self {
            Phase::Idle => DeviceState::Idle,
            Phase::Downloading { .. } => DeviceState::Downloading,
            Phase::Verifying { .. } => DeviceState::Verifying,
            Phase::Staging { .. } => DeviceState::Staged,
            Phase::Checking { .. } => DeviceState::HealthCheck,
            Phase::Activating { .. } => DeviceState::Activating,
        }
    }

    /// The version being installed, if any.
    pub fn target(&self) -> Option<u64> {
        match self {
            Phase::Idle => None,
            Phase::Downloading { offer, .. } => Some(offer.version),
            Phase::Verifying { version }
            | Phase::Staging { version }
            | Phase::Checking { version }
            | Phase::Activating { version } => Some(*version),
        }
    }
}

/// Corrupt chunks of a download asked for again at once; after these, a download with corrupt
/// deliveries is asked for again only when it stalls (the agent's `download_stall_s`), so a
/// flood of garbage costs the device one request per stall period.
pub const MAX_CORRUPT_REFETCHES: u32 = 3;

/// What an [`Updater`] installs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The model that answers requests: activated atomically, the previous one kept.
    #[default]
    Install,
    /// A candidate run beside the active model, never answering: `active` is the version
    /// running beside it.
    Shadow,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Updater {
    #[serde(default)]
    pub role: Role,
    pub active: Option<u64>,
    pub previous: Option<u64>,
    pub phase: Phase,
    pub last_error: Option<String>,
    /// The version whose installation failed last (rejected or rolled back).
    #[serde(default)]
    pub last_failed: Option<u64>,
    /// Largest artifact accepted.
    pub max_bytes: u64,
}

impl Updater {
    pub fn new(max_bytes: u64) -> Self {
        Self {
            role: Role::Install,
            active: None,
            previous: None,
            phase: Phase::Idle,
            last_error: None,
            last_failed: None,
            max_bytes,
        }
    }

    /// An updater for a shadow model ([`Role::Shadow`]).
    pub fn shadow(max_bytes: u64) -> Self {
        Self {
            role: Role::Shadow,
            ..Self::new(max_bytes)
        }
    }

    fn reject(&mut self, version: u64, reason: String) -> Vec<Action> {
        let mut out = Vec::new();
        if self.phase.target() == Some(version) {
            out.push(Action::Discard { version });
            self.phase = Phase::Idle;
        }
        self.last_error = Some(reason.clone());
        self.last_failed = Some(version);
        out.push(Action::Report(Report::Rejected { version, reason }));
        out
    }

    /// Feeds one event; returns what to do.
    pub fn handle(&mut self, ev: Event) -> Vec<Action> {
        match ev {
            Event::Offered(o) => self.offered(o),
            Event::Refused { version, reason } => self.reject(version, reason),
            Event::ChunkStored { version, index } => self.chunk_stored(version, index),
            Event::ChunkCorrupt { version, index } => self.chunk_corrupt(version, index),
            Event::Verified { version } if self.phase == (Phase::Verifying { version }) => {
                self.phase = Phase::Staging { version };
                vec![Action::Stage { version }]
            }
            Event::VerifyFailed { version, reason }
                if self.phase == (Phase::Verifying { version }) =>
            {
                self.reject(version, format!("verification failed: {reason}"))
            }
            Event::Staged { version } if self.phase == (Phase::Staging { version }) => {
                self.phase = Phase::Checking { version };
                vec![Action::HealthCheck { version }]
            }
            Event::HealthPassed { version } if self.phase == (Phase::Checking { version }) => {
                match self.role {
                    Role::Install => {
                        self.phase = Phase::Activating { version };
                        vec![Action::Activate { version }]
                    }
                    Role::Shadow => {
                        let mut out = vec![Action::RunBeside { version }];
                        out.extend(self.activated(version));
                        out
                    }
                }
            }
            Event::HealthFailed { version, reason }
                if self.phase == (Phase::Checking { version }) =>
            {
                self.health_failed(version, reason)
            }
            Event::Activated { version } if self.phase == (Phase::Activating { version }) => {
                self.activated(version)
            }
            Event::Damaged { version, reason }
                if self.active == Some(version) && self.phase == Phase::Idle =>
            {
                self.active = None;
                self.last_error = Some(reason);
                vec![]
            }
            // Stale or out-of-order results (e.g. for a superseded version) change nothing.
            _ => vec![],
        }
    }

    /// A new desired version: supersedes any update in progress, then is refused or fetched.
    fn offered(&mut self, o: Offer) -> Vec<Action> {
        let target = self.phase.target();
        if target == Some(o.version) {
            return vec![]; // redelivery of what is in progress
        }
        let mut out = Vec::new();
        if let Some(t) = target {
            out.push(Action::Discard { version: t }); // a newer desired state supersedes
            self.phase = Phase::Idle;
        }
        if self.active == Some(o.version) {
            return out; // already active (a redelivery, or back to it mid-update)
        }
        if let Some(reason) = self.refusal(&o) {
            out.extend(self.reject(o.version, reason));
            return out;
        }
        let version = o.version;
        let have: BTreeSet<u32> = o.held.iter().copied().filter(|&i| i < o.chunks).collect();
        let missing: Vec<u32> = (0..o.chunks).filter(|i| !have.contains(i)).collect();
        if missing.is_empty() {
            out.push(Action::Report(Report::Downloading { version }));
            out.push(Action::Verify { version });
            self.phase = Phase::Verifying { version };
            return out;
        }
        out.push(Action::Fetch {
            version,
            chunks: missing,
        });
        out.push(Action::Report(Report::Downloading { version }));
        self.phase = Phase::Downloading {
            offer: o,
            have,
            corrupt: 0,
        };
        out
    }

    /// Why an offer cannot be accepted at all, if it cannot.
    fn refusal(&self, o: &Offer) -> Option<String> {
        match self.active {
            _ if o.chunks == 0 => Some("the offer has no chunks".to_string()),
            _ if o.total_bytes > self.max_bytes => Some(format!(
                "artifact of {} bytes is over the limit of {}",
                o.total_bytes, self.max_bytes
            )),
            Some(a) if o.version < a && !o.rollback => Some(format!(
                "v{} is older than the active v{a}: a downgrade needs --rollback",
                o.version
            )),
            _ => None,
        }
    }

    fn chunk_stored(&mut self, version: u64, index: u32) -> Vec<Action> {
        match &mut self.phase {
            Phase::Downloading { offer, have, .. }
                if offer.version == version && index < offer.chunks =>
            {
                have.insert(index);
                if have.len() as u32 == offer.chunks {
                    self.phase = Phase::Verifying { version };
                    vec![Action::Verify { version }]
                } else {
                    vec![]
                }
            }
            _ => vec![],
        }
    }

    /// A chunk that failed its sha256: dropped and asked for again, never a failure.
    fn chunk_corrupt(&mut self, version: u64, index: u32) -> Vec<Action> {
        let Phase::Downloading { offer, corrupt, .. } = &mut self.phase else {
            return vec![];
        };
        if offer.version != version {
            return vec![];
        }
        *corrupt = corrupt.saturating_add(1);
        let n = *corrupt;
        self.last_error = Some(format!(
            "chunk {index} of v{version} failed its sha256 check ({n} corrupt deliveries so far): \
             dropped, asked for again"
        ));
        if n <= MAX_CORRUPT_REFETCHES {
            vec![Action::Fetch {
                version,
                chunks: vec![index],
            }]
        } else {
            vec![]
        }
    }

    /// The staged version failed its health check: discarded, the active one stays.
    fn health_failed(&mut self, version: u64, reason: String) -> Vec<Action> {
        let reason = format!("health check failed: {reason}");
        self.phase = Phase::Idle;
        self.last_error = Some(reason.clone());
        self.last_failed = Some(version);
        vec![
            Action::Discard { version },
            Action::Report(Report::RolledBack {
                version,
                active: self.active,
                reason,
            }),
        ]
    }

    fn activated(&mut self, version: u64) -> Vec<Action> {
        // (None after a damaged active version: its previous stays.)
        if let Some(a) = self.active.filter(|a| *a != version) {
            self.previous = Some(a);
        }
        self.active = Some(version);
        self.phase = Phase::Idle;
        self.last_error = None;
        vec![Action::Report(Report::Active {
            version,
            previous: self.previous,
        })]
    }

    /// After a restart with this (journaled) state: the actions that continue the update.
    pub fn resume(&mut self) -> Vec<Action> {
        if let Phase::Staging { version } | Phase::Checking { version } = self.phase {
            // Staged files may be half-written: verify them again before going on.
            self.phase = Phase::Verifying { version };
        }
        match &self.phase {
            Phase::Idle => vec![],
            Phase::Downloading { offer, have, .. } => {
                let missing: Vec<u32> = (0..offer.chunks).filter(|i| !have.contains(i)).collect();
                vec![Action::Fetch {
                    version: offer.version,
                    chunks: missing,
                }]
            }
            Phase::Verifying { version }
            | Phase::Staging { version }
            | Phase::Checking { version } => {
                vec![Action::Verify { version: *version }]
            }
            // The swap is idempotent: redo it.
            Phase::Activating { version } => vec![Action::Activate { version: *version }],
        }
    }
}

#[cfg(test)]
mod tests;
