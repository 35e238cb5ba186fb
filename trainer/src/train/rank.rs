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
use super::head::{self, HeadSolve, Standardizer};
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
struct Sets {
    train: Vec<usize>,
    val: Vec<usize>,
    test: Vec<usize>,
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
    // What rank 0 records.
    let lead_rec = rec.filter(|_| r.is_lead());
    let out = lead_rec.map(|rec| rec.dir);
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
    let loss = Loss::new(p, pp.labels(), &sets.train, classes);
    let start = start_head(p, pp, r)?;
    if p.optimizer == Optimizer::Lbfgs {
        let start = start.as_ref();
        return solve_head(p, rec, pp, &sets, &loss, r, feature_seconds, start);
    }
    let mut model = Trainable::new(&pp.backbone, pp.boundary, classes, None, p.seed, None)?;
    let first_stage = if p.head_first {
        Some(head_first(
            p,
            pp,
            &sets,
            &loss,
            &mut model,
            r,
            start.as_ref(),
        )?)
    } else {
        if let Some(h) = &start {
            model.set_classifier(&h.weight, &h.bias)?;
        }
        None
    };
    let init = start.map(|h| h.info);
    let mut opt = Opt::new(p, &model.vars)?;
    let resume_from = lead_rec.filter(|rec| rec.resume).map(|rec| rec.dir);
    let mut state = start_state(p, resume_from, &model, &mut opt, r)?;
    if let Some(dir) = out {
        checkpoint::begin(dir, p, pp, &state)?;
    }
    if state.epoch == 0 {
        r.log(model_summary(pp, &model));
    }
    let lr_factor = lr_factor(p, r);
    let aug = Augmenter::new(p, pp, r.threads)?;
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
        let m = run_epoch(
            p,
            pp,
            &model,
            &mut opt,
            &sets,
            state.epoch + 1,
            lr,
            aug.as_ref(),
            &loss,
            r,
            out.is_some(),
        )?;
        r.log(format!(
            "epoch {:>3}/{}: lr {lr:.2e} train loss {:.4} acc {:.3} | val loss {:.4} acc {:.3} | {:.0} samples/s",
            m.epoch, p.epochs, m.train_loss, m.train_accuracy, m.val_loss, m.val_accuracy, m.samples_per_s
        ));
        record_epoch(&mut state, &m, opt.step, &model, out, r, &mut best)?;
        if let Some(rec) = lead_rec {
            checkpoint::save_epoch(rec.dir, &model, &opt, &state, &m)?;
            rec.observer.epoch(&m);
        }
    }
    let train_seconds = started.elapsed().as_secs_f64();
    if !r.is_lead() {
        return Ok(None);
    }
    let summary = finish(
        pp,
        &model,
        &state,
        best,
        out,
        &sets,
        (feature_seconds, train_seconds),
        first_stage,
        init,
    )?;
    Ok(Some(FitOutcome {
        run_dir: rec.map(|rec| rec.dir.to_path_buf()).unwrap_or_default(),
        summary,
    }))
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

