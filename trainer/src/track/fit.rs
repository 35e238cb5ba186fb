//! `trainer fit` tracked: the run's params, its epochs as they end, then its results and files.

use std::path::Path;

use super::{KeyValue, TrackError, TrackTo, flatten_params};
use crate::distributed::Job;
use crate::train;

#[derive(Debug, thiserror::Error)]
pub enum TrackedFitError {
    #[error(transparent)]
    Track(#[from] TrackError),
    #[error(transparent)]
    Fit(#[from] train::TrainError),
}

/// [`train::fit`], tracked in MLflow when `to` says where (rank 0; a resumed run continues its
/// MLflow run): params and `tags` first, each epoch as it ends, then the results and artifacts.
/// Also returns the line saying what is left to `trainer mlflow sync`, if anything.
pub fn tracked_fit(
    p: &train::FitParams,
    dir: &Path,
    resuming: bool,
    job: &Job,
    to: Option<&TrackTo>,
    tags: Vec<KeyValue>,
) -> Result<(Option<train::FitOutcome>, Option<String>), TrackedFitError> {
    let tracker = match (job.is_lead(), to) {
        (true, Some(to)) => Some(to.open(dir, "fit", resuming)?),
        _ => None,
    };
    if let Some(t) = &tracker {
        t.log(Vec::new(), flatten_params("", p), tags);
    }
    let observer: &dyn train::Observer = tracker.as_ref().map_or(&(), |t| t);
    let fitted = train::fit(p, dir, resuming, job, observer);
    let pending = match (&tracker, &fitted) {
        (Some(t), Ok(Some(o))) => t.finish_fit(&o.run_dir, &o.summary),
        (Some(t), _) => t.end("FAILED"),
        (None, _) => None,
    };
    Ok((fitted?, pending))
}
