//! Delta Lake tables: a directory with `_delta_log/` is read through delta-kernel-rs (the Delta
//! project's Rust kernel, with its default Arrow engine) rather than as a Parquet directory, whose
//! files still include the rows that overwrites, deletes and updates removed (until VACUUM).
//!
//! The kernel replays the log (checkpoints included), applies deletion vectors, fills partition
//! columns from the log and maps column names (column mapping); a table needing a reader feature
//! it does not support fails with the kernel's error, which names the feature. Time travel:
//! `--data-version N`, or `--data-timestamp T` for the last version committed at or before T (as
//! Spark's `timestampAsOf`).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use delta_kernel::arrow::array::{AsArray, RecordBatch};
use delta_kernel::arrow::compute::cast;
use delta_kernel::arrow::datatypes::DataType;
use delta_kernel::engine::arrow_data::ArrowEngineData;
use delta_kernel::history_manager;
use delta_kernel::snapshot::Snapshot;

use super::columns::Roles;
use super::location::Location;
use super::spool::Rows;
use super::{DataError, SourceOpts, TableRef};

/// A read Delta table: its rows and the snapshot's version.
pub(super) struct DeltaRows {
    pub rows: Rows,
    /// Rows left out for having no label (`--skip-unlabelled`).
    pub unlabelled: usize,
    pub version: u64,
    /// The labels table the labels came from, if the table names one.
    pub labels: Option<TableRef>,
}

/// A capture table's labels, read from its labels table (see [`super::delta_write`]).
pub(super) struct Labels {
    pub by_path: HashMap<String, String>,
    /// How messages name the labels table (the table's path or URL and the directory).
    pub origin: std::path::PathBuf,
    /// Its version read.
    pub version: u64,
}

/// The capture table's property naming its labels table (a directory name inside the table:
/// Delta readers see only the files its log names, and VACUUM skips names starting with `_`).
pub const LABELS_TABLE_KEY: &str = "kestrel.labelsTable";

/// The labels table's directory inside a capture table (also where it is looked for in a table
/// without the property, such as one written by Spark).
pub const LABELS_TABLE: &str = "_labels";

/// Checks a labels table's name from a table property: one directory inside the table.
pub(super) fn labels_dir(name: &str) -> Result<&str, String> {
    let ok = !name.is_empty()
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b));
    match ok {
        true => Ok(name),
        false => Err(format!(
            "labels table `{name}` (property `{}`) is not a directory name inside the table",
            LABELS_TABLE_KEY
        )),
    }
}

/// The name of the labels table of the table `snapshot`: its `kestrel.labelsTable` property,
/// else `_labels` (for capture tables written by others), checked to be a directory name.
pub(super) fn labels_name(snapshot: &Snapshot) -> Result<&str, String> {
    let key = LABELS_TABLE_KEY;
    let name = snapshot.table_properties().unknown_properties.get(key);
    labels_dir(name.map_or(LABELS_TABLE, String::as_str))
}

/// The labels of the table `snapshot` (at `url`) from its labels table ([`labels_name`]),
/// `None` when it has none; with `as_of` (milliseconds since the epoch), the labels table's last
/// version at or before it (`None` when it had none yet).
pub(super) fn labels_of(
    snapshot: &Snapshot,
    url: &url::Url,
    engine: Arc<dyn delta_kernel::Engine>,
    origin: &Path,
    as_of: Option<i64>,
) -> Result<Option<Labels>, DataError> {
    let err = |message: String| DataError::Delta {
        path: origin.to_path_buf(),
        message,
    };
    let name = labels_name(snapshot).map_err(err)?;
    let url = url
        .join(&format!("{name}/"))
        .map_err(|e| err(format!("labels table {name}: {e}")))?;
    let labels_origin = origin.join(name);
    let kernel = |e: delta_kernel::KernelError| err(format!("labels table {name}: {e}"));
    // No labels given yet: no labels table.
    let log = url.join("_delta_log/").map_err(|e| err(e.to_string()))?;
    match engine.storage_handler().list_from(&log) {
        Ok(mut files) => {
            if files.next().transpose().map_err(kernel)?.is_none() {
                return Ok(None);
            }
        }
        Err(delta_kernel::KernelError::FileNotFound(_)) => return Ok(None),
        Err(e) => return Err(kernel(e)),
    }
    check_log_sizes(engine.as_ref(), &url, &labels_origin)?;
    let latest = Snapshot::builder_for(url.as_str())
        .build(engine.as_ref())
        .map_err(kernel)?;
    let snapshot = match as_of {
        None => latest,
        Some(ms) => {
            use delta_kernel::history_manager::error::LogHistoryError;
            let kind = history_manager::HistoryCommitType::Recreatable;
            match history_manager::latest_version_as_of(&latest, engine.as_ref(), ms, kind) {
                Ok(at) if at.version == latest.version() => latest,
                Ok(at) => Snapshot::builder_for(url.as_str())
                    .at_version(at.version)
                    .build(engine.as_ref())
                    .map_err(kernel)?,
                // Labelled only after that time.
                Err(delta_kernel::KernelError::LogHistory(e))
                    if matches!(*e, LogHistoryError::TimestampOutOfRange { .. }) =>
                {
                    return Ok(None);
                }
                Err(e) => return Err(kernel(e)),
            }
        }
    };
    let version = snapshot.version();
    let mut by_path = HashMap::new();
    let columns = ["path", "label"];
    scan_snapshot(snapshot, engine, &labels_origin, Some(&columns), |batch| {
        let utf8 = |i: usize| {
            cast(batch.column(i), &DataType::Utf8)
                .map_err(|e| err(format!("labels table {name}: {}: {e}", columns[i])))
        };
        let (paths, labels) = (utf8(0)?, utf8(1)?);
        let (paths, labels) = (paths.as_string::<i32>(), labels.as_string::<i32>());
        for (p, l) in paths.iter().zip(labels.iter()) {
            if let (Some(p), Some(l)) = (p, l) {
                by_path.insert(p.to_string(), l.to_string());
            }
        }
        Ok(())
    })?;
    Ok(Some(Labels {
        by_path,
        origin: labels_origin,
        version,
    }))
}

