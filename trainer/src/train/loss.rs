//! The training loss: cross-entropy with optional per-class weights and label smoothing, the same
//! in the sgd/adamw loop and in the L-BFGS head. Reported validation losses stay the plain
//! cross-entropy, comparable between runs whatever their weights.

use candle_core::{D, Tensor as CTensor};

use super::{ClassWeights, FitParams};

/// Per-sample weights and smoothed targets.
#[derive(Debug, Clone)]
pub struct Loss {
    /// Weight of each class (all 1 without class weights).
    class_weight: Vec<f32>,
    smoothing: f32,
}

impl Loss {
    /// The loss of `p` for a training split with these labels (class weights count the split).
    pub fn new(p: &FitParams, labels: &[usize], train: &[usize], classes: usize) -> Self {
        let class_weight = match p.class_weights {
            ClassWeights::None => vec![1.0; classes],
            ClassWeights::Balanced => {
                let mut count = vec![0usize; classes];
                for &i in train {
                    count[labels[i]] += 1;
                }
                count
                    .iter()
                    .map(|&c| match c {
                        0 => 0.0,
                        c => train.len() as f32 / (classes * c) as f32,
                    })
                    .collect()
            }
        };
        Loss {
            class_weight,
            smoothing: p.label_smoothing as f32,
        }
    }

    /// The plain cross-entropy over `classes`: no weights, no smoothing.
    pub fn plain(classes: usize) -> Self {
        Loss {
            class_weight: vec![1.0; classes],
            smoothing: 0.0,
        }
    }

    pub fn classes(&self) -> usize {
        self.class_weight.len()
    }

    /// Weighted targets `w_y * ((1 - eps) onehot(y) + eps / classes)`, row-major `[n, classes]`.
    pub fn weighted_targets(&self, y: &[usize]) -> Vec<f32> {
        let k = self.classes();
        let off = self.smoothing / k as f32;
        let mut t = Vec::with_capacity(y.len() * k);
        for &c in y {
            let w = self.class_weight[c];
            t.extend((0..k).map(|j| {
                w * if j == c {
                    1.0 - self.smoothing + off
                } else {
                    off
                }
            }));
        }
        t
    }

    /// The sample weights `w_y`.
    pub fn sample_weights(&self, y: &[usize]) -> Vec<f32> {
        y.iter().map(|&c| self.class_weight[c]).collect()
    }

    /// Mean over the batch of the weighted, smoothed cross-entropy (differentiable).
    pub fn mean(&self, logits: &CTensor, y: &[usize]) -> candle_core::Result<CTensor> {
        let n = y.len();
        let t = CTensor::from_vec(
            self.weighted_targets(y),
            (n, self.classes()),
            logits.device(),
        )?;
        let logp = candle_nn::ops::log_softmax(logits, D::Minus1)?;
        (t * logp)?.sum_all()?.affine(-1.0 / n as f64, 0.0)
    }
}
