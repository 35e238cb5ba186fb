//! Quantization for the ONNX lowering, in forms both tract and ONNX Runtime run correctly:
//! - weights: int8, symmetric, per output channel, stored as int8 initializers behind
//!   `DequantizeLinear(axis=0)` (activations stay float; ~4x smaller, same speed in tract). The
//!   stem and the first `float_blocks` blocks keep f32 weights (7 KB for the default one block):
//!   their error reaches every later layer. Measured on the default digits run (2026-12-05,
//!   lbfgs head): every layer int8 gave a max logit error of 6.31 and lost 0.56 points (3.06
//!   with the earlier SGD head); f32 stem alone 2.12; f32 stem and block 0: 0.94 and no loss
//!   (0.9471 against 0.9443). The head alone in f32 changed nothing (6.34).
//! - activations (static int8): uint8, asymmetric, per tensor, a `QuantizeLinear → DequantizeLinear`
//!   pair on the input of every Conv and Gemm, on both inputs of every residual Add and on the
//!   pooling's input, with ranges calibrated on training samples: the QDQ form that ONNX Runtime
//!   fuses into integer kernels end to end (QLinearConv, QLinearAdd, QLinearGlobalAveragePool,
//!   QGemm: a quantized tensor stays quantized from one layer to the next) and tract executes as
//!   written, in float.
//!
//! Softmax never appears (graphs output logits), which keeps clear of tract's Q/DQ-after-Softmax bug.

use std::collections::BTreeMap;

use tract_onnx::pb::{TensorProto, tensor_proto::DataType};

use crate::onnx_graph::{GraphBuilder, attr_int, f32_tensor};
use crate::tensor::Tensor;

/// How a lowering quantizes.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Quant {
    #[default]
    None,
    /// int8 per-channel weights (Conv, Gemm) but in the stem and the first `float_blocks`
    /// blocks; float activations.
    Weights { float_blocks: usize },
    /// int8 weights plus uint8 activations with these calibrated `(min, max)` per layer input
    /// (keyed by conv name, or `classifier`).
    Static(BTreeMap<String, (f32, f32)>),
}

/// Whether `layer` is the stem or in one of the first `blocks` blocks (`blocks.N.…`): the layers
/// nearest the input, kept in float (weights, and in static int8 activations too).
pub fn float_layer(layer: &str, blocks: usize) -> bool {
    layer == "stem"
        || layer
            .strip_prefix("blocks.")
            .and_then(|r| r.split('.').next())
            .and_then(|b| b.parse::<usize>().ok())
            .is_some_and(|b| b < blocks)
}

/// Symmetric per-output-channel int8 quantization of a weight `[out, ...]`: `w ≈ q * scale[out]`.
pub fn quantize_per_channel(t: &Tensor) -> (Vec<i8>, Vec<f32>) {
    quantize_per_channel_to(t, 127)
}

/// [`quantize_per_channel`] onto `-qmax..=qmax`.
pub fn quantize_per_channel_to(t: &Tensor, qmax: i8) -> (Vec<i8>, Vec<f32>) {
    let qmax = f32::from(qmax);
    let out = t.shape[0];
    let per = t.numel() / out;
    let mut q = Vec::with_capacity(t.numel());
    let mut scales = Vec::with_capacity(out);
    for row in t.data.chunks(per) {
        let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = if max > 0.0 { max / qmax } else { 1.0 };
        scales.push(s);
        q.extend(row.iter().map(|v| (v / s).round().clamp(-qmax, qmax) as i8));
    }
    (q, scales)
}

/// uint8 affine parameters `(scale, zero_point)` for a calibrated range (always containing 0).
pub fn activation_params(min: f32, max: f32) -> (f32, u8) {
    let (min, max) = (min.min(0.0), max.max(0.0));
    let scale = if max > min { (max - min) / 255.0 } else { 1.0 };
    (scale, (-min / scale).round().clamp(0.0, 255.0) as u8)
}

fn typed_tensor(name: &str, dims: &[usize], dt: DataType, raw: Vec<u8>) -> TensorProto {
    TensorProto {
        name: name.into(),
        dims: dims.iter().map(|&d| d as i64).collect(),
        data_type: dt as i32,
        raw_data: raw,
        ..Default::default()
    }
}