/// The most bytes of a JSON file in a Delta log (a commit, `_last_checkpoint`, a CRC file): the
/// kernel reads each whole, and commits of tables with many thousands of files stay in the tens of
/// MiB.
pub(super) const MAX_LOG_JSON_BYTES: u64 = 256 << 20;
/// The most bytes of any other file in a Delta log (Parquet checkpoints and their sidecars).
pub(super) const MAX_LOG_FILE_BYTES: u64 = 1 << 30;

/// Refuses the table at `table` when a file of its `_delta_log/` is over the caps above, before
/// the kernel reads any of it; errors name the file.
pub(super) fn check_log_sizes(
    engine: &dyn delta_kernel::Engine,
    table: &url::Url,
    origin: &Path,
) -> Result<(), DataError> {
    let err = |message: String| DataError::Delta {
        path: origin.to_path_buf(),
        message,
    };
    let log = table.join("_delta_log/").map_err(|e| err(e.to_string()))?;
    let files = match engine.storage_handler().list_from(&log) {
        Ok(files) => files,
        Err(delta_kernel::KernelError::FileNotFound(_)) => return Ok(()),
        Err(e) => return Err(err(e.to_string())),
    };
    for meta in files {
        let meta = meta.map_err(|e| err(e.to_string()))?;
        let name = meta.location.path();
        let json = [".json", ".crc", "_last_checkpoint"]
            .iter()
            .any(|end| name.ends_with(end));
        let cap = if json {
            MAX_LOG_JSON_BYTES
        } else {
            MAX_LOG_FILE_BYTES
        };
        if meta.size > cap {
            return Err(err(format!(
                "log file {} is {} bytes, over the limit of {cap} for a Delta log file",
                meta.location, meta.size
            )));
        }
    }
    Ok(())
}

/// Parses `--data-timestamp`: RFC 3339 (`2026-12-01T06:00:00Z`), `YYYY-MM-DD HH:MM:SS` or
/// `YYYY-MM-DD` (both UTC). Returns milliseconds since the epoch.
pub fn parse_timestamp(s: &str) -> Result<i64, String> {
    use chrono::{DateTime, NaiveDate, NaiveDateTime};
    let s = s.trim();
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.timestamp_millis());
    }
    for f in ["%Y-%m-%d %H:%M:%S%.f", "%Y-%m-%dT%H:%M:%S%.f"] {
        if let Ok(t) = NaiveDateTime::parse_from_str(s, f) {
            return Ok(t.and_utc().timestamp_millis());
        }
    }
    if let Ok(d) = NaiveDate::parse_from_str(s, "%Y-%m-%d") {
        return Ok(d
            .and_hms_opt(0, 0, 0)
            .expect("midnight")
            .and_utc()
            .timestamp_millis());
    }
    Err(format!(
        "`{s}` is not a timestamp (expected RFC 3339 such as 2026-12-01T06:00:00Z, or \
         YYYY-MM-DD [HH:MM:SS] in UTC)"
    ))
}

