//! Downloads: a signed offer for the wanted version checked and journaled, its chunks checked
//! against their sha256 and journaled in the store, each fed to the update machine.

use std::time::Instant;

use anyhow::Result;
use kestrel_shared::protocol::sha256_hex;

use super::Agent;
use super::shadow::OfferError;
use crate::desired::Verdict;
use crate::update::{Event, Offer, Phase};

impl Agent {
    /// An offer on the topic of `artifact` (name, version); only the wanted version's is taken.
    pub(super) async fn on_offer(
        &mut self,
        topic: &str,
        (name, version): (&str, u64),
        payload: &[u8],
    ) -> Result<()> {
        let Some(w) = self.pursued.clone() else {
            return Ok(());
        };
        if (name, version) != (w.name.as_str(), w.version) || payload.is_empty() {
            return Ok(());
        }
        if self.updater.phase.target() == Some(w.version)
            || (self.updater.active == Some(w.version) && self.updater.phase == Phase::Idle)
        {
            return Ok(()); // redelivery
        }
        let (o, m) = match self.check_offer(topic, payload, &w.name, w.version) {
            Ok(x) => x,
            // Unverified bytes change nothing: reported, and the download waits for the
            // publisher's offer (a retained one is delivered again on the next subscription).
            Err(OfferError::Unverified(reason)) => {
                return self
                    .on_verdict(Verdict::Refused(format!("offer refused: {reason}")), 0)
                    .await;
            }
            Err(OfferError::Invalid(reason)) => {
                let reason = format!("artifact refused: {reason}");
                return self
                    .feed(Event::Refused {
                        version: w.version,
                        reason,
                    })
                    .await;
            }
        };
        // Not written (a full disk): the download goes on from memory (the chunk writes fail
        // too until space returns); after a restart without offer.json it starts over.
        let r = self.store.write_offer(o.version, payload);
        self.stored(r, &self.store.offer_path(o.version));
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

    /// Chunk `index` of `name` v`version`; only the offered download's are taken.
    pub(super) async fn on_chunk(
        &mut self,
        (name, version, index): (&str, u64, u32),
        payload: &[u8],
    ) -> Result<()> {
        let Some((o, _)) = &self.offer else {
            return Ok(());
        };
        if (name, version) != (o.name.as_str(), o.version) {
            return Ok(());
        }
        let topic = &self.topics.chunk(name, version, index);
        let Phase::Downloading { offer, have, .. } = &self.updater.phase else {
            return Ok(());
        };
        if offer.version != version || have.contains(&index) || index >= offer.chunks {
            return Ok(());
        }
        let ev = if sha256_hex(payload) == o.chunks[index as usize] {
            // A failed write (a full disk) drops the chunk: the stalled download asks for the
            // missing chunks again (on_tick), and the active model keeps serving meanwhile.
            let r = self.store.write_chunk(version, index, payload);
            if !self.stored(r, &self.store.chunk_path(version, index)) {
                return Ok(());
            }
            self.last_progress = Instant::now();
            self.status_dirty = true;
            Event::ChunkStored { version, index }
        } else {
            tracing::warn!("{}: {topic}: sha256 mismatch", self.cfg.device_id);
            Event::ChunkCorrupt { version, index }
        };
        self.feed(ev).await
    }
}
