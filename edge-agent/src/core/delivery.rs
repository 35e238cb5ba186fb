//! Deliveries: a signed offer for the wanted version checked, its chunks checked against their
//! sha256, verified, staged and health-checked, each step fed to the lane's [`Updater`] and its
//! actions turned into effects. One code path for both lanes: the update of the active model
//! (last step: activate) and the shadow (last step: run beside, [`super::shadow`]).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use kestrel_runtime::artifact;
use kestrel_shared::manifest::Manifest;
use kestrel_shared::protocol::{ArtifactOffer, parse, sha256_hex};
use kestrel_shared::topics::Topics;
use kestrel_shared::wire::EventKind;

use super::pieces::{Pending, piece_fetches};
use super::{Core, Effect, Lane, Model, Now};
use crate::core::desired::Verdict;
use crate::core::update::{Action, Event, MAX_CORRUPT_REFETCHES, Offer, Phase, Report, Updater};

/// One lane's download and checks.
pub(super) struct Delivery<M> {
    lane: Lane,
    pub(super) updater: Updater,
    /// The accepted offer of the version being downloaded.
    pub(super) offer: Option<(ArtifactOffer, Manifest)>,
    last_progress: std::time::Instant,
    /// The health-checked model, until it is activated (or runs beside).
    pub(super) candidate: Option<(u64, Arc<M>)>,
    /// An offer in pieces waiting to learn which of them the part store holds (the download
    /// in progress, if any, goes on meanwhile).
    pub(super) checking: Option<Pending>,
}

impl<M> Delivery<M> {
    pub(super) fn new(
        lane: Lane,
        updater: Updater,
        offer: Option<(ArtifactOffer, Manifest)>,
        now: Now,
    ) -> Self {
        Self {
            lane,
            updater,
            offer,
            last_progress: now.mono,
            candidate: None,
            checking: None,
        }
    }

    /// The missing chunks of a download that made no progress for `stall`, if any.
    pub(super) fn stalled(&self, now: Now, stall: Duration) -> Option<(u64, Vec<u32>)> {
        match &self.updater.phase {
            Phase::Downloading { offer, have, .. }
                if now.mono.duration_since(self.last_progress) > stall =>
            {
                let missing = (0..offer.chunks).filter(|i| !have.contains(i)).collect();
                Some((offer.version, missing))
            }
            _ => None,
        }
    }

    /// The chunk topics of the download in progress: its bundle's, or those of the pieces it
    /// still lacks.
    pub(super) fn chunk_filters(&self, topics: &Topics) -> Vec<String> {
        match (&self.updater.phase, &self.offer) {
            (Phase::Downloading { offer, .. }, Some((o, _)))
                if o.version == offer.version && o.pieces.is_empty() =>
            {
                vec![topics.chunks_filter(&o.name, o.version)]
            }
            (Phase::Downloading { offer, have, .. }, Some((o, _)))
                if o.version == offer.version =>
            {
                let lacking = o.pieces.iter().zip(o.piece_ranges());
                let mut f: Vec<String> = lacking
                    .filter(|(_, r)| r.clone().any(|i| !have.contains(&i)))
                    .map(|(p, _)| topics.part_chunks_filter(&p.sha256, o.chunk_bytes))
                    .collect();
                f.dedup();
                f
            }
            _ => vec![],
        }
    }

    /// sha256 of the signed manifest of the offer of `version` being installed, if any.
    pub(super) fn manifest_sha256(&self, version: u64) -> Option<String> {
        let (o, _) = self.offer.as_ref().filter(|(o, _)| o.version == version)?;
        Some(sha256_hex(o.manifest.as_bytes()))
    }

    /// An offer of `version` redelivered: it is being installed, or is installed.
    fn has(&self, version: u64) -> bool {
        let u = &self.updater;
        u.phase.target() == Some(version) || (u.active == Some(version) && u.phase == Phase::Idle)
    }

    /// "shadow " for the shadow's messages.
    fn prefix(&self) -> &'static str {
        match self.lane {
            Lane::Install => "",
            Lane::Shadow => "shadow ",
        }
    }
}

/// Why an offer was not taken.
enum OfferError {
    /// It does not parse or its signature does not verify: nothing in it is acted on.
    Unverified(String),
    /// Signed by a trusted key, but not an artifact this device can install.
    Invalid(String),
}

