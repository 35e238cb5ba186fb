//! Dequantizing int8 weights once, at load: an `int8-weights` graph keeps its weights as int8
//! initializers behind `DequantizeLinear` (0.27x the download), and neither tract nor ONNX
//! Runtime folds those constants, so both dequantized every weight on every request (tract 22%,
//! ORT 2.8x slower than f32 on Lite0). [`dequantize_weights`] rewrites the graph in memory, after
//! its file has been verified: every `DequantizeLinear` whose inputs are all initializers becomes
//! an f32 initializer holding `(q - zero_point) * scale` (per `axis`), computed in f32 exactly as
//! the operator does, so the engines run the f32 graph's kernels on the same weights.

use std::collections::{HashMap, HashSet};

use prost::Message;
use tract_onnx::pb::{ModelProto, NodeProto, TensorProto, tensor_proto::DataType};

use crate::engine::EngineError;

fn bad(what: String) -> EngineError {
    EngineError::Tract(tract_onnx::prelude::TractError::msg(format!(
        "dequantizing int8 weights: {what}"
    )))
}

/// The graph with constant `DequantizeLinear`s folded into f32 initializers; returns the new
/// ONNX bytes and how many were folded.
pub fn dequantize_weights(bytes: &[u8]) -> Result<(Vec<u8>, usize), EngineError> {
    let mut model = ModelProto::decode(bytes).map_err(|e| bad(format!("not ONNX: {e}")))?;
    let Some(graph) = model.graph.as_mut() else {
        return Ok((bytes.to_vec(), 0));
    };
    let index: HashMap<String, usize> = graph
        .initializer
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.clone(), i))
        .collect();
    let (mut folded, mut kept) = (Vec::new(), Vec::new());
    for node in std::mem::take(&mut graph.node) {
        let consts: Option<Vec<&TensorProto>> = (node.op_type == "DequantizeLinear")
            .then(|| {
                node.input
                    .iter()
                    .map(|n| index.get(n).map(|&i| &graph.initializer[i]))
                    .collect()
            })
            .flatten();
        match consts {
            Some(inputs) if node.output.len() == 1 => folded.push(fold(&node, &inputs)?),
            _ => kept.push(node),
        }
    }
    graph.node = kept;
    let n = folded.len();
    // Initializers no remaining node reads (the int8 weights, scales, zero points) go.
    let read: HashSet<&str> = graph
        .node
        .iter()
        .flat_map(|n| n.input.iter().map(String::as_str))
        .chain(graph.output.iter().map(|o| o.name.as_str()))
        .collect();
    let read: HashSet<String> = read.into_iter().map(String::from).collect();
    graph.initializer.retain(|t| read.contains(&t.name));
    graph.initializer.extend(folded);
    Ok((model.encode_to_vec(), n))
}

/// `(q - zero_point) * scale` of one constant `DequantizeLinear` node, as an f32 initializer named
/// after its output.
fn fold(node: &NodeProto, inputs: &[&TensorProto]) -> Result<TensorProto, EngineError> {
    let name = &node.output[0];
    let q = ints(inputs[0])
        .ok_or_else(|| bad(format!("{name}: weights are not int8/uint8 raw data")))?;
    let scale =
        floats(inputs.get(1).copied()).ok_or_else(|| bad(format!("{name}: no f32 scale")))?;
    let zp = match inputs.get(2) {
        Some(t) => ints(t).ok_or_else(|| bad(format!("{name}: zero point not int8/uint8")))?,
        None => vec![0; scale.len()],
    };
    let dims: Vec<usize> = inputs[0].dims.iter().map(|&d| d as usize).collect();
    let axis = node
        .attribute
        .iter()
        .find(|a| a.name == "axis")
        .map_or(1, |a| a.i);
    let axis = if axis < 0 {
        axis + dims.len() as i64
    } else {
        axis
    } as usize;
    let (channels, inner) = if scale.len() == 1 {
        (1, q.len().max(1))
    } else {
        let c = *dims
            .get(axis)
            .ok_or_else(|| bad(format!("{name}: axis {axis} out of range")))?;
        (c, dims[axis + 1..].iter().product::<usize>())
    };
    if scale.len() != channels || zp.len() != channels || q.len() != dims.iter().product::<usize>()
    {
        return Err(bad(format!(
            "{name}: scale/zero point/weight sizes disagree"
        )));
    }
    let data: Vec<f32> = q
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let c = (i / inner) % channels;
            (v - zp[c]) as f32 * scale[c]
        })
        .collect();
    Ok(TensorProto {
        name: name.clone(),
        dims: inputs[0].dims.clone(),
        data_type: DataType::Float as i32,
        raw_data: data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ..Default::default()
    })
}

fn ints(t: &TensorProto) -> Option<Vec<i32>> {
    let raw = &t.raw_data;
    match DataType::try_from(t.data_type).ok()? {
        DataType::Int8 if !raw.is_empty() || t.dims.iter().product::<i64>() == 0 => {
            Some(raw.iter().map(|&b| b as i8 as i32).collect())
        }
        DataType::Uint8 if !raw.is_empty() => Some(raw.iter().map(|&b| b as i32).collect()),
        DataType::Int8 | DataType::Uint8 => Some(t.int32_data.clone()),
        _ => None,
    }
}

fn floats(t: Option<&TensorProto>) -> Option<Vec<f32>> {
    let t = t?;
    if DataType::try_from(t.data_type).ok()? != DataType::Float {
        return None;
    }
    if t.raw_data.is_empty() {
        return Some(t.float_data.clone());
    }
    Some(
        t.raw_data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    )
}
