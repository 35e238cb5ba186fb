//! A user's ONNX image model (a torchvision, timm, Keras or TensorFlow export, as it is) used whole
//! as the frozen backbone (`--backbone model.onnx`).
//!
//! The file is read with the ONNX protobuf types `tract_onnx::pb` carries and rewritten into the
//! shape every engine and the export expect of a feature graph: one input `input`, float
//! `[N, 3, H, W]` (an NHWC graph gets a Transpose in front), and one output `features`, `[N, D]`
//! (the chosen tensor, flattened from axis 1), with only the nodes and initializers that tensor
//! needs. The feature tensor is `--feature-output NAME`, by default the input of the graph's last
//! Gemm/MatMul (a classifier's pooled features). The rewritten graph keeps the file's opset and
//! operators; tract and ONNX Runtime run it, and [`OnnxBackbone::with_head`] appends a trained
//! classifier to it for export.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use prost::Message;
use sha2::{Digest, Sha256};
use tract_onnx::pb::{self, GraphProto, ModelProto, NodeProto, ValueInfoProto};
use tract_onnx::prelude::{Datum, Framework, InferenceFact, InferenceModelExt};

use crate::onnx::{self, Linear, attr_int, attr_ints, f32_tensor, float_value_info, value_info};

/// The oldest default-domain opset accepted.
pub const MIN_OPSET: i64 = 11;
/// The rewritten graph's feature output.
pub const FEATURES: &str = "features";
/// The user's image tensor inside the rewritten graph (after the layout change).
const IMAGE: &str = "kestrel:image";
const FLOAT: i32 = pb::tensor_proto::DataType::Float as i32;

#[derive(Debug, thiserror::Error)]
pub enum OnnxBackboneError {
    #[error("{path}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not an ONNX model")]
    NotOnnx {
        path: String,
        #[source]
        source: kestrel_shared::error::Cause,
    },
    #[error(
        "{path}: default-domain opset {found}; Kestrel reads ONNX graphs of opset {MIN_OPSET} or later"
    )]
    Opset { path: String, found: i64 },
    #[error(
        "{path}: not an image model: found {found}; expected one float input of rank 4, [N, 3, H, W] or [N, H, W, 3]"
    )]
    NotImage { path: String, found: String },
    #[error(
        "{path}: the graph's input is {graph:?} (height, width) but the preprocessing gives {spec:?}: pass a --preprocess whose input_size matches"
    )]
    InputSize {
        path: String,
        graph: [usize; 2],
        spec: [usize; 2],
    },
    #[error(
        "{path}: --feature-output `{name}` is not a tensor of the graph; candidates: {candidates}"
    )]
    NoSuchTensor {
        path: String,
        name: String,
        candidates: String,
    },
    #[error(
        "{path}: no Gemm or MatMul whose input could be the pooled features: pass --feature-output NAME (candidates: {candidates})"
    )]
    NoDefaultFeatures { path: String, candidates: String },
    #[error("{path}: the features `{name}` do not have a fixed size: {found}")]
    FeatureShape {
        path: String,
        name: String,
        found: String,
    },
    #[error("{path}: tract cannot load the feature graph")]
    Tract {
        path: String,
        #[source]
        source: tract_onnx::prelude::TractError,
    },
}

/// Memory layout of the user's image input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum InputLayout {
    Nchw,
    Nhwc,
}

/// A user's ONNX graph rewritten into Kestrel's feature graph.
#[derive(Debug, Clone)]
pub struct OnnxBackbone {
    pub path: PathBuf,
    /// sha256 of the file as given.
    pub sha256: String,
    /// The graph's own image input and its layout.
    pub input: String,
    pub layout: InputLayout,
    /// The tensor taken as the features (`--feature-output`, or the default found).
    pub feature_output: String,
    /// Features per sample (after flattening).
    pub feature_dim: usize,
    pub input_hw: [usize; 2],
    /// The rewritten graph: input `input` `[N, 3, H, W]`, output `features` `[N, D]`.
    pub model: ModelProto,
}

