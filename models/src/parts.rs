//! An ONNX model cut into parts whose concatenation is the model: a protobuf message that
//! appears twice in a serialization is merged (its repeated fields appended), so
//! `frame ‖ part 1 ‖ … ‖ part n`, each a `ModelProto` holding only some graph nodes and
//! initializers, parses as the whole model. The frame holds everything but nodes and initializers
//! (opset, metadata, the graph's inputs and outputs); each part holds the nodes that compute one
//! boundary tensor from the previous one (the frozen backbone up to where training starts, each
//! trained block, the head), and the initializers first read there. A part's bytes depend only on
//! what it computes, so two versions that share a backbone share that part byte for byte
//! (`kestrel_shared::manifest::Composition` names parts by their sha256).

use std::collections::{HashMap, HashSet};

use prost::Message;
pub use tract_onnx::pb::ModelProto;
use tract_onnx::pb::{GraphProto, NodeProto, TensorProto};

use crate::onnx::INPUT_NAME;

/// One part of a model: its role, its bytes, and the tensors that join it to the others.
#[derive(Debug, Clone, PartialEq)]
pub struct Part {
    /// `frame`, `backbone`, `block:<name>`, `head`.
    pub role: String,
    pub bytes: Vec<u8>,
    /// Tensors it reads that parts before it compute (or the graph's input).
    pub reads: Vec<String>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PartsError {
    #[error("no node of the graph computes the boundary tensor `{0}`")]
    NoBoundary(String),
    #[error("the model has no graph")]
    NoGraph,
}

/// Cuts `model` at `boundaries` (`(role, tensor)`, in graph order): part `i` holds the nodes that
/// compute `tensor i` and no earlier boundary; the nodes left over form the last part, `last`.
pub fn split(
    model: &ModelProto,
    boundaries: &[(&str, &str)],
    last: &str,
) -> Result<Vec<Part>, PartsError> {
    let graph = model.graph.as_ref().ok_or(PartsError::NoGraph)?;
    let producer: HashMap<&str, usize> = graph
        .node
        .iter()
        .enumerate()
        .flat_map(|(i, n)| n.output.iter().map(move |o| (o.as_str(), i)))
        .collect();
    let mut owner: Vec<Option<usize>> = vec![None; graph.node.len()];
    for (p, (_, tensor)) in boundaries.iter().enumerate() {
        let start = *producer
            .get(tensor)
            .ok_or_else(|| PartsError::NoBoundary(tensor.to_string()))?;
        let mut stack = vec![start];
        while let Some(i) = stack.pop() {
            if owner[i].is_some() {
                continue;
            }
            owner[i] = Some(p);
            stack.extend(
                graph.node[i]
                    .input
                    .iter()
                    .filter_map(|t| producer.get(t.as_str())),
            );
        }
    }
    let parts = boundaries.len() + 1;
    let owner: Vec<usize> = owner.into_iter().map(|o| o.unwrap_or(parts - 1)).collect();
    let mut nodes: Vec<Vec<NodeProto>> = vec![Vec::new(); parts];
    for (n, &p) in graph.node.iter().zip(&owner) {
        nodes[p].push(n.clone());
    }
    // An initializer goes with the first part that reads it.
    let mut first_reader: HashMap<&str, usize> = HashMap::new();
    for (n, &p) in graph.node.iter().zip(&owner) {
        for t in &n.input {
            let e = first_reader.entry(t.as_str()).or_insert(p);
            *e = (*e).min(p);
        }
    }
    let mut inits: Vec<Vec<TensorProto>> = vec![Vec::new(); parts];
    for t in &graph.initializer {
        let p = first_reader
            .get(t.name.as_str())
            .copied()
            .unwrap_or(parts - 1);
        inits[p].push(t.clone());
    }
    let mut frame = model.clone();
    let fg = frame.graph.as_mut().expect("checked");
    fg.node.clear();
    fg.initializer.clear();
    let mut out = vec![Part {
        role: "frame".into(),
        bytes: frame.encode_to_vec(),
        reads: Vec::new(),
    }];
    let mut known: HashSet<String> = graph.input.iter().map(|v| v.name.clone()).collect();
    known.insert(INPUT_NAME.into());
    for (p, (nodes, inits)) in nodes.into_iter().zip(inits).enumerate() {
        let role = boundaries.get(p).map_or(last, |(role, _)| role).to_string();
        let own: HashSet<&str> = nodes
            .iter()
            .flat_map(|n| n.output.iter().map(String::as_str))
            .chain(inits.iter().map(|t| t.name.as_str()))
            .collect();
        let mut reads: Vec<String> = nodes
            .iter()
            .flat_map(|n| n.input.iter())
            .filter(|t| !t.is_empty() && !own.contains(t.as_str()) && known.contains(t.as_str()))
            .cloned()
            .collect();
        reads.sort();
        reads.dedup();
        known.extend(own.iter().map(|s| s.to_string()));
        let part = ModelProto {
            graph: Some(GraphProto {
                node: nodes,
                initializer: inits,
                ..Default::default()
            }),
            ..Default::default()
        };
        out.push(Part {
            role,
            bytes: part.encode_to_vec(),
            reads,
        });
    }
    Ok(out)
}

/// The model's bytes: the parts' bytes one after another.
pub fn concat(parts: &[Part]) -> Vec<u8> {
    parts.iter().flat_map(|p| p.bytes.iter().copied()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::{Arch, Network};
    use crate::onnx::{self, Linear, LowerOpts};
    use crate::tensor::Tensor;
    use crate::weights::FoldedConv;

    fn model(seed: f32) -> ModelProto {
        let net = Network::new(Arch::Mobilenetv2);
        let convs: Vec<FoldedConv> = net
            .convs()
            .map(|c| FoldedConv {
                weight: Tensor::new(
                    c.weight_shape(),
                    vec![0.01; c.weight_shape().iter().product()],
                ),
                bias: vec![0.0; c.cout],
            })
            .collect();
        let head = Linear {
            weight: Tensor::new(vec![3, net.feature_dim], vec![seed; 3 * net.feature_dim]),
            bias: vec![seed; 3],
        };
        let opts = LowerOpts {
            features_output: Some("features".into()),
            ..LowerOpts::logits(&net, head)
        };
        onnx::lower(&net, &convs, &opts)
    }

    #[test]
    fn the_parts_concatenated_parse_as_the_model() {
        let m = model(0.5);
        let parts = split(&m, &[("backbone", "features")], "head").unwrap();
        assert_eq!(
            parts.iter().map(|p| p.role.as_str()).collect::<Vec<_>>(),
            ["frame", "backbone", "head"]
        );
        let back = ModelProto::decode(concat(&parts).as_slice()).unwrap();
        let (g, h) = (m.graph.as_ref().unwrap(), back.graph.as_ref().unwrap());
        assert_eq!(h.node.len(), g.node.len());
        assert_eq!(h.initializer.len(), g.initializer.len());
        assert_eq!(
            (&h.input, &h.output, &h.name),
            (&g.input, &g.output, &g.name)
        );
        assert_eq!(back.metadata_props, m.metadata_props);
        assert_eq!(back.opset_import, m.opset_import);
        // The head reads the pooled features, and only its own initializers besides.
        let head = &parts[2];
        let hg = ModelProto::decode(head.bytes.as_slice())
            .unwrap()
            .graph
            .unwrap();
        assert!(hg.node.iter().any(|n| n.op_type == "Gemm"));
        assert!(
            hg.initializer
                .iter()
                .all(|t| t.name.starts_with("classifier"))
        );
        assert_eq!(head.reads.len(), 1, "{:?}", head.reads);
    }

    #[test]
    fn another_head_changes_only_the_head_part() {
        let a = split(&model(0.5), &[("backbone", "features")], "head").unwrap();
        let b = split(&model(0.25), &[("backbone", "features")], "head").unwrap();
        assert_eq!(
            a[1].bytes, b[1].bytes,
            "the backbone part is the same bytes"
        );
        assert_ne!(a[2].bytes, b[2].bytes);
        assert_eq!(
            split(&model(0.5), &[("backbone", "nowhere")], "head").unwrap_err(),
            PartsError::NoBoundary("nowhere".into())
        );
    }
}
