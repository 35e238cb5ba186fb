//! `trainer tune`: hyperparameter search with a Tree-structured Parzen Estimator (Bergstra et al.
//! 2011, as in Hyperopt), written out here, over trials that train heads on the shared feature
//! cache in parallel.
//!
//! - **Space** ([`Space`]): log-uniform learning rate, uniform momentum and weight decay,
//!   categorical batch size and optimizer, integer epochs; from flags or a TOML file.
//! - **Warm-up**: the first `startup` trials are drawn uniformly at random (seeded).
//! - **TPE**: the finished trials are split at the `gamma` quantile of validation loss into good
//!   and bad; per parameter, Parzen densities `l(x)` (good) and `g(x)` (bad) are built — truncated
//!   Gaussians at each observation (bandwidth from the neighbours, as Hyperopt) plus a wide prior
//!   component for continuous parameters, smoothed counts for categorical ones — candidates are
//!   drawn from `l` and the one with the largest `l(x)/g(x)` is proposed.
//! - **Parallel and deterministic**: trials run `parallel` at a time on worker threads; each batch
//!   of `parallel` proposals is made from the trials finished before the batch, with a generator
//!   seeded from (seed, trial number), so the sequence of trials does not depend on timing.
//! - The features are computed (or found in the cache) once, before any trial.

use std::path::Path;
use std::time::Instant;

use serde::{Deserialize, Serialize};

pub mod space;
pub mod tpe;

pub use space::{Dim, Space, TrialParams, read_space};
pub use tpe::Tpe;

use crate::distributed::{self, CollectiveError, Job, WorkerError};
use crate::report::{self, ReportError};
use crate::train::{self, FitParams, Optimizer, TrainError, TrainingData};

/// What tuning reports as it goes, on rank 0: what a training run reports, and each trial.
pub trait Observer: train::Observer {
    /// A trial finished (the line just appended to `trials.jsonl`).
    fn trial(&self, _t: &TrialResult) {}
}

impl Observer for () {}

#[derive(Debug, thiserror::Error)]
pub enum TuneError {
    #[error("search space: {0}")]
    Space(String),
    #[error("{path}")]
    File {
        path: String,
        #[source]
        source: kestrel_shared::error::Cause,
    },
    #[error("--trials and --parallel must be positive")]
    NoTrials,
    #[error("trials {first}..{end} came back incomplete or out of order")]
    Incomplete { first: usize, end: usize },
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error(transparent)]
    Report(#[from] ReportError),
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error(transparent)]
    Worker(#[from] WorkerError),
}

/// One line of `trials.jsonl`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrialResult {
    pub trial: usize,
    /// `random` (warm-up) or `tpe`.
    pub source: String,
    pub params: TrialParams,
    /// Validation loss of the trial's best epoch; null when training diverged.
    pub val_loss: Option<f64>,
    pub val_accuracy: f64,
    pub best_epoch: usize,
    pub seconds: f64,
    /// When the trial ended (milliseconds since the Unix epoch; 0 in files that predate it): it
    /// started `seconds` before.
    #[serde(default)]
    pub ended_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub error: Option<String>,
}

impl TrialResult {
    /// The result of trial `trial`: its summary, or the error that ended it.
    fn new(
        trial: usize,
        by_tpe: bool,
        params: TrialParams,
        r: Result<train::Summary, TrainError>,
        seconds: f64,
    ) -> Self {
        let source = if by_tpe { "tpe" } else { "random" }.to_string();
        let ended_ms = kestrel_shared::time::now_ms();
        match r {
            Ok(sm) => TrialResult {
                trial,
                source,
                params,
                val_loss: Some(sm.val_loss).filter(|l| l.is_finite()),
                val_accuracy: sm.val_accuracy,
                best_epoch: sm.best_epoch,
                seconds,
                ended_ms,
                error: None,
            },
            Err(e) => TrialResult {
                trial,
                source,
                params,
                val_loss: None,
                val_accuracy: 0.0,
                best_epoch: 0,
                seconds,
                ended_ms,
                error: Some(kestrel_shared::chain(&e)),
            },
        }
    }

    /// The log line of a finished trial.
    fn line(&self) -> String {
        format!(
            "trial {:>3} ({:<6}) val loss {:<8} acc {:.3} | lr {:.2e} momentum {:.3} wd {:.1e} batch {} {:?} epochs {} | {:.2}s",
            self.trial,
            self.source,
            self.val_loss
                .map(|l| format!("{l:.4}"))
                .unwrap_or("diverged".into()),
            self.val_accuracy,
            self.params.lr,
            self.params.momentum,
            self.params.weight_decay,
            self.params.batch_size,
            self.params.optimizer,
            self.params.epochs,
            self.seconds
        )
    }

