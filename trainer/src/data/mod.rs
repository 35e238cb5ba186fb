//! Image-table sources: an ImageFolder tree, a `path,label` CSV manifest, Parquet (one file, a
//! Spark output directory of part files, or Hive-partitioned `column=value/` directories) or a Delta
//! table, shaped like Spark's binaryFile reader: `path`, `content`, `label`. Every source loads to the same [`Dataset`]: encoded image bytes and class indices.
//! Images are not decoded here; the caller validates them with the shared preprocessing.
//!
//! Class names are sorted: numerically when every label is a canonical decimal integer (so integer
//! Parquet labels, CSV labels and ImageFolder directory names agree, and 2 < 10), otherwise
//! lexicographically. Samples keep a deterministic order: ImageFolder by class then file name,
//! CSV and Parquet by row (part files sorted by name).
//!
//! Several sources ([`load_all`], `--data A --data B`) load into one dataset: the union of their
//! class names, sorted by the same rule, and their samples one source after another. Rows without
//! a label (null, or an empty string: a class has a name) fail the load, or with
//! `--skip-unlabelled` are left out and counted per source (a table of captures not labelled yet).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub mod cache;
pub mod extract;
pub mod source;
pub mod split;

pub use cache::features::Features;
pub use cache::samples::{Prepared, SamplePlan};
pub use source::spool::Content;
pub use source::{load, load_all};
pub use split::Split;

/// One labelled image: where its encoded bytes are, their SHA-256 and the index of its class in
/// [`Dataset::labels`].
#[derive(Clone, Debug)]
pub struct Sample {
    /// The file path; for Parquet the row's path column value, or `<file>#row <n>`.
    pub id: String,
    pub content: Content,
    /// SHA-256 (hex) of the encoded bytes.
    pub sha256: String,
    pub label: usize,
}

impl Sample {
    /// A sample whose bytes are in memory.
    pub fn in_memory(id: String, bytes: Vec<u8>, label: usize) -> Sample {
        Sample {
            id,
            sha256: kestrel_shared::protocol::sha256_hex(&bytes),
            content: bytes.into(),
            label,
        }
    }

    /// The encoded image.
    pub fn bytes(&self) -> Result<std::borrow::Cow<'_, [u8]>, DataError> {
        self.content.bytes()
    }
}

#[derive(Clone, Debug)]
pub struct Dataset {
    pub samples: Vec<Sample>,
    /// `labels[i]` is the name of class `i`.
    pub labels: Vec<String>,
    /// What was loaded, e.g. `parquet /data/digits.parquet`; several sources joined by ` + `.
    pub source: String,
    /// Rows left out for having no label (`--skip-unlabelled`): (source, count) for every source
    /// that had some.
    pub unlabelled: Vec<(String, usize)>,
    /// The tables read, in order (what tracking records as the run's dataset inputs).
    pub tables: Vec<TableRef>,
}

/// One table a dataset was read from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TableRef {
    /// The `--data` path or URL as given.
    pub location: String,
    /// `delta`, `parquet`, `csv` or `imagefolder`.
    pub format: &'static str,
    /// The Delta table version read.
    pub version: Option<u64>,
}

impl Dataset {
    /// All rows left out for having no label.
    pub fn unlabelled_total(&self) -> usize {
        self.unlabelled.iter().map(|u| u.1).sum()
    }
}

/// Column names for CSV manifests and Parquet tables (saved in a run's `params.json`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SourceOpts {
    pub label_column: String,
    pub content_column: String,
    pub path_column: String,
    /// Delta tables: read this version (time travel) instead of the current one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_version: Option<u64>,
    /// Delta tables: read the last version committed at or before this time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_timestamp: Option<String>,
    /// Leave out (and count) rows whose label is null or empty instead of failing.
    #[serde(default)]
    pub skip_unlabelled: bool,
}

impl Default for SourceOpts {
    fn default() -> Self {
        Self {
            label_column: "label".into(),
            content_column: "content".into(),
            path_column: "path".into(),
            data_version: None,
            data_timestamp: None,
            skip_unlabelled: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: expected a .csv or .parquet file, or a directory (ImageFolder or Parquet part files)", path.display())]
    UnsupportedSource { path: PathBuf },
    #[error("{}: {message}", path.display())]
    Csv { path: PathBuf, message: String },
    #[error("cannot read Parquet {}: {message}", path.display())]
    Parquet { path: PathBuf, message: String },
    #[error("{}: no {role} column `{column}`; columns are: {}", file.display(), found.join(", "))]
    MissingColumn {
        file: PathBuf,
        role: &'static str,
        column: String,
        found: Vec<String>,
    },
    #[error("{}: no content column `{column}` (expected binary image bytes); columns are: {}", file.display(), found.join(", "))]
    MissingContentColumn {
        file: PathBuf,
        column: String,
        found: Vec<String>,
    },
    #[error("{}: column `{column}` has type {found}, expected {expected}", file.display())]
    WrongColumnType {
        file: PathBuf,
        column: String,
        expected: &'static str,
        found: String,
    },
    #[error("{}: label column `{column}` has unsupported type {found}, expected a string or integer type", file.display())]
    UnsupportedLabelType {
        file: PathBuf,
        column: String,
        found: String,
    },
    #[error("{}: null in column `{column}` at row {row}{hint}", file.display())]
    NullValue {
        file: PathBuf,
        column: String,
        row: usize,
        /// What to do about it (for a label: `--skip-unlabelled`), or empty.
        hint: &'static str,
    },
    #[error("empty class `{class}` in {}: no .png/.jpg/.jpeg/.bmp files", dir.display())]
    EmptyClass { class: String, dir: PathBuf },
    #[error("{}: line {line}: image file {} does not exist", csv.display(), path.display())]
    MissingFile {
        csv: PathBuf,
        line: u64,
        path: PathBuf,
    },
    #[error("{}: empty dataset (no samples found)", path.display())]
    EmptyDataset { path: PathBuf },
    #[error("{}: no labelled rows ({unlabelled} unlabelled rows skipped)", path.display())]
    NoLabelled { path: PathBuf, unlabelled: usize },
    #[error("no table given (--data TABLE)")]
    NoSource,
    #[error("Delta table {}: {message}", path.display())]
    Delta { path: PathBuf, message: String },
    #[error(
        "{url}: no Delta table (_delta_log/) and no Parquet part files there (an ImageFolder is read from local disk only)"
    )]
    NoTableAt { url: String },
    #[error("{url}: object store request failed")]
    ObjectStore {
        url: String,
        #[source]
        source: kestrel_shared::error::Cause,
    },
    #[error("{}: --data-version and --data-timestamp apply to Delta tables (a directory with _delta_log/) only", path.display())]
    NotDelta { path: PathBuf },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn pq_err(path: &Path, e: impl std::fmt::Display) -> DataError {
    DataError::Parquet {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

#[cfg(test)]
mod tests;
