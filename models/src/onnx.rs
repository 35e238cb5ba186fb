//! Lowering of a [`Network`] to an ONNX graph, written with the protobuf types that
//! `tract_onnx::pb` carries (standard ONNX domain only, opset 13, symbolic batch `N`).

use tract_onnx::pb::{GraphProto, ModelProto};

use crate::arch::Network;
use crate::quant::Quant;
use crate::tensor::Tensor;
use crate::weights::FoldedConv;

pub use crate::onnx_graph::{
    BATCH_DIM, GraphBuilder, IR_VERSION, OPSET, attr_int, attr_ints, f32_tensor, float_value_info,
    model, set_metadata, to_bytes, value_info,
};

pub const INPUT_NAME: &str = "input";

/// A linear layer `y = x W^T + b` with `W: [out, in]`.
#[derive(Debug, Clone)]
pub struct Linear {
    pub weight: Tensor,
    pub bias: Vec<f32>,
}

/// What part of the network a graph computes.
#[derive(Debug, Clone)]
pub struct LowerOpts {
    /// Blocks `[start, end)` to run. `start > 0` makes the input the activation at that boundary.
    pub blocks: std::ops::Range<usize>,
    /// Global-average-pool + flatten after the last block (only meaningful when `end == len`).
    pub pool: bool,
    /// Classifier on the pooled features.
    pub classifier: Option<Linear>,
    /// Name of the graph output.
    pub output_name: String,
    /// Quantization of weights and activations.
    pub quant: Quant,
    /// Calibration probe: also output the input of every Conv/Gemm (as the layer reads it, after
    /// any activation quantization) as `act:<layer>`.
    pub probe: bool,
    /// With a classifier: also output the pooled features it reads (float, `[N, feature_dim]`)
    /// under this name, as the graph's second output (what a device's drift statistic reads).
    pub features_output: Option<String>,
}

impl LowerOpts {
    /// The whole backbone up to pooled features `[N, feature_dim]`.
    pub fn features(net: &Network) -> Self {
        Self {
            blocks: 0..net.blocks.len(),
            pool: true,
            classifier: None,
            output_name: "features".into(),
            quant: Quant::None,
            probe: false,
            features_output: None,
        }
    }

    /// Backbone + classifier, output logits `[N, classes]`.
    pub fn logits(net: &Network, classifier: Linear) -> Self {
        Self {
            classifier: Some(classifier),
            output_name: "logits".into(),
            ..Self::features(net)
        }
    }

    /// Shape of one sample at the graph input (without the batch dimension).
    pub fn input_shape(&self, net: &Network) -> Vec<usize> {
        match self.blocks.start {
            0 => vec![3, net.input_hw[0], net.input_hw[1]],
            // Past the last block: the pooled features.
            s if s == net.blocks.len() => vec![net.feature_dim],
            s => net.blocks[s].in_shape().to_vec(),
        }
    }

    /// Shape of one sample at the graph output.
    pub fn output_shape(&self, net: &Network) -> Vec<usize> {
        match (&self.classifier, self.pool) {
            (Some(l), _) => vec![l.weight.shape[0]],
            // Pooling comes after the last block: its channels are the features.
            (None, true) => vec![net.feature_dim],
            (None, false) => net.blocks[self.blocks.end - 1].out_shape().to_vec(),
        }
    }
}