/// Reads the rows of the Delta table at `loc`: the current snapshot, or the one `opts` names,
/// with the labels of its labels table where it has one: the latest, or those as of
/// `--data-timestamp` (`--data-version` names a version of the table itself, not of its labels:
/// the labels known now are used for the images it held then).
pub(super) fn read(loc: &Location, opts: &SourceOpts) -> Result<DeltaRows, DataError> {
    let dir = loc.origin.as_path();
    let snapshot = snapshot(loc, opts)?;
    let version = snapshot.version();
    let as_of = opts
        .data_timestamp
        .as_deref()
        .map(parse_timestamp)
        .transpose();
    let as_of = as_of.map_err(|message| DataError::Delta {
        path: loc.origin.clone(),
        message,
    })?;
    let labels = labels_of(&snapshot, &loc.url, loc.engine.clone(), dir, as_of)?;
    let columns = [&opts.content_column, &opts.label_column, &opts.path_column];
    let schema = snapshot.schema();
    let table_columns: Vec<String> = schema.fields().map(|f| f.name().clone()).collect();
    let wanted: Vec<&str> = columns
        .into_iter()
        .map(String::as_str)
        .filter(|c| schema.contains(c))
        .collect();
    let mut rows = Rows::new()?;
    let (mut row, mut unlabelled) = (0, 0);
    let mut roles: Option<Roles> = None;
    let by_path = labels.as_ref().map(|l| &l.by_path);
    scan_snapshot(snapshot, loc.engine.clone(), dir, Some(&wanted), |batch| {
        if roles.is_none() {
            let r = Roles::resolve(&batch.schema(), &[], opts, dir)?;
            roles = Some(match by_path {
                Some(by_path) => r.with_labels(by_path, opts, dir)?,
                None => r,
            });
        }
        let r = roles.as_ref().expect("resolved");
        r.batch_rows(&batch, opts, dir, &mut row, &mut rows, &mut unlabelled)
    })
    .map_err(|e| match e {
        // The batches hold the wanted columns only: name every column of the table instead.
        DataError::MissingColumn {
            file, role, column, ..
        } => DataError::MissingColumn {
            file,
            role,
            column,
            found: table_columns.clone(),
        },
        DataError::MissingContentColumn { file, column, .. } => DataError::MissingContentColumn {
            file,
            column,
            found: table_columns.clone(),
        },
        e => e,
    })?;
    Ok(DeltaRows {
        rows,
        unlabelled,
        version,
        labels: labels.map(|l| TableRef {
            location: l.origin.display().to_string(),
            format: "delta",
            version: Some(l.version),
        }),
    })
}

/// Calls `f` with each record batch of the table's rows (those of `columns` the table has, by
/// their logical names), after deletion vectors; returns the snapshot's version. `table_columns`
/// receives the names of all the table's columns first.
#[cfg(test)]
pub(in crate::data) fn scan(
    loc: &Location,
    opts: &SourceOpts,
    columns: &[&str],
    table_columns: &mut Vec<String>,
    f: impl FnMut(RecordBatch) -> Result<(), DataError>,
) -> Result<u64, DataError> {
    let snapshot = snapshot(loc, opts)?;
    let schema = snapshot.schema();
    *table_columns = schema.fields().map(|f| f.name().clone()).collect();
    let wanted: Vec<&str> = columns
        .iter()
        .copied()
        .filter(|c| schema.contains(c))
        .collect();
    let version = snapshot.version();
    scan_snapshot(snapshot, loc.engine.clone(), &loc.origin, Some(&wanted), f)?;
    Ok(version)
}

/// Calls `f` with each record batch of `snapshot`'s rows (after deletion vectors), projected to
/// `columns` (all of them when `None`); kernel errors name `origin`.
pub(super) fn scan_snapshot(
    snapshot: Arc<Snapshot>,
    engine: Arc<dyn delta_kernel::Engine>,
    origin: &std::path::Path,
    columns: Option<&[&str]>,
    mut f: impl FnMut(RecordBatch) -> Result<(), DataError>,
) -> Result<(), DataError> {
    let kernel = |e: delta_kernel::KernelError| DataError::Delta {
        path: origin.to_path_buf(),
        message: e.to_string(),
    };
    let mut builder = snapshot.clone().scan_builder();
    if let Some(columns) = columns {
        builder = builder.with_schema(snapshot.schema().project(columns).map_err(kernel)?);
    }
    let scan = builder.build().map_err(kernel)?;
    for data in scan.execute(engine).map_err(kernel)? {
        let batch = ArrowEngineData::try_from_engine_data(data.map_err(kernel)?).map_err(kernel)?;
        f(RecordBatch::from(*batch))?;
    }
    Ok(())
}

/// The snapshot `opts` names (`--data-version`, `--data-timestamp`), else the latest.
fn snapshot(loc: &Location, opts: &SourceOpts) -> Result<Arc<Snapshot>, DataError> {
    let err = |message: String| DataError::Delta {
        path: loc.origin.clone(),
        message,
    };
    let (url, engine) = (&loc.url, &loc.engine);
    check_log_sizes(engine.as_ref(), url, &loc.origin)?;
    let latest = Snapshot::builder_for(url.as_str())
        .build(engine.as_ref())
        .map_err(|e| err(e.to_string()))?;
    let version = match (opts.data_version, &opts.data_timestamp) {
        (Some(v), _) => Some(v),
        (None, Some(t)) => {
            let ms = parse_timestamp(t).map_err(err)?;
            let at = history_manager::latest_version_as_of(
                &latest,
                engine.as_ref(),
                ms,
                history_manager::HistoryCommitType::Recreatable,
            )
            .map_err(|e| err(format!("--data-timestamp {t}: {e}")))?;
            Some(at.version)
        }
        (None, None) => None,
    };
    Ok(match version {
        Some(v) if v != latest.version() => Snapshot::builder_for(url.as_str())
            .at_version(v)
            .build(engine.as_ref())
            .map_err(|e| err(format!("version {v}: {e}")))?,
        _ => latest,
    })
}
