//! Canonical weights for a [`Network`]: name mapping, shape checks, seeded initialisation and
//! batch-norm folding (shared by every lowering so they compute the same function).

use rand::{Rng, SeedableRng, rngs::StdRng};
use rand_distr::{Distribution, Normal};

use crate::arch::{BN_FIELDS, ConvBn, Network};
use crate::tensor::{Tensor, Weights};

#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    #[error(
        "missing tensor `{canonical}` (looked for `{source_name}` and `{canonical}`), expected shape {expected:?}"
    )]
    Missing {
        canonical: String,
        source_name: String,
        expected: Vec<usize>,
    },
    #[error(
        "tensor `{found_as}` (canonical `{canonical}`) has shape {found:?}, expected {expected:?}"
    )]
    Shape {
        canonical: String,
        found_as: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
}

/// Which parameters a weight set must provide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Backbone,
    BackboneAndClassifier,
}

fn expected(net: &Network, part: Part) -> Vec<(String, Vec<usize>)> {
    let mut p = net.backbone_params();
    if part == Part::BackboneAndClassifier {
        p.extend(net.classifier_params());
    }
    p
}

/// Maps a checkpoint (upstream or canonical names) onto canonical names, checking every shape.
/// Extra tensors in the source are ignored.
pub fn canonicalize(net: &Network, source: &Weights, part: Part) -> Result<Weights, WeightError> {
    let mut out = Weights::new();
    for (canonical, shape) in expected(net, part) {
        let src = net.source_name(&canonical);
        let (found_as, t) = match source.get(&canonical) {
            Some(t) => (canonical.clone(), t),
            None => match source.get(&src) {
                Some(t) => (src, t),
                None => {
                    return Err(WeightError::Missing {
                        canonical,
                        source_name: src,
                        expected: shape,
                    });
                }
            },
        };
        if t.shape != shape {
            return Err(WeightError::Shape {
                canonical,
                found_as,
                expected: shape,
                found: t.shape.clone(),
            });
        }
        out.insert(canonical, t.clone());
    }
    Ok(out)
}

/// Seeded random weights (He-normal convs, non-trivial batch-norm statistics so folding is exercised).
pub fn random(net: &Network, part: Part, seed: u64) -> Weights {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Weights::new();
    for (name, shape) in expected(net, part) {
        let n: usize = shape.iter().product();
        let data: Vec<f32> = if name.ends_with("conv.weight") || name == "classifier.weight" {
            let fan_in: usize = shape[1..].iter().product();
            let normal = Normal::new(0.0f32, (2.0 / fan_in as f32).sqrt()).unwrap();
            (0..n).map(|_| normal.sample(&mut rng)).collect()
        } else if name.ends_with("bn.weight") || name.ends_with("running_var") {
            (0..n).map(|_| rng.random_range(0.5f32..1.5)).collect()
        } else {
            (0..n).map(|_| rng.random_range(-0.1f32..0.1)).collect()
        };
        out.insert(name, Tensor::new(shape, data));
    }
    out
}

/// A conv with its batch norm folded in: `y = conv(x, weight) + bias`.
#[derive(Debug, Clone)]
pub struct FoldedConv {
    pub weight: Tensor,
    pub bias: Vec<f32>,
}

/// Folds each conv's batch norm (inference statistics) into the conv. `weights` must be canonical.
pub fn fold(net: &Network, weights: &Weights) -> Result<Vec<FoldedConv>, WeightError> {
    net.convs()
        .map(|c| fold_one(c, net.bn_eps, weights))
        .collect()
}

fn get<'a>(
    weights: &'a Weights,
    name: String,
    shape: Vec<usize>,
) -> Result<&'a Tensor, WeightError> {
    match weights.get(&name) {
        Some(t) if t.shape == shape => Ok(t),
        Some(t) => Err(WeightError::Shape {
            canonical: name.clone(),
            found_as: name,
            expected: shape,
            found: t.shape.clone(),
        }),
        None => Err(WeightError::Missing {
            source_name: name.clone(),
            canonical: name,
            expected: shape,
        }),
    }
}

fn fold_one(c: &ConvBn, eps: f32, weights: &Weights) -> Result<FoldedConv, WeightError> {
    let w = get(weights, c.weight_name(), c.weight_shape())?;
    let [gamma, beta, mean, var] = BN_FIELDS.map(|f| get(weights, c.bn_name(f), vec![c.cout]));
    let (gamma, beta, mean, var) = (gamma?, beta?, mean?, var?);
    let per_out = w.numel() / c.cout;
    let mut weight = w.clone();
    let mut bias = vec![0f32; c.cout];
    for o in 0..c.cout {
        let k = gamma.data[o] / (var.data[o] + eps).sqrt();
        for v in &mut weight.data[o * per_out..(o + 1) * per_out] {
            *v *= k;
        }
        bias[o] = beta.data[o] - mean.data[o] * k;
    }
    Ok(FoldedConv { weight, bias })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::Arch;

    #[test]
    fn wrong_shape_and_missing_tensor_are_named() {
        let net = Network::new(Arch::EfficientnetLite0);
        let mut w = random(&net, Part::BackboneAndClassifier, 1);
        // Rename to upstream names to exercise mapping.
        let upstream: Weights = w
            .iter()
            .map(|(k, v)| (net.source_name(k), v.clone()))
            .collect();
        assert_eq!(
            canonicalize(&net, &upstream, Part::BackboneAndClassifier).unwrap(),
            w
        );

        w.insert(
            "blocks.3.dw.conv.weight".into(),
            Tensor::zeros(vec![144, 1, 3, 3]),
        );
        let e = canonicalize(&net, &w, Part::Backbone)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("blocks.3.dw.conv.weight")
                && e.contains("[144, 1, 5, 5]")
                && e.contains("[144, 1, 3, 3]"),
            "{e}"
        );

        let mut w = random(&net, Part::BackboneAndClassifier, 1);
        w.remove("head.bn.running_var");
        let e = canonicalize(&net, &w, Part::Backbone)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("head.bn.running_var") && e.contains("_bn1.running_var"),
            "{e}"
        );
    }
}