impl<M: Model> Core<M> {
    pub(super) fn delivery(&self, lane: Lane) -> &Delivery<M> {
        match lane {
            Lane::Install => &self.install,
            Lane::Shadow => &self.shadow.delivery,
        }
    }

    pub(super) fn delivery_mut(&mut self, lane: Lane) -> &mut Delivery<M> {
        match lane {
            Lane::Install => &mut self.install,
            Lane::Shadow => &mut self.shadow.delivery,
        }
    }

    /// What the lane downloads: the pursued model (and whether a downgrade is allowed), or the
    /// wanted shadow.
    pub(super) fn wanted(&self, lane: Lane) -> Option<(String, u64, bool)> {
        match lane {
            Lane::Install => self
                .pursued
                .as_ref()
                .map(|p| (p.name.clone(), p.version, p.rollback)),
            Lane::Shadow => self
                .shadow
                .fetchable()
                .map(|w| (w.name.clone(), w.version, false)),
        }
    }

    /// An offer on the topic of `artifact` (name, version); only the lane's wanted version's is
    /// taken, once.
    pub(super) fn on_offer(
        &mut self,
        lane: Lane,
        topic: &str,
        (name, version): (&str, u64),
        payload: &[u8],
    ) {
        let Some((want, want_version, rollback)) = self.wanted(lane) else {
            return;
        };
        let d = self.delivery(lane);
        if (name, version) != (want.as_str(), want_version)
            || payload.is_empty()
            || d.checking
                .as_ref()
                .is_some_and(|p| p.offer.version == version)
        {
            return;
        }
        if d.has(version) {
            if lane == Lane::Install && d.updater.active == Some(version) {
                self.check_installed(topic, payload, &want, version);
            }
            return;
        }
        let prefix = d.prefix();
        let (o, m) = match self.check_offer(topic, payload, &want, version) {
            Ok(x) => x,
            // Unverified bytes change nothing: reported, and the download waits for the
            // publisher's offer (a retained one is delivered again on the next subscription).
            Err(OfferError::Unverified(reason)) => {
                let reason = format!("{prefix}offer refused: {reason}");
                return self.on_verdict(Verdict::Refused(reason), 0);
            }
            Err(OfferError::Invalid(reason)) => {
                let reason = format!("{prefix}artifact refused: {reason}");
                return self.step(lane, Event::Refused { version, reason });
            }
        };
        // Not written (a full disk): the download goes on from memory (the chunk writes fail
        // too until space returns); after a restart without offer.json it starts over.
        self.out.push(Effect::WriteOffer {
            lane,
            version,
            payload: payload.to_vec(),
        });
        self.drop_pending(lane);
        if !o.pieces.is_empty() {
            // Which pieces the device holds decides what it fetches: asked first.
            let pieces = o.pieces.iter().map(|p| p.sha256.clone()).collect();
            self.delivery_mut(lane).checking = Some(Pending {
                offer: o,
                manifest: m,
                rollback,
            });
            self.out.push(Effect::CheckParts {
                lane,
                version,
                pieces,
            });
            return;
        }
        let offer = Offer {
            version,
            chunks: o.chunks.len() as u32,
            total_bytes: o.total_bytes,
            rollback,
            held: vec![],
        };
        self.delivery_mut(lane).offer = Some((o, m));
        self.start(lane, offer);
    }

    /// Feeds an accepted offer to the lane's updater; whether its download started.
    pub(super) fn start(&mut self, lane: Lane, offer: Offer) -> bool {
        let version = offer.version;
        self.step(lane, Event::Offered(offer));
        let d = self.delivery_mut(lane);
        if d.updater.phase.target() != Some(version) {
            // Refused (too large, a downgrade): nothing of it stays on disk.
            d.offer = None;
            self.out.push(Effect::RemoveDownload { lane, version });
            return false;
        }
        true
    }

    /// An offer of the active version: the model installed, or a conflict (another model at the
    /// same version), which is reported and never taken as installed.
    fn check_installed(&mut self, topic: &str, payload: &[u8], name: &str, version: u64) {
        let Some(installed) = self.active_manifest.clone() else {
            return; // not known (an agent from before it recorded one)
        };
        let Ok((o, _)) = self.check_offer(topic, payload, name, version) else {
            return; // unverified or not installable: changes nothing
        };
        let offered = sha256_hex(o.manifest.as_bytes());
        if offered != installed {
            let reason = format!(
                "conflict: {name} v{version} offered with manifest sha256 {offered}, but the \
                 installed v{version} has manifest sha256 {installed}: a different model at an \
                 installed version is not installed (publish it as a new version)"
            );
            self.on_verdict(Verdict::Refused(reason), version);
        }
    }

