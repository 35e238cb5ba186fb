//! Capture tables: Delta tables that `trainer collect` appends to and `trainer label` rewrites,
//! read like any other table (`--data`, through delta-kernel-rs).
//!
//! The commits are written here, not through the kernel: delta_kernel 0.30 offers creating a
//! table only behind its unstable `internal-api` feature, and these writes are the protocol's
//! two simplest commits (an append: `add` actions; a rewrite: `remove` of every live file and one
//! `add`), a few JSON lines each (protocol reader 1 / writer 2, no table features). Data files
//! are Parquet (snappy) written with arrow-rs. A commit is published with a hard link to
//! `_delta_log/<version>.json`, which fails if another writer took that version first (the
//! protocol's put-if-absent), so nothing is overwritten. The kernel reads every commit back in
//! the tests, and so does Python's `deltalake`.

use std::collections::HashSet;
use std::fs;
use std::path::Path;
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, BinaryArray, Float64Array, Int64Array, RecordBatch, StringArray,
    TimestampMicrosecondArray,
};
use arrow::datatypes::{DataType, Field, Schema, TimeUnit, TimestampMicrosecondType};
use delta_kernel::engine::arrow_data::ArrowEngineData;
use delta_kernel::object_store::local::LocalFileSystem;
use delta_kernel::scan::state::ScanFile;
use delta_kernel::snapshot::Snapshot;
use delta_kernel_default_engine::DefaultEngineBuilder;
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;
use serde_json::json;

use super::{DataError, io_err};

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

/// The columns, in order: (name, Arrow type, Delta type, nullable).
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

pub fn schema() -> Arc<Schema> {
    Arc::new(Schema::new(
        COLUMNS
            .iter()
            .map(|(n, t, null)| Field::new(*n, arrow_type(t), *null))
            .collect::<Vec<_>>(),
    ))
}

