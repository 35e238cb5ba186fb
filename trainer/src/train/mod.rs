//! `trainer fit`: transfer learning on cached backbone features (candle), with resumable,
//! deterministic runs.
//!
//! The frozen part of the backbone (`[0, boundary)`, `boundary = blocks - unfreeze_last`) comes from
//! the feature cache; the unfrozen blocks (batch norm folded into their convs, i.e. BN statistics
//! stay frozen) and a new linear classifier train in candle. Initial classifier weights come from a
//! seeded generator, each epoch's order from (seed, epoch), so a run is a pure function of its
//! parameters and a resumed run ends with the same weights as an uninterrupted one.
//!
//! - [`params`]: what determines a run; [`prepare`]: table → caches → split;
//! - [`rank`]: one rank's training loop; [`checkpoint`]: the run directory;
//! - [`model`] and [`optim`]: the trainable part and its optimizers; [`augment`]: augmented views.

use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{D, Device, Tensor as CTensor};
use kestrel_models::Weights;
use serde::{Deserialize, Serialize};

pub mod augment;
pub mod checkpoint;
pub mod fit;
pub mod head;
pub mod init;
pub mod loss;
pub mod model;
pub mod optim;
pub mod params;
pub mod prepare;
pub mod run_dir;
mod solve;

pub use fit::train_rank;
pub use model::{Trainable, model_summary};
pub use params::{ClassWeights, ComputeDevice, FitParams, LrScaling, Optimizer, Schedule};
pub use prepare::{SplitRecord, TrainingData, prepare};
pub use run_dir::RunDir;

use kestrel_shared::error::Cause;

use crate::data::{self, cache::CacheError};
use crate::distributed::{CollectiveError, ErrorScope, Job, RankError, WorkerError};
use crate::report::{self, EpochMetrics, Evaluation};

/// What a training run reports as it goes, on rank 0 (MLflow's tracker listens); `()` ignores
/// everything. Tuning adds its trials ([`crate::tune::Observer`]).
pub trait Observer: Sync {
    /// The samples and features are ready.
    fn prepared(&self, _pp: &TrainingData) {}
    /// An epoch finished (the line just appended to `metrics.jsonl`).
    fn epoch(&self, _m: &EpochMetrics) {}
}

impl Observer for () {}