    /// A signed offer checked: signature, file names, name and version.
    fn check_offer(
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
        artifact::check_names(&m).map_err(|e| OfferError::Invalid(kestrel_shared::chain(&e)))?;
        if m.name != name || m.version != version {
            return Err(OfferError::Invalid(format!(
                "offer is {} v{}, wanted {name} v{version}",
                m.name, m.version
            )));
        }
        Ok((o, m))
    }

    /// Chunk `index` of `name` v`version`: only the lane's download in progress takes it, once.
    /// An empty payload (a retained chunk cleared) is no delivery.
    pub(super) fn on_chunk(
        &mut self,
        lane: Lane,
        topic: &str,
        (name, version, index): (&str, u64, u32),
        payload: Vec<u8>,
    ) {
        let d = self.delivery(lane);
        let Some((o, _)) = &d.offer else { return };
        let Phase::Downloading { offer, have, .. } = &d.updater.phase else {
            return;
        };
        if (name, version) != (o.name.as_str(), o.version)
            || !o.pieces.is_empty()
            || offer.version != version
            || index >= offer.chunks
            || have.contains(&index)
            || payload.is_empty()
        {
            return;
        }
        let want = o.chunks[index as usize].clone();
        self.take_chunk(lane, topic, index, payload, &want);
    }

    /// A delivered chunk of the lane's download: written when it matches `want` (its sha256),
    /// else dropped, counted and asked for again.
    pub(super) fn take_chunk(
        &mut self,
        lane: Lane,
        topic: &str,
        index: u32,
        payload: Vec<u8>,
        want: &str,
    ) {
        let d = self.delivery(lane);
        let Phase::Downloading { offer, corrupt, .. } = &d.updater.phase else {
            return;
        };
        let version = offer.version;
        if sha256_hex(&payload) == want {
            self.requests.counters.bytes_fetched += payload.len() as u64;
            self.out.push(Effect::WriteChunk {
                lane,
                version,
                index,
                payload,
            });
        } else {
            // Counted; past the refetch bound a flood of garbage costs no journal write, status
            // or request each (the stall timer asks again).
            let (refetch, prefix) = (*corrupt < MAX_CORRUPT_REFETCHES, d.prefix());
            self.requests.counters.chunks_corrupt += 1;
            if refetch {
                tracing::warn!(
                    "{}: {topic}: sha256 mismatch ({prefix}chunk): dropped, asked for again",
                    self.id()
                );
                self.step(lane, Event::ChunkCorrupt { version, index });
            }
        }
    }

    /// A chunk is on disk (or, the store full, dropped: asked for again when the download stalls).
    pub(super) fn chunk_written(&mut self, lane: Lane, version: u64, index: u32, ok: bool) {
        if ok {
            self.delivery_mut(lane).last_progress = self.now.mono;
            self.step(lane, Event::ChunkStored { version, index });
        }
    }

    pub(super) fn verified(&mut self, lane: Lane, version: u64, result: Result<(), String>) {
        if lane == Lane::Shadow && !self.shadow.wants_version(version) {
            return; // for a shadow no longer wanted
        }
        self.step(
            lane,
            match result {
                Ok(()) => Event::Verified { version },
                Err(reason) => Event::VerifyFailed { version, reason },
            },
        );
    }

    /// Staging failed (a full disk): the version is refused, the active one stays.
    pub(super) fn staged(&mut self, lane: Lane, version: u64, result: Result<(), String>) {
        let ev = match result {
            Ok(()) => Event::Staged { version },
            Err(e) => Event::Refused {
                version,
                reason: format!("staging v{version}: {e}"),
            },
        };
        self.step(lane, ev);
    }

    pub(super) fn install_loaded(&mut self, version: u64, result: Result<Arc<M>, String>) {
        match result {
            Ok(m) => {
                self.install.candidate = Some((version, m));
                self.step(Lane::Install, Event::HealthPassed { version });
            }
            Err(reason) => self.step(Lane::Install, Event::HealthFailed { version, reason }),
        }
    }

    /// Feeds one event to the lane's updater and turns the actions (and the events they cause)
    /// into effects; the journal goes first.
    pub(super) fn step(&mut self, lane: Lane, ev: Event) {
        let actions = self.delivery_mut(lane).updater.handle(ev);
        self.journal_dirty[lane as usize] = true;
        self.status_dirty = true;
        self.act_all(lane, actions);
        self.publish_status();
    }

