//! `trainer fit`: transfer learning on cached backbone features (candle), with resumable,
//! deterministic runs.
//!
//! The frozen part of the backbone (`[0, boundary)`, `boundary = blocks - unfreeze_last`) comes from
//! the feature cache; the unfrozen blocks (batch norm folded into their convs, i.e. BN statistics
//! stay frozen) and a new linear classifier train in candle. Initial classifier weights come from a
//! seeded generator, each epoch's order from (seed, epoch), so a run is a pure function of its
//! parameters and a resumed run ends with the same weights as an uninterrupted one.

use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{D, DType, Device, Tensor as CTensor};
use kestrel_models::backbone::Backbone;
use kestrel_models::{EngineKind, Weights, torch};
use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::{Deserialize, Serialize};

use crate::cache::{self, CacheError, Features, Prepared};
use crate::collective::{self, AbortOnPanic, Collective, CollectiveError};
use crate::data::{self, Dataset, SourceOpts};
pub use crate::model::{Trainable, model_summary};
use crate::optim::{self, Opt};
use crate::report::{self, EpochMetrics, Evaluation};
use crate::split::{self, Split};

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Data(#[from] data::DataError),
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error(transparent)]
    Backbone(#[from] kestrel_models::backbone::BackboneError),
    #[error("candle: {0}")]
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
    #[error("worker rank {rank}: {message}")]
    Worker { rank: usize, message: String },
    #[error("{path}: {reason}")]
    Run { path: String, reason: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Optimizer {
    Sgd,
    Adamw,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// x0.1 at 1/3 and 2/3 of the epochs.
    Step,
    /// Cosine decay to 0 over the epochs.
    Cosine,
    None,
}

/// How the learning rate changes with the number of workers (ranks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LrScaling {
    /// The same learning rate for any worker count: with the same global batch, N workers train
    /// exactly what 1 worker trains (the default).
    #[default]
    None,
    /// lr x workers (Horovod's recipe, for when the global batch grows with the workers).
    Linear,
}

/// Everything that determines a run (saved as `params.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FitParams {
    pub data: PathBuf,
    pub source: SourceOptsSer,
    pub backbone: String,
    pub arch: Option<String>,
    pub engine: EngineKind,
    pub epochs: usize,
    pub batch_size: usize,
    pub lr: f64,
    pub momentum: f64,
    pub weight_decay: f64,
    pub optimizer: Optimizer,
    pub schedule: Schedule,
    pub early_stopping: Option<usize>,
    pub seed: u64,
    pub val_fraction: f64,
    pub test_fraction: f64,
    pub unfreeze_last: usize,
    pub augment_flip: bool,
    pub augment_crop: bool,
    pub workers: usize,
    pub skip_invalid: bool,
    /// Learning-rate scaling with the worker count (absent in older params.json: none).
    #[serde(default)]
    pub lr_scaling: LrScaling,
}

/// Serializable copy of [`SourceOpts`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SourceOptsSer {
    pub label_column: String,
    pub content_column: String,
    pub path_column: String,
}

impl From<&SourceOptsSer> for SourceOpts {
    fn from(s: &SourceOptsSer) -> Self {
        SourceOpts {
            label_column: s.label_column.clone(),
            content_column: s.content_column.clone(),
            path_column: s.path_column.clone(),
        }
    }
}

impl Default for SourceOptsSer {
    fn default() -> Self {
        let d = SourceOpts::default();
        Self {
            label_column: d.label_column,
            content_column: d.content_column,
            path_column: d.path_column,
        }
    }
}

impl FitParams {
    pub fn lr_at(&self, epoch: usize) -> f64 {
        match self.schedule {
            Schedule::None => self.lr,
            Schedule::Step => {
                let k = (epoch * 3) / self.epochs.max(1);
                self.lr * 0.1f64.powi(k as i32)
            }
            Schedule::Cosine => {
                self.lr
                    * 0.5
                    * (1.0
                        + (std::f64::consts::PI * epoch as f64 / self.epochs.max(1) as f64).cos())
            }
        }
    }

