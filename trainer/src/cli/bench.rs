//! `trainer bench`: feature-extraction throughput.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::classify::throughput;
use crate::distributed::{Job, JobOpts};
use anyhow::Result;

use super::args::{BackboneArgs, EngineArgs};

/// Measure feature-extraction throughput (decode + preprocess + backbone), images/s.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    backbone: BackboneArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// Images per batch.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Timed repetitions after one warm-up.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Print the throughput as JSON.
    #[arg(long)]
    json: bool,
    #[arg(required = true)]
    images: Vec<PathBuf>,
}

pub fn job_opts(a: &Args) -> Result<JobOpts> {
    Ok(a.engine.job_opts())
}

pub fn run(a: Args, job: &Job) -> Result<ExitCode> {
    let b = a.backbone.load()?;
    let t = throughput(
        &b,
        a.engine.engine,
        &a.images,
        a.batch,
        job.threads(),
        a.rounds,
    )?;
    if a.json {
        outln!("{}", serde_json::to_string(&t)?);
    } else {
        outln!(
            "{} {} batch {} threads {}: {:.1} images/s",
            t.engine,
            t.arch,
            t.batch,
            t.threads,
            t.images_per_s
        );
    }
    Ok(ExitCode::SUCCESS)
}
