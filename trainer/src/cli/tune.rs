//! `trainer tune`: TPE search over head hyperparameters, trials in parallel on one feature cache.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::distributed::{Job, JobOpts};
use crate::track::{self, TrackedTune, kv, tracked_tune};
use crate::train::Optimizer;
use crate::tune::{self, Space};
use anyhow::{Result, bail};

use super::args::{DataArgs, EngineArgs, FitArgs, TrackArgs};

/// Search head hyperparameters with TPE over trials trained in parallel on one feature cache.
///
/// A seeded random warm-up, then the Tree-structured Parzen Estimator; the features are computed
/// once and shared by every trial. Writes OUT/trials.jsonl and OUT/best.json and prints the trials sorted by validation loss.
/// The training flags are the trials' base; the searched ones come from the space. Under
/// `mpirun -np N` the trials are spread over the ranks too.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    data: DataArgs,
    #[command(flatten)]
    fit: FitArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// Number of trials.
    #[arg(long, default_value_t = 50)]
    trials: usize,
    /// Trials trained at the same time (worker threads).
    #[arg(long, default_value_t = 1)]
    parallel: usize,
    /// Random warm-up trials before TPE proposes.
    #[arg(long, default_value_t = 10)]
    startup: usize,
    /// Output directory (trials.jsonl, best.json).
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    space: SpaceArgs,
    #[command(flatten)]
    track: TrackArgs,
    /// Then train the final model with the best trial's parameters into RUN_DIR.
    #[arg(long, value_name = "RUN_DIR")]
    then_fit: Option<PathBuf>,
    /// Print {"best": ..., "trials": [...sorted], "then_fit": summary} as JSON on stdout.
    #[arg(long)]
    json: bool,
}

/// The search space: a TOML file, and flags that override it.
#[derive(clap::Args)]
struct SpaceArgs {
    /// Search space as TOML (keys lr, momentum, weight_decay: [lo, hi]; batch_size: [..];
    /// optimizer: ["sgd", "adamw"]; epochs: [lo, hi]); the range flags below override it.
    #[arg(long, value_name = "SPACE.toml")]
    space: Option<PathBuf>,
    /// Learning-rate range, log-uniform [default: 1e-4,0.3].
    #[arg(long, value_delimiter = ',', value_name = "LO,HI")]
    lr_range: Option<Vec<f64>>,
    /// Momentum range, uniform [default: 0,0.99].
    #[arg(long, value_delimiter = ',', value_name = "LO,HI")]
    momentum_range: Option<Vec<f64>>,
    /// Weight-decay range, uniform [default: 0,0.001].
    #[arg(long, value_delimiter = ',', value_name = "LO,HI")]
    weight_decay_range: Option<Vec<f64>>,
    /// Batch sizes to choose from [default: 16,32,64].
    #[arg(long, value_delimiter = ',')]
    batch_sizes: Option<Vec<usize>>,
    /// Optimizers to choose from [default: sgd,adamw].
    #[arg(long, value_delimiter = ',', value_enum)]
    optimizers: Option<Vec<Optimizer>>,
    /// Epoch range, integers inclusive [default: 5,30].
    #[arg(long, value_delimiter = ',', value_name = "LO,HI")]
    epochs_range: Option<Vec<usize>>,
}

impl SpaceArgs {
    fn space(self) -> Result<Space> {
        fn pair<T: Copy>(v: Option<Vec<T>>, flag: &str) -> Result<Option<[T; 2]>> {
            match v {
                None => Ok(None),
                Some(v) if v.len() == 2 => Ok(Some([v[0], v[1]])),
                Some(_) => bail!("{flag} takes two comma-separated values LO,HI"),
            }
        }
        let mut sp = match &self.space {
            Some(f) => tune::read_space(f)?,
            None => Space::default(),
        };
        sp.lr = pair(self.lr_range, "--lr-range")?.unwrap_or(sp.lr);
        sp.momentum = pair(self.momentum_range, "--momentum-range")?.unwrap_or(sp.momentum);
        sp.weight_decay =
            pair(self.weight_decay_range, "--weight-decay-range")?.unwrap_or(sp.weight_decay);
        sp.epochs = pair(self.epochs_range, "--epochs-range")?.unwrap_or(sp.epochs);
        sp.batch_size = self.batch_sizes.unwrap_or(sp.batch_size);
        sp.optimizer = self.optimizers.unwrap_or(sp.optimizer);
        Ok(sp)
    }
}

pub fn job_opts(a: &Args) -> Result<JobOpts> {
    Ok(JobOpts {
        cache_root: a.data.cache.root(),
        distributed: true,
        ..a.engine.job_opts()
    })
}

pub fn run(a: Args, job: &Job) -> Result<ExitCode> {
    let base = a.fit.params(&a.data, a.engine.engine, 1)?;
    let opts = tune::TuneOpts {
        trials: a.trials,
        parallel: a.parallel,
        seed: a.fit.seed,
        space: a.space.space()?,
        startup: a.startup,
    };
    let to = a.track.to();
    let TrackedTune {
        outcome,
        run_id,
        mut pending,
    } = tracked_tune(&base, &opts, &a.out, job, to.as_ref())?;
    let fitted = match &a.then_fit {
        Some(dir) => {
            job.log(format!(
                "fitting the best parameters (trial {}) into {}",
                outcome.best.trial,
                dir.display()
            ));
            // Under MPI the final model trains data-parallel on every rank.
            let p = tune::best_params(&base, &outcome.best, a.fit.seed);
            let tags = run_id
                .iter()
                .map(|id| kv("kestrel.tune_run", id.as_str()))
                .collect();
            let (fitted, left) = track::tracked_fit(&p, dir, false, job, to.as_ref(), tags)?;
            pending.extend(left);
            fitted
        }
        None => None,
    };
    for line in &pending {
        tracing::info!("{line}");
    }
    if !job.is_lead() {
        return Ok(ExitCode::SUCCESS);
    }
    if a.json {
        let v = serde_json::json!({
            "best": outcome.best,
            "trials": tune::sorted(&outcome.trials),
            "then_fit": fitted.as_ref().map(|o| &o.summary),
        });
        outln!("{v}");
        return Ok(ExitCode::SUCCESS);
    }
    out!("{}", tune::table(&outcome.trials));
    if let Some(o) = &fitted {
        outln!(
            "final model: val accuracy {:.4} (loss {:.4}) -> {}",
            o.summary.val_accuracy,
            o.summary.val_loss,
            o.run_dir.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}
