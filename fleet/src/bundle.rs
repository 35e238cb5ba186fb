//! An exported artifact made ready to publish: files checked against the manifest, the manifest
//! signed, the device files cut into chunks.

use std::path::Path;

use ed25519_dalek::SigningKey;
use kestrel_models::artifact::{self, read_manifest};
use kestrel_shared::manifest::{MANIFEST_FILE, Manifest};
use kestrel_shared::protocol::{ArtifactOffer, Piece, device_files};
use kestrel_shared::signing::{PayloadType, sign};
use kestrel_shared::topics::Topics;

use crate::FleetError;

/// An artifact ready to publish: its signed offer and the chunks of its device files, whole
/// (for agents from before parts) and as content-addressed pieces.
pub struct Bundle {
    pub manifest: Manifest,
    pub offer: ArtifactOffer,
    pub chunks: Vec<Vec<u8>>,
    /// The bytes of every piece of the offer, in its order.
    pub pieces: Vec<Vec<u8>>,
}

impl Bundle {
    /// Reads `dir`, checks every file against the manifest, signs the manifest with `key` and cuts
    /// the device files into `chunk_bytes` chunks.
    pub fn from_dir(dir: &Path, key: &SigningKey, chunk_bytes: usize) -> Result<Self, FleetError> {
        let manifest = read_manifest(dir)?;
        artifact::verify_files(dir, &manifest, u64::MAX)?;
        let mpath = dir.join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&mpath).map_err(|e| FleetError::Io {
            path: mpath.display().to_string(),
            source: e,
        })?;
        let mut bundle = Vec::new();
        for f in device_files(&manifest) {
            let p = dir.join(artifact::safe_relative(&f.path)?);
            bundle.extend(std::fs::read(&p).map_err(|e| FleetError::Io {
                path: p.display().to_string(),
                source: e,
            })?);
        }
        let chunk_bytes = chunk_bytes.max(1);
        let signature = sign(key, PayloadType::Manifest, text.as_bytes());
        let offer = ArtifactOffer::new(&manifest, text, signature, &bundle, chunk_bytes);
        let chunks = bundle.chunks(chunk_bytes).map(<[u8]>::to_vec).collect();
        let mut at = 0;
        let pieces = (offer.pieces.iter())
            .map(|p| {
                at += p.size as usize;
                bundle[at - p.size as usize..at].to_vec()
            })
            .collect();
        Ok(Self {
            manifest,
            offer,
            chunks,
            pieces,
        })
    }

    /// The bytes a device fetches to install this version when it already holds the pieces of
    /// `held` (another version's offer): every piece of this one it lacks. `None`: all of them.
    pub fn bytes_beside(&self, held: Option<&ArtifactOffer>) -> u64 {
        let has = |sha: &str| held.is_some_and(|o| o.pieces.iter().any(|p| p.sha256 == sha));
        if self.offer.pieces.is_empty() {
            return self.offer.total_bytes;
        }
        let mut new: Vec<&Piece> = self
            .offer
            .pieces
            .iter()
            .filter(|p| !has(&p.sha256))
            .collect();
        new.sort_by(|a, b| a.sha256.cmp(&b.sha256));
        new.dedup_by(|a, b| a.sha256 == b.sha256);
        new.iter().map(|p| p.size).sum()
    }

    /// The retained messages of the artifact: every piece's chunks (each piece once), the whole
    /// bundle's chunks (for agents from before pieces), then the offer.
    pub fn messages(&self, topics: &Topics) -> Vec<(String, Vec<u8>, bool)> {
        let (name, v) = (&self.offer.name, self.offer.version);
        let chunk_bytes = self.offer.chunk_bytes.max(1) as usize;
        let mut out = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for (p, bytes) in self.offer.pieces.iter().zip(&self.pieces) {
            if seen.insert(&p.sha256) {
                let cut = bytes.chunks(chunk_bytes).enumerate();
                let m = cut.map(|(i, c)| {
                    let topic = topics.part_chunk(&p.sha256, chunk_bytes as u64, i as u32);
                    (topic, c.to_vec(), true)
                });
                out.extend(m);
            }
        }
        let whole = self.chunks.iter().enumerate();
        out.extend(whole.map(|(i, c)| (topics.chunk(name, v, i as u32), c.clone(), true)));
        out.push((
            topics.artifact_manifest(name, v),
            serde_json::to_vec(&self.offer).expect("serializable"),
            true,
        ));
        out
    }

    /// The bundle as a publisher from before pieces offers it: whole-bundle chunks only (what
    /// every agent fetches then).
    pub fn without_pieces(mut self) -> Self {
        self.offer.pieces.clear();
        self.pieces.clear();
        self
    }
}
