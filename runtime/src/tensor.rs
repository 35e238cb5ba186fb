//! A plain, owned f32 tensor: the currency between weight import, the architecture
//! descriptions and the engines. Deliberately minimal (shape + contiguous row-major data).

use std::collections::BTreeMap;

/// Row-major contiguous f32 tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl Tensor {
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "tensor data length does not match shape {shape:?}"
        );
        Self { shape, data }
    }

    pub fn zeros(shape: Vec<usize>) -> Self {
        let n = shape.iter().product();
        Self {
            shape,
            data: vec![0.0; n],
        }
    }

    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// Largest absolute element-wise difference; `None` when shapes differ.
    pub fn max_abs_diff(&self, other: &Tensor) -> Option<f32> {
        (self.shape == other.shape).then(|| max_abs_diff(&self.data, &other.data))
    }
}

/// Largest `|a[i] - b[i]|` over the common length.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// Named weights, sorted by name (canonical or source names).
pub type Weights = BTreeMap<String, Tensor>;