    fn validate(&self) -> Result<(), TrainError> {
        let bad = |m: String| Err(TrainError::Invalid(m));
        if self.epochs == 0 || self.batch_size == 0 {
            return bad("--epochs and --batch-size must be positive".into());
        }
        if !(self.lr > 0.0) {
            return bad(format!("--lr must be positive, got {}", self.lr));
        }
        if !(0.0..1.0).contains(&(self.val_fraction + self.test_fraction))
            || self.val_fraction <= 0.0
        {
            return bad("--val-fraction must be > 0 and val + test fractions < 1".into());
        }
        if self.batch_size < self.workers.max(1) {
            return bad(format!(
                "--batch-size {} is smaller than --workers {}: every worker needs at least one sample of each global batch",
                self.batch_size, self.workers
            ));
        }
        Ok(())
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
    pub backbone_runs: usize,
    pub feature_seconds: f64,
    pub train_seconds: f64,
}

/// Data ready for training: cached samples and features, labels and split.
pub struct Prepped {
    pub dataset_labels: Vec<String>,
    pub prepared: Prepared,
    pub features: Features,
    pub splits: Vec<Split>,
    pub backbone: Backbone,
    pub boundary: usize,
}

impl Prepped {
    pub fn indices(&self, s: Split) -> Vec<usize> {
        (0..self.splits.len())
            .filter(|&i| self.splits[i] == s)
            .collect()
    }

    pub fn labels(&self) -> &[usize] {
        &self.prepared.meta.sample_labels
    }
}

/// Which sample went to which split, written into every run directory.
pub const SPLIT_FILE: &str = "split.json";

/// One sample's assignment: its id in the table, label, content hash and split.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SplitRecord {
    pub split: Split,
    pub id: String,
    pub label: String,
    pub sha256: String,
}

fn split_records(pp: &Prepped) -> Vec<SplitRecord> {
    let m = &pp.prepared.meta;
    (0..pp.splits.len())
        .map(|i| SplitRecord {
            split: pp.splits[i],
            id: m.ids[i].clone(),
            label: m.labels[m.sample_labels[i]].clone(),
            sha256: m.content_sha256[i].clone(),
        })
        .collect()
}

/// Loads the table, builds or reuses the sample and feature caches, and splits.
pub fn prepare(
    p: &FitParams,
    cache_root: &Path,
    threads: usize,
    log: &mut dyn FnMut(String),
) -> Result<Prepped, TrainError> {
    prepare_on(p, cache_root, threads, None, log)
}

/// [`prepare`] on one rank of `comm` (MPI): rank 0 builds the sample cache first (the others then
/// find it on a shared file system, or build their own copy), and the ranks extract the features
/// together ([`cache::features_on`]). Without `comm`, `p.workers` local workers extract them.
pub fn prepare_on(
    p: &FitParams,
    cache_root: &Path,
    threads: usize,
    comm: Option<&dyn Collective>,
    log: &mut dyn FnMut(String),
) -> Result<Prepped, TrainError> {
    let ds: Dataset = data::load(&p.data, &(&p.source).into())?;
    let arch = p
        .arch
        .as_deref()
        .map(|a| {
            kestrel_models::Arch::parse(a)
                .ok_or_else(|| TrainError::Invalid(format!("unknown architecture `{a}`")))
        })
        .transpose()?;
    let backbone = Backbone::resolve(&p.backbone, arch)?;
    let blocks = backbone.net.blocks.len();
    if p.unfreeze_last >= blocks {
        return Err(TrainError::Invalid(format!(
            "--unfreeze-last {} but {} has {blocks} blocks",
            p.unfreeze_last, backbone.net.arch
        )));
    }
    let boundary = blocks - p.unfreeze_last;
    let build = || {
        Prepared::open_or_build(
            &cache_root.join(""),
            &ds,
            &backbone.net.preprocess,
            p.workers,
            p.skip_invalid,
        )
    };
    let prepared = match comm {
        Some(c) if c.world() > 1 => {
            let first = if c.rank() == 0 { Some(build()?) } else { None };
            c.barrier()?;
            match first {
                Some(p) => p,
                None => build()?,
            }
        }
        _ => build()?,
    };
    log(format!(
        "samples: {} from {} ({} classes){}, cache {} {}",
        prepared.len(),
        ds.source,
        ds.labels.len(),
        match prepared.meta.skipped.len() {
            0 => String::new(),
            n => format!(", {n} invalid skipped"),
        },
        if prepared.reused { "reused" } else { "built" },
        prepared.dir.display()
    ));
    for (id, why) in prepared.meta.skipped.iter().take(5) {
        log(format!("  skipped {id}: {why}"));
    }
    let features = match comm {
        Some(c) => cache::features_on(
            cache_root, &prepared, &backbone, boundary, p.engine, threads, c,
        )?,
        None => cache::features_local(
            cache_root, &prepared, &backbone, boundary, p.engine, threads, p.workers,
        )?,
    };
    log(format!(
        "features: boundary {boundary}/{blocks} dims {:?}, backbone runs: {} ({})",
        features.meta.dims,
        features.computed,
        if features.computed == 0 {
            "cache hit".to_string()
        } else {
            format!(
                "{:.1}s on {}, {} worker(s)",
                features.meta.seconds, p.engine, features.meta.workers
            )
        }
    ));
    let labels = prepared.meta.sample_labels.clone();
    let classes = prepared.meta.labels.len();
    let splits = split::stratified(&labels, classes, p.val_fraction, p.test_fraction, p.seed);
    Ok(Prepped {
        dataset_labels: prepared.meta.labels.clone(),
        prepared,
        features,
        splits,
        backbone,
        boundary,
    })
}

