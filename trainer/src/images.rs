//! Batching images through the shared preprocessing.

use std::path::PathBuf;

use kestrel_models::Tensor;
use kestrel_shared::{ImageLimits, PreprocessError, PreprocessSpec};

/// Preprocesses each path; failures are returned per image (named by path) so good images still run.
pub fn preprocess_paths(
    spec: &PreprocessSpec,
    paths: &[PathBuf],
    limits: &ImageLimits,
) -> Vec<Result<Vec<f32>, PreprocessError>> {
    paths
        .iter()
        .map(|p| spec.run_file(p, limits).map(|x| x.data))
        .collect()
}

/// Stacks per-image CHW tensors into one NCHW batch.
pub fn stack(spec: &PreprocessSpec, items: &[&[f32]]) -> Tensor {
    let [h, w] = spec.input_size;
    let mut data = Vec::with_capacity(items.len() * spec.tensor_len());
    for i in items {
        data.extend_from_slice(i);
    }
    Tensor::new(vec![items.len(), 3, h as usize, w as usize], data)
}

/// Numerically stable softmax.
pub fn softmax(logits: &[f32]) -> Vec<f32> {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = logits.iter().map(|v| (v - m).exp()).collect();
    let s: f32 = e.iter().sum();
    e.into_iter().map(|v| v / s).collect()
}

/// Indices and values of the `k` largest entries, largest first.
pub fn top_k(values: &[f32], k: usize) -> Vec<(usize, f32)> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.into_iter().take(k).map(|i| (i, values[i])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_is_largest_first_with_ties_to_the_lower_index_and_softmax_is_stable() {
        assert_eq!(
            top_k(&[0.1, 0.5, 0.5, 0.2], 3),
            vec![(1, 0.5), (2, 0.5), (3, 0.2)]
        );
        assert_eq!(top_k(&[0.3], 5), vec![(0, 0.3)]);
        let p = softmax(&[0.0, 2f32.ln()]);
        assert!((p[0] - 1.0 / 3.0).abs() < 1e-6, "{p:?}");
        assert!((p[1] - 2.0 / 3.0).abs() < 1e-6, "{p:?}");
        // Logits far beyond exp's range: the maximum is subtracted first.
        assert_eq!(softmax(&[1000.0, 1000.0]), vec![0.5, 0.5]);
    }
}
