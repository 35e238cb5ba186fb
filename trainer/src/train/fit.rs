//! One rank's share of a synchronous data-parallel run (Horovod semantics):
//! - every rank checks that the others run the same parameters on the same feature cache;
//! - rank 0's initial parameters (and, on resume, its checkpoint: weights, optimizer state,
//!   history) are broadcast to all;
//! - each global batch of [`split::epoch_batches`] is cut into contiguous parts
//!   ([`distributed::share`]); each rank's mean-loss gradient is weighted by `part / batch` and the
//!   weighted gradients are summed (allreduce), which is exactly the global batch's mean-loss
//!   gradient whatever the parts' sizes; every rank then takes the same optimizer step;
//! - training and validation metrics are summed over ranks (validation is split like batches);
//! - only rank 0 writes the run directory and logs. It returns the outcome; other ranks `None`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{D, DType};
use kestrel_models::{Weights, torch};
use rand::{SeedableRng, rngs::StdRng};

use super::augment::Augmenter;
use super::head::HeadSolve;
use super::init::{self, InitHead, StartHead};
use super::loss::Loss;
use super::model::{Trainable, model_summary};
use super::optim::{self, Opt};
use super::run_dir::RunDir;
use super::{
    FitOutcome, FitParams, LrScaling, Optimizer, Recording, Summary, TrainError, TrainState,
    TrainingData, batch_tensor, checkpoint, predict, predict_sum,
};
use crate::data::split::{self, Split};
use crate::distributed::{self, Collective, Rank};
use crate::report::{self, EpochMetrics, Evaluation};

/// The split's sample indices.
pub(super) struct Sets {
    pub train: Vec<usize>,
    pub val: Vec<usize>,
    pub test: Vec<usize>,
}

/// What stays the same for a whole fit on this rank: the parameters, the data and its split,
/// the loss, the rank, and where rank 0 records the run (`None`: nothing written, or not rank 0).
pub(super) struct Fit<'a> {
    pub p: &'a FitParams,
    pub pp: &'a TrainingData,
    pub sets: Sets,
    pub loss: Loss,
    pub r: &'a Rank<'a>,
    /// Rank 0's recording of the run.
    pub rec: Option<&'a Recording<'a>>,
}

/// Trains `p` on this rank (see the module docs). With `rec`, rank 0 writes the run in its
/// directory (tuning trials pass `None`: nothing is written), continuing from the run's latest
/// checkpoint when it says so.
pub fn train_rank(
    p: &FitParams,
    pp: &TrainingData,
    rec: Option<&Recording<'_>>,
    r: &Rank<'_>,
    feature_seconds: f64,
) -> Result<Option<FitOutcome>, TrainError> {
    check_same_everywhere(p, pp, r.comm)?;
    r.log(format!(
        "split (seed {}):\n{}",
        p.seed,
        split::count_table(pp.labels(), &pp.splits, &pp.dataset_labels)
    ));
    let sets = Sets {
        train: pp.indices(Split::Train),
        val: pp.indices(Split::Val),
        test: pp.indices(Split::Test),
    };
    if sets.val.is_empty() {
        return Err(TrainError::Invalid(
            "the validation split is empty: raise --val-fraction".into(),
        ));
    }
    let classes = pp.dataset_labels.len();
    let fit = Fit {
        p,
        pp,
        loss: Loss::new(p, pp.labels(), &sets.train, classes),
        sets,
        r,
        rec: rec.filter(|_| r.is_lead()),
    };
    let start = start_head(p, pp, r)?;
    if p.optimizer == Optimizer::Lbfgs {
        return fit.solve_head(feature_seconds, start.as_ref());
    }
    let device = p.compute_device.candle(r.local_rank())?;
    let mut model = Trainable::fresh(pp, p.seed, &device)?;
    let first_stage = if p.head_first {
        Some(fit.head_first(&mut model, start.as_ref())?)
    } else {
        if let Some(h) = &start {
            model.set_classifier(&h.weight, &h.bias)?;
        }
        None
    };
    let init = start.map(|h| h.info);
    let mut opt = Opt::new(p, &model.vars)?;
    let resume_from = fit.rec.filter(|rec| rec.resume).map(|rec| rec.dir);
    let mut state = start_state(p, resume_from, &model, &mut opt, r)?;
    if let Some(rec) = fit.rec {
        checkpoint::begin(rec.dir, p, pp, &state)?;
    }
    if state.epoch == 0 {
        r.log(model_summary(pp, &model));
    }
    let lr_factor = lr_factor(p, r);
    let aug = Augmenter::new(p, pp, r.engine_opts())?;
    // The best epoch's weights (also in best.safetensors when writing a run).
    let mut best: Option<Weights> = None;
    let started = Instant::now();
    while state.epoch < p.epochs {
        if p.early_stopping.is_some_and(|pat| state.bad_epochs >= pat) {
            r.log(format!(
                "early stopping: no val_loss improvement for {} epochs",
                state.bad_epochs
            ));
            break;
        }
        let lr = p.lr_at(state.epoch) * lr_factor;
        let m = fit.run_epoch(&model, &mut opt, state.epoch + 1, lr, aug.as_ref())?;
        r.log(format!(
            "epoch {:>3}/{}: lr {lr:.2e} train loss {:.4} acc {:.3} | val loss {:.4} acc {:.3} | {:.0} samples/s",
            m.epoch, p.epochs, m.train_loss, m.train_accuracy, m.val_loss, m.val_accuracy, m.samples_per_s
        ));
        fit.record_epoch(&mut state, &m, opt.step, &model, &mut best)?;
        if let Some(rec) = fit.rec {
            checkpoint::save_epoch(rec.dir, &model, &opt, &state, &m)?;
            rec.observer.epoch(&m);
        }
    }
    let train_seconds = started.elapsed().as_secs_f64();
    if !r.is_lead() {
        return Ok(None);
    }
    let times = (feature_seconds, train_seconds);
    let summary = fit.finish(&model, &state, best, times, first_stage, init)?;
    Ok(Some(fit.outcome(summary)))
}

