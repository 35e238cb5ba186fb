//! `trainer label`: labels into a capture table (`trainer collect`'s), or its unlabelled rows out
//! to a CSV and image files for whatever labelling tool is at hand ([`crate::data::source::label`]).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use crate::data::source::delta_write;
use crate::data::source::label::{apply_labels, export_todo};
use anyhow::{Result, bail};

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
    /// Cells come from devices: one that begins with =, +, -, @, a tab or a carriage return
    /// (or ') gets a leading ' so a spreadsheet shows it as text (--from strips it from path).
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
            let labels: BTreeMap<String, String> = rows
                .iter()
                .filter_map(|r| Some((r.path.clone(), r.label.clone()?)))
                .collect();
            let v = delta_write::write_labels(&a.table, &labels)?;
            let left = rows.len() - labels.len();
            tracing::info!(
                "labelled {n} rows of {} ({left} still unlabelled), labels table version {v}",
                a.table.display()
            );
            serde_json::json!({"labelled": n, "unlabelled": left, "labels_version": v})
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
