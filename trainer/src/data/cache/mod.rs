//! `trainer prepare`: the caches. The sample cache ([`samples`]) holds decoded + preprocessed pixels in shards;
//! the feature cache ([`features`]) the frozen backbone's output at the freeze boundary. Both are
//! content-addressed. This module holds what both share: errors and crash-safe reads and writes.
//!
//! - The **sample cache** key is a hash of the preprocessing spec and, per sample, the sha256 of its
//!   encoded bytes and its label name, in a canonical order (label, then content hash). Paths and
//!   row order do not enter it: the same images read through ImageFolder, CSV or Parquet share one
//!   cache (and so one split and one training run per seed). A changed image, label or spec is a new key.
//!   Samples are stored as 8-bit RGB pixels after resize + crop (`PreprocessSpec::to_pixels`),
//!   sample `i` in shard `i % shards`; normalisation happens on read, with the same code as inference.
//! - The **feature cache** key adds the backbone's weight hash and the freeze boundary. The backbone
//!   runs once per sample per key, whatever the engine; later fits and tuning trials only read it.
//!
//! Every file is written to a temporary name, fsynced and renamed, so a crash leaves either the
//! old state or the new one.

use std::fs;
use std::path::Path;

use kestrel_shared::PreprocessError;
use serde::{Deserialize, Serialize};

use crate::distributed::{CollectiveError, ErrorScope, RankError, WorkerError};

pub mod features;
pub mod samples;

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error(transparent)]
    Interrupted(#[from] crate::interrupt::Interrupted),
    #[error("{path}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "{}\n(pass --skip-invalid to skip undecodable images and continue)",
        kestrel_shared::chain(.0)
    )]
    Invalid(PreprocessError),
    #[error("{path}: corrupt cache metadata")]
    Meta {
        path: String,
        #[source]
        source: kestrel_shared::error::Cause,
    },
    #[error("{path}: shard has {found} bytes, expected {expected}")]
    Shard {
        path: String,
        found: u64,
        expected: u64,
    },
    #[error("only {samples} usable samples for {workers} workers: every worker needs at least one")]
    TooFewSamples { samples: usize, workers: usize },
    #[error("no usable samples in {0}")]
    Empty(String),
    #[error(transparent)]
    Data(#[from] super::DataError),
    #[error(transparent)]
    Backbone(#[from] kestrel_models::backbone::BackboneError),
    #[error(transparent)]
    Engine(#[from] kestrel_models::EngineError),
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error(transparent)]
    Worker(#[from] WorkerError),
}

impl RankError for CacheError {
    fn scope(&self) -> ErrorScope {
        match self {
            CacheError::Collective(e) => ErrorScope::of_collective(Some(e)),
            CacheError::Worker(_) => ErrorScope::Job,
            _ => ErrorScope::Own,
        }
    }
}

pub(super) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CacheError + '_ {
    move |source| CacheError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Writes `bytes` to `path` crash-safely (see [`kestrel_shared::fsutil::write_atomic`]), creating
/// the directory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CacheError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(io(dir))?;
    kestrel_shared::fsutil::write_atomic(path, bytes).map_err(io(path))
}

/// Writes `values` (little-endian f32) to `path` crash-safely, a block at a time: no second copy
/// of a large feature matrix in memory.
pub fn write_f32s(path: &Path, values: &[f32]) -> Result<(), CacheError> {
    use std::io::Write;
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(io(dir))?;
    let mut f = kestrel_shared::fsutil::AtomicFile::create(path).map_err(io(path))?;
    for block in values.chunks(1 << 14) {
        let bytes: Vec<u8> = block.iter().flat_map(|v| v.to_le_bytes()).collect();
        f.write_all(&bytes).map_err(io(path))?;
    }
    f.commit().map_err(io(path))
}

pub(super) fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, CacheError> {
    let text = fs::read_to_string(path).map_err(io(path))?;
    serde_json::from_str(&text).map_err(|e| CacheError::Meta {
        path: path.display().to_string(),
        source: e.into(),
    })
}

pub(super) fn write_json<T: Serialize>(path: &Path, v: &T) -> Result<(), CacheError> {
    write_atomic(
        path,
        serde_json::to_string_pretty(v)
            .expect("serializable")
            .as_bytes(),
    )
}
