//! Labelling a capture table (`trainer label`): labels from a `path,label` CSV, or the
//! unlabelled rows out to a CSV and image files for whatever labelling tool is at hand.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use kestrel_shared::protocol::{check_name, sha256_hex};

use super::delta_write::CaptureRow;

#[derive(Debug, thiserror::Error)]
pub enum LabelError {
    #[error("{}", path.display())]
    Csv {
        path: PathBuf,
        #[source]
        source: csv::Error,
    },
    #[error("{}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: no `{name}` column; columns are: {columns}", path.display())]
    NoColumn {
        path: PathBuf,
        name: &'static str,
        columns: String,
    },
    #[error("{}: line {line}: no row `{row}` in the table", path.display())]
    NoRow {
        path: PathBuf,
        line: u64,
        row: String,
    },
    #[error(
        "{}: line {line}: `{label}` is not a class (known: {known}); --add-classes adds it",
        path.display()
    )]
    NotAClass {
        path: PathBuf,
        line: u64,
        label: String,
        known: String,
    },
}

fn csv_err(path: &Path) -> impl FnOnce(csv::Error) -> LabelError + '_ {
    move |source| LabelError::Csv {
        path: path.to_path_buf(),
        source,
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> LabelError + '_ {
    move |source| LabelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Fills labels from `csv`; returns how many rows got one. Every path must be a row of the table
/// and every label a known class (unless `add_classes`); nothing is changed otherwise.
pub fn apply_labels(
    rows: &mut [CaptureRow],
    csv: &Path,
    add_classes: bool,
) -> Result<usize, LabelError> {
    let mut known: BTreeSet<String> = rows.iter().filter_map(|r| r.label.clone()).collect();
    known.extend(rows.iter().map(|r| r.predicted.clone()));
    let index: HashMap<String, usize> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| (r.path.clone(), i))
        .collect();
    let mut reader = csv::ReaderBuilder::new()
        .trim(csv::Trim::All)
        .from_path(csv)
        .map_err(csv_err(csv))?;
    let headers = reader.headers().map_err(csv_err(csv))?.clone();
    let col = |name: &'static str| {
        headers
            .iter()
            .position(|h| h == name)
            .ok_or_else(|| LabelError::NoColumn {
                path: csv.to_path_buf(),
                name,
                columns: headers.iter().collect::<Vec<_>>().join(", "),
            })
    };
    let (pi, li) = (col("path")?, col("label")?);
    let mut updates = Vec::new();
    for rec in reader.records() {
        let rec = rec.map_err(csv_err(csv))?;
        let line = rec.position().map_or(0, |p| p.line());
        let (path, label) = (rec.get(pi).unwrap_or(""), rec.get(li).unwrap_or(""));
        if label.is_empty() {
            continue;
        }
        let Some(&i) = index.get(path) else {
            return Err(LabelError::NoRow {
                path: csv.to_path_buf(),
                line,
                row: path.to_string(),
            });
        };
        if !add_classes && !known.contains(label) {
            return Err(LabelError::NotAClass {
                path: csv.to_path_buf(),
                line,
                label: label.to_string(),
                known: known.iter().cloned().collect::<Vec<_>>().join(", "),
            });
        }
        updates.push((i, label.to_string()));
    }
    for (i, label) in &updates {
        rows[*i].label = Some(label.clone());
    }
    Ok(updates.len())
}

/// Where a row's image goes under the images directory, without its extension: `DEVICE/ID`,
/// distinct for distinct rows (device ids and capture ids are checked names: no `/`, at most 64
/// characters); a row whose device or id is not such a name (written before they were checked)
/// goes to `_/` under the first 16 hex digits of its path's sha256.
fn image_stem(r: &CaptureRow) -> String {
    let id = r.path.strip_prefix(&format!("{}/", r.device));
    match id {
        Some(id) if check_name(&r.device).is_ok() && check_name(id).is_ok() => {
            format!("{}/{id}", r.device)
        }
        _ => format!("_/{}", &sha256_hex(r.path.as_bytes())[..16]),
    }
}

/// Writes the unlabelled rows and their images; returns how many.
pub fn export_todo(rows: &[CaptureRow], csv: &Path) -> Result<usize, LabelError> {
    let stem = csv.file_stem().unwrap_or_default().to_string_lossy();
    let images = csv.with_file_name(format!("{stem}-images"));
    std::fs::create_dir_all(&images).map_err(io_err(&images))?;
    let mut w = csv::Writer::from_path(csv).map_err(csv_err(csv))?;
    w.write_record([
        "path",
        "file",
        "device",
        "model",
        "version",
        "predicted",
        "score",
        "reason",
        "captured_at",
        "label",
    ])
    .map_err(csv_err(csv))?;
    let mut n = 0;
    for r in rows.iter().filter(|r| r.label.is_none()) {
        let ext = image::guess_format(&r.content)
            .ok()
            .and_then(|f| f.extensions_str().first().copied())
            .unwrap_or("bin");
        let name = format!("{}.{ext}", image_stem(r));
        let file = images.join(&name);
        if let Some(dir) = file.parent() {
            std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        }
        std::fs::write(&file, &r.content).map_err(io_err(&file))?;
        let at = chrono::DateTime::from_timestamp_micros(r.captured_at)
            .map(|t| t.to_rfc3339())
            .unwrap_or_default();
        w.write_record([
            r.path.as_str(),
            &format!("{stem}-images/{name}"),
            &r.device,
            &r.model,
            &r.version.to_string(),
            &r.predicted,
            &r.score.to_string(),
            &r.reason,
            &at,
            "",
        ])
        .map_err(csv_err(csv))?;
        n += 1;
    }
    w.flush().map_err(io_err(csv))?;
    Ok(n)
}