impl Quant {
    /// The weights' integer range `-qmax..=qmax`. Static int8 uses 7 bits (ONNX Runtime's
    /// `reduce_range`): its uint8 x int8 kernels on x86 without VNNI add pairs of products in
    /// saturating int16 (`vpmaddubsw`), and 255 x 63 x 2 stays below 32767 where 255 x 127 x 2
    /// does not (digits lost 1.1 points to that saturation with 8-bit weights, AVX2 EPYC,
    /// 2026-12-01). The int8-weights form is dequantized before it runs and keeps 8 bits.
    pub fn weight_max(&self) -> i8 {
        match self {
            Quant::Static(_) => 63,
            _ => 127,
        }
    }

    /// Whether layer `layer`'s weights are int8 in this form.
    pub fn quantizes_weights(&self, layer: &str) -> bool {
        match self {
            Quant::None => false,
            Quant::Weights { float_blocks } => !float_layer(layer, *float_blocks),
            Quant::Static(ranges) => ranges.contains_key(layer),
        }
    }

    /// Adds the weight `w` (named `name`) of layer `layer` and returns the tensor name its
    /// Conv/Gemm should read. In static int8, a layer kept with float activations keeps f32
    /// weights: int8 ones there would be dequantized on every run (ONNX Runtime keeps constant
    /// `DequantizeLinear`s unfolded for its QDQ fusions) for a few kilobytes saved.
    pub fn weight(&self, g: &mut GraphBuilder, layer: &str, name: &str, w: &Tensor) -> String {
        if !self.quantizes_weights(layer) {
            return g.initializer(f32_tensor(name, &w.shape, &w.data));
        }
        let (q, scales) = quantize_per_channel_to(w, self.weight_max());
        let raw = q.iter().map(|v| *v as u8).collect();
        let qn = g.initializer(typed_tensor(
            &format!("{name}.int8"),
            &w.shape,
            DataType::Int8,
            raw,
        ));
        let s = g.initializer(f32_tensor(
            &format!("{name}.scale"),
            &[scales.len()],
            &scales,
        ));
        let z = g.initializer(typed_tensor(
            &format!("{name}.zero_point"),
            &[scales.len()],
            DataType::Int8,
            vec![0; scales.len()],
        ));
        g.node(
            "DequantizeLinear",
            name,
            &[&qn, &s, &z],
            vec![attr_int("axis", 0)],
            None,
        )
    }

    /// Passes activation `x` entering layer `layer`, returning the tensor name to read
    /// (quantized and dequantized for static int8).
    pub fn activation(&self, g: &mut GraphBuilder, layer: &str, x: &str) -> String {
        match self {
            Quant::None | Quant::Weights { .. } => x.to_string(),
            Quant::Static(ranges) => {
                let Some(&(min, max)) = ranges.get(layer) else {
                    return x.to_string();
                };
                let (scale, zp) = activation_params(min, max);
                let s = g.initializer(f32_tensor(&format!("{layer}.act.scale"), &[], &[scale]));
                let z = g.initializer(typed_tensor(
                    &format!("{layer}.act.zero_point"),
                    &[],
                    DataType::Uint8,
                    vec![zp],
                ));
                let q = g.node("QuantizeLinear", layer, &[x, &s, &z], vec![], None);
                g.node("DequantizeLinear", layer, &[&q, &s, &z], vec![], None)
            }
        }
    }

    /// Op types whose inputs are int8 in this form.
    pub fn int8_ops(&self) -> Vec<String> {
        match self {
            Quant::None => vec![],
            Quant::Weights { .. } => vec!["Conv (weights)".into(), "Gemm (weights)".into()],
            Quant::Static(_) => vec!["Conv".into(), "Gemm".into(), "Add (residual)".into()],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_channel_round_trip() {
        let t = Tensor::new(vec![2, 3], vec![1.0, -0.5, 0.25, 0.0, 0.0, 0.0]);
        let (q, s) = quantize_per_channel(&t);
        assert_eq!(q, vec![127, -64, 32, 0, 0, 0]);
        assert!((s[0] - 1.0 / 127.0).abs() < 1e-9 && s[1] == 1.0);
        assert_eq!(activation_params(0.0, 6.0), (6.0 / 255.0, 0));
        let (scale, zp) = activation_params(-1.0, 1.0);
        assert!((scale - 2.0 / 255.0).abs() < 1e-9 && (127..=128).contains(&zp));
    }
}