/// sha256 of a file, hex.
pub fn file_sha256(path: &Path) -> Result<String, OnnxBackboneError> {
    let bytes = read(path)?;
    Ok(hex_sha256(&bytes))
}

fn hex_sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn read(path: &Path) -> Result<Vec<u8>, OnnxBackboneError> {
    std::fs::read(path).map_err(|source| OnnxBackboneError::Io {
        path: path.display().to_string(),
        source,
    })
}

/// The model's default-domain opset (0 when it imports none).
fn default_opset(model: &ModelProto) -> i64 {
    model
        .opset_import
        .iter()
        .find(|o| o.domain.is_empty() || o.domain == "ai.onnx")
        .map_or(0, |o| o.version)
}

/// Reads an ONNX file (no rewriting) and checks its opset.
pub fn read_model(path: &Path) -> Result<(ModelProto, Vec<u8>), OnnxBackboneError> {
    let p = path.display().to_string();
    let bytes = read(path)?;
    let model = ModelProto::decode(bytes.as_slice()).map_err(|e| OnnxBackboneError::NotOnnx {
        path: p.clone(),
        source: e.into(),
    })?;
    if model.graph.is_none() {
        return Err(OnnxBackboneError::NotOnnx {
            path: p,
            source: "no graph".into(),
        });
    }
    let opset = default_opset(&model);
    if opset < MIN_OPSET {
        return Err(OnnxBackboneError::Opset {
            path: p,
            found: opset,
        });
    }
    Ok((model, bytes))
}

/// One dimension: fixed, or symbolic (`None`).
fn dims(v: &ValueInfoProto) -> Option<(i32, Vec<Option<i64>>)> {
    let Some(pb::type_proto::Value::TensorType(t)) = v.r#type.as_ref()?.value.as_ref() else {
        return None;
    };
    let shape = t.shape.as_ref()?;
    let d = shape
        .dim
        .iter()
        .map(|d| match d.value {
            Some(pb::tensor_shape_proto::dimension::Value::DimValue(n)) => Some(n),
            _ => None,
        })
        .collect();
    Some((t.elem_type, d))
}

fn describe(v: &ValueInfoProto) -> String {
    match dims(v) {
        Some((ty, d)) => {
            let ty = pb::tensor_proto::DataType::try_from(ty)
                .map_or(format!("type {ty}"), |t| format!("{t:?}").to_lowercase());
            let d: Vec<String> = d
                .iter()
                .map(|x| x.map_or("?".into(), |n| n.to_string()))
                .collect();
            format!("input `{}`: {ty} [{}]", v.name, d.join(", "))
        }
        None => format!("input `{}` of unknown type or shape", v.name),
    }
}

/// The image input: its name, layout and fixed height/width (if fixed).
fn image_input(
    path: &str,
    g: &GraphProto,
) -> Result<(String, InputLayout, [Option<i64>; 2]), OnnxBackboneError> {
    let inits: HashSet<&str> = g.initializer.iter().map(|t| t.name.as_str()).collect();
    let inputs: Vec<&ValueInfoProto> = g
        .input
        .iter()
        .filter(|v| !inits.contains(v.name.as_str()))
        .collect();
    for v in &inputs {
        let Some((FLOAT, d)) = dims(v) else { continue };
        if d.len() != 4 {
            continue;
        }
        if d[1] == Some(3) {
            return Ok((v.name.clone(), InputLayout::Nchw, [d[2], d[3]]));
        }
        if d[3] == Some(3) {
            return Ok((v.name.clone(), InputLayout::Nhwc, [d[1], d[2]]));
        }
    }
    let found = if inputs.is_empty() {
        "no graph input".to_string()
    } else {
        inputs
            .iter()
            .map(|v| describe(v))
            .collect::<Vec<_>>()
            .join("; ")
    };
    Err(OnnxBackboneError::NotImage {
        path: path.into(),
        found,
    })
}

