//! An exported artifact made ready to publish: files checked against the manifest, the manifest
//! signed, the device files cut into chunks.

use std::path::Path;

use ed25519_dalek::SigningKey;
use kestrel_models::artifact::{self, read_manifest};
use kestrel_shared::manifest::{MANIFEST_FILE, Manifest};
use kestrel_shared::protocol::{ArtifactOffer, Topics, device_files};
use kestrel_shared::signing::{PayloadType, sign};

use crate::FleetError;

/// An artifact ready to publish: its signed offer and the chunks of its device files.
pub struct Bundle {
    pub manifest: Manifest,
    pub offer: ArtifactOffer,
    pub chunks: Vec<Vec<u8>>,
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
        Ok(Self {
            manifest,
            offer,
            chunks,
        })
    }

    /// The retained messages of the artifact: every chunk, then the offer.
    pub fn messages(&self, topics: &Topics) -> Vec<(String, Vec<u8>, bool)> {
        let (name, v) = (&self.offer.name, self.offer.version);
        let mut out: Vec<_> = self
            .chunks
            .iter()
            .enumerate()
            .map(|(i, c)| (topics.chunk(name, v, i as u32), c.clone(), true))
            .collect();
        out.push((
            topics.artifact_manifest(name, v),
            serde_json::to_vec(&self.offer).expect("serializable"),
            true,
        ));
        out
    }
}
