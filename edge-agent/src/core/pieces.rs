//! Deliveries in pieces: which pieces of an offer the part store holds decides what is fetched,
//! a piece's chunks are taken wherever the offer lists it, and the subscriptions that fetch them.

use kestrel_shared::manifest::Manifest;
use kestrel_shared::protocol::ArtifactOffer;
use kestrel_shared::topics::Topics;

use super::{Core, Effect, Lane, Model};
use crate::core::update::{Offer, Phase};

/// A checked offer in pieces, and whether it may go below the active version.
pub(super) struct Pending {
    pub(super) offer: ArtifactOffer,
    pub(super) manifest: Manifest,
    pub(super) rollback: bool,
}

/// The subscriptions that (re)deliver `chunks` (download indexes) of an offer in pieces: a
/// piece's whole filter when all of it is wanted, else each wanted chunk's own topic.
pub(super) fn piece_fetches<M>(
    topics: &Topics,
    o: &ArtifactOffer,
    chunks: &[u32],
) -> Vec<Effect<M>> {
    let (mut out, cb) = (Vec::new(), o.chunk_bytes);
    let mut subscribed = Vec::new();
    for (p, range) in o.pieces.iter().zip(o.piece_ranges()) {
        let want: Vec<u32> = (chunks.iter())
            .filter(|i| range.contains(i))
            .map(|i| i - range.start)
            .collect();
        if want.is_empty() {
            continue;
        }
        if want.len() == p.chunks.len() {
            if !subscribed.contains(&&p.sha256) {
                subscribed.push(&p.sha256);
                out.push(Effect::Resubscribe(
                    topics.part_chunks_filter(&p.sha256, cb),
                ));
            }
        } else {
            let t = want
                .into_iter()
                .map(|j| topics.part_chunk(&p.sha256, cb, j));
            out.extend(t.map(Effect::Resubscribe));
        }
    }
    out
}

impl<M: Model> Core<M> {
    /// A pending check superseded: its journaled offer goes, unless that version is the one
    /// being downloaded.
    pub(super) fn drop_pending(&mut self, lane: Lane) {
        let d = self.delivery_mut(lane);
        if let Some(p) = d.checking.take()
            && d.updater.phase.target() != Some(p.offer.version)
        {
            let version = p.offer.version;
            self.out.push(Effect::RemoveDownload { lane, version });
        }
    }

    /// The pieces of the offer being checked that the part store holds: the download starts
    /// without them.
    pub(super) fn parts_held(&mut self, lane: Lane, version: u64, held: &[String]) {
        if !(self.delivery(lane).checking.as_ref()).is_some_and(|p| p.offer.version == version) {
            return; // superseded
        }
        if self.wanted(lane).map(|w| w.1) != Some(version) {
            // The desired state moved on meanwhile (perhaps back to the active version).
            return self.drop_pending(lane);
        }
        let Pending {
            offer: o,
            manifest,
            rollback,
        } = self
            .delivery_mut(lane)
            .checking
            .take()
            .expect("checked above");
        let (mut have, mut reused) = (Vec::new(), 0);
        for (i, (p, range)) in o.pieces.iter().zip(o.piece_ranges()).enumerate() {
            if held.contains(&p.sha256) {
                have.extend(range);
                // A piece listed twice is held (and counted) once.
                if !o.pieces[..i].iter().any(|q| q.sha256 == p.sha256) {
                    reused += p.size;
                }
            }
        }
        let offer = Offer {
            version,
            chunks: o.download_chunks().len() as u32,
            total_bytes: o.total_bytes,
            rollback,
            held: have,
        };
        self.delivery_mut(lane).offer = Some((o, manifest));
        if self.start(lane, offer) {
            self.requests.counters.bytes_reused += reused;
        }
    }

    /// Chunk `index` of the piece `sha256`: taken by the lane's download in progress for every
    /// place the piece has in its offer that still lacks it.
    pub(super) fn on_part_chunk(
        &mut self,
        lane: Lane,
        topic: &str,
        (sha256, chunk_bytes, index): (&str, u64, u32),
        payload: &[u8],
    ) {
        let d = self.delivery(lane);
        let Some((o, _)) = &d.offer else { return };
        let Phase::Downloading { offer, have, .. } = &d.updater.phase else {
            return;
        };
        if offer.version != o.version || payload.is_empty() || chunk_bytes != o.chunk_bytes {
            return;
        }
        let places: Vec<(u32, String)> = (o.pieces.iter().zip(o.piece_ranges()))
            .filter(|(p, _)| p.sha256 == sha256 && (index as usize) < p.chunks.len())
            .map(|(p, r)| (r.start + index, p.chunks[index as usize].clone()))
            .filter(|(i, _)| !have.contains(i))
            .collect();
        for (i, want) in places {
            self.take_chunk(lane, topic, i, payload.to_vec(), &want);
        }
    }
}
