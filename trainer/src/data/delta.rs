//! Delta Lake tables: a directory with `_delta_log/` is read through delta-kernel-rs (the Delta
//! project's Rust kernel, with its default Arrow engine) rather than as a Parquet directory, whose
//! files still include the rows that overwrites, deletes and updates removed (until VACUUM).
//!
//! The kernel replays the log (checkpoints included), applies deletion vectors, fills partition
//! columns from the log and maps column names (column mapping); a table needing a reader feature
//! it does not support fails with the kernel's error, which names the feature. Time travel:
//! `--data-version N`, or `--data-timestamp T` for the last version committed at or before T (as
//! Spark's `timestampAsOf`).

use std::sync::Arc;

use delta_kernel::arrow::array::RecordBatch;
use delta_kernel::engine::arrow_data::ArrowEngineData;
use delta_kernel::history_manager;
use delta_kernel::snapshot::Snapshot;

use super::spool::Rows;
use super::store::Location;
use super::table::Roles;
use super::{DataError, SourceOpts};

/// A read Delta table: its rows and the snapshot's version.
pub(super) struct DeltaRows {
    pub rows: Rows,
    /// Rows left out for having no label (`--skip-unlabelled`).
    pub unlabelled: usize,
    pub version: u64,
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

/// Reads the rows of the Delta table at `loc`: the current snapshot, or the one `opts` names.
pub(super) fn read(loc: &Location, opts: &SourceOpts) -> Result<DeltaRows, DataError> {
    let dir = loc.origin.as_path();
    let columns = [&opts.content_column, &opts.label_column, &opts.path_column];
    let columns: Vec<&str> = columns.into_iter().map(String::as_str).collect();
    let mut rows = Rows::new()?;
    let (mut row, mut unlabelled) = (0, 0);
    let mut roles: Option<Roles> = None;
    let mut table_columns = Vec::new();
    let version = scan(loc, opts, &columns, &mut table_columns, |batch| {
        if roles.is_none() {
            roles = Some(Roles::resolve(&batch.schema(), &[], opts, dir)?);
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
    })
}

/// Calls `f` with each record batch of the table's rows (those of `columns` the table has, by
/// their logical names), after deletion vectors; returns the snapshot's version. `table_columns`
/// receives the names of all the table's columns first.
pub(super) fn scan(
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
