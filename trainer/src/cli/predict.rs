//! `trainer predict`: batch inference of an artifact over a table, into Parquet.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::distributed::{Job, JobOpts};
use crate::predict;
use anyhow::{Context, Result};

use super::args::{ModelArgs, TableArgs, ThreadArgs, WorkerArgs};

/// Classify every row of an image table with an exported artifact, into Parquet.
///
/// The artifact is verified and health-checked exactly as the edge loads it; the rows are spread
/// over workers; the Parquet file has columns path, label, prediction, class, score, error (rows
/// in table order).
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    data: TableArgs,
    /// Output Parquet file: a local path, or an object-store URL (`s3://`, `az://`, `abfss://`,
    /// `gs://`; credentials from the environment as for `--data`).
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
    #[command(flatten)]
    workers: WorkerArgs,
    #[command(flatten)]
    threads: ThreadArgs,
    /// Largest artifact accepted, in bytes (sum of the manifest's files).
    #[arg(long, default_value_t = 64 << 20)]
    max_bytes: u64,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
}

pub fn job_opts(a: &Args) -> Result<JobOpts> {
    a.workers.job_opts(a.threads.job_opts())
}

pub fn run(a: Args, job: &Job) -> Result<ExitCode> {
    let data = a.data.path()?;
    let model = a.model.dir();
    let s = predict::predict(model, &data, &a.data.source(), &a.out, a.max_bytes, job)
        .with_context(|| format!("predicting {} with {}", data.display(), model.display()))?;
    let Some(s) = s else {
        return Ok(ExitCode::SUCCESS);
    };
    if a.json {
        outln!("{}", serde_json::to_string(&s)?);
        return Ok(ExitCode::SUCCESS);
    }
    outln!(
        "{} v{}: {} rows ({} errors){} in {:.2}s on {} worker(s), {:.1} images/s -> {}",
        s.model,
        s.version,
        s.rows,
        s.errors,
        s.accuracy
            .map(|a| format!(", accuracy {a:.4}"))
            .unwrap_or_default(),
        s.seconds,
        s.workers,
        s.images_per_s,
        s.out
    );
    Ok(ExitCode::SUCCESS)
}
