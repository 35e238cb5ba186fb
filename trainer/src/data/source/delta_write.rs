//! Kestrel's own Delta tables, on local disk or an object store (the URLs `--data` takes:
//! `s3://`, `az://`, `abfss://`, `gs://`), read like any other table (`--data`, through
//! delta-kernel-rs):
//! - **capture tables**, which `trainer collect` appends to: the images and what the device
//!   predicted; never rewritten;
//! - their **labels tables** (`<table>/_labels`, named by the capture table's
//!   `kestrel.labelsTable` property), which `trainer label` rewrites: a `path` and a `label` per
//!   labelled row, so labelling never copies an image. A reader of the capture table (`--data`)
//!   takes each row's label from there (the capture table's own `label` column otherwise).
//!
//! Appends and rewrites go through delta_kernel's public transaction API: its default engine
//! writes each data file (Parquet) with its column statistics (min/max/null counts) and builds the
//! `add` actions; a rewrite removes every live file through the scan's own file list; the commit
//! is put-if-absent (a local hard link, an object store's conditional PUT), so two writers never
//! take one version: the second fails and nothing is overwritten. An append may carry a
//! transaction id (`txn`: application id and its next sequence number), so which collector wrote
//! which commit is in the log. Creating a table is still behind the kernel's unstable
//! `internal-api` feature in 0.30, so version 0 (protocol reader 1 / writer 2 and the schema, no
//! files) is written here, put-if-absent through the kernel's storage handler. Every 10th
//! version the kernel writes a checkpoint (its public `Snapshot::checkpoint`), so the log a reader
//! replays stays short however long `collect` runs. The kernel reads every commit back in the
//! tests, and so does Python's `deltalake`.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, BinaryArray, Float64Array, Int64Array, RecordBatch, StringArray,
    TimestampMicrosecondArray,
};
use arrow::datatypes::{DataType, Field, Schema, TimeUnit, TimestampMicrosecondType};
use delta_kernel::committer::FileSystemCommitter;
use delta_kernel::engine::arrow_data::ArrowEngineData;
use delta_kernel::object_store::DynObjectStore;
use delta_kernel::object_store::local::LocalFileSystem;
use delta_kernel::snapshot::Snapshot;
use delta_kernel::transaction::{CommitResult, UpdateTableOperation};
use delta_kernel::{Engine as _, KernelError};
use delta_kernel_default_engine::executor::TaskExecutor;
use delta_kernel_default_engine::executor::tokio::TokioMultiThreadExecutor;
use delta_kernel_default_engine::{DefaultEngine, DefaultEngineBuilder};
use serde_json::json;
use url::Url;

use super::delta::{LABELS_TABLE, LABELS_TABLE_KEY, scan_snapshot};
use super::{DataError, io_err, location};

/// One row of a capture table.
#[derive(Debug, Clone, PartialEq)]
pub struct CaptureRow {
    pub content: Vec<u8>,
    /// `<device>/<capture-id>`: the row's identity (a capture delivered twice is stored once).
    pub path: String,
    pub device: String,
    pub model: String,
    pub version: i64,
    pub predicted: String,
    pub score: f64,
    pub reason: String,
    /// Microseconds since the epoch, UTC.
    pub captured_at: i64,
    pub label: Option<String>,
}

/// A table's columns, in order: (name, Delta type, nullable).
type Columns = [(&'static str, &'static str, bool)];

/// The capture table's columns.
const COLUMNS: [(&str, &str, bool); 10] = [
    ("content", "binary", false),
    ("path", "string", false),
    ("device", "string", false),
    ("model", "string", false),
    ("version", "long", false),
    ("predicted", "string", false),
    ("score", "double", false),
    ("reason", "string", false),
    ("captured_at", "timestamp", false),
    ("label", "string", true),
];

fn arrow_type(delta: &str) -> DataType {
    match delta {
        "binary" => DataType::Binary,
        "string" => DataType::Utf8,
        "long" => DataType::Int64,
        "double" => DataType::Float64,
        _ => DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
    }
}

/// The labels table's columns: the capture row's `path`, its label and when it was given.
const LABEL_COLUMNS: [(&str, &str, bool); 3] = [
    ("path", "string", false),
    ("label", "string", false),
    ("labelled_at", "timestamp", false),
];

