//! The head solved to convergence (L-BFGS, [`head::fit_head`]) inside a fit: `--optimizer lbfgs`,
//! recorded as a one-epoch run, and the first stage of `--fine-tune`.

use std::time::Instant;

use kestrel_models::torch;

use super::fit::Fit;
use super::head::{self, HeadSolve, Standardizer};
use super::init::StartHead;
use super::model::Trainable;
use super::run_dir::RunDir;
use super::{FitOutcome, TrainError, TrainState, batch_tensor, checkpoint, predict};
use crate::distributed;
use crate::report::{self, EpochMetrics};

/// The second stage of `--fine-tune` starts from the first stage's head with its logits scaled by
/// this. The converged head fits the training split almost perfectly (training loss ~0.04 on
/// digits), which leaves the blocks no gradient: started from it as it is, the second stage
/// overfitted the few samples left (digits seed 3: best validation 0.922 after a 0.944 head).
/// Shrunk, the head keeps its direction and every sample pulls on the blocks again: 0.972.
const STAGE2_HEAD_SCALE: f32 = 0.1;

impl Fit<'_> {
    /// `--optimizer lbfgs`: the head solved to convergence ([`head::fit_head`]) on every rank together;
    /// rank 0 records it as a one-epoch run (same files as the first-order loop). Deterministic, so a
    /// resumed run solves again.
    pub(super) fn solve_head(
        &self,
        feature_seconds: f64,
        start: Option<&StartHead>,
    ) -> Result<Option<FitOutcome>, TrainError> {
        let Fit {
            p,
            pp,
            sets,
            loss,
            r,
            ..
        } = self;
        let started = Instant::now();
        let init = start.map(|h| (h.weight.as_slice(), h.bias.as_slice()));
        let head = head::fit_head(pp.rows(), &sets.train, p.l2, loss, p.seed, r, init)?;
        let model = Trainable::fresh(pp, p.seed, &candle_core::Device::Cpu)?;
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
        if let Some(rec) = self.rec {
            checkpoint::begin(rec.dir, p, pp, &TrainState::default())?;
            torch::write_safetensors(&rec.dir.join(RunDir::BEST), &weights, None)?;
            report::append_jsonl(&rec.dir.join(RunDir::METRICS), &m)?;
            rec.observer.epoch(&m);
        }
        let summary = self.finish(
            &model,
            &state,
            Some(weights),
            (feature_seconds, train_seconds),
            Some((head.solve, None)),
            start.map(|h| h.info.clone()),
        )?;
        Ok(Some(self.outcome(summary)))
    }

    /// The first stage of `--fine-tune`: the unfrozen blocks as they are (pretrained) pool every
    /// sample once (each rank its share), the head is solved to convergence on those features
    /// ([`head::fit_head`]), and `model`'s classifier starts from it scaled by [`STAGE2_HEAD_SCALE`],
    /// on features standardized with the training split's statistics (the folded head of a
    /// standardized solve has large weights on low-variance features, which made the second stage
    /// diverge). Returns the solve and the head's validation accuracy.
    pub(super) fn head_first(
        &self,
        model: &mut Trainable,
        start: Option<&StartHead>,
    ) -> Result<(HeadSolve, Option<f64>), TrainError> {
        let Fit {
            p,
            pp,
            sets,
            loss,
            r,
            ..
        } = self;
        let n = pp.prepared.len();
        let mine: Vec<usize> = distributed::share(n, r.rank(), r.world()).collect();
        let mut local = Vec::new();
        for chunk in mine.chunks(32) {
            let (x, _) = batch_tensor(pp, chunk, None, model.device())?;
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
}