fn delta_schema_string() -> String {
    let fields: Vec<_> = COLUMNS
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

pub fn to_batch(rows: &[CaptureRow]) -> RecordBatch {
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

/// The live rows of the capture table at `dir` (none if it does not exist yet) and its version.
pub fn read(dir: &Path) -> Result<(Vec<CaptureRow>, Option<u64>), DataError> {
    if !dir.join("_delta_log").is_dir() {
        return Ok((Vec::new(), None));
    }
    let (snapshot, engine) = snapshot(dir)?;
    let missing: Vec<&str> = COLUMNS
        .iter()
        .map(|c| c.0)
        .filter(|c| !snapshot.schema().contains(c))
        .collect();
    if !missing.is_empty() {
        return Err(delta_err(
            dir,
            format!("not a capture table: no column(s) {}", missing.join(", ")),
        ));
    }
    let scan = snapshot
        .clone()
        .scan_builder()
        .build()
        .map_err(|e| delta_err(dir, e))?;
    let mut rows = Vec::new();
    for data in scan.execute(engine).map_err(|e| delta_err(dir, e))? {
        let batch: RecordBatch =
            ArrowEngineData::try_from_engine_data(data.map_err(|e| delta_err(dir, e))?)
                .map_err(|e| delta_err(dir, e))?
                .into();
        rows.extend(from_batch(&batch).map_err(|e| delta_err(dir, e))?);
    }
    Ok((rows, Some(snapshot.version())))
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

type Engine = Arc<dyn delta_kernel::Engine>;

fn snapshot(dir: &Path) -> Result<(Arc<Snapshot>, Engine), DataError> {
    let abs = dir.canonicalize().map_err(io_err(dir))?;
    let url = url::Url::from_directory_path(&abs)
        .map_err(|()| delta_err(dir, "not an absolute directory path"))?;
    let engine: Engine =
        Arc::new(DefaultEngineBuilder::new(Arc::new(LocalFileSystem::new())).build());
    let s = Snapshot::builder_for(url.as_str())
        .build(engine.as_ref())
        .map_err(|e| delta_err(dir, e))?;
    Ok((s, engine))
}

/// The table's live data files (relative paths, as the log names them).
fn live_files(dir: &Path) -> Result<Vec<String>, DataError> {
    let (snapshot, engine) = snapshot(dir)?;
    let scan = snapshot
        .scan_builder()
        .build()
        .map_err(|e| delta_err(dir, e))?;
    let mut files = Vec::new();
    for meta in scan
        .scan_metadata(engine.as_ref())
        .map_err(|e| delta_err(dir, e))?
    {
        let meta = meta.map_err(|e| delta_err(dir, e))?;
        files = meta
            .visit_scan_files(files, |f: &mut Vec<String>, s: ScanFile| f.push(s.path))
            .map_err(|e| delta_err(dir, e))?;
    }
    Ok(files)
}

/// Appends rows (creating the table when `dir` has none); returns the new version.
pub fn append(dir: &Path, rows: &[CaptureRow]) -> Result<u64, DataError> {
    let version = match read_version(dir)? {
        Some(v) => v + 1,
        None => 0,
    };
    let mut actions = Vec::new();
    if version == 0 {
        actions.extend(create_actions());
    }
    actions.push(write_part(dir, rows)?);
    commit(dir, version, "WRITE", actions)?;
    Ok(version)
}

/// Replaces every row with `rows` (one commit: every live file removed, one added).
pub fn replace(dir: &Path, rows: &[CaptureRow]) -> Result<u64, DataError> {
    let Some(current) = read_version(dir)? else {
        return append(dir, rows);
    };
    let now = now_ms();
    let mut actions: Vec<serde_json::Value> = live_files(dir)?
        .into_iter()
        .map(|path| json!({"remove": {"path": path, "deletionTimestamp": now, "dataChange": true}}))
        .collect();
    actions.push(write_part(dir, rows)?);
    commit(dir, current + 1, "WRITE", actions)?;
    Ok(current + 1)
}

fn read_version(dir: &Path) -> Result<Option<u64>, DataError> {
    if !dir.join("_delta_log").is_dir() {
        return Ok(None);
    }
    Ok(Some(snapshot(dir)?.0.version()))
}

fn create_actions() -> Vec<serde_json::Value> {
    vec![
        json!({"protocol": {"minReaderVersion": 1, "minWriterVersion": 2}}),
        json!({"metaData": {
            "id": uuid(),
            "format": {"provider": "parquet", "options": {}},
            "schemaString": delta_schema_string(),
            "partitionColumns": [],
            "configuration": {},
            "createdTime": now_ms(),
        }}),
    ]
}

/// Writes `rows` as a new Parquet data file; returns its `add` action.
fn write_part(dir: &Path, rows: &[CaptureRow]) -> Result<serde_json::Value, DataError> {
    fs::create_dir_all(dir).map_err(io_err(dir))?;
    let name = format!("part-00000-{}-c000.snappy.parquet", uuid());
    let path = dir.join(&name);
    let props = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .build();
    let mut buf = Vec::new();
    let mut w =
        ArrowWriter::try_new(&mut buf, schema(), Some(props)).map_err(|e| delta_err(dir, e))?;
    w.write(&to_batch(rows)).map_err(|e| delta_err(dir, e))?;
    w.close().map_err(|e| delta_err(dir, e))?;
    kestrel_shared::fsutil::write_atomic(&path, &buf).map_err(io_err(&path))?;
    Ok(json!({"add": {
        "path": name,
        "partitionValues": {},
        "size": buf.len(),
        "modificationTime": now_ms(),
        "dataChange": true,
        "stats": json!({"numRecords": rows.len()}).to_string(),
    }}))
}

/// Publishes `actions` as commit `version`, failing if that version exists already.
fn commit(
    dir: &Path,
    version: u64,
    operation: &str,
    actions: Vec<serde_json::Value>,
) -> Result<(), DataError> {
    let log = dir.join("_delta_log");
    fs::create_dir_all(&log).map_err(io_err(&log))?;
    let mut text = json!({"commitInfo": {
        "timestamp": now_ms(),
        "operation": operation,
        "engineInfo": concat!("kestrel-trainer/", env!("CARGO_PKG_VERSION")),
    }})
    .to_string();
    for a in actions {
        text.push('\n');
        text.push_str(&a.to_string());
    }
    text.push('\n');
    let target = log.join(format!("{version:020}.json"));
    let tmp = log.join(format!(".{version:020}.json.{}.tmp", std::process::id()));
    fs::write(&tmp, text).map_err(io_err(&tmp))?;
    let linked = fs::hard_link(&tmp, &target);
    let _ = fs::remove_file(&tmp);
    match linked {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err(delta_err(
            dir,
            format!("version {version} was committed by another writer meanwhile; run again"),
        )),
        Err(e) => Err(io_err(&target)(e)),
    }
}

/// The paths of the rows, for de-duplication.
pub fn paths(rows: &[CaptureRow]) -> HashSet<String> {
    rows.iter().map(|r| r.path.clone()).collect()
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
mod tests {
    use super::*;

    fn row(path: &str, label: Option<&str>) -> CaptureRow {
        CaptureRow {
            content: path.as_bytes().to_vec(),
            path: path.into(),
            device: "cam-1".into(),
            model: "m".into(),
            version: 2,
            predicted: "3".into(),
            score: 0.4,
            reason: "low-confidence".into(),
            captured_at: 1_764_633_600_000_000,
            label: label.map(String::from),
        }
    }

    #[test]
    fn appends_and_a_rewrite_read_back_through_the_kernel() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("captures");
        assert_eq!(read(&t).unwrap(), (vec![], None));
        assert_eq!(append(&t, &[row("a", None), row("b", None)]).unwrap(), 0);
        assert_eq!(append(&t, &[row("c", None)]).unwrap(), 1);
        let (rows, v) = read(&t).unwrap();
        assert_eq!((rows.len(), v), (3, Some(1)));
        let labelled: Vec<_> = rows
            .iter()
            .map(|r| CaptureRow {
                label: Some(format!("L{}", r.path)),
                ..r.clone()
            })
            .collect();
        assert_eq!(replace(&t, &labelled).unwrap(), 2);
        let (mut back, _) = read(&t).unwrap();
        let mut labelled = labelled;
        back.sort_by(|a, b| a.path.cmp(&b.path));
        labelled.sort_by(|a, b| a.path.cmp(&b.path));
        assert_eq!(back, labelled, "one live file: the rewrite");
        // The general table reader sees the same rows (labels and content).
        let ds = crate::data::load(&t, &Default::default()).unwrap();
        assert_eq!(ds.labels, ["La", "Lb", "Lc"]);
        assert_eq!(ds.samples.len(), 3);
        // Time travel still shows the unlabelled version.
        let (old, _) = (
            crate::data::load(
                &t,
                &crate::data::SourceOpts {
                    data_version: Some(1),
                    ..Default::default()
                },
            ),
            (),
        );
        assert!(
            old.unwrap_err().to_string().contains("null"),
            "version 1 has no labels"
        );
    }
}
