//! The ONNX protobuf building blocks (the types `tract_onnx::pb` carries): a graph builder,
//! attributes, tensors and value infos, the model wrapper with Kestrel's producer, IR version and
//! opset. [`crate::onnx`] lowers a network with them, [`crate::quant`] its quantized layers.

use prost::Message;
use tract_onnx::pb::{
    self, AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto,
    StringStringEntryProto, TensorProto, TypeProto, ValueInfoProto,
    attribute_proto::AttributeType,
    tensor_proto::DataType,
    tensor_shape_proto::{Dimension, dimension::Value as DimValue},
};

use crate::tensor::Tensor;

pub const OPSET: i64 = 13;
pub const IR_VERSION: i64 = 8;
pub const BATCH_DIM: &str = "N";

/// Accumulates nodes and initializers.
#[derive(Default)]
pub struct GraphBuilder {
    pub nodes: Vec<NodeProto>,
    pub initializers: Vec<TensorProto>,
    counter: usize,
}

pub fn attr_ints(name: &str, v: &[i64]) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: AttributeType::Ints as i32,
        ints: v.to_vec(),
        ..Default::default()
    }
}

pub fn attr_int(name: &str, v: i64) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: AttributeType::Int as i32,
        i: v,
        ..Default::default()
    }
}

pub fn f32_tensor(name: &str, dims: &[usize], data: &[f32]) -> TensorProto {
    TensorProto {
        name: name.into(),
        dims: dims.iter().map(|&d| d as i64).collect(),
        data_type: DataType::Float as i32,
        raw_data: data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ..Default::default()
    }
}

impl GraphBuilder {
    pub fn initializer(&mut self, t: TensorProto) -> String {
        let name = t.name.clone();
        self.initializers.push(t);
        name
    }

    /// Adds a node with one output and returns the output's name (`out` or a generated one).
    pub fn node(
        &mut self,
        op: &str,
        name: &str,
        inputs: &[&str],
        attrs: Vec<AttributeProto>,
        out: Option<&str>,
    ) -> String {
        self.counter += 1;
        let output = out
            .map(String::from)
            .unwrap_or_else(|| format!("{name}:{}", self.counter));
        self.nodes.push(NodeProto {
            op_type: op.into(),
            name: format!("{name}/{op}"),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: vec![output.clone()],
            attribute: attrs,
            ..Default::default()
        });
        output
    }
}

/// A float tensor `[N, dims...]` with the symbolic batch `N`.
pub fn value_info(name: &str, dims: &[usize]) -> ValueInfoProto {
    let mut dim = vec![Dimension {
        denotation: String::new(),
        value: Some(DimValue::DimParam(BATCH_DIM.into())),
    }];
    dim.extend(dims.iter().map(|&d| Dimension {
        denotation: String::new(),
        value: Some(DimValue::DimValue(d as i64)),
    }));
    float_value_info(name, Some(pb::TensorShapeProto { dim }))
}

/// A float tensor of the given (or unspecified, e.g. calibration probes) shape.
pub fn float_value_info(name: &str, shape: Option<pb::TensorShapeProto>) -> ValueInfoProto {
    ValueInfoProto {
        name: name.into(),
        r#type: Some(TypeProto {
            denotation: String::new(),
            value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                elem_type: DataType::Float as i32,
                shape,
            })),
        }),
        doc_string: String::new(),
    }
}

/// Wraps a graph into a model with Kestrel's producer, IR version and opset.
pub fn model(graph: GraphProto, metadata: Vec<(String, String)>) -> ModelProto {
    ModelProto {
        ir_version: IR_VERSION,
        opset_import: vec![OperatorSetIdProto {
            domain: String::new(),
            version: OPSET,
        }],
        producer_name: "kestrel".into(),
        producer_version: env!("CARGO_PKG_VERSION").into(),
        graph: Some(graph),
        metadata_props: metadata
            .into_iter()
            .map(|(key, value)| StringStringEntryProto { key, value })
            .collect(),
        ..Default::default()
    }
}

/// Replaces the model's `metadata_props`.
pub fn set_metadata(model: &mut ModelProto, props: Vec<(String, String)>) {
    model.metadata_props = props
        .into_iter()
        .map(|(key, value)| StringStringEntryProto { key, value })
        .collect();
}

pub fn to_bytes(model: &ModelProto) -> Vec<u8> {
    model.encode_to_vec()
}

/// A float TensorProto as a tensor (raw little-endian data or `float_data`).
pub fn float_tensor(t: &TensorProto) -> Option<Tensor> {
    if t.data_type != DataType::Float as i32 {
        return None;
    }
    let shape: Vec<usize> = t.dims.iter().map(|&d| d as usize).collect();
    let data: Vec<f32> = if t.raw_data.is_empty() {
        t.float_data.clone()
    } else {
        t.raw_data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    };
    (data.len() == shape.iter().product::<usize>()).then(|| Tensor::new(shape, data))
}