/// The head `--init-from` names, mapped onto this run's classes (logged once).
fn start_head(
    p: &FitParams,
    pp: &TrainingData,
    r: &Rank<'_>,
) -> Result<Option<StartHead>, TrainError> {
    let Some(dir) = &p.init_from else {
        return Ok(None);
    };
    let h = init::load(dir, &pp.dataset_labels, pp.backbone.net.feature_dim)?;
    r.log(format!(
        "init: head from {} ({} of {} classes by name{}{})",
        dir.display(),
        h.info.matched,
        pp.dataset_labels.len(),
        match h.info.new_classes.as_slice() {
            [] => String::new(),
            new => format!("; new, starting at zero: {}", new.join(", ")),
        },
        match h.info.dropped_classes.as_slice() {
            [] => String::new(),
            gone => format!("; not in these tables, dropped: {}", gone.join(", ")),
        },
    ));
    Ok(Some(h))
}

/// Same parameters and data on every rank (the table and cache paths may differ between hosts).
fn check_same_everywhere(
    p: &FitParams,
    pp: &TrainingData,
    comm: &dyn Collective,
) -> Result<(), TrainError> {
    let same = FitParams {
        data: PathBuf::new(),
        more_data: Vec::new(),
        init_from: None,
        cache: None,
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
    Ok(())
}

/// The training state to start from: fresh, or (rank 0, `resume_from`) the latest checkpoint;
/// then rank 0's state, optimizer state and parameters everywhere.
fn start_state(
    p: &FitParams,
    resume_from: Option<&Path>,
    model: &Trainable,
    opt: &mut Opt,
    r: &Rank<'_>,
) -> Result<TrainState, TrainError> {
    let mut state = TrainState::default();
    let mut resumed = false;
    if let Some(dir) = resume_from {
        match checkpoint::load_latest(dir, model, opt)? {
            Some((e, s)) => {
                state = s;
                resumed = true;
                r.log(format!("resuming after epoch {e} of {}", p.epochs));
            }
            None => r.log("no checkpoint yet: starting from the beginning"),
        }
    }
    if r.world() == 1 {
        return Ok(state);
    }
    // JSON has no infinity: the best loss travels as bits.
    let comm = r.comm;
    let mut st = if r.is_lead() {
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
    Ok(state)
}

/// The learning-rate factor for the rank count (logged once with the batch parts).
fn lr_factor(p: &FitParams, r: &Rank<'_>) -> f64 {
    let world = r.world();
    let (factor, name) = match p.lr_scaling {
        LrScaling::None => (1.0, "none"),
        LrScaling::Linear => (world as f64, "linear"),
    };
    if world > 1 {
        r.log(format!(
            "{world} workers: global batch {} (parts of {}..={}), lr x{factor} (--lr-scaling {name})",
            p.batch_size,
            p.batch_size / world,
            p.batch_size.div_ceil(world),
        ));
    }
    factor
}

impl Fit<'_> {
    /// The run directory rank 0 writes, if any.
    pub fn out(&self) -> Option<&Path> {
        self.rec.map(|rec| rec.dir)
    }

    /// Rank 0's outcome.
    pub fn outcome(&self, summary: Summary) -> FitOutcome {
        FitOutcome {
            run_dir: self.out().map(Path::to_path_buf).unwrap_or_default(),
            summary,
        }
    }

    /// One epoch over this rank's parts of the global batches, then validation; metrics summed over
    /// ranks. Rank 0 shows a progress bar when it records the run.
    fn run_epoch(
        &self,
        model: &Trainable,
        opt: &mut Opt,
        epoch: usize,
        lr: f64,
        aug: Option<&Augmenter>,
    ) -> Result<EpochMetrics, TrainError> {
        let Fit { p, pp, sets, r, .. } = self;
        let loss_fn = &self.loss;
        let show_progress = self.rec.is_some();
        let (rank, world, comm) = (r.rank(), r.world(), r.comm);
        let t0 = Instant::now();
        let batches = split::epoch_batches(&sets.train, p.batch_size, p.seed, epoch);
        let pb = if show_progress {
            r.progress(batches.len() as u64, &format!("epoch {epoch}"))
        } else {
            indicatif::ProgressBar::hidden()
        };
        let (mut loss_sum, mut correct, mut seen) = (0.0f64, 0usize, 0usize);
        let mut aug_rng = StdRng::seed_from_u64(p.seed.wrapping_add(epoch as u64 * 7919));
        for b in &batches {
            crate::interrupt::check()?;
            let mine = distributed::share(b.len(), rank, world);
            let part = &b[mine.clone()];
            let aug_feats = aug
                .map(|a| a.features(pp, b, mine, &mut aug_rng))
                .transpose()?;
            let (x, y) = batch_tensor(pp, part, aug_feats.as_deref(), model.device())?;
            let logits = model.forward(&x)?;
            let labels: Vec<usize> = part.iter().map(|&i| pp.labels()[i]).collect();
            let loss = loss_fn.mean(&logits, &labels)?;
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
            correct += logits
                .argmax(D::Minus1)?
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
        let val_part = &sets.val[distributed::share(sets.val.len(), rank, world)];
        let (val_loss_sum, val_pred) = predict_sum(pp, model, val_part)?;
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
        Ok(EpochMetrics {
            epoch,
            train_loss: loss_sum / seen,
            train_accuracy: correct / seen,
            val_loss: val_loss_sum / sets.val.len() as f64,
            val_accuracy: val_correct / sets.val.len() as f64,
            samples_per_s: seen / secs.max(1e-9),
        })
    }

    /// Updates the state with a finished epoch; a new best epoch's weights are kept (rank 0) and
    /// saved as `best.safetensors` in a run directory.
    fn record_epoch(
        &self,
        state: &mut TrainState,
        m: &EpochMetrics,
        opt_step: u64,
        model: &Trainable,
        best: &mut Option<Weights>,
    ) -> Result<(), TrainError> {
        let (r, out) = (self.r, self.out());
        state.epoch = m.epoch;
        state.opt_step = opt_step;
        if m.val_loss < state.best_val_loss {
            state.best_val_loss = m.val_loss;
            state.best_val_accuracy = m.val_accuracy;
            state.best_epoch = m.epoch;
            state.bad_epochs = 0;
            if r.is_lead() {
                let w = model.weights()?;
                if let Some(dir) = out {
                    torch::write_safetensors(&dir.join(RunDir::BEST), &w, None)?;
                }
                *best = Some(w);
            }
        } else {
            state.bad_epochs += 1;
        }
        state.history.push(m.clone());
        Ok(())
    }

    /// Rank 0 after the last epoch: `last.safetensors`, the best epoch evaluated on validation (and
    /// test), `summary.json` and the curves.
    pub(super) fn finish(
        &self,
        model: &Trainable,
        state: &TrainState,
        best: Option<Weights>,
        (feature_seconds, train_seconds): (f64, f64),
        head: Option<(HeadSolve, Option<f64>)>,
        init: Option<InitHead>,
    ) -> Result<Summary, TrainError> {
        let (pp, sets, out) = (self.pp, &self.sets, self.out());
        if let Some(dir) = out {
            torch::write_safetensors(&dir.join(RunDir::LAST), &model.weights()?, None)?;
        }
        let best = match (best, out) {
            (Some(w), _) => w,
            // Resumed after the best epoch: it is on disk.
            (None, Some(dir)) if state.best_epoch > 0 => checkpoint::best_weights(dir)?,
            _ => {
                return Err(TrainError::Diverged {
                    epochs: state.epoch,
                });
            }
        };
        model.load(&best)?;
        let eval = |idx: &[usize]| -> Result<Evaluation, TrainError> {
            let (loss, pred) = predict(pp, model, idx)?;
            let truth: Vec<usize> = idx.iter().map(|&i| pp.labels()[i]).collect();
            Ok(report::evaluate(
                &pred,
                &truth,
                &pp.dataset_labels,
                Some(loss),
            ))
        };
        let validation = eval(&sets.val)?;
        let test = if sets.test.is_empty() {
            None
        } else {
            Some(eval(&sets.test)?)
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
            features_reused: pp.features.reused,
            unlabelled_skipped: pp.unlabelled,
            init,
            feature_seconds,
            train_seconds,
            head_val_accuracy: head.as_ref().and_then(|h| h.1),
            head: head.map(|h| h.0),
        };
        if let Some(dir) = out {
            report::write_json_atomic(&dir.join(RunDir::SUMMARY), &summary)?;
            report::plot_curves(&state.history, dir)?;
        }
        Ok(summary)
    }
}