fn batch_tensor(
    pp: &Prepped,
    idx: &[usize],
    feats: Option<&[f32]>,
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
        CTensor::from_vec(x, shape, &Device::Cpu)?,
        CTensor::from_vec(y, idx.len(), &Device::Cpu)?,
    ))
}

/// Loss and predictions of `model` over `idx` (batched).
pub fn predict(
    pp: &Prepped,
    model: &Trainable,
    idx: &[usize],
) -> Result<(f64, Vec<usize>), TrainError> {
    let (loss_sum, preds) = predict_sum(pp, model, idx)?;
    Ok((loss_sum / idx.len().max(1) as f64, preds))
}

/// Summed (not averaged) loss and predictions of `model` over `idx`.
pub fn predict_sum(
    pp: &Prepped,
    model: &Trainable,
    idx: &[usize],
) -> Result<(f64, Vec<usize>), TrainError> {
    let mut loss_sum = 0.0;
    let mut preds = Vec::with_capacity(idx.len());
    for chunk in idx.chunks(256) {
        let (x, y) = batch_tensor(pp, chunk, None)?;
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

fn ckpt_path(run: &Path, epoch: usize, ext: &str) -> PathBuf {
    run.join("checkpoints")
        .join(format!("epoch-{epoch:04}.{ext}"))
}

/// The latest complete checkpoint (its `.json` is written last).
pub fn latest_checkpoint(run: &Path) -> Option<usize> {
    let dir = std::fs::read_dir(run.join("checkpoints")).ok()?;
    dir.filter_map(|e| {
        let name = e.ok()?.file_name().to_string_lossy().into_owned();
        name.strip_prefix("epoch-")?
            .strip_suffix(".json")?
            .parse()
            .ok()
    })
    .filter(|&e| ckpt_path(run, e, "safetensors").exists())
    .max()
}

/// One sample's random augmentation: the crop origin (7/8 of each side) and whether to flip.
/// Drawn for every sample of a global batch on every rank, in batch order, so each rank applies
/// to its part exactly what one worker would.
#[derive(Clone, Copy)]
struct AugDraw {
    crop: Option<(u32, u32)>,
    flip: bool,
}

fn draw_augment(hw: [u32; 2], flip: bool, crop: bool, rng: &mut StdRng) -> AugDraw {
    let [h, w] = hw;
    let crop = crop.then(|| {
        let (cw, ch) = (w * 7 / 8, h * 7 / 8);
        (rng.random_range(0..=w - cw), rng.random_range(0..=h - ch))
    });
    AugDraw {
        crop,
        flip: flip && rng.random_bool(0.5),
    }
}

/// Augmentation of cached pixels (random horizontal flip; random crop of 7/8 of each side resized back).
fn augment(pixels: &[u8], hw: [u32; 2], d: AugDraw) -> Vec<u8> {
    let [h, w] = hw;
    let mut img = image::RgbImage::from_raw(w, h, pixels.to_vec()).expect("cached pixels");
    if let Some((x0, y0)) = d.crop {
        let (cw, ch) = (w * 7 / 8, h * 7 / 8);
        let c = image::imageops::crop_imm(&img, x0, y0, cw, ch).to_image();
        img = image::imageops::resize(&c, w, h, image::imageops::FilterType::Triangle);
    }
    if d.flip {
        image::imageops::flip_horizontal_in_place(&mut img);
    }
    img.into_raw()
}

pub struct FitOutcome {
    pub run_dir: PathBuf,
    pub summary: Summary,
}

/// Trains (or resumes) a run in `run_dir` on `p.workers` local worker threads (see [`fit_local`])
/// with the default collective timeout. `log` receives human-readable progress lines.
pub fn fit(
    p: &FitParams,
    run_dir: &Path,
    resume: bool,
    cache_root: &Path,
    threads: usize,
    log: &mut dyn FnMut(String),
) -> Result<FitOutcome, TrainError> {
    fit_local(
        p,
        run_dir,
        resume,
        cache_root,
        threads,
        collective::DEFAULT_TIMEOUT,
        log,
    )
}

/// Synchronous data-parallel training on `p.workers` threads of this process, connected by
/// [`collective::local_group`]. Features are prepared once and shared; each worker trains its
/// part of every global batch ([`train_rank`]).
pub fn fit_local(
    p: &FitParams,
    run_dir: &Path,
    resume: bool,
    cache_root: &Path,
    threads: usize,
    timeout: std::time::Duration,
    log: &mut dyn FnMut(String),
) -> Result<FitOutcome, TrainError> {
    p.validate()?;
    let run_err = |reason: String| TrainError::Run {
        path: run_dir.display().to_string(),
        reason,
    };
    std::fs::create_dir_all(run_dir.join("checkpoints")).map_err(|e| run_err(e.to_string()))?;
    let started = Instant::now();
    let pp = prepare(p, cache_root, threads, log)?;
    let feature_seconds = started.elapsed().as_secs_f64();
    let world = p.workers.max(1);
    let comms = collective::local_group(world, timeout);
    let lead_only = |r: Result<Option<FitOutcome>, TrainError>| {
        r.and_then(|o| o.ok_or_else(|| TrainError::Invalid("rank 0 returned no outcome".into())))
    };
    if world == 1 {
        return lead_only(train_rank(
            p,
            Some(run_dir),
            resume,
            &pp,
            &comms[0],
            threads,
            feature_seconds,
            log,
        ));
    }
    // Threads for each worker's own engine (augmentation only); candle shares rayon's pool.
    let per_worker = (threads / world).max(1);
    let (first, results) = std::thread::scope(|s| {
        let handles: Vec<_> = comms[1..]
            .iter()
            .map(|c| {
                let pp = &pp;
                s.spawn(move || {
                    let _guard = AbortOnPanic(c);
                    let r = train_rank(
                        p,
                        Some(run_dir),
                        resume,
                        pp,
                        c,
                        per_worker,
                        feature_seconds,
                        &mut |_| {},
                    );
                    if let Err(e) = &r {
                        c.abort(&e.to_string());
                    }
                    r
                })
            })
            .collect();
        let first = {
            let _guard = AbortOnPanic(&comms[0]);
            let r = train_rank(
                p,
                Some(run_dir),
                resume,
                &pp,
                &comms[0],
                per_worker,
                feature_seconds,
                log,
            );
            if let Err(e) = &r {
                comms[0].abort(&e.to_string());
            }
            r
        };
        let results: Vec<Result<Option<FitOutcome>, TrainError>> = handles
            .into_iter()
            .enumerate()
            .map(|(i, h)| {
                h.join().unwrap_or_else(|_| {
                    Err(TrainError::Worker {
                        rank: i + 1,
                        message: "panicked".into(),
                    })
                })
            })
            .collect();
        (first, results)
    });
    // Report the root cause: an error that is not just "another rank failed".
    let secondary = |e: &TrainError| {
        matches!(
            e,
            TrainError::Collective(CollectiveError::PeerFailed { .. })
        )
    };
    let mut errors: Vec<(usize, TrainError)> = Vec::new();
    let first = match first {
        Ok(o) => o,
        Err(e) => {
            errors.push((0, e));
            None
        }
    };
    for (i, r) in results.into_iter().enumerate() {
        if let Err(e) = r {
            errors.push((i + 1, e));
        }
    }
    if !errors.is_empty() {
        let pick = errors.iter().position(|(_, e)| !secondary(e)).unwrap_or(0);
        let (rank, e) = errors.swap_remove(pick);
        return Err(match e {
            e @ (TrainError::Worker { .. } | TrainError::Collective(_)) => e,
            e if rank == 0 => e,
            e => TrainError::Worker {
                rank,
                message: e.to_string(),
            },
        });
    }
    lead_only(Ok(first))
}

/// A run on one rank of `comm` (an MPI job: one process per rank): `p.workers` must be 1 or the
/// world size (it is recorded as the world size); only rank 0 logs and writes the run directory.
/// Rank 0 returns the outcome, the others `None`.
pub fn fit_on(
    p: &FitParams,
    run_dir: &Path,
    resume: bool,
    cache_root: &Path,
    threads: usize,
    comm: &dyn Collective,
    log: &mut dyn FnMut(String),
) -> Result<Option<FitOutcome>, TrainError> {
    let world = comm.world();
    if p.workers != 1 && p.workers != world {
        return Err(TrainError::Invalid(format!(
            "--workers {} under a {world}-rank job: the ranks are the workers (pass 1 or {world})",
            p.workers
        )));
    }
    let p = FitParams {
        workers: world,
        ..p.clone()
    };
    p.validate()?;
    let mut quiet = |_: String| {};
    let log: &mut dyn FnMut(String) = if comm.rank() == 0 { log } else { &mut quiet };
    if comm.rank() == 0 {
        std::fs::create_dir_all(run_dir.join("checkpoints")).map_err(|e| TrainError::Run {
            path: run_dir.display().to_string(),
            reason: e.to_string(),
        })?;
    }
    let started = Instant::now();
    let pp = prepare_on(&p, cache_root, threads, Some(comm), log)?;
    let feature_seconds = started.elapsed().as_secs_f64();
    if comm.rank() == 0 && world > 1 {
        log(format!("{world} ranks (MPI)"));
    }
    train_rank(
        &p,
        Some(run_dir),
        resume,
        &pp,
        comm,
        threads,
        feature_seconds,
        log,
    )
}

/// One rank's share of a synchronous data-parallel run (Horovod semantics):
/// - every rank checks that the others run the same parameters on the same feature cache;
/// - rank 0's initial parameters (and, on resume, its checkpoint: weights, optimizer state,
///   history) are broadcast to all;
/// - each global batch of [`split::epoch_batches`] is cut into contiguous parts
///   ([`split::local_part`]); each rank's mean-loss gradient is weighted by `part / batch` and the
///   weighted gradients are summed (allreduce), which is exactly the global batch's mean-loss
///   gradient whatever the parts' sizes; every rank then takes the same optimizer step;
/// - training and validation metrics are summed over ranks (validation is split like batches);
/// - only rank 0 writes the run directory and logs. It returns the outcome; other ranks `None`.
#[allow(clippy::too_many_arguments)]
pub fn train_rank(
    p: &FitParams,
    run_dir: Option<&Path>,
    resume: bool,
    pp: &Prepped,
    comm: &dyn Collective,
    threads: usize,
    feature_seconds: f64,
    log: &mut dyn FnMut(String),
) -> Result<Option<FitOutcome>, TrainError> {
    let (rank, world) = (comm.rank(), comm.world());
    let lead = rank == 0;
    // Where rank 0 writes the run (nothing is written without a run directory: tuning trials).
    let out = run_dir.filter(|_| lead);
    let run_err = |reason: String| TrainError::Run {
        path: run_dir.map(|d| d.display().to_string()).unwrap_or_default(),
        reason,
    };
    // Same parameters and data on every rank (the table path may differ between hosts).
    let same = FitParams {
        data: PathBuf::new(),
        ..p.clone()
    };
    comm.check_same(
        "training parameters",
        &serde_json::to_vec(&same).expect("params serialize"),
    )?;
    comm.check_same(
        "samples and features (cache keys)",
        format!(
            "{} {} {:?} {}",
            pp.prepared.meta.key,
            pp.features.meta.backbone_id,
            pp.features.meta.dims,
            pp.prepared.len()
        )
        .as_bytes(),
    )?;
    let classes = pp.dataset_labels.len();
    if lead {
        log(format!(
            "split (seed {}):\n{}",
            p.seed,
            split::count_table(pp.labels(), &pp.splits, &pp.dataset_labels)
        ));
    }
    let train_idx = pp.indices(Split::Train);
    let val_idx = pp.indices(Split::Val);
    let test_idx = pp.indices(Split::Test);
    if val_idx.is_empty() {
        return Err(TrainError::Invalid(
            "the validation split is empty: raise --val-fraction".into(),
        ));
    }

    let model = Trainable::new(&pp.backbone, pp.boundary, classes, None, p.seed)?;
    let mut opt = Opt::new(p, &model.vars)?;
    let mut state = TrainState {
        epoch: 0,
        opt_step: 0,
        best_epoch: 0,
        best_val_loss: f64::INFINITY,
        best_val_accuracy: 0.0,
        bad_epochs: 0,
        history: Vec::new(),
    };
    let mut resumed = false;
    if let (true, Some(run_dir)) = (resume, out) {
        if let Some(e) = latest_checkpoint(run_dir) {
            let text = std::fs::read_to_string(ckpt_path(run_dir, e, "json"))
                .map_err(|e| run_err(e.to_string()))?;
            state = serde_json::from_str(&text)
                .map_err(|e| run_err(format!("checkpoint state: {e}")))?;
            let w = torch::read_safetensors(&ckpt_path(run_dir, e, "safetensors"))?;
            model.load(&w)?;
            opt.load(&model.vars, &w, state.opt_step)?;
            resumed = true;
            log(format!("resuming after epoch {e} of {}", p.epochs));
        } else {
            log("no checkpoint yet: starting from the beginning".into());
        }
    }
    if world > 1 {
        // Rank 0's state everywhere: training state, optimizer state (on resume), parameters.
        // (JSON has no infinity: the best loss travels as bits.)
        let mut st = if lead {
            let finite = TrainState {
                best_val_loss: 0.0,
                ..state.clone()
            };
            serde_json::to_vec(&(resumed, state.best_val_loss.to_bits(), finite))
                .expect("state serializes")
        } else {
            Vec::new()
        };
        comm.broadcast_bytes(&mut st, 0)?;
        let best_bits: u64;
        (resumed, best_bits, state) = serde_json::from_slice(&st)
            .map_err(|e| TrainError::Invalid(format!("broadcast training state: {e}")))?;
        state.best_val_loss = f64::from_bits(best_bits);
        if resumed {
            let mut o = opt.state_flat()?;
            comm.broadcast_f32(&mut o, 0)?;
            opt.set_state_flat(&o, state.opt_step)?;
        }
        let mut w = optim::flatten_vars(&model.vars)?;
        comm.broadcast_f32(&mut w, 0)?;
        optim::set_vars(&model.vars, &w)?;
    }
    let metrics_path = out.map(|d| d.join("metrics.jsonl"));
    if let (Some(run_dir), Some(metrics_path)) = (out, &metrics_path) {
        report::write_json_atomic(&run_dir.join("params.json"), p)?;
        report::write_json_atomic(&run_dir.join(SPLIT_FILE), &split_records(pp))?;
        // metrics.jsonl is rewritten from the checkpoint's history, dropping lines of a lost epoch.
        let _ = std::fs::remove_file(metrics_path);
        for m in &state.history {
            report::append_jsonl(metrics_path, m)?;
        }
    }
    if lead && state.epoch == 0 {
        log(model_summary(pp, &model));
    }
    // The best epoch's weights (also in best.safetensors when writing a run).
    let mut best_weights: Option<Weights> = None;
    let lr_factor = match p.lr_scaling {
        LrScaling::None => 1.0,
        LrScaling::Linear => world as f64,
    };
    if lead && world > 1 {
        log(format!(
            "{world} workers: global batch {} (parts of {}..={}), lr x{lr_factor} (--lr-scaling {})",
            p.batch_size,
            p.batch_size / world,
            p.batch_size.div_ceil(world),
            match p.lr_scaling {
                LrScaling::None => "none",
                LrScaling::Linear => "linear",
            }
        ));
    }

    let augmenting = p.augment_flip || p.augment_crop;
    let (pixels, frozen) = if augmenting {
        let opts = cache::frozen_opts(&pp.backbone, pp.boundary);
        (
            Some(pp.prepared.load_pixels()?),
            Some(pp.backbone.engine(p.engine, &opts, threads)?),
        )
    } else {
        (None, None)
    };
    let hw = pp.prepared.meta.spec.input_size;
    let train_started = Instant::now();
    while state.epoch < p.epochs {
        if p.early_stopping.is_some_and(|pat| state.bad_epochs >= pat) {
            if lead {
                log(format!(
                    "early stopping: no val_loss improvement for {} epochs",
                    state.bad_epochs
                ));
            }
            break;
        }
        let epoch = state.epoch + 1;
        let lr = p.lr_at(state.epoch) * lr_factor;
        let t0 = Instant::now();
        let batches = split::epoch_batches(&train_idx, p.batch_size, p.seed, epoch);
        let pb = if out.is_some() {
            cache::progress(batches.len() as u64, &format!("epoch {epoch}"))
        } else {
            indicatif::ProgressBar::hidden()
        };
        let (mut loss_sum, mut correct, mut seen) = (0.0f64, 0usize, 0usize);
        let mut aug_rng = StdRng::seed_from_u64(p.seed.wrapping_add(epoch as u64 * 7919));
        for b in &batches {
            let mine = collective::share(b.len(), rank, world);
            let part = &b[mine.clone()];
            let aug_feats = match (&pixels, &frozen) {
                (Some(px), Some(engine)) => {
                    // Draw for the whole global batch (same generator state on every rank).
                    let draws: Vec<AugDraw> = b
                        .iter()
                        .map(|_| draw_augment(hw, p.augment_flip, p.augment_crop, &mut aug_rng))
                        .collect();
                    let views: Vec<Vec<u8>> = part
                        .iter()
                        .zip(&draws[mine.clone()])
                        .map(|(&i, d)| augment(&px[i], hw, *d))
                        .collect();
                    let refs: Vec<&[u8]> = views.iter().map(|v| v.as_slice()).collect();
                    Some(cache::run_frozen(
                        engine.as_ref(),
                        &pp.prepared,
                        &refs,
                        pp.features.per_sample(),
                        "augment",
                    )?)
                }
                _ => None,
            };
            let (x, y) = batch_tensor(pp, part, aug_feats.as_deref())?;
            let logits = model.forward(&x)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
            let grads = loss.backward()?;
            if world == 1 {
                opt.apply(&model.vars, &grads, lr)?;
            } else {
                let weight = part.len() as f32 / b.len() as f32;
                let mut g = optim::flatten_grads(&model.vars, &grads, weight)?;
                comm.allreduce_sum(&mut g)?;
                opt.apply_flat(&model.vars, &g, lr)?;
            }
            let l = loss.to_scalar::<f32>()? as f64;
            loss_sum += l * part.len() as f64;
            let pred = logits.argmax(D::Minus1)?;
            correct += pred
                .eq(&y)?
                .to_dtype(DType::U32)?
                .sum_all()?
                .to_scalar::<u32>()? as usize;
            seen += part.len();
            pb.inc(1);
            pb.set_message(format!("epoch {epoch} loss {l:.4}"));
        }
        pb.finish_and_clear();
        let secs = t0.elapsed().as_secs_f64();
        // Validation split like the batches; sums over ranks.
        let val_part = &val_idx[collective::share(val_idx.len(), rank, world)];
        let (val_loss_sum, val_pred) = predict_sum(pp, &model, val_part)?;
        let val_correct = val_pred
            .iter()
            .zip(val_part)
            .filter(|(a, i)| **a == pp.labels()[**i])
            .count();
        let mut sums = [
            loss_sum,
            correct as f64,
            seen as f64,
            val_loss_sum,
            val_correct as f64,
        ];
        comm.allreduce_sum_f64(&mut sums)?;
        let [loss_sum, correct, seen, val_loss_sum, val_correct] = sums;
        let val_loss = val_loss_sum / val_idx.len() as f64;
        let val_accuracy = val_correct / val_idx.len() as f64;
        let m = EpochMetrics {
            epoch,
            train_loss: loss_sum / seen,
            train_accuracy: correct / seen,
            val_loss,
            val_accuracy,
            samples_per_s: seen / secs.max(1e-9),
        };
        if lead {
            log(format!(
                "epoch {epoch:>3}/{}: lr {lr:.2e} train loss {:.4} acc {:.3} | val loss {:.4} acc {:.3} | {:.0} samples/s",
                p.epochs,
                m.train_loss,
                m.train_accuracy,
                m.val_loss,
                m.val_accuracy,
                m.samples_per_s
            ));
        }
        state.epoch = epoch;
        state.opt_step = opt.step;
        if val_loss < state.best_val_loss {
            state.best_val_loss = val_loss;
            state.best_val_accuracy = val_accuracy;
            state.best_epoch = epoch;
            state.bad_epochs = 0;
            if lead {
                let w = model.weights()?;
                if let Some(run_dir) = out {
                    torch::write_safetensors(&run_dir.join("best.safetensors"), &w, None)?;
                }
                best_weights = Some(w);
            }
        } else {
            state.bad_epochs += 1;
        }
        state.history.push(m.clone());
        if let (Some(run_dir), Some(metrics_path)) = (out, &metrics_path) {
            // Checkpoint: weights + optimizer state, then the state JSON (its presence completes it).
            let mut ck = model.weights()?;
            ck.extend(opt.state(&model.vars)?);
            torch::write_safetensors(&ckpt_path(run_dir, epoch, "safetensors"), &ck, None)?;
            report::write_json_atomic(&ckpt_path(run_dir, epoch, "json"), &state)?;
            report::append_jsonl(metrics_path, &m)?;
            // Keep the two latest checkpoints.
            if epoch > 2 {
                for ext in ["json", "safetensors"] {
                    let _ = std::fs::remove_file(ckpt_path(run_dir, epoch - 2, ext));
                }
            }
        }
    }
    let train_seconds = train_started.elapsed().as_secs_f64();
    if !lead {
        return Ok(None);
    }
    // Final weights of the last epoch, and evaluation of the best epoch.
    if let Some(run_dir) = out {
        torch::write_safetensors(&run_dir.join("last.safetensors"), &model.weights()?, None)?;
    }
    let best = match (best_weights, out) {
        (Some(w), _) => w,
        // Resumed after the best epoch: it is on disk.
        (None, Some(run_dir)) if state.best_epoch > 0 => {
            torch::read_safetensors(&run_dir.join("best.safetensors"))?
        }
        _ => {
            return Err(TrainError::Diverged {
                epochs: state.epoch,
            });
        }
    };
    model.load(&best)?;
    let eval = |idx: &[usize]| -> Result<Evaluation, TrainError> {
        let (loss, pred) = predict(pp, &model, idx)?;
        let truth: Vec<usize> = idx.iter().map(|&i| pp.labels()[i]).collect();
        Ok(report::evaluate(
            &pred,
            &truth,
            &pp.dataset_labels,
            Some(loss),
        ))
    };
    let validation = eval(&val_idx)?;
    let test = if test_idx.is_empty() {
        None
    } else {
        Some(eval(&test_idx)?)
    };
    let summary = Summary {
        best_epoch: state.best_epoch,
        epochs_run: state.epoch,
        val_accuracy: validation.accuracy,
        val_loss: validation.loss.unwrap_or(f64::NAN),
        test_accuracy: test.as_ref().map(|t| t.accuracy),
        labels: pp.dataset_labels.clone(),
        validation,
        test,
        backbone_runs: pp.features.computed,
        feature_seconds,
        train_seconds,
    };
    if let Some(run_dir) = out {
        report::write_json_atomic(&run_dir.join("summary.json"), &summary)?;
        report::plot_curves(&state.history, run_dir)?;
    }
    Ok(Some(FitOutcome {
        run_dir: run_dir.map(Path::to_path_buf).unwrap_or_default(),
        summary,
    }))
}

/// Loads a finished run's parameters and best weights.
pub fn load_run(run_dir: &Path) -> Result<(FitParams, Weights), TrainError> {
    let run_err = |reason: String| TrainError::Run {
        path: run_dir.display().to_string(),
        reason,
    };
    let text = std::fs::read_to_string(run_dir.join("params.json"))
        .map_err(|e| run_err(format!("params.json: {e}")))?;
    let params: FitParams =
        serde_json::from_str(&text).map_err(|e| run_err(format!("params.json: {e}")))?;
    let weights = torch::read_safetensors(&run_dir.join("best.safetensors"))?;
    Ok((params, weights))
}

/// `trainer evaluate --run`: the run's best model over every sample of `data`.
pub fn evaluate_run(
    run_dir: &Path,
    data: &Path,
    cache_root: &Path,
    threads: usize,
    log: &mut dyn FnMut(String),
) -> Result<Evaluation, TrainError> {
    let (params, weights) = load_run(run_dir)?;
    let p = FitParams {
        data: data.to_path_buf(),
        skip_invalid: false,
        ..params.clone()
    };
    let pp = prepare(&p, cache_root, threads, log)?;
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
    let text =
        std::fs::read_to_string(run_dir.join("summary.json")).map_err(|e| TrainError::Run {
            path: run_dir.display().to_string(),
            reason: format!("summary.json: {e}"),
        })?;
    let s: Summary = serde_json::from_str(&text).map_err(|e| TrainError::Run {
        path: run_dir.display().to_string(),
        reason: format!("summary.json: {e}"),
    })?;
    Ok(s.labels)
}
