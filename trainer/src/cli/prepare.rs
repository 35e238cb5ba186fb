//! `trainer prepare`: the table into the sample cache, and the frozen backbone once per sample
//! into the feature cache (reused by every later fit and tune on the same data).

use std::process::ExitCode;

use crate::data::split;
use crate::distributed::{Job, JobOpts};
use crate::train;
use anyhow::Result;

use super::args::{DataArgs, EngineArgs, FitArgs, WorkerArgs};

/// Fill the sample and feature caches of an image table (the backbone runs once per sample).
///
/// Decodes and preprocesses the table into the sample cache and runs the frozen backbone once
/// per sample into the feature cache, reused by every later fit/tune on the same data.
/// Under `mpirun -np N` the ranks extract the features together.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    data: DataArgs,
    #[command(flatten)]
    fit: FitArgs,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    workers: WorkerArgs,
    /// Print the caches' summary as JSON.
    #[arg(long)]
    json: bool,
}

pub fn job_opts(a: &Args) -> Result<JobOpts> {
    a.workers.job_opts(JobOpts {
        cache_root: a.data.cache.root(),
        ..a.engine.job_opts()
    })
}

pub fn run(a: Args, job: &Job) -> Result<ExitCode> {
    let p = a.fit.params(&a.data, a.engine.engine, job.world())?;
    let pp = train::prepare(&p, job)?;
    if !job.is_lead() {
        return Ok(ExitCode::SUCCESS);
    }
    if a.json {
        let v = serde_json::json!({
            "samples": pp.prepared.len(),
            "labels": pp.dataset_labels,
            "skipped": pp.prepared.meta.skipped.len(),
            "shards": pp.prepared.meta.shards,
            "samples_cache": pp.prepared.dir,
            "samples_cache_reused": pp.prepared.reused,
            "feature_dims": pp.features.meta.dims,
            "backbone_runs": pp.features.computed,
            "features_reused": pp.features.reused,
            "unlabelled_skipped": pp.unlabelled,
            "feature_seconds": pp.features.meta.seconds,
            "feature_workers": pp.features.meta.workers,
            "features_cache": pp.features.dir,
            "tables": pp.tables,
        });
        outln!("{v}");
    } else {
        out!(
            "{}",
            split::count_table(pp.labels(), &pp.splits, &pp.dataset_labels)
        );
    }
    Ok(ExitCode::SUCCESS)
}