/// What one of Kestrel's tables holds.
struct Kind {
    what: &'static str,
    columns: &'static Columns,
    /// Version 0's `configuration`.
    configuration: fn() -> serde_json::Value,
}

const CAPTURES: Kind = Kind {
    what: "capture table",
    columns: &COLUMNS,
    configuration: || json!({ LABELS_TABLE_KEY: LABELS_TABLE }),
};

const LABELS: Kind = Kind {
    what: "labels table",
    columns: &LABEL_COLUMNS,
    configuration: || json!({}),
};

/// The capture table's Arrow schema.
fn schema() -> Arc<Schema> {
    arrow_schema(&COLUMNS)
}

fn arrow_schema(columns: &Columns) -> Arc<Schema> {
    Arc::new(Schema::new(
        columns
            .iter()
            .map(|(n, t, null)| Field::new(*n, arrow_type(t), *null))
            .collect::<Vec<_>>(),
    ))
}

fn delta_schema_string(columns: &Columns) -> String {
    let fields: Vec<_> = columns
        .iter()
        .map(|(n, t, nullable)| json!({"name": n, "type": t, "nullable": nullable, "metadata": {}}))
        .collect();
    json!({"type": "struct", "fields": fields}).to_string()
}

fn delta_err(dir: &Path, message: impl std::fmt::Display) -> DataError {
    DataError::Delta {
        path: dir.to_path_buf(),
        message: message.to_string(),
    }
}

fn to_batch(rows: &[CaptureRow]) -> RecordBatch {
    let s = |f: fn(&CaptureRow) -> &str| -> ArrayRef {
        Arc::new(StringArray::from_iter_values(rows.iter().map(f)))
    };
    let columns: Vec<ArrayRef> = vec![
        Arc::new(BinaryArray::from_iter_values(
            rows.iter().map(|r| &r.content),
        )),
        s(|r| &r.path),
        s(|r| &r.device),
        s(|r| &r.model),
        Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.version))),
        s(|r| &r.predicted),
        Arc::new(Float64Array::from_iter_values(rows.iter().map(|r| r.score))),
        s(|r| &r.reason),
        Arc::new(
            TimestampMicrosecondArray::from_iter_values(rows.iter().map(|r| r.captured_at))
                .with_timezone("UTC"),
        ),
        Arc::new(
            rows.iter()
                .map(|r| r.label.as_deref())
                .collect::<StringArray>(),
        ),
    ];
    RecordBatch::try_new(schema(), columns).expect("columns match the schema")
}

/// The live rows of the capture table at `dir` (a path or object URL; none if it does not exist
/// yet), each with its label from the labels table where it has one, and the table's version.
pub fn read(dir: &Path) -> Result<(Vec<CaptureRow>, Option<u64>), DataError> {
    let t = Table::open(dir, &CAPTURES)?;
    let Some(snapshot) = t.snapshot()? else {
        return Ok((Vec::new(), None));
    };
    let version = snapshot.version();
    let labels = super::delta::labels_of(&snapshot, &t.url, t.engine.clone(), &t.origin, None)?;
    let mut rows = Vec::new();
    scan_snapshot(snapshot, t.engine.clone(), &t.origin, None, |batch| {
        rows.extend(from_batch(&batch).map_err(|e| t.err(e))?);
        Ok(())
    })?;
    if let Some(labels) = labels {
        for r in &mut rows {
            if let Some(l) = labels.by_path.get(&r.path) {
                r.label = Some(l.clone());
            }
        }
    }
    Ok((rows, Some(version)))
}

/// Replaces the labels of the capture table at `dir` with `labels` (path → label): one commit
/// of its labels table, which is created on first use. The capture table is not written.
/// Returns the labels table's new version.
pub fn write_labels(dir: &Path, labels: &BTreeMap<String, String>) -> Result<u64, DataError> {
    let captures = Table::open(dir, &CAPTURES)?;
    let snapshot = captures
        .snapshot()?
        .ok_or_else(|| captures.err("no capture table there (trainer collect creates it)"))?;
    let name = super::delta::labels_name(&snapshot).map_err(|e| captures.err(e))?;
    let sub = PathBuf::from(format!(
        "{}/{name}",
        dir.display().to_string().trim_end_matches('/'),
    ));
    let at = chrono::Utc::now().timestamp_micros();
    let columns: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from_iter_values(labels.keys())),
        Arc::new(StringArray::from_iter_values(labels.values())),
        Arc::new(
            TimestampMicrosecondArray::from_iter_values(labels.iter().map(|_| at))
                .with_timezone("UTC"),
        ),
    ];
    let batch = RecordBatch::try_new(arrow_schema(&LABEL_COLUMNS), columns)
        .expect("columns match the schema");
    Table::open(&sub, &LABELS)?.write(batch, true, None)
}

