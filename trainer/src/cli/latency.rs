//! `trainer latency`: batch-1 latency of an exported model.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::distributed::{Job, JobOpts};
use crate::export;
use anyhow::Result;

use super::args::{EngineArgs, ModelArgs};

/// Batch-1 latency of an exported model, in milliseconds per image.
///
/// Inference only: the image is preprocessed once with the manifest's spec. The median of the
/// timed repetitions is printed.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// Timed repetitions after one warm-up.
    #[arg(long, default_value_t = 50)]
    rounds: usize,
    /// Print {"model", "engine", "threads", "ms"} as JSON.
    #[arg(long)]
    json: bool,
    image: PathBuf,
}

pub fn job_opts(a: &Args) -> Result<JobOpts> {
    Ok(a.engine.job_opts())
}

pub fn run(a: Args, job: &Job) -> Result<ExitCode> {
    let engine = a.engine.engine;
    let ms = export::latency_ms(
        &a.model.model,
        engine,
        &a.image,
        a.rounds,
        job.engine_opts(),
    )?;
    let model = a.model.model.display();
    if a.json {
        outln!(
            "{}",
            serde_json::json!({"model": a.model.model, "engine": engine, "threads": job.threads(), "ms": ms})
        );
    } else {
        outln!(
            "{model} on {engine}, {} threads: {ms:.2} ms per image",
            job.threads()
        );
    }
    Ok(ExitCode::SUCCESS)
}
