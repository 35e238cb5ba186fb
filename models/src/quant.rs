//! Quantization for the ONNX lowering, in forms both tract and ONNX Runtime run correctly:
//! - weights: int8, symmetric, per output channel, stored as int8 initializers behind
//!   `DequantizeLinear(axis=0)` (activations stay float; ~4x smaller, same speed in tract);
//! - activations (static int8): uint8, asymmetric, per tensor, a `QuantizeLinear → DequantizeLinear`
//!   pair on the input of every Conv and Gemm, with ranges calibrated on training samples (the QDQ
//!   form that ONNX Runtime fuses into integer kernels and tract executes as written).
//!
//! Softmax never appears (graphs output logits), which keeps clear of tract's Q/DQ-after-Softmax bug.

use std::collections::BTreeMap;

use tract_onnx::pb::{TensorProto, tensor_proto::DataType};

use crate::onnx::{GraphBuilder, attr_int, f32_tensor};
use crate::tensor::Tensor;

/// How a lowering quantizes.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Quant {
    #[default]
    None,
    /// int8 per-channel weights (Conv, Gemm); float activations.
    Weights,
    /// int8 weights plus uint8 activations with these calibrated `(min, max)` per layer input
    /// (keyed by conv name, or `classifier`).
    Static(BTreeMap<String, (f32, f32)>),
}

/// Symmetric per-output-channel int8 quantization of a weight `[out, ...]`: `w ≈ q * scale[out]`.
pub fn quantize_per_channel(t: &Tensor) -> (Vec<i8>, Vec<f32>) {
    let out = t.shape[0];
    let per = t.numel() / out;
    let mut q = Vec::with_capacity(t.numel());
    let mut scales = Vec::with_capacity(out);
    for row in t.data.chunks(per) {
        let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = if max > 0.0 { max / 127.0 } else { 1.0 };
        scales.push(s);
        q.extend(
            row.iter()
                .map(|v| (v / s).round().clamp(-127.0, 127.0) as i8),
        );
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
    /// Adds weight `w` (named `name`) and returns the tensor name a Conv/Gemm should read.
    pub fn weight(&self, g: &mut GraphBuilder, name: &str, w: &Tensor) -> String {
        match self {
            Quant::None => g.initializer(f32_tensor(name, &w.shape, &w.data)),
            Quant::Weights | Quant::Static(_) => {
                let (q, scales) = quantize_per_channel(w);
                // Static int8 stores the same values as uint8 with zero point 128, so ONNX Runtime
                // runs its uint8 x uint8 integer kernels: on x86 without VNNI its uint8 x int8
                // ones add pairs of products in saturating int16, and digits lost 1.1 points
                // that way (AVX2 EPYC, 2026-12-01). Dequantized, both are q * scale.
                let (dt, raw, zp) = match self {
                    Quant::Static(_) => (
                        DataType::Uint8,
                        q.iter().map(|v| (*v as i16 + 128) as u8).collect(),
                        128u8,
                    ),
                    _ => (DataType::Int8, q.iter().map(|v| *v as u8).collect(), 0u8),
                };
                let qn = g.initializer(typed_tensor(&format!("{name}.int8"), &w.shape, dt, raw));
                let s = g.initializer(f32_tensor(
                    &format!("{name}.scale"),
                    &[scales.len()],
                    &scales,
                ));
                let z = g.initializer(typed_tensor(
                    &format!("{name}.zero_point"),
                    &[scales.len()],
                    dt,
                    vec![zp; scales.len()],
                ));
                g.node(
                    "DequantizeLinear",
                    name,
                    &[&qn, &s, &z],
                    vec![attr_int("axis", 0)],
                    None,
                )
            }
        }
    }

    /// Passes activation `x` entering layer `layer`, returning the tensor name to read
    /// (quantized and dequantized for static int8).
    pub fn activation(&self, g: &mut GraphBuilder, layer: &str, x: &str) -> String {
        match self {
            Quant::None | Quant::Weights => x.to_string(),
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
            Quant::Weights => vec!["Conv (weights)".into(), "Gemm (weights)".into()],
            Quant::Static(_) => vec!["Conv".into(), "Gemm".into()],
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
