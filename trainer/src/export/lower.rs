//! Stage 3: the (quantized) network lowered to one ONNX graph — backbone + head, symbolic batch,
//! float logits, and the pooled features as a second output — carrying the artifact's description as metadata properties.

use kestrel_models::onnx::{self, LowerOpts};
use kestrel_models::onnx_backbone::OnnxBackbone;
use kestrel_models::parts::{self, ModelProto, Part};
use kestrel_models::quant::Quant;

use super::calibrate::Quantized;
use super::trained::Trained;
use super::{ExportError, ExportOpts};

/// The exported graph's second output: the pooled features the classifier reads (the device's
/// drift statistic projects them; [`kestrel_shared::quality`]).
pub const FEATURES_OUTPUT: &str = "features";

pub(super) struct Lowered {
    /// The artifact's name.
    pub name: String,
    pub opts: LowerOpts,
    /// `model.onnx`: the parts' bytes one after another.
    pub onnx: Vec<u8>,
    /// The frame, the frozen backbone, each trained block, the head.
    pub parts: Vec<Part>,
    /// Per-sample input shape (without the batch dimension).
    pub input_shape: Vec<usize>,
    /// Per-sample output shape (without the batch dimension).
    pub output_shape: Vec<usize>,
}

pub(super) fn lower(
    run: &Trained,
    q: &Quantized,
    o: &ExportOpts,
    name: String,
) -> Result<Lowered, ExportError> {
    let net = run.net();
    let opts = LowerOpts {
        quant: q.quant.clone(),
        features_output: Some(FEATURES_OUTPUT.into()),
        ..LowerOpts::logits(net, q.head.clone())
    };
    // An ONNX backbone: the user's feature graph with the trained classifier appended.
    let mut model = match &run.pp.backbone.graph {
        Some(g) => {
            let mut m = g.with_head(&q.head, &opts.output_name, FEATURES_OUTPUT);
            if matches!(q.quant, Quant::Weights { .. }) {
                OnnxBackbone::quantize_weights(&mut m).map_err(ExportError::Unsupported)?;
            }
            m
        }
        None => onnx::lower(net, &q.folded, &opts),
    };
    model.model_version = o.version as i64;
    let mut meta_props = vec![
        ("kestrel.name", name.clone()),
        ("kestrel.version", o.version.to_string()),
        ("kestrel.arch", net.arch.to_string()),
        (
            "kestrel.labels",
            serde_json::to_string(run.labels()).expect("json"),
        ),
        (
            "kestrel.preprocess",
            serde_json::to_string(&net.preprocess).expect("json"),
        ),
        ("kestrel.quantization", o.quantize.form().to_string()),
        ("kestrel.input", onnx::INPUT_NAME.to_string()),
        ("kestrel.output", opts.output_name.clone()),
        ("kestrel.features", FEATURES_OUTPUT.to_string()),
    ];
    if let Some(g) = &run.pp.backbone.graph {
        meta_props.push(("kestrel.backbone_sha256", g.sha256.clone()));
        meta_props.push(("kestrel.backbone_feature_output", g.feature_output.clone()));
    }
    onnx::set_metadata(
        &mut model,
        meta_props
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
    );
    let cuts = cuts(run, &model);
    let cuts: Vec<(&str, &str)> = cuts.iter().map(|(r, t)| (r.as_str(), t.as_str())).collect();
    let parts = parts::split(&model, &cuts, "head")
        .map_err(|e| ExportError::Unsupported(format!("cutting model.onnx into parts: {e}")))?;
    Ok(Lowered {
        name,
        onnx: parts::concat(&parts),
        parts,
        input_shape: opts.input_shape(net),
        output_shape: opts.output_shape(net),
        opts,
    })
}

/// Where `model.onnx` is cut into parts, `(role of the part that ends there, tensor)`: after the
/// frozen backbone (at the input of the first trained block), after each trained block, and at
/// the pooled features the head reads; the head is what is left.
fn cuts(run: &Trained, model: &ModelProto) -> Vec<(String, String)> {
    let net = run.net();
    let mut out = Vec::new();
    if run.pp.backbone.graph.is_none() {
        let trained = &net.blocks[run.pp.boundary.min(net.blocks.len())..];
        let mut role = "backbone".to_string();
        for block in trained {
            let next = format!("block:{}", block.name);
            match block.convs.first().and_then(|c| conv_input(model, &c.name)) {
                Some(t) => out.push((std::mem::replace(&mut role, next), t)),
                // It reads the graph's input: nothing frozen comes before it.
                None => role = next,
            }
        }
        out.push((role, FEATURES_OUTPUT.to_string()));
    } else {
        out.push(("backbone".to_string(), FEATURES_OUTPUT.to_string()));
    }
    out
}

/// The tensor conv `name` of the lowered graph reads, before any quantization of it (the block's
/// input as the block before it gives it); none for the graph's own input.
fn conv_input(model: &ModelProto, name: &str) -> Option<String> {
    let g = model.graph.as_ref()?;
    let conv = g.node.iter().find(|n| n.name == format!("{name}/Conv"))?;
    let mut t = conv.input.first()?.clone();
    while let Some(n) = g.node.iter().find(|n| n.output.contains(&t))
        && matches!(n.op_type.as_str(), "QuantizeLinear" | "DequantizeLinear")
    {
        t = n.input.first()?.clone();
    }
    (t != onnx::INPUT_NAME).then_some(t)
}