/// The `path` of every live row of the capture table at `dir` (the identities `collect`
/// de-duplicates by; the image bytes are not read) and its version.
pub fn read_paths(dir: &Path) -> Result<(HashSet<String>, Option<u64>), DataError> {
    let t = Table::open(dir, &CAPTURES)?;
    let Some(snapshot) = t.snapshot()? else {
        return Ok((HashSet::new(), None));
    };
    let version = snapshot.version();
    let mut paths = HashSet::new();
    scan_snapshot(
        snapshot,
        t.engine.clone(),
        &t.origin,
        Some(&["path"]),
        |batch| {
            let column = arrow::compute::cast(batch.column(0), &DataType::Utf8)
                .map_err(|e| t.err(format!("path: {e}")))?;
            paths.extend(column.as_string::<i32>().iter().flatten().map(String::from));
            Ok(())
        },
    )?;
    Ok((paths, Some(version)))
}

fn from_batch(b: &RecordBatch) -> Result<Vec<CaptureRow>, String> {
    let col = |n: &str| b.column_by_name(n).expect("checked").clone();
    let cast =
        |n: &str, t: &DataType| arrow::compute::cast(&col(n), t).map_err(|e| format!("{n}: {e}"));
    let utf8: Vec<ArrayRef> = ["path", "device", "model", "predicted", "reason", "label"]
        .iter()
        .map(|n| cast(n, &DataType::Utf8))
        .collect::<Result<_, _>>()?;
    let s = |i: usize| utf8[i].as_string::<i32>();
    let content = cast("content", &DataType::Binary)?;
    let version = cast("version", &DataType::Int64)?;
    let score = cast("score", &DataType::Float64)?;
    let at = cast("captured_at", &arrow_type("timestamp"))?;
    let (content, version) = (
        content.as_binary::<i32>(),
        version.as_primitive::<arrow::datatypes::Int64Type>(),
    );
    let score = score.as_primitive::<arrow::datatypes::Float64Type>();
    let at = at.as_primitive::<TimestampMicrosecondType>();
    Ok((0..b.num_rows())
        .map(|i| CaptureRow {
            content: content.value(i).to_vec(),
            path: s(0).value(i).to_string(),
            device: s(1).value(i).to_string(),
            model: s(2).value(i).to_string(),
            version: version.value(i),
            predicted: s(3).value(i).to_string(),
            score: score.value(i),
            reason: s(4).value(i).to_string(),
            captured_at: at.value(i),
            label: (!s(5).is_null(i)).then(|| s(5).value(i).to_string()),
        })
        .collect())
}

const ENGINE_INFO: &str = concat!("kestrel-trainer/", env!("CARGO_PKG_VERSION"));

/// Commits between checkpoints (Delta's default `delta.checkpointInterval`).
pub const CHECKPOINT_INTERVAL: u64 = 10;

/// One of Kestrel's tables: its kind, its place and the kernel engine that reads and writes it.
struct Table {
    kind: &'static Kind,
    /// The table's directory URL (ending in `/`).
    url: Url,
    /// How messages name it: the path or URL as given.
    origin: PathBuf,
    /// Runs the engine's writes (the checkpoint writer waits on tasks it spawns, which the
    /// kernel's single-threaded default executor never finished).
    exec: Arc<TokioMultiThreadExecutor>,
    engine: Arc<DefaultEngine<TokioMultiThreadExecutor>>,
}

