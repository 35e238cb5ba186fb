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

#[cfg(test)]
mod tests {
    use super::*;

    /// Parameters of a head-only SGD run with these class weights and label smoothing.
    fn params(class_weights: &str, label_smoothing: f64) -> FitParams {
        serde_json::from_value(serde_json::json!({
            "data": "t.csv",
            "source": { "label_column": "label", "content_column": "content", "path_column": "path" },
            "backbone": "mobilenet", "arch": null, "engine": "tract",
            "epochs": 1, "batch_size": 4, "lr": 0.1, "momentum": 0.0, "weight_decay": 0.0,
            "optimizer": "sgd", "schedule": "none", "early_stopping": null, "seed": 0,
            "val_fraction": 0.2, "test_fraction": 0.0, "unfreeze_last": 0,
            "augment_flip": false, "augment_crop": false, "workers": 1, "skip_invalid": false,
            "class_weights": class_weights, "label_smoothing": label_smoothing,
        }))
        .expect("FitParams from JSON")
    }

    #[test]
    fn balanced_weights_are_n_over_classes_times_the_class_count_in_the_training_split() {
        // Samples 4 and 5 are not in the training split: class 2 has no training sample.
        let labels = [0, 0, 0, 1, 2, 2];
        let loss = Loss::new(&params("balanced", 0.0), &labels, &[0, 1, 2, 3], 3);
        let w = loss.sample_weights(&[0, 1, 2]);
        let want = [4.0f32 / 9.0, 4.0 / 3.0, 0.0];
        for (a, e) in w.iter().zip(want) {
            assert!((a - e).abs() < 1e-6, "{w:?}");
        }
        let plain = Loss::new(&params("none", 0.0), &labels, &[0, 1, 2, 3], 3);
        assert_eq!(plain.sample_weights(&[0, 1, 2]), [1.0, 1.0, 1.0]);
    }

    #[test]
    fn smoothed_targets_put_one_minus_eps_plus_eps_over_k_on_the_label() {
        let loss = Loss::new(&params("none", 0.3), &[0, 1, 2], &[0, 1, 2], 3);
        let t = loss.weighted_targets(&[2, 0]);
        let want = [0.1f32, 0.1, 0.8, 0.8, 0.1, 0.1];
        for (a, e) in t.iter().zip(want) {
            assert!((a - e).abs() < 1e-6, "{t:?}");
        }
        assert_eq!(Loss::plain(2).weighted_targets(&[1]), [0.0, 1.0]);
        // Uniform logits: every row's targets sum to 1, so the mean loss is ln 3 whatever eps.
        let logits =
            CTensor::zeros((2, 3), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        let mean = loss
            .mean(&logits, &[2, 0])
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!((mean - 3f32.ln()).abs() < 1e-5, "{mean}");
    }
}