    pub(super) fn act_all(&mut self, lane: Lane, actions: Vec<Action>) {
        let mut actions = VecDeque::from(actions);
        while let Some(a) = actions.pop_front() {
            if let Some(ev) = self.act(lane, a) {
                let more = self.delivery_mut(lane).updater.handle(ev);
                self.journal_dirty[lane as usize] = true;
                actions.extend(more);
            }
        }
    }

    /// One action as effects; an event it leads to at once, if any.
    fn act(&mut self, lane: Lane, a: Action) -> Option<Event> {
        // Subscriptions belong to the session: the other lane's stay.
        let other = match lane {
            Lane::Install => Lane::Shadow,
            Lane::Shadow => Lane::Install,
        };
        let keep = match a {
            Action::Verify { .. } => self.delivery(other).chunk_filters(&self.topics),
            _ => vec![],
        };
        let keys = self.trust.keys().to_vec();
        let now = self.now.mono;
        let topics = self.topics.clone();
        let (d, out) = match lane {
            Lane::Install => (&mut self.install, &mut self.out),
            Lane::Shadow => (&mut self.shadow.delivery, &mut self.out),
        };
        match a {
            Action::Fetch { version, chunks } => {
                let Some((o, _)) = d.offer.as_ref().filter(|(o, _)| o.version == version) else {
                    let reason = "no offer journaled for this download".into();
                    return Some(Event::Refused { version, reason });
                };
                d.last_progress = now;
                if !o.pieces.is_empty() {
                    out.extend(piece_fetches(&topics, o, &chunks));
                } else if chunks.len() == o.chunks.len() {
                    // Afresh: a broker resends retained messages on a new subscription, not
                    // always on one it has (rumqttd does not).
                    let f = topics.chunks_filter(&o.name, version);
                    out.push(Effect::Resubscribe(f));
                } else {
                    // Re-subscribing to a chunk's own topic makes the broker resend it.
                    let t = chunks
                        .into_iter()
                        .map(|i| topics.chunk(&o.name, version, i));
                    out.extend(t.map(Effect::Resubscribe));
                }
            }
            Action::Verify { version } => {
                if let Some((o, _)) = &d.offer {
                    if o.pieces.is_empty() {
                        out.push(Effect::Unsubscribe(topics.chunks_filter(&o.name, version)));
                    }
                    let parts = (o.pieces.iter())
                        .map(|p| topics.part_chunks_filter(&p.sha256, o.chunk_bytes))
                        .filter(|f| !keep.contains(f));
                    out.extend(parts.map(Effect::Unsubscribe));
                }
                let offer = d.offer.clone();
                out.push(Effect::Verify {
                    lane,
                    version,
                    offer,
                    keys,
                });
            }
            Action::Stage { version } => out.push(Effect::Stage { lane, version }),
            Action::HealthCheck { version } => out.push(Effect::Load { lane, version }),
            Action::Activate { version } => {
                let model = d.candidate.take().filter(|(v, _)| *v == version);
                let model = model.map(|(_, m)| m);
                out.push(Effect::Activate { version, model });
            }
            Action::RunBeside { version } => match d.candidate.take() {
                Some((v, m)) if v == version => self.run_beside(version, m),
                _ => out.push(Effect::Load { lane, version }),
            },
            Action::Discard { version } => {
                if d.offer.as_ref().is_some_and(|(o, _)| o.version == version) {
                    d.offer = None;
                }
                out.push(Effect::Discard { lane, version });
            }
            Action::Report(r) => match lane {
                Lane::Install => self.report(r),
                Lane::Shadow => self.shadow_report(r),
            },
        }
        None
    }

    /// An update's transition: counted, and published as a device event.
    fn report(&mut self, r: Report) {
        let c = &mut self.requests.counters;
        let (kind, version, reason) = match r {
            Report::Downloading { version } => (EventKind::Downloading, version, None),
            Report::Rejected { version, reason } => {
                c.updates_rejected += 1;
                (EventKind::Rejected, version, Some(reason))
            }
            Report::RolledBack {
                version, reason, ..
            } => {
                c.updates_rolled_back += 1;
                (EventKind::RolledBack, version, Some(reason))
            }
            Report::Active { version, .. } => {
                c.updates_active += 1;
                (EventKind::Active, version, None)
            }
        };
        self.event(kind, version, reason);
        self.publish_status();
    }
}