impl Table {
    fn open(dir: &Path, kind: &'static Kind) -> Result<Table, DataError> {
        let err = |e: &dyn std::fmt::Display| delta_err(dir, e);
        let (url, store): (Url, Arc<DynObjectStore>) = match location::object_url(dir) {
            Some(mut url) => {
                if !url.path().ends_with('/') {
                    url.set_path(&format!("{}/", url.path()));
                }
                let store = location::object_store(&url)?;
                (url, store)
            }
            None => {
                let abs = std::path::absolute(dir).map_err(io_err(dir))?;
                let url = Url::from_directory_path(&abs)
                    .map_err(|()| err(&"not an absolute directory path"))?;
                // fsync'd: a commit that returns is on disk (`trainer collect` tells the devices
                // their captures are stored only then, and they delete them).
                (url, Arc::new(LocalFileSystem::new().with_fsync(true)))
            }
        };
        let exec =
            TokioMultiThreadExecutor::new_owned_runtime(Some(2), None).map_err(|e| err(&e))?;
        let exec = Arc::new(exec);
        let engine = DefaultEngineBuilder::new(store)
            .with_task_executor(exec.clone())
            .build();
        Ok(Table {
            kind,
            url,
            origin: dir.to_path_buf(),
            exec,
            engine: Arc::new(engine),
        })
    }

    fn err(&self, e: impl std::fmt::Display) -> DataError {
        delta_err(&self.origin, e)
    }

    /// The latest snapshot, checked to be of the table's kind; `None` when there is no table yet
    /// (no commit in `_delta_log/`).
    fn snapshot(&self) -> Result<Option<Arc<Snapshot>>, DataError> {
        let first = self.url.join("_delta_log/").map_err(|e| self.err(e))?;
        let exists = match self.engine.storage_handler().list_from(&first) {
            Ok(mut files) => files.next().transpose().map_err(|e| self.err(e))?.is_some(),
            Err(KernelError::FileNotFound(_)) => false,
            Err(e) => return Err(self.err(e)),
        };
        if !exists {
            return Ok(None);
        }
        super::delta::check_log_sizes(self.engine.as_ref(), &self.url, &self.origin)?;
        let snapshot = Snapshot::builder_for(self.url.as_str())
            .build(self.engine.as_ref())
            .map_err(|e| self.err(e))?;
        let missing: Vec<&str> = (self.kind.columns)
            .iter()
            .map(|c| c.0)
            .filter(|c| !snapshot.schema().contains(c))
            .collect();
        if !missing.is_empty() {
            let message = format!(
                "not a {}: no column(s) {}",
                self.kind.what,
                missing.join(", ")
            );
            return Err(self.err(message));
        }
        Ok(Some(snapshot))
    }

    /// Writes version 0: the protocol and the schema, no files (put-if-absent: a table another
    /// writer created meanwhile is kept).
    fn create(&self) -> Result<(), DataError> {
        let mut text = json!({"commitInfo": {
            "timestamp": now_ms(),
            "operation": "CREATE TABLE",
            "engineInfo": ENGINE_INFO,
        }})
        .to_string();
        for a in create_actions(self.kind) {
            text.push('\n');
            text.push_str(&a.to_string());
        }
        text.push('\n');
        let url =
            (self.url.join(&format!("_delta_log/{:020}.json", 0))).map_err(|e| self.err(e))?;
        match self.engine.storage_handler().put(&url, text.into(), false) {
            Ok(()) | Err(KernelError::FileAlreadyExists(_)) => Ok(()),
            Err(e) => Err(self.err(e)),
        }
    }

