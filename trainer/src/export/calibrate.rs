//! Stage 2: the quantized forms. Calibration of quantized exports: a probe graph run in tract
//! measures every Conv/Gemm input (activation ranges for static int8, per-channel means for bias
//! correction).

use std::collections::{BTreeMap, BTreeSet};

use kestrel_models::Tensor;
use kestrel_models::engine::{Engine, TractEngine};
use kestrel_models::onnx::{self, Linear, LowerOpts};
use kestrel_models::quant::{Quant, float_layer, quantize_per_channel_to};
use kestrel_models::weights::FoldedConv;

use super::trained::Trained;
use super::{ExportError, ExportOpts, Quantize};
use crate::data::Split;

/// The network as it is lowered: the quantization and the (bias-corrected) weights it applies to.
/// For `--quantize none`, the trained network unchanged.
pub(super) struct Quantized {
    pub quant: Quant,
    pub folded: Vec<FoldedConv>,
    pub head: Linear,
}

/// Quantized forms: calibrate on training samples (activation ranges for int8, input means for
/// the bias correction of both forms), then bias-correct a copy of the trained network.
pub(super) fn quantize(
    run: &Trained,
    o: &ExportOpts,
    threads: usize,
    log: &mut dyn FnMut(String),
) -> Result<Quantized, ExportError> {
    let (folded, head) = (&run.folded, &run.head);
    if o.quantize == Quantize::None {
        return Ok(Quantized {
            quant: Quant::None,
            folded: folded.clone(),
            head: head.clone(),
        });
    }
    if run.pp.backbone.graph.is_some() {
        // An ONNX backbone: int8 weights written into its graph at lowering (no calibration, no
        // bias correction: Kestrel does not know its layers).
        if o.quantize != Quantize::Int8Weights {
            return Err(ExportError::Unsupported(format!(
                "--quantize {} of an ONNX backbone: its graph is exported as it is (none) or with \
                 int8 weights (int8-weights); static int8 needs Kestrel's own layers",
                o.quantize.form()
            )));
        }
        log("int8 weights of the ONNX backbone's Conv and Gemm layers (no bias correction)".into());
        return Ok(Quantized {
            quant: Quant::Weights { float_blocks: 0 },
            folded: folded.clone(),
            head: head.clone(),
        });
    }
    let train_idx = run.pp.indices(Split::Train);
    let step = (train_idx.len() / o.calibration.max(1)).max(1);
    let calib: Vec<usize> = train_idx
        .iter()
        .step_by(step)
        .take(o.calibration)
        .copied()
        .collect();
    log(format!("calibrating on {} training samples", calib.len()));
    let samples = run.inputs(&calib);
    // Static int8: activation ranges of the float network. Both forms: bias correction from
    // the inputs the quantized network sees.
    let quant = match o.quantize {
        Quantize::Int8 => {
            let mut ranges =
                calibrate(&run.pp, folded, head, &Quant::None, &samples, threads)?.ranges;
            // The layers nearest the input keep float activations (their weights stay int8):
            // they see the widest, least regular ranges, and quantizing them costs the most.
            ranges.retain(|k, _| !float_layer(k, o.float_blocks));
            Quant::Static(ranges)
        }
        _ => Quant::Weights {
            float_blocks: o.float_blocks,
        },
    };
    let (mut qf, mut qh) = (folded.clone(), head.clone());
    let qcal = calibrate(&run.pp, &qf, &qh, &quant, &samples, threads)?;
    // `--shared-backbone` (int8 weights): the frozen blocks keep their weights' plain rounding. A
    // correction from this run's samples makes the frozen backbone's part differ from run to run,
    // and devices that hold it fetch it again for every new head (model.onnx in parts:
    // `kestrel_models::parts`). Static int8's activation ranges come from the run anyway.
    let net = run.net();
    let shared = o.shared_backbone && matches!(quant, Quant::Weights { .. });
    let frozen: BTreeSet<&str> = net.blocks[..run.pp.boundary.min(net.blocks.len())]
        .iter()
        .filter(|_| shared)
        .flat_map(|b| b.convs.iter().map(|c| c.name.as_str()))
        .collect();
    let means = qcal
        .means
        .into_iter()
        .filter(|(k, _)| !frozen.contains(k.as_str()))
        .collect();
    bias_correct(net, (folded, head), (&mut qf, &mut qh), &means, &quant);
    Ok(Quantized {
        quant,
        folded: qf,
        head: qh,
    })
}

/// What calibration measures at the input of every Conv/Gemm (keyed by layer name).
struct Calibration {
    /// `(min, max)` over all samples (static int8 activation ranges).
    pub ranges: BTreeMap<String, (f32, f32)>,
    /// Per-channel mean (bias correction).
    pub means: BTreeMap<String, Vec<f64>>,
}

