//! Capture tables: Delta tables that `trainer collect` appends to and `trainer label` rewrites,
//! read like any other table (`--data`, through delta-kernel-rs).
//!
//! The commits are written here, not through the kernel: delta_kernel 0.30 offers creating a
//! table only behind its unstable `internal-api` feature, and these writes are the protocol's
//! two simplest commits (an append: `add` actions; a rewrite: `remove` of every live file and one
//! `add`), a few JSON lines each (protocol reader 1 / writer 2, no table features), each file with
//! its column statistics. Every 10th version the kernel writes a checkpoint (its public
//! `Snapshot::checkpoint`), so the log a reader replays stays short however long `collect` runs. Data files
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
use delta_kernel_default_engine::executor::tokio::TokioMultiThreadExecutor;
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
    checkpoint_if_due(dir, version);
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
    checkpoint_if_due(dir, current + 1);
    Ok(current + 1)
}

/// Commits between checkpoints (Delta's default `delta.checkpointInterval`).
pub const CHECKPOINT_INTERVAL: u64 = 10;

/// Every [`CHECKPOINT_INTERVAL`] versions, a checkpoint of the table written by the kernel
/// (`<version>.checkpoint.parquet` and `_last_checkpoint`), so reading replays at most that many
/// JSON commits. The commit stands whether or not it succeeds: a failure is logged.
fn checkpoint_if_due(dir: &Path, version: u64) {
    if version == 0 || version % CHECKPOINT_INTERVAL != 0 {
        return;
    }
    // The checkpoint writer waits on tasks it spawns: the kernel asks for the multi-threaded
    // executor (with the default one, the write never finished).
    let written = TokioMultiThreadExecutor::new_owned_runtime(Some(2), None)
        .map_err(|e| delta_err(dir, e))
        .and_then(|exec| {
            let engine = DefaultEngineBuilder::new(Arc::new(LocalFileSystem::new()))
                .with_task_executor(Arc::new(exec))
                .build();
            let (s, _) = snapshot(dir)?;
            s.checkpoint(&engine, None).map_err(|e| delta_err(dir, e))
        });
    if let Err(e) = written {
        tracing::warn!("checkpoint of version {version} not written: {e}");
    }
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
        "stats": stats(rows).to_string(),
    }}))
}

/// A data file's statistics as Delta records them: row count, and per column (not the image
/// bytes) the minimum, maximum and null count, so readers can skip files (`device = 'cam-1'`,
/// `captured_at > T`). Timestamps are kept to milliseconds as Spark writes them: the minimum
/// rounded down, the maximum up, so the bounds still hold.
fn stats(rows: &[CaptureRow]) -> serde_json::Value {
    use serde_json::{Map, Value};
    let (mut min, mut max, mut nulls) = (Map::new(), Map::new(), Map::new());
    let mut bound = |name: &str, values: Vec<Value>| {
        let lo = values.iter().min_by(|a, b| cmp(a, b)).cloned();
        let hi = values.iter().max_by(|a, b| cmp(a, b)).cloned();
        nulls.insert(name.into(), json!(rows.len() - values.len()));
        if let (Some(lo), Some(hi)) = (lo, hi) {
            min.insert(name.into(), lo);
            max.insert(name.into(), hi);
        }
    };
    let strings = |f: fn(&CaptureRow) -> Option<&str>| -> Vec<Value> {
        rows.iter().filter_map(f).map(|v| json!(v)).collect()
    };
    bound("path", strings(|r| Some(&r.path)));
    bound("device", strings(|r| Some(&r.device)));
    bound("model", strings(|r| Some(&r.model)));
    bound("version", rows.iter().map(|r| json!(r.version)).collect());
    bound("predicted", strings(|r| Some(&r.predicted)));
    bound("score", rows.iter().map(|r| json!(r.score)).collect());
    bound("reason", strings(|r| Some(&r.reason)));
    bound("label", strings(|r| r.label.as_deref()));
    let ms = |us: i64, up: bool| {
        let ms = us.div_euclid(1000) + i64::from(up && us.rem_euclid(1000) != 0);
        chrono::DateTime::from_timestamp_millis(ms)
            .map(|t| json!(t.format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string()))
    };
    let at = rows.iter().map(|r| r.captured_at);
    if let (Some(lo), Some(hi)) = (at.clone().min(), at.max()) {
        min.extend(ms(lo, false).map(|v| ("captured_at".to_string(), v)));
        max.extend(ms(hi, true).map(|v| ("captured_at".to_string(), v)));
    }
    nulls.insert("captured_at".into(), json!(0));
    json!({"numRecords": rows.len(), "minValues": min, "maxValues": max, "nullCount": nulls})
}

