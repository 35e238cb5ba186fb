//! `trainer evaluate`: a run's best model or an exported artifact on a table.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::distributed::{Job, JobOpts};
use crate::{export, train};
use anyhow::{Result, bail};

use super::args::{DataArgs, EngineArgs};

/// Evaluate a run's best model or an exported artifact on a table.
///
/// --run: the run's best weights; --model: the artifact through its manifest, exactly as the edge
/// runs it. Prints accuracy, per-class metrics and the confusion matrix.
#[derive(clap::Args)]
pub struct Args {
    /// Run directory written by `trainer fit`.
    #[arg(
        long,
        value_name = "RUN_DIR",
        required_unless_present = "model",
        conflicts_with = "model"
    )]
    run: Option<PathBuf>,
    /// Exported artifact: the directory `trainer export` wrote (or the model.onnx in it, with its
    /// manifest.json beside it).
    #[arg(long, value_name = "ART_DIR")]
    model: Option<PathBuf>,
    #[command(flatten)]
    data: DataArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// Print the evaluation as JSON.
    #[arg(long)]
    json: bool,
}

pub fn job_opts(a: &Args) -> Result<JobOpts> {
    Ok(JobOpts {
        cache_root: a.data.cache.root(),
        ..a.engine.job_opts()
    })
}

pub fn run(a: Args, job: &Job) -> Result<ExitCode> {
    let data = a.data.path()?;
    let e = match (a.run, a.model) {
        (Some(run), _) => train::evaluate_run(&run, &data, job)?,
        (None, Some(model)) => export::evaluate_model(
            &model,
            &data,
            &a.data.source(),
            a.engine.engine,
            job.cache_root(),
            job.engine_opts(),
        )?,
        (None, None) => bail!("pass --run RUN_DIR or --model ART_DIR"),
    };
    if a.json {
        outln!("{}", serde_json::to_string(&e)?);
    } else {
        outln!("{}", e.to_table());
    }
    Ok(ExitCode::SUCCESS)
}