    /// Commits `batch` (rows of the table's kind) as one new data file (after removing every
    /// live file when `replace`), creating the table first when there is none; `app` adds a
    /// transaction id (its next sequence number). Returns the new version.
    fn write(
        &self,
        batch: RecordBatch,
        replace: bool,
        app: Option<&str>,
    ) -> Result<u64, DataError> {
        let snapshot = match self.snapshot()? {
            Some(s) => s,
            None => {
                self.create()?;
                self.snapshot()?
                    .ok_or_else(|| self.err("no table after creating it"))?
            }
        };
        let kernel = |e: KernelError| self.err(e);
        let engine = self.engine.as_ref();
        let mut builder =
            snapshot
                .clone()
                .update_table(UpdateTableOperation::Write, ENGINE_INFO, true);
        if !replace {
            builder = builder.with_blind_append();
        }
        if let Some(app) = app {
            let last = snapshot.get_app_id_version(app, engine).map_err(kernel)?;
            builder = builder.with_transaction_id(app, last.map_or(0, |v| v + 1));
        }
        let committer = Box::new(FileSystemCommitter::new());
        let mut txn = builder.build(engine, committer).map_err(kernel)?;
        if replace {
            let scan = snapshot.clone().scan_builder().build().map_err(kernel)?;
            for meta in scan.scan_metadata(engine).map_err(kernel)? {
                txn.remove_files(meta.map_err(kernel)?.scan_files);
            }
        }
        let wc = txn
            .write_state()
            .and_then(|w| w.write_context_builder().build())
            .map_err(kernel)?;
        let data = ArrowEngineData::new(batch);
        let writer = self.engine.clone();
        let adds = self
            .exec
            .block_on(async move { writer.write_parquet(&data, &wc).await })
            .map_err(kernel)?;
        txn.add_files(adds);
        match txn.commit(engine).map_err(kernel)? {
            CommitResult::Committed(c) => {
                let version = c.commit_version();
                self.checkpoint_if_due(version);
                Ok(version)
            }
            CommitResult::Conflicted(c) => Err(self.err(format!(
                "version {} was committed by another writer meanwhile; run again",
                c.conflict_version()
            ))),
            CommitResult::Retryable(_) => {
                Err(self.err("the commit failed on an I/O error; run again"))
            }
        }
    }

    /// Every [`CHECKPOINT_INTERVAL`] versions, a checkpoint of the table written by the kernel
    /// (`<version>.checkpoint.parquet` and `_last_checkpoint`), so reading replays at most that
    /// many JSON commits. The commit stands whether or not it succeeds: a failure is logged.
    fn checkpoint_if_due(&self, version: u64) {
        if version == 0 || version % CHECKPOINT_INTERVAL != 0 {
            return;
        }
        let written = self.snapshot().and_then(|s| {
            let s = s.ok_or_else(|| self.err("no table"))?;
            s.checkpoint(self.engine.as_ref(), None)
                .map_err(|e| self.err(e))
        });
        if let Err(e) = written {
            tracing::warn!(
                "checkpoint of version {version} not written: {}",
                kestrel_shared::Chain(&e)
            );
        }
    }

    /// The table's live data files (relative paths, as the log names them).
    #[cfg(test)]
    fn live_files(&self) -> Result<Vec<String>, DataError> {
        use delta_kernel::scan::state::ScanFile;
        let Some(snapshot) = self.snapshot()? else {
            return Ok(Vec::new());
        };
        let kernel = |e: KernelError| self.err(e);
        let scan = snapshot.scan_builder().build().map_err(kernel)?;
        let mut files = Vec::new();
        for meta in scan.scan_metadata(self.engine.as_ref()).map_err(kernel)? {
            files = meta
                .map_err(kernel)?
                .visit_scan_files(files, |f: &mut Vec<String>, s: ScanFile| f.push(s.path))
                .map_err(kernel)?;
        }
        Ok(files)
    }
}

/// Appends rows to the capture table at `dir` (a path or object URL), creating it when there is
/// none; `app` (the collector's id) records a transaction id. Returns the new version.
pub fn append(dir: &Path, rows: &[CaptureRow], app: Option<&str>) -> Result<u64, DataError> {
    Table::open(dir, &CAPTURES)?.write(to_batch(rows), false, app)
}

fn create_actions(kind: &Kind) -> Vec<serde_json::Value> {
    vec![
        json!({"protocol": {"minReaderVersion": 1, "minWriterVersion": 2}}),
        json!({"metaData": {
            "id": uuid(),
            "format": {"provider": "parquet", "options": {}},
            "schemaString": delta_schema_string(kind.columns),
            "partitionColumns": [],
            "configuration": (kind.configuration)(),
            "createdTime": now_ms(),
        }}),
    ]
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// A random (version 4) UUID.
fn uuid() -> String {
    let b: [u8; 16] = rand::random();
    let h = hex::encode(b);
    let v = format!("4{}", &h[13..16]);
    let var = ["8", "9", "a", "b"][(b[8] & 3) as usize];
    format!(
        "{}-{}-{v}-{var}{}-{}",
        &h[..8],
        &h[8..12],
        &h[17..20],
        &h[20..32]
    )
}

#[cfg(test)]
mod tests;
