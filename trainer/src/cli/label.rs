//! `trainer label`: labels into a capture table (`trainer collect`'s), or its unlabelled rows out
//! to a CSV and image files for whatever labelling tool is at hand.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::data::delta_write::{self, CaptureRow};
use anyhow::{Context, Result, bail};
use kestrel_shared::protocol::{check_name, sha256_hex};

/// Fill in the labels of a capture table from a `path,label` CSV, or export its unlabelled rows
/// (CSV + images) for labelling.
#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("what").required(true).args(["from", "export"])))]
pub struct Args {
    /// The capture table (a path or an object URL, as `collect --out` takes).
    #[arg(long, value_name = "TABLE")]
    table: PathBuf,
    /// A CSV with `path` and `label` columns (other columns are ignored, so an exported
    /// todo.csv with its label column filled in will do); empty labels are left alone.
    #[arg(long, value_name = "CSV")]
    from: Option<PathBuf>,
    /// Write the unlabelled rows to this CSV (path, file, device, model, version, predicted,
    /// score, reason, captured_at, label) and their images beside it in `<stem>-images/`.
    #[arg(long, value_name = "CSV")]
    export: Option<PathBuf>,
    /// Accept labels that are not yet classes (known: the table's labels and predictions).
    #[arg(long)]
    add_classes: bool,
    /// A JSON summary on stdout.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<ExitCode> {
    let (mut rows, version) = delta_write::read(&a.table)?;
    if version.is_none() {
        bail!(
            "{}: no capture table there (trainer collect creates it)",
            a.table.display()
        );
    }
    let summary = match (&a.from, &a.export) {
        (Some(csv), _) => {
            let n = apply_labels(&mut rows, csv, a.add_classes)?;
            let v = delta_write::replace(&a.table, &rows)?;
            let left = rows.iter().filter(|r| r.label.is_none()).count();
            tracing::info!(
                "labelled {n} rows of {} ({left} still unlabelled), version {v}",
                a.table.display()
            );
            serde_json::json!({"labelled": n, "unlabelled": left, "version": v})
        }
        (None, Some(csv)) => {
            let n = export_todo(&rows, csv)?;
            tracing::info!("{n} unlabelled rows written to {}", csv.display());
            serde_json::json!({"exported": n, "csv": csv})
        }
        (None, None) => unreachable!("clap requires one"),
    };
    if a.json {
        outln!("{summary}");
    }
    Ok(ExitCode::SUCCESS)
}

/// Fills labels from `csv`; returns how many rows got one. Every path must be a row of the table
/// and every label a known class (unless `add_classes`); nothing is changed otherwise.
fn apply_labels(rows: &mut [CaptureRow], csv: &Path, add_classes: bool) -> Result<usize> {
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
        .with_context(|| format!("reading {}", csv.display()))?;
    let headers = reader.headers()?.clone();
    let col = |name: &str| {
        headers.iter().position(|h| h == name).with_context(|| {
            format!(
                "{}: no `{name}` column; columns are: {}",
                csv.display(),
                headers.iter().collect::<Vec<_>>().join(", ")
            )
        })
    };
    let (pi, li) = (col("path")?, col("label")?);
    let mut updates = Vec::new();
    for rec in reader.records() {
        let rec = rec.with_context(|| format!("reading {}", csv.display()))?;
        let line = rec.position().map_or(0, |p| p.line());
        let (path, label) = (rec.get(pi).unwrap_or(""), rec.get(li).unwrap_or(""));
        if label.is_empty() {
            continue;
        }
        let Some(&i) = index.get(path) else {
            bail!(
                "{}: line {line}: no row `{path}` in the table",
                csv.display()
            );
        };
        if !add_classes && !known.contains(label) {
            bail!(
                "{}: line {line}: `{label}` is not a class (known: {}); --add-classes adds it",
                csv.display(),
                known.iter().cloned().collect::<Vec<_>>().join(", ")
            );
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
fn export_todo(rows: &[CaptureRow], csv: &Path) -> Result<usize> {
    let stem = csv.file_stem().unwrap_or_default().to_string_lossy();
    let images = csv.with_file_name(format!("{stem}-images"));
    std::fs::create_dir_all(&images).with_context(|| format!("creating {}", images.display()))?;
    let mut w =
        csv::Writer::from_path(csv).with_context(|| format!("writing {}", csv.display()))?;
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
    ])?;
    let mut n = 0;
    for r in rows.iter().filter(|r| r.label.is_none()) {
        let ext = image::guess_format(&r.content)
            .ok()
            .and_then(|f| f.extensions_str().first().copied())
            .unwrap_or("bin");
        let name = format!("{}.{ext}", image_stem(r));
        let file = images.join(&name);
        if let Some(dir) = file.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        std::fs::write(&file, &r.content).with_context(|| format!("writing {}", file.display()))?;
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
        ])?;
        n += 1;
    }
    w.flush()?;
    Ok(n)
}
