//! `trainer fit`: a new head (and optionally the last blocks) on cached features, into a run
//! directory; `--resume` continues one.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::distributed::{Job, JobOpts};
use crate::track;
use crate::train::{self, FitOutcome, FitParams};
use anyhow::Result;

use super::args::{DataArgs, EngineArgs, FitArgs, TrackArgs, WorkerArgs};

/// Train a new head (and optionally the last blocks) on cached features into a run directory.
///
/// `--workers N` trains data-parallel on N threads; under `mpirun -np N` (a build with
/// `--features kestrel-trainer/mpi`) each process is one rank and rank 0 writes the run.
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
    #[command(flatten)]
    track: TrackArgs,
    /// Run directory (params.json, metrics.jsonl, summary.json, checkpoints/, *.png).
    #[arg(long, required_unless_present = "resume")]
    out: Option<PathBuf>,
    /// Continue RUN_DIR from its last checkpoint with its saved parameters (and cache, unless
    /// --cache is given).
    #[arg(long, value_name = "RUN_DIR", conflicts_with = "out")]
    resume: Option<PathBuf>,
    /// Start the head from RUN_DIR's trained head (best.safetensors) instead of from scratch:
    /// classes mapped by name, new classes starting at zero (retraining on old + new tables).
    #[arg(long, value_name = "RUN_DIR", conflicts_with = "resume")]
    init_from: Option<PathBuf>,
    /// Print summary.json on stdout.
    #[arg(long)]
    json: bool,
}

pub fn job_opts(a: &Args) -> Result<JobOpts> {
    let opts = a.workers.job_opts(JobOpts {
        cache_root: a.data.cache.root(),
        ..a.engine.job_opts()
    })?;
    Ok(match &a.resume {
        // A resumed run keeps its worker count (under mpirun: the ranks) and, unless --cache
        // says otherwise, its cache.
        Some(dir) => {
            let saved = saved_params(dir)?;
            JobOpts {
                workers: saved.workers,
                cache_root: a
                    .data
                    .cache
                    .cache
                    .clone()
                    .or(saved.cache)
                    .unwrap_or(opts.cache_root),
                ..opts
            }
        }
        None => opts,
    })
}

pub fn run(a: Args, job: &Job) -> Result<ExitCode> {
    let (params, dir, resuming) = match a.resume {
        Some(dir) => (saved_params(&dir)?, dir, true),
        None => {
            let p = a.fit.params(&a.data, a.engine.engine, a.workers.workers)?;
            if let Some(w) = a.fit.unused_epoch_flags(&p)
                && job.rank() == 0
            {
                tracing::warn!("{w}");
            }
            let p = FitParams {
                init_from: a.init_from,
                ..p
            };
            (p, a.out.expect("clap requires --out"), false)
        }
    };
    let to = a.track.to();
    let (fitted, pending) =
        track::tracked_fit(&params, &dir, resuming, job, to.as_ref(), Vec::new())?;
    let Some(o) = fitted else {
        return Ok(ExitCode::SUCCESS); // ranks other than 0 print nothing
    };
    print_outcome(&o, a.json)?;
    if let Some(line) = pending {
        tracing::info!("{line}");
    }
    Ok(ExitCode::SUCCESS)
}

/// The parameters a run directory was trained with.
pub fn saved_params(dir: &std::path::Path) -> Result<FitParams> {
    Ok(train::RunDir(dir).params()?)
}

/// The summary line and the validation table, or summary.json with `json`.
pub fn print_outcome(o: &FitOutcome, json: bool) -> Result<()> {
    let s = &o.summary;
    if json {
        outln!("{}", serde_json::to_string(s)?);
        return Ok(());
    }
    outln!(
        "best epoch {} of {}: val accuracy {:.4} (loss {:.4}){} -> {}",
        s.best_epoch,
        s.epochs_run,
        s.val_accuracy,
        s.val_loss,
        s.test_accuracy
            .map(|a| format!(", test accuracy {a:.4}"))
            .unwrap_or_default(),
        o.run_dir.display()
    );
    outln!("{}", s.validation.to_table());
    Ok(())
}