/// Tensors a user might mean: the inputs of Gemm/MatMul nodes, the graph outputs, and the
/// outputs of pooling and flattening nodes (last ones first).
fn candidates(g: &GraphProto) -> String {
    let mut out: Vec<String> = Vec::new();
    for n in g.node.iter().rev() {
        let name = match n.op_type.as_str() {
            "Gemm" | "MatMul" => n.input.first(),
            "GlobalAveragePool" | "Flatten" | "ReduceMean" | "Squeeze" | "Reshape" => {
                n.output.first()
            }
            _ => None,
        };
        if let Some(name) = name.filter(|s| !out.contains(s)) {
            out.push(name.clone());
        }
    }
    for o in &g.output {
        if !out.contains(&o.name) {
            out.push(o.name.clone());
        }
    }
    out.truncate(8);
    if out.is_empty() {
        "none found".into()
    } else {
        out.iter()
            .map(|s| format!("`{s}`"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The feature tensor: the one named (it must be some node's output), else the first input of
/// the last Gemm/MatMul, else the graph's one output when it is already pooled (a classifier-less
/// export: `timm.create_model(..., num_classes=0)`, a torchvision model without its classifier):
/// declared `[N, C]`, or made by a pooling or flattening node.
fn feature_tensor(
    path: &str,
    g: &GraphProto,
    name: Option<&str>,
) -> Result<String, OnnxBackboneError> {
    if let Some(name) = name {
        if g.node.iter().any(|n| n.output.iter().any(|o| o == name)) {
            return Ok(name.to_string());
        }
        return Err(OnnxBackboneError::NoSuchTensor {
            path: path.into(),
            name: name.into(),
            candidates: candidates(g),
        });
    }
    g.node
        .iter()
        .rev()
        .find(|n| matches!(n.op_type.as_str(), "Gemm" | "MatMul"))
        .and_then(|n| n.input.first().cloned())
        .or_else(|| pooled_output(g))
        .ok_or_else(|| OnnxBackboneError::NoDefaultFeatures {
            path: path.into(),
            candidates: candidates(g),
        })
}

/// The graph's single output, when it is already a pooled `[N, C]` vector.
fn pooled_output(g: &GraphProto) -> Option<String> {
    let [out] = g.output.as_slice() else {
        return None;
    };
    let rank = out
        .r#type
        .as_ref()
        .and_then(|t| match &t.value {
            Some(pb::type_proto::Value::TensorType(t)) => t.shape.as_ref(),
            _ => None,
        })
        .map(|s| s.dim.len());
    let pooling = g
        .node
        .iter()
        .find(|n| n.output.contains(&out.name))
        .is_some_and(|n| {
            matches!(
                n.op_type.as_str(),
                "GlobalAveragePool" | "GlobalMaxPool" | "ReduceMean" | "Flatten"
            )
        });
    (rank == Some(2) || pooling).then(|| out.name.clone())
}

/// The nodes `target` depends on, in graph order.
fn needed_nodes(g: &GraphProto, target: &str) -> Vec<NodeProto> {
    let producer: HashMap<&str, usize> = g
        .node
        .iter()
        .enumerate()
        .flat_map(|(i, n)| n.output.iter().map(move |o| (o.as_str(), i)))
        .collect();
    let mut keep = vec![false; g.node.len()];
    let mut stack = vec![target];
    while let Some(t) = stack.pop() {
        if let Some(&i) = producer.get(t)
            && !keep[i]
        {
            keep[i] = true;
            stack.extend(g.node[i].input.iter().map(String::as_str));
        }
    }
    g.node
        .iter()
        .zip(keep)
        .filter(|(_, k)| *k)
        .map(|(n, _)| n.clone())
        .collect()
}

fn node(op: &str, inputs: &[&str], output: &str, attribute: Vec<pb::AttributeProto>) -> NodeProto {
    NodeProto {
        op_type: op.into(),
        name: format!("kestrel/{op}:{output}"),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: vec![output.into()],
        attribute,
        ..Default::default()
    }
}

/// The feature graph of `g`: `input` NCHW → (layout) → the user's nodes → Flatten → `features`.
fn feature_graph(
    g: &GraphProto,
    input: &str,
    layout: InputLayout,
    feature: &str,
    hw: [usize; 2],
) -> GraphProto {
    let mut nodes = vec![match layout {
        InputLayout::Nchw => node("Identity", &[onnx::INPUT_NAME], IMAGE, vec![]),
        InputLayout::Nhwc => node(
            "Transpose",
            &[onnx::INPUT_NAME],
            IMAGE,
            vec![attr_ints("perm", &[0, 2, 3, 1])],
        ),
    }];
    // The user's own tensors keep their names, except the image (now IMAGE) and any named like
    // a tensor Kestrel adds (`input`, `features`, `logits`), which get a `user:` prefix.
    let rename = |t: &str| -> String {
        match t {
            _ if t == input => IMAGE.into(),
            onnx::INPUT_NAME | FEATURES | "logits" => format!("user:{t}"),
            _ => t.into(),
        }
    };
    for mut n in needed_nodes(g, feature) {
        for t in n.input.iter_mut().chain(n.output.iter_mut()) {
            *t = rename(t);
        }
        nodes.push(n);
    }
    nodes.push(node(
        "Flatten",
        &[&rename(feature)],
        FEATURES,
        vec![attr_int("axis", 1)],
    ));
    let used: HashSet<&str> = nodes
        .iter()
        .flat_map(|n| n.input.iter().map(String::as_str))
        .collect();
    let initializer = g
        .initializer
        .iter()
        .map(|t| pb::TensorProto {
            name: rename(&t.name),
            ..t.clone()
        })
        .filter(|t| used.contains(t.name.as_str()))
        .collect();
    GraphProto {
        name: format!("kestrel-features:{}", g.name),
        initializer,
        node: nodes,
        input: vec![value_info(onnx::INPUT_NAME, &[3, hw[0], hw[1]])],
        output: vec![float_value_info(FEATURES, None)],
        ..Default::default()
    }
}

/// Features per sample, as tract infers them for one image.
fn feature_dim(
    path: &str,
    model: &ModelProto,
    hw: [usize; 2],
    name: &str,
) -> Result<usize, OnnxBackboneError> {
    let tract = |e: tract_onnx::prelude::TractError| OnnxBackboneError::Tract {
        path: path.into(),
        source: e,
    };
    let m = tract_onnx::onnx()
        .model_for_read(&mut std::io::Cursor::new(onnx::to_bytes(model)))
        .and_then(|m| {
            m.with_input_fact(
                0,
                InferenceFact::dt_shape(f32::datum_type(), vec![1, 3, hw[0], hw[1]]),
            )
        })
        .and_then(|m| m.into_typed())
        .map_err(tract)?;
    let fact = m.output_fact(0).map_err(tract)?;
    match fact.shape.as_concrete() {
        Some([1, d]) => Ok(*d),
        _ => Err(OnnxBackboneError::FeatureShape {
            path: path.into(),
            name: name.into(),
            found: format!("{:?}", fact.shape),
        }),
    }
}

impl OnnxBackbone {
    /// Reads `path` and rewrites it into a feature graph for images of `spec_hw` (height, width).
    pub fn load(
        path: &Path,
        feature_output: Option<&str>,
        spec_hw: [usize; 2],
    ) -> Result<Self, OnnxBackboneError> {
        let p = path.display().to_string();
        let (user, bytes) = read_model(path)?;
        let g = user.graph.as_ref().expect("read_model checks the graph");
        let (input, layout, fixed) = image_input(&p, g)?;
        if fixed
            .iter()
            .zip(spec_hw)
            .any(|(f, s)| f.is_some_and(|f| f as usize != s))
        {
            return Err(OnnxBackboneError::InputSize {
                path: p,
                graph: fixed.map(|f| f.unwrap_or(0) as usize),
                spec: spec_hw,
            });
        }
        let feature = feature_tensor(&p, g, feature_output)?;
        let mut model = ModelProto {
            graph: Some(feature_graph(g, &input, layout, &feature, spec_hw)),
            metadata_props: Vec::new(),
            ..user.clone()
        };
        let dim = feature_dim(&p, &model, spec_hw, &feature)?;
        model.graph.as_mut().expect("graph").output = vec![value_info(FEATURES, &[dim])];
        Ok(Self {
            path: path.to_path_buf(),
            sha256: hex_sha256(&bytes),
            input,
            layout,
            feature_output: feature,
            feature_dim: dim,
            input_hw: spec_hw,
            model,
        })
    }

    /// The feature graph as ONNX bytes.
    pub fn bytes(&self) -> Vec<u8> {
        onnx::to_bytes(&self.model)
    }

    /// What identifies these features: the file's content, the feature tensor and the layout.
    pub fn id(&self) -> String {
        hex_sha256(format!("{}:{}:{:?}", self.sha256, self.feature_output, self.layout).as_bytes())
    }

    /// The feature graph with a classifier: outputs `logits` `[N, classes]` (Gemm on the
    /// features) and, second, `features_output` `[N, D]`.
    pub fn with_head(&self, head: &Linear, logits: &str, features_output: &str) -> ModelProto {
        let mut model = self.model.clone();
        let g = model.graph.as_mut().expect("graph");
        let (w, b) = ("kestrel:classifier.weight", "kestrel:classifier.bias");
        g.initializer
            .push(f32_tensor(w, &head.weight.shape, &head.weight.data));
        g.initializer
            .push(f32_tensor(b, &[head.bias.len()], &head.bias));
        for n in &mut g.node {
            for o in n.output.iter_mut().filter(|o| *o == FEATURES) {
                *o = features_output.into();
            }
        }
        g.node.push(node(
            "Gemm",
            &[features_output, w, b],
            logits,
            vec![attr_int("transB", 1)],
        ));
        g.output = vec![
            value_info(logits, &[head.bias.len()]),
            value_info(features_output, &[self.feature_dim]),
        ];
        model
    }

    /// `int8-weights` of a graph from [`OnnxBackbone::with_head`]: every Conv weight and every
    /// Gemm `B` (with `transB = 1`) held as a float initializer becomes int8, symmetric per output
    /// channel, behind `DequantizeLinear(axis = 0)` (as Kestrel's own lowering quantizes); other
    /// layers stay float. Needs opset 13 (per-axis DequantizeLinear); returns the weights quantized.
    pub fn quantize_weights(model: &mut ModelProto) -> Result<usize, String> {
        let opset = default_opset(model);
        if opset < 13 {
            return Err(format!(
                "int8 weights need opset 13 (per-channel DequantizeLinear); this graph has opset {opset}"
            ));
        }
        let g = model.graph.as_mut().expect("graph");
        let floats: HashMap<String, crate::tensor::Tensor> = g
            .initializer
            .iter()
            .filter_map(|t| Some((t.name.clone(), crate::onnx_graph::float_tensor(t)?)))
            .filter(|(_, t)| t.shape.len() >= 2)
            .collect();
        let mut b = onnx::GraphBuilder::default();
        let mut done: HashMap<String, String> = HashMap::new();
        for n in &mut g.node {
            let transposed = n.attribute.iter().any(|a| a.name == "transB" && a.i == 1);
            let weight = match n.op_type.as_str() {
                "Conv" => n.input.get(1),
                "Gemm" if transposed => n.input.get(1),
                _ => None,
            };
            let Some(t) = weight.and_then(|w| floats.get(w)) else {
                continue;
            };
            let w = n.input[1].clone();
            let dq = done.entry(w.clone()).or_insert_with(|| {
                crate::quant::Quant::Weights { float_blocks: 0 }.weight(&mut b, &w, &w, t)
            });
            n.input[1] = dq.clone();
        }
        g.initializer.retain(|t| !done.contains_key(&t.name));
        g.initializer.extend(b.initializers);
        b.nodes.append(&mut g.node);
        g.node = b.nodes;
        Ok(done.len())
    }
}