    /// The objective, lower is better (diverged trials are worst).
    pub fn loss(&self) -> f64 {
        self.val_loss
            .filter(|l| l.is_finite())
            .unwrap_or(f64::INFINITY)
    }
}

/// How `tune` runs.
#[derive(Debug, Clone)]
pub struct TuneOpts {
    pub trials: usize,
    pub parallel: usize,
    pub seed: u64,
    pub space: Space,
    pub startup: usize,
}

pub struct TuneOutcome {
    /// Every trial, in trial order.
    pub trials: Vec<TrialResult>,
    pub best: TrialResult,
}

/// Trials sorted best first (loss, then accuracy, then trial number).
pub fn sorted(trials: &[TrialResult]) -> Vec<TrialResult> {
    let mut s = trials.to_vec();
    s.sort_by(|a, b| {
        a.loss()
            .total_cmp(&b.loss())
            .then(b.val_accuracy.total_cmp(&a.val_accuracy))
            .then(a.trial.cmp(&b.trial))
    });
    s
}

/// The sorted results table printed by `trainer tune`.
pub fn table(trials: &[TrialResult]) -> String {
    let mut s = format!(
        "{:>4} {:>5} {:<6} {:>9} {:>7} {:>9} {:>8} {:>8} {:>5} {:<6} {:>6} {:>7}\n",
        "rank",
        "trial",
        "source",
        "val_loss",
        "val_acc",
        "lr",
        "momentum",
        "wd",
        "batch",
        "opt",
        "epochs",
        "seconds"
    );
    for (i, t) in sorted(trials).iter().enumerate() {
        s += &format!(
            "{:>4} {:>5} {:<6} {:>9} {:>7.4} {:>9.2e} {:>8.3} {:>8.1e} {:>5} {:<6} {:>6} {:>7.2}\n",
            i + 1,
            t.trial,
            t.source,
            t.val_loss
                .map(|l| format!("{l:.3e}"))
                .unwrap_or("diverged".into()),
            t.val_accuracy,
            t.params.lr,
            t.params.momentum,
            t.params.weight_decay,
            t.params.batch_size,
            match t.params.optimizer {
                Optimizer::Sgd => "sgd",
                Optimizer::Adamw => "adamw",
                Optimizer::Lbfgs => "lbfgs",
            },
            t.params.epochs,
            t.seconds
        );
    }
    s
}

/// Parameters of the best trial as a full fit (for `--then-fit`).
pub fn best_params(base: &FitParams, best: &TrialResult, seed: u64) -> FitParams {
    FitParams {
        seed,
        ..best.params.apply(base)
    }
}

/// Trains one trial's head on the prepared features on one quiet worker; nothing is written.
pub fn run_trial(
    pp: &TrainingData,
    p: &FitParams,
    job: &Job,
) -> Result<train::Summary, TrainError> {
    let o = job.run(|rank| train::train_rank(p, pp, None, rank, 0.0))?;
    Ok(o.expect("rank 0 returns its outcome").summary)
}