/// Where rank 0 records a run: its directory, whether to continue the run found there, and who
/// hears of each epoch. Tuning trials record nothing.
pub struct Recording<'a> {
    pub dir: &'a Path,
    pub resume: bool,
    pub observer: &'a dyn Observer,
}

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Interrupted(#[from] crate::interrupt::Interrupted),
    #[error(transparent)]
    Data(#[from] data::DataError),
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error(transparent)]
    Backbone(#[from] kestrel_models::backbone::BackboneError),
    #[error("candle")]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Engine(#[from] kestrel_models::EngineError),
    #[error(transparent)]
    Preprocess(#[from] kestrel_shared::PreprocessError),
    #[error(transparent)]
    Import(#[from] kestrel_models::torch::ImportError),
    #[error(transparent)]
    Report(#[from] report::ReportError),
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error("training diverged: no epoch of {epochs} had a finite validation loss (lower --lr)")]
    Diverged { epochs: usize },
    #[error(transparent)]
    Worker(#[from] WorkerError),
    #[error("{path}")]
    Run {
        path: String,
        #[source]
        source: Cause,
    },
    #[error("{path}: --init-from")]
    InitFrom {
        path: String,
        #[source]
        source: Cause,
    },
}

impl RankError for TrainError {
    fn scope(&self) -> ErrorScope {
        match self {
            TrainError::Collective(e) => ErrorScope::of_collective(Some(e)),
            TrainError::Worker(_) => ErrorScope::Job,
            _ => ErrorScope::Own,
        }
    }
}

/// What is saved with every checkpoint besides the weights.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainState {
    /// Epochs completed.
    pub epoch: usize,
    pub opt_step: u64,
    pub best_epoch: usize,
    pub best_val_loss: f64,
    pub best_val_accuracy: f64,
    pub bad_epochs: usize,
    pub history: Vec<EpochMetrics>,
}

/// `summary.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    pub best_epoch: usize,
    pub epochs_run: usize,
    pub val_accuracy: f64,
    pub val_loss: f64,
    pub test_accuracy: Option<f64>,
    pub labels: Vec<String>,
    pub validation: Evaluation,
    pub test: Option<Evaluation>,
    /// Backbone runs this fit did to get its features (0 on a feature-cache hit).
    pub backbone_runs: usize,
    /// Feature rows this fit did not run the backbone for: every row on a feature-cache hit, else
    /// the rows copied from other feature caches (rows seen before, e.g. the old table of
    /// `--data OLD --data NEW`). `backbone_runs + features_reused` is the sample count.
    #[serde(default)]
    pub features_reused: usize,
    /// Rows of the tables left out for having no label (`--skip-unlabelled`).
    #[serde(default)]
    pub unlabelled_skipped: usize,
    /// Where the head started (`--init-from`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init: Option<init::InitHead>,
    pub feature_seconds: f64,
    pub train_seconds: f64,
    /// How the head was solved by L-BFGS (`--optimizer lbfgs`, or the first stage of `--fine-tune`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head: Option<head::HeadSolve>,
    /// The first stage's validation accuracy (`--fine-tune`: the head alone, before the blocks train).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_val_accuracy: Option<f64>,
}

impl Default for TrainState {
    fn default() -> Self {
        TrainState {
            epoch: 0,
            opt_step: 0,
            best_epoch: 0,
            best_val_loss: f64::INFINITY,
            best_val_accuracy: 0.0,
            bad_epochs: 0,
            history: Vec::new(),
        }
    }
}

pub struct FitOutcome {
    pub run_dir: PathBuf,
    pub summary: Summary,
}

/// Trains (or, with `resume`, continues) a run in `run_dir` on the job's ranks: the features are
/// prepared once (by the ranks together), then every rank trains its part of every global batch
/// ([`train_rank`]), so N local workers or N MPI ranks train exactly what 1 worker trains with the
/// same `--batch-size` and `--seed`. Rank 0's process returns the outcome, the others `None`.
///
/// `observer` hears (on rank 0) when the features are ready and each epoch as it is written.
pub fn fit(
    p: &FitParams,
    run_dir: &Path,
    resume: bool,
    job: &Job,
    observer: &dyn Observer,
) -> Result<Option<FitOutcome>, TrainError> {
    let p = p.on_ranks(job.world())?;
    if let Some(dir) = &p.init_from {
        init::check(dir)?;
    }
    if job.is_lead() {
        checkpoint::create(run_dir)?;
    }
    let started = Instant::now();
    let pp = prepare(&p, job)?;
    let feature_seconds = started.elapsed().as_secs_f64();
    if job.procs().is_some() && job.world() > 1 {
        let over = if crate::distributed::launched_by_mpi() {
            "MPI"
        } else {
            "TCP"
        };
        job.log(format!("{} ranks ({over})", job.world()));
    }
    if job.is_lead() {
        observer.prepared(&pp);
    }
    let rec = Recording {
        dir: run_dir,
        resume,
        observer,
    };
    job.run(|rank| train_rank(&p, &pp, Some(&rec), rank, feature_seconds))
}

/// The inputs and labels of samples `idx` (or the features `feats` of them), on `device`.
fn batch_tensor(
    pp: &TrainingData,
    idx: &[usize],
    feats: Option<&[f32]>,
    device: &Device,
) -> Result<(CTensor, CTensor), TrainError> {
    let per = pp.features.per_sample();
    let mut x = Vec::with_capacity(idx.len() * per);
    match feats {
        Some(f) => x.extend_from_slice(f),
        None => {
            for &i in idx {
                x.extend_from_slice(pp.features.row(i));
            }
        }
    }
    let mut shape = vec![idx.len()];
    shape.extend(&pp.features.meta.dims);
    let y: Vec<u32> = idx.iter().map(|&i| pp.labels()[i] as u32).collect();
    Ok((
        CTensor::from_vec(x, shape, device)?,
        CTensor::from_vec(y, idx.len(), device)?,
    ))
}

/// Loss and predictions of `model` over `idx` (batched).
pub fn predict(
    pp: &TrainingData,
    model: &Trainable,
    idx: &[usize],
) -> Result<(f64, Vec<usize>), TrainError> {
    let (loss_sum, preds) = predict_sum(pp, model, idx)?;
    Ok((loss_sum / idx.len().max(1) as f64, preds))
}

/// Summed (not averaged) loss and predictions of `model` over `idx`.
pub fn predict_sum(
    pp: &TrainingData,
    model: &Trainable,
    idx: &[usize],
) -> Result<(f64, Vec<usize>), TrainError> {
    let mut loss_sum = 0.0;
    let mut preds = Vec::with_capacity(idx.len());
    // Small chunks: the forward pass keeps its graph (the variables are tracked) until the chunk is done.
    for chunk in idx.chunks(32) {
        let (x, y) = batch_tensor(pp, chunk, None, model.device())?;
        let logits = model.forward(&x)?;
        loss_sum += candle_nn::loss::cross_entropy(&logits, &y)?.to_scalar::<f32>()? as f64
            * chunk.len() as f64;
        preds.extend(
            logits
                .argmax(D::Minus1)?
                .to_vec1::<u32>()?
                .into_iter()
                .map(|v| v as usize),
        );
    }
    Ok((loss_sum, preds))
}

/// Loads a finished run's parameters and best weights.
pub fn load_run(run_dir: &Path) -> Result<(FitParams, Weights), TrainError> {
    let run = RunDir(run_dir);
    Ok((run.params()?, run.best_weights()?))
}

/// `trainer evaluate --run`: the run's best model over every sample of `data`.
pub fn evaluate_run(run_dir: &Path, data: &Path, job: &Job) -> Result<Evaluation, TrainError> {
    let (params, weights) = load_run(run_dir)?;
    let p = FitParams {
        data: data.to_path_buf(),
        more_data: Vec::new(),
        skip_invalid: false,
        ..params.clone()
    };
    let pp = prepare(&p, job)?;
    if pp.dataset_labels != load_labels(run_dir)? {
        return Err(TrainError::Invalid(format!(
            "{} has labels {:?}, the run was trained on {:?}",
            data.display(),
            pp.dataset_labels,
            load_labels(run_dir)?
        )));
    }
    let model = Trainable::new(
        &pp.backbone,
        pp.boundary,
        pp.dataset_labels.len(),
        Some(&weights),
        p.seed,
        None,
        &Device::Cpu,
    )?;
    let idx: Vec<usize> = (0..pp.prepared.len()).collect();
    let (loss, pred) = predict(&pp, &model, &idx)?;
    Ok(report::evaluate(
        &pred,
        pp.labels(),
        &pp.dataset_labels,
        Some(loss),
    ))
}

fn load_labels(run_dir: &Path) -> Result<Vec<String>, TrainError> {
    Ok(RunDir(run_dir).summary()?.labels)
}