/// Lowers `net` with BN-folded `convs` (one per `net.convs()`) to an ONNX model.
pub fn lower(net: &Network, convs: &[FoldedConv], opts: &LowerOpts) -> ModelProto {
    let mut g = GraphBuilder::default();
    let mut probes = Vec::new();
    let probe = |g: &mut GraphBuilder, probes: &mut Vec<String>, layer: &str, x: &str| {
        if opts.probe {
            let name = format!("act:{layer}");
            g.node("Identity", layer, &[x], vec![], Some(&name));
            probes.push(name);
        }
    };
    let q = &opts.quant;
    let lo = g.initializer(f32_tensor("relu6.min", &[], &[0.0]));
    let hi = g.initializer(f32_tensor("relu6.max", &[], &[6.0]));
    let mut x = INPUT_NAME.to_string();
    let first_conv: usize = net.blocks[..opts.blocks.start]
        .iter()
        .map(|b| b.convs.len())
        .sum();
    let mut folded = convs[first_conv..].iter();
    for block in &net.blocks[opts.blocks.clone()] {
        let block_in = x.clone();
        // The block's input as its first conv reads it (quantized in static int8): the residual
        // Add reads the same, so ONNX Runtime fuses it into an integer Add.
        let mut block_in_q = None;
        for c in &block.convs {
            let f = folded.next().expect("one folded conv per conv");
            let w = q.weight(&mut g, &c.name, &c.weight_name(), &f.weight);
            let b = g.initializer(f32_tensor(
                &format!("{}.conv.bias", c.name),
                &[c.cout],
                &f.bias,
            ));
            let k = c.kernel as i64;
            let s = c.stride as i64;
            let attrs = vec![
                attr_ints("kernel_shape", &[k, k]),
                attr_ints("strides", &[s, s]),
                attr_ints("pads", &c.pads.map(|p| p as i64)),
                attr_ints("dilations", &[1, 1]),
                attr_int("group", c.groups as i64),
            ];
            let xin = q.activation(&mut g, &c.name, &x);
            probe(&mut g, &mut probes, &c.name, &xin);
            block_in_q.get_or_insert_with(|| xin.clone());
            x = g.node("Conv", &c.name, &[&xin, &w, &b], attrs, None);
            if c.relu6 {
                x = g.node("Clip", &c.name, &[&x, &lo, &hi], vec![], None);
            }
        }
        if block.residual {
            let key = format!("{}.residual", block.name);
            let y = q.activation(&mut g, &key, &x);
            probe(&mut g, &mut probes, &key, &y);
            let a = block_in_q.unwrap_or(block_in);
            x = g.node("Add", &block.name, &[&a, &y], vec![], None);
        }
    }
    if opts.pool {
        let xin = q.activation(&mut g, "pool", &x);
        probe(&mut g, &mut probes, "pool", &xin);
        x = g.node("GlobalAveragePool", "pool", &[&xin], vec![], None);
        x = g.node("Flatten", "pool", &[&x], vec![attr_int("axis", 1)], None);
    }
    let mut extra = Vec::new();
    if let (Some(name), Some(_)) = (&opts.features_output, &opts.classifier) {
        g.node("Identity", "features", &[&x], vec![], Some(name));
        extra.push(value_info(name, &[net.feature_dim]));
    }
    if let Some(l) = &opts.classifier {
        let w = q.weight(&mut g, "classifier", "classifier.weight", &l.weight);
        let b = g.initializer(f32_tensor("classifier.bias", &[l.bias.len()], &l.bias));
        let xin = q.activation(&mut g, "classifier", &x);
        probe(&mut g, &mut probes, "classifier", &xin);
        x = g.node(
            "Gemm",
            "classifier",
            &[&xin, &w, &b],
            vec![attr_int("transB", 1)],
            None,
        );
    }
    // Name the final tensor as the graph output (probe Identity nodes never come last).
    let last = g
        .nodes
        .iter_mut()
        .rev()
        .find(|n| n.output[0] == x)
        .expect("a lowered graph has nodes");
    last.output[0] = opts.output_name.clone();
    let mut output = vec![value_info(&opts.output_name, &opts.output_shape(net))];
    output.extend(extra);
    output.extend(probes.iter().map(|p| float_value_info(p, None)));
    let graph = GraphProto {
        name: format!("kestrel-{}", net.arch),
        node: g.nodes,
        initializer: g.initializers,
        input: vec![value_info(INPUT_NAME, &opts.input_shape(net))],
        output,
        ..Default::default()
    };
    model(graph, Vec::new())
}