/// Runs the network (quantized as `quant`) with probes in tract over `samples` (on `threads`
/// cores), recording each Conv/Gemm input's range and per-channel mean.
fn calibrate(
    pp: &crate::train::TrainingData,
    folded: &[FoldedConv],
    head: &Linear,
    quant: &Quant,
    samples: &[Vec<f32>],
    threads: usize,
) -> Result<Calibration, ExportError> {
    let net = &pp.backbone.net;
    let opts = LowerOpts {
        quant: quant.clone(),
        probe: true,
        ..LowerOpts::logits(net, head.clone())
    };
    let model = onnx::lower(net, folded, &opts);
    let names: Vec<String> = model.graph.as_ref().expect("graph").output[1..]
        .iter()
        .map(|o| o.name.trim_start_matches("act:").to_string())
        .collect();
    let engine = TractEngine::from_onnx(&onnx::to_bytes(&model), opts.input_shape(net), threads)?;
    let mut cal = Calibration {
        ranges: BTreeMap::new(),
        means: BTreeMap::new(),
    };
    let [h, w] = net.preprocess.input_size.map(|v| v as usize);
    // A few samples per call, one per thread: every probe's activations of a chunk are held at
    // once (megabytes per sample).
    for chunk in samples.chunks(threads.max(1)) {
        let x = Tensor::new(vec![chunk.len(), 3, h, w], chunk.concat());
        let outs = engine.run_outputs(&x)?;
        for (name, t) in names.iter().zip(&outs[1..]) {
            let (lo, hi) = t
                .data
                .iter()
                .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), v| {
                    (a.min(*v), b.max(*v))
                });
            let e = cal.ranges.entry(name.clone()).or_insert((lo, hi));
            *e = (e.0.min(lo), e.1.max(hi));
            // [n, channels, ..]: the mean of each channel over its positions, averaged over samples.
            let channels = t.shape[1];
            let per = t.numel() / chunk.len() / channels;
            let m = cal
                .means
                .entry(name.clone())
                .or_insert_with(|| vec![0.0; channels]);
            for (i, plane) in t.data.chunks(per).enumerate() {
                m[i % channels] += plane.iter().map(|v| *v as f64).sum::<f64>()
                    / per as f64
                    / samples.len() as f64;
            }
        }
    }
    Ok(cal)
}

/// `Σ w[o, ci, k] · mean[input channel of (o, ci)]` per output channel `o` (grouped convs included).
fn channel_dot(w: &Tensor, groups: usize, mean: &[f64]) -> Vec<f64> {
    let out = w.shape[0];
    let per = w.numel() / out;
    let cin_per_group = w.shape[1];
    let k = per / cin_per_group;
    (0..out)
        .map(|o| {
            let g = o / (out / groups);
            let row = &w.data[o * per..(o + 1) * per];
            (0..cin_per_group)
                .map(|ci| {
                    row[ci * k..(ci + 1) * k]
                        .iter()
                        .map(|v| *v as f64)
                        .sum::<f64>()
                        * mean[g * cin_per_group + ci]
                })
                .sum()
        })
        .collect()
}

/// The int8 weights (on `-qmax..=qmax`) as the graph dequantizes them.
fn dequantized(w: &Tensor, qmax: i8) -> Tensor {
    let (q, scales) = quantize_per_channel_to(w, qmax);
    let per = w.numel() / w.shape[0];
    Tensor::new(
        w.shape.clone(),
        q.iter()
            .enumerate()
            .map(|(i, v)| *v as f32 * scales[i / per])
            .collect(),
    )
}

/// Bias correction (Nagel et al., "Data-Free Quantization", 2019): rounding a layer's weights to
/// int8 shifts its mean output by `(W_q − W)·E[x]`; that systematic error otherwise accumulates
/// through the network. `means` are the layer inputs as the quantized network sees them; the bias
/// absorbs the shift: `b_q = b − (W_q − W)·E[x]`. (Also correcting for upstream mean errors, i.e.
/// matching the float network's means, over-corrects when done for all layers at once: measured,
/// it diverged.)
fn bias_correct(
    net: &kestrel_models::Network,
    float: (&[FoldedConv], &Linear),
    quant: (&mut [FoldedConv], &mut Linear),
    means: &BTreeMap<String, Vec<f64>>,
    form: &Quant,
) {
    let qmax = form.weight_max();
    let correct = |w: &Tensor, b: &[f32], groups: usize, name: &str, out: &mut Vec<f32>| {
        let Some(m) = means.get(name).filter(|_| form.quantizes_weights(name)) else {
            return;
        };
        let exact = channel_dot(w, groups, m);
        let rounded = channel_dot(&dequantized(w, qmax), groups, m);
        for (o, v) in out.iter_mut().enumerate() {
            *v = (b[o] as f64 + exact[o] - rounded[o]) as f32;
        }
    };
    for ((c, f), q) in net.convs().zip(float.0).zip(quant.0.iter_mut()) {
        correct(&f.weight, &f.bias, c.groups, &c.name, &mut q.bias);
    }
    correct(
        &float.1.weight,
        &float.1.bias,
        1,
        "classifier",
        &mut quant.1.bias,
    );
}