/// One epoch over this rank's parts of the global batches, then validation; metrics summed over
/// ranks.
#[allow(clippy::too_many_arguments)]
fn run_epoch(
    p: &FitParams,
    pp: &TrainingData,
    model: &Trainable,
    opt: &mut Opt,
    sets: &Sets,
    epoch: usize,
    lr: f64,
    aug: Option<&Augmenter>,
    loss_fn: &Loss,
    r: &Rank<'_>,
    show_progress: bool,
) -> Result<EpochMetrics, TrainError> {
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
        let mine = distributed::share(b.len(), rank, world);
        let part = &b[mine.clone()];
        let aug_feats = aug
            .map(|a| a.features(pp, b, mine, &mut aug_rng))
            .transpose()?;
        let (x, y) = batch_tensor(pp, part, aug_feats.as_deref())?;
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
    state: &mut TrainState,
    m: &EpochMetrics,
    opt_step: u64,
    model: &Trainable,
    out: Option<&Path>,
    r: &Rank<'_>,
    best: &mut Option<Weights>,
) -> Result<(), TrainError> {
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
#[allow(clippy::too_many_arguments)]
fn finish(
    pp: &TrainingData,
    model: &Trainable,
    state: &TrainState,
    best: Option<Weights>,
    out: Option<&Path>,
    sets: &Sets,
    (feature_seconds, train_seconds): (f64, f64),
    head: Option<(HeadSolve, Option<f64>)>,
    init: Option<InitHead>,
) -> Result<Summary, TrainError> {
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

/// `--optimizer lbfgs`: the head solved to convergence ([`head::fit_head`]) on every rank together;
/// rank 0 records it as a one-epoch run (same files as the first-order loop). Deterministic, so a
/// resumed run solves again.
#[allow(clippy::too_many_arguments)]
fn solve_head(
    p: &FitParams,
    rec: Option<&Recording<'_>>,
    pp: &TrainingData,
    sets: &Sets,
    loss: &Loss,
    r: &Rank<'_>,
    feature_seconds: f64,
    start: Option<&StartHead>,
) -> Result<Option<FitOutcome>, TrainError> {
    let lead_rec = rec.filter(|_| r.is_lead());
    let out = lead_rec.map(|rec| rec.dir);
    let started = Instant::now();
    let init = start.map(|h| (h.weight.as_slice(), h.bias.as_slice()));
    let head = head::fit_head(pp.rows(), &sets.train, p.l2, loss, p.seed, r, init)?;
    let classes = pp.dataset_labels.len();
    let model = Trainable::new(&pp.backbone, pp.boundary, classes, None, p.seed, None)?;
    model.set_classifier(&head.weight, &head.bias)?;
    let train_seconds = started.elapsed().as_secs_f64();
    r.log(format!(
        "head: L-BFGS {} iterations, l2 {:.2e}, gradient norm {:.1e}, {:.2}s",
        head.solve.iterations, head.solve.l2, head.solve.grad_norm, train_seconds
    ));
    if !r.is_lead() {
        return Ok(None);
    }
    let (train_loss, train_pred) = predict(pp, &model, &sets.train)?;
    let (val_loss, val_pred) = predict(pp, &model, &sets.val)?;
    let acc = |pred: &[usize], idx: &[usize]| {
        report::accuracy(pred.iter().copied(), idx.iter().map(|&i| pp.labels()[i]))
    };
    let m = EpochMetrics {
        epoch: 1,
        train_loss,
        train_accuracy: acc(&train_pred, &sets.train),
        val_loss,
        val_accuracy: acc(&val_pred, &sets.val),
        samples_per_s: (sets.train.len() as f64 * head.solve.iterations.max(1) as f64)
            / train_seconds.max(1e-9),
    };
    let weights = model.weights()?;
    let state = TrainState {
        epoch: 1,
        best_epoch: 1,
        best_val_loss: m.val_loss,
        best_val_accuracy: m.val_accuracy,
        history: vec![m.clone()],
        ..TrainState::default()
    };
    if let Some(rec) = lead_rec {
        checkpoint::begin(rec.dir, p, pp, &TrainState::default())?;
        torch::write_safetensors(&rec.dir.join(RunDir::BEST), &weights, None)?;
        report::append_jsonl(&rec.dir.join(RunDir::METRICS), &m)?;
        rec.observer.epoch(&m);
    }
    let summary = finish(
        pp,
        &model,
        &state,
        Some(weights),
        out,
        sets,
        (feature_seconds, train_seconds),
        Some((head.solve, None)),
        start.map(|h| h.info.clone()),
    )?;
    Ok(Some(FitOutcome {
        run_dir: rec.map(|rec| rec.dir.to_path_buf()).unwrap_or_default(),
        summary,
    }))
}

/// The second stage of `--fine-tune` starts from the first stage's head with its logits scaled by
/// this. The converged head fits the training split almost perfectly (training loss ~0.04 on
/// digits), which leaves the blocks no gradient: started from it as it is, the second stage
/// overfitted the few samples left (digits seed 3: best validation 0.922 after a 0.944 head).
/// Shrunk, the head keeps its direction and every sample pulls on the blocks again: 0.972.
const STAGE2_HEAD_SCALE: f32 = 0.1;

/// The first stage of `--fine-tune`: the unfrozen blocks as they are (pretrained) pool every
/// sample once (each rank its share), the head is solved to convergence on those features
/// ([`head::fit_head`]), and `model`'s classifier starts from it scaled by [`STAGE2_HEAD_SCALE`],
/// on features standardized with the training split's statistics (the folded head of a
/// standardized solve has large weights on low-variance features, which made the second stage
/// diverge). Returns the solve and the head's validation accuracy.
fn head_first(
    p: &FitParams,
    pp: &TrainingData,
    sets: &Sets,
    loss: &Loss,
    model: &mut Trainable,
    r: &Rank<'_>,
    start: Option<&StartHead>,
) -> Result<(HeadSolve, Option<f64>), TrainError> {
    let n = pp.prepared.len();
    let mine: Vec<usize> = distributed::share(n, r.rank(), r.world()).collect();
    let mut local = Vec::new();
    for chunk in mine.chunks(32) {
        let (x, _) = batch_tensor(pp, chunk, None)?;
        local.extend(model.pooled(&x)?.flatten_all()?.to_vec1::<f32>()?);
    }
    let pooled = r.comm.allgather_f32(&local)?;
    let dim = pooled.len() / n.max(1);
    let rows = head::FeatureRows {
        data: &pooled,
        dim,
        labels: pp.labels(),
    };
    let init = start.map(|h| (h.weight.as_slice(), h.bias.as_slice()));
    let h = head::fit_head(rows, &sets.train, p.l2, loss, p.seed, r, init)?;
    model.set_standardizer(Standardizer::fit(rows, &sets.train))?;
    let shrink = |v: &[f32]| -> Vec<f32> { v.iter().map(|x| x * STAGE2_HEAD_SCALE).collect() };
    model.set_classifier(&shrink(&h.weight), &shrink(&h.bias))?;
    let predicted = |i: usize| {
        let x = &pooled[i * dim..(i + 1) * dim];
        let score = |c: usize| {
            h.bias[c]
                + h.weight[c * dim..(c + 1) * dim]
                    .iter()
                    .zip(x)
                    .map(|(w, v)| w * v)
                    .sum::<f32>()
        };
        (0..h.bias.len())
            .max_by(|&a, &b| score(a).total_cmp(&score(b)))
            .unwrap_or(usize::MAX)
    };
    let acc = report::accuracy(
        sets.val.iter().map(|&i| predicted(i)),
        sets.val.iter().map(|&i| pp.labels()[i]),
    );
    r.log(format!(
        "fine-tune stage 1: head alone (L-BFGS, l2 {:.2e}): val accuracy {acc:.4}; stage 2: the last {} blocks and the head (starting from it x{STAGE2_HEAD_SCALE}), {:?} lr {:.1e}",
        h.solve.l2, p.unfreeze_last, p.optimizer, p.lr
    ));
    Ok((h.solve, Some(acc)))
}
