//! `dequant` (in kestrel-runtime) against graphs this crate lowers: folded int8 weights give the
//! operator's values.

use crate::dequant::dequantize_weights;
use crate::engine::{Engine, TractEngine};
use crate::onnx::{GraphBuilder, attr_int, model, value_info};
use crate::quant::Quant;
use crate::tensor::Tensor;
use prost::Message;
use tract_onnx::pb::GraphProto;
use tract_onnx::pb::ModelProto;

/// `y = x W^T + b` with W behind int8 weights (`Quant::Weights`, every layer).
fn gemm(quant: &Quant, w: &Tensor) -> Vec<u8> {
    let mut g = GraphBuilder::default();
    let wn = quant.weight(&mut g, "fc", "fc.weight", w);
    let b = g.initializer(crate::onnx::f32_tensor("fc.bias", &[3], &[0.5, -1.0, 2.0]));
    g.node(
        "Gemm",
        "fc",
        &["x", &wn, &b],
        vec![attr_int("transB", 1)],
        Some("y"),
    );
    let graph = GraphProto {
        name: "t".into(),
        node: g.nodes,
        initializer: g.initializers,
        input: vec![value_info("x", &[4])],
        output: vec![value_info("y", &[3])],
        ..Default::default()
    };
    model(graph, vec![]).encode_to_vec()
}

#[test]
fn folded_weights_give_the_operator_s_values() {
    let w = Tensor::new(
        vec![3, 4],
        (0..12)
            .map(|i| (i as f32 * 0.37).sin() * (i as f32 + 1.0))
            .collect(),
    );
    let q = gemm(&Quant::Weights { float_blocks: 0 }, &w);
    let (f, n) = dequantize_weights(&q).unwrap();
    assert_eq!(n, 1);
    let m = ModelProto::decode(f.as_slice()).unwrap();
    let g = m.graph.unwrap();
    assert!(g.node.iter().all(|n| n.op_type != "DequantizeLinear"));
    assert_eq!(
        g.initializer.len(),
        2,
        "the int8 weight, scale and zero point are gone"
    );
    let x = Tensor::new(vec![1, 4], vec![1.0, -2.0, 0.25, 3.0]);
    let run = |b: &[u8]| {
        TractEngine::from_onnx(b, vec![4], 1)
            .unwrap()
            .run(&x)
            .unwrap()
            .data
    };
    assert_eq!(run(&q), run(&f), "the same f32 weights");
    let exact = run(&gemm(&Quant::None, &w));
    assert!(run(&f).iter().zip(&exact).all(|(a, b)| (a - b).abs() < 0.1));
    // A graph without constant DequantizeLinear is left as it is.
    assert_eq!(dequantize_weights(&gemm(&Quant::None, &w)).unwrap().1, 0);
}