/// Orders JSON numbers by value and strings by their bytes (as Delta compares them).
fn cmp(a: &serde_json::Value, b: &serde_json::Value) -> std::cmp::Ordering {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x.total_cmp(&y),
        _ => a.as_str().cmp(&b.as_str()),
    }
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

    /// 200 appends (a long `collect`): a checkpoint every 10 versions (the kernel's), every row
    /// read back from the last one and the commits after it, and files carry min/max/null
    /// statistics. The read after 200 commits replays what the read after 10 does (a checkpoint
    /// and at most 9 JSON commits): the older commits can go and it still reads every row.
    #[test]
    fn long_collects_are_checkpointed_and_files_carry_statistics() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("captures");
        let log = t.join("_delta_log");
        // Log replay (snapshot and live files) timed apart from reading the rows, whose cost
        // grows with the rows, not the log (shown with --no-capture; not asserted).
        let timed_read = |commits: usize| {
            let start = std::time::Instant::now();
            assert_eq!(live_files(&t).unwrap().len(), commits);
            let replay = start.elapsed();
            let (rows, v) = read(&t).unwrap();
            assert_eq!((rows.len(), v), (2 * commits, Some(commits as u64 - 1)));
            eprintln!(
                "after {commits} commits: log replay {replay:?}, read with rows {:?}",
                start.elapsed() - replay
            );
        };
        for i in 0..200 {
            let mut r = row(&format!("cam-1/{i:03}"), (i % 2 == 0).then_some("cat"));
            r.captured_at += i * 1_500;
            append(&t, &[r, row(&format!("cam-2/{i:03}"), None)]).unwrap();
            if i == 10 {
                timed_read(11);
            }
        }
        for v in (10..200).step_by(10) {
            let checkpoint = log.join(format!("{v:020}.checkpoint.parquet"));
            assert!(checkpoint.is_file(), "{v}");
        }
        let last = std::fs::read_to_string(log.join("_last_checkpoint")).unwrap();
        assert!(last.contains("\"version\":190"), "{last}");
        timed_read(200);
        // The commits before the last checkpoint are no longer needed to read the table.
        for v in 0..190 {
            std::fs::remove_file(log.join(format!("{v:020}.json"))).unwrap();
        }
        let (rows, _) = read(&t).unwrap();
        assert_eq!(rows.len(), 400);
        assert_eq!(
            rows.iter().filter(|r| r.label.is_some()).count(),
            100,
            "labels kept through the checkpoints"
        );
        let commit = std::fs::read_to_string(log.join(format!("{:020}.json", 198))).unwrap();
        let add: serde_json::Value = commit
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .find(|a| a.get("add").is_some())
            .unwrap();
        let st: serde_json::Value =
            serde_json::from_str(add["add"]["stats"].as_str().unwrap()).unwrap();
        assert_eq!(st["numRecords"], 2);
        assert_eq!(st["minValues"]["path"], "cam-1/198");
        assert_eq!(st["maxValues"]["path"], "cam-2/198");
        assert_eq!(st["nullCount"]["label"], 1);
        assert_eq!(st["minValues"]["captured_at"], "2025-12-02T00:00:00.000Z");
        assert_eq!(st["maxValues"]["captured_at"], "2025-12-02T00:00:00.297Z");
    }
}
