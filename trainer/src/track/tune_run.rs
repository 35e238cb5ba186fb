//! `trainer tune` tracked: a parent MLflow run with the base parameters and the search settings,
//! one child run per trial (the tracker is the search's observer), and the best trial on the
//! parent when the search ends.

use std::path::Path;

use super::{Metric, TrackError, TrackTo, Tracker, flatten_params, kv};
use crate::distributed::Job;
use crate::train::FitParams;
use crate::tune::{self, TuneError, TuneOpts, TuneOutcome};

#[derive(Debug, thiserror::Error)]
pub enum TrackedTuneError {
    #[error(transparent)]
    Track(#[from] TrackError),
    #[error(transparent)]
    Tune(#[from] TuneError),
}

/// A finished search and its tracking.
pub struct TrackedTune {
    pub outcome: TuneOutcome,
    /// The parent run (rank 0, when tracking): what a fit of the best parameters is tagged with.
    pub run_id: Option<String>,
    /// What is left to `trainer mlflow sync`, if anything.
    pub pending: Vec<String>,
}

/// [`tune::tune`], tracked in MLflow when `to` says where (rank 0).
pub fn tracked_tune(
    base: &FitParams,
    opts: &TuneOpts,
    out: &Path,
    job: &Job,
    to: Option<&TrackTo>,
) -> Result<TrackedTune, TrackedTuneError> {
    let parent = match (job.is_lead(), to) {
        (true, Some(to)) => Some(start_parent(to, out, base, opts)?),
        _ => None,
    };
    let observer: &dyn tune::Observer = parent.as_ref().map_or(&(), |t| t);
    let outcome = tune::tune(base, opts, out, job, observer);
    let pending = parent
        .iter()
        .flat_map(|t| end_parent(t, &outcome))
        .collect();
    Ok(TrackedTune {
        outcome: outcome?,
        run_id: parent.map(|t| t.run_id().to_string()),
        pending,
    })
}

/// The tune run: the base params and the search settings; the parent of one run per trial.
fn start_parent(
    to: &TrackTo,
    out: &Path,
    base: &FitParams,
    opts: &TuneOpts,
) -> Result<Tracker, TrackError> {
    let t = to.open(out, "tune", false)?;
    let mut params = flatten_params("", base);
    let settings = serde_json::json!({
        "trials": opts.trials, "parallel": opts.parallel, "startup": opts.startup, "space": opts.space,
    });
    params.extend(flatten_params("tune", &settings));
    t.log(Vec::new(), params, Vec::new());
    Ok(t)
}

/// The best trial on the parent run: its parameters as `best.*` params, its results as metrics;
/// then the run ends.
fn end_parent(t: &Tracker, outcome: &Result<TuneOutcome, TuneError>) -> Option<String> {
    let Ok(o) = outcome else {
        return t.end("FAILED");
    };
    let mut metrics = vec![Metric::now("best_val_accuracy", o.best.val_accuracy, 0)];
    metrics.extend(o.best.val_loss.map(|l| Metric::now("best_val_loss", l, 0)));
    let mut params = flatten_params("best", &o.best.params);
    params.push(kv("best.trial", o.best.trial.to_string()));
    t.log(metrics, params, Vec::new());
    t.end("FINISHED")
}