/// Runs the search: prepares features once (the job's ranks together), then `opts.trials` trials,
/// `opts.parallel` at a time on worker threads, writing `out/trials.jsonl` (one line per finished
/// trial, in trial order) and `out/best.json`. As an MPI job, each round of `parallel x ranks`
/// proposals (made identically on every rank) is split in contiguous chunks of `parallel` trials
/// per rank and the results are gathered in trial order; only rank 0 logs and writes `out`. With
/// the same seed and rank count the trials are the same.
///
/// `observer` hears (on rank 0) when the features are ready and each trial as it is written.
pub fn tune(
    base: &FitParams,
    opts: &TuneOpts,
    out: &Path,
    job: &Job,
    observer: &dyn Observer,
) -> Result<TuneOutcome, TuneError> {
    opts.space.validate()?;
    if opts.trials == 0 || opts.parallel == 0 {
        return Err(TuneError::NoTrials);
    }
    let trials_path = out.join("trials.jsonl");
    if job.is_lead() {
        std::fs::create_dir_all(out).map_err(|e| TuneError::File {
            path: out.display().to_string(),
            source: e.into(),
        })?;
        let _ = std::fs::remove_file(&trials_path);
    }
    // Every trial trains on one worker; the features once, before any trial.
    let base = FitParams {
        workers: 1,
        seed: opts.seed,
        ..base.clone()
    };
    let pp = train::prepare(
        &FitParams {
            workers: job.world(),
            ..base.clone()
        },
        job,
    )?;
    if job.is_lead() {
        observer.prepared(&pp);
    }
    let (rank, ranks) = job.procs().map_or((0, 1), |c| (c.rank(), c.world()));
    job.log(format!(
        "tune: {} trials, {} in parallel{}, {} random warm-up, seed {}; {} training samples",
        opts.trials,
        opts.parallel,
        if ranks > 1 {
            format!(" on each of {ranks} ranks")
        } else {
            String::new()
        },
        opts.startup,
        opts.seed,
        pp.indices(crate::data::Split::Train).len()
    ));
    let mut tpe = Tpe::new(opts.space.dims());
    tpe.startup = opts.startup;
    let mut done: Vec<TrialResult> = Vec::new();
    let mut history: Vec<(Vec<f64>, f64)> = Vec::new();
    let started = Instant::now();
    while done.len() < opts.trials {
        let first = done.len();
        let round: Vec<Proposal> = (first..(first + opts.parallel * ranks).min(opts.trials))
            .map(|t| {
                let (x, by_tpe) = tpe.propose(t, &history, opts.seed);
                Proposal {
                    trial: t,
                    x,
                    by_tpe,
                }
            })
            .collect();
        let mine = &round[distributed::share(round.len(), rank, ranks)];
        let results = gather(job, run_round(&pp, &base, opts, mine, job))?;
        if results.len() != round.len()
            || results.iter().zip(&round).any(|(r, b)| r.trial != b.trial)
        {
            return Err(TuneError::Incomplete {
                first,
                end: first + round.len(),
            });
        }
        for (r, proposal) in results.into_iter().zip(round) {
            if job.is_lead() {
                report::append_jsonl(&trials_path, &r)?;
                observer.trial(&r);
            }
            job.log(r.line());
            history.push((proposal.x, r.loss()));
            done.push(r);
        }
    }
    let best = sorted(&done)[0].clone();
    if job.is_lead() {
        report::write_json_atomic(&out.join("best.json"), &best)?;
    }
    job.log(format!(
        "tune: {} trials in {:.1}s; best trial {} val loss {} accuracy {:.4}",
        done.len(),
        started.elapsed().as_secs_f64(),
        best.trial,
        best.val_loss
            .map(|l| format!("{l:.4}"))
            .unwrap_or("-".into()),
        best.val_accuracy
    ));
    Ok(TuneOutcome { trials: done, best })
}

/// One proposed trial: its number, TPE coordinates and whether TPE (not the warm-up) chose it.
struct Proposal {
    trial: usize,
    x: Vec<f64>,
    by_tpe: bool,
}

/// Trains this process's trials of a round, each on its own thread.
fn run_round(
    pp: &TrainingData,
    base: &FitParams,
    opts: &TuneOpts,
    mine: &[Proposal],
    job: &Job,
) -> Vec<TrialResult> {
    let trial = job.single((job.threads() / opts.parallel).max(1));
    std::thread::scope(|s| {
        let handles: Vec<_> = mine
            .iter()
            .map(|prop| {
                let params = opts.space.decode(&prop.x);
                let p = params.apply(base);
                let trial = trial.clone();
                s.spawn(move || {
                    let t0 = Instant::now();
                    let r = run_trial(pp, &p, &Job::local(trial).quiet());
                    TrialResult::new(
                        prop.trial,
                        prop.by_tpe,
                        params,
                        r,
                        t0.elapsed().as_secs_f64(),
                    )
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("trial thread"))
            .collect()
    })
}

/// Every process's results of a round, in rank order (an MPI job); locally, this process's.
fn gather(job: &Job, results: Vec<TrialResult>) -> Result<Vec<TrialResult>, TuneError> {
    let Some(comm) = job.procs().filter(|c| c.world() > 1) else {
        return Ok(results);
    };
    let bytes = serde_json::to_vec(&results).expect("results serialize");
    let mut all = Vec::new();
    for (rank, b) in comm.allgather_bytes(&bytes)?.iter().enumerate() {
        let part: Vec<TrialResult> = serde_json::from_slice(b).map_err(|e| WorkerError {
            rank,
            message: format!("its trial results do not parse: {e}"),
        })?;
        all.extend(part);
    }
    Ok(all)
}
