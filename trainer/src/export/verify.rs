//! Stage 4: verification on the validation split. Every runtime — tract (the edge's) and ONNX
//! Runtime when its library loads — runs `model.onnx` against the trainer's reference logits;
//! the gates refuse an f32 form whose logits differ by more than `--tolerance` times the logits'
//! scale (the largest |reference logit|, at least 1: f32 rounding grows with it) and any form
//! that loses more than `--max-accuracy-drop` accuracy points.

use kestrel_models::Tensor;
use kestrel_models::artifact::argmax;
use kestrel_models::engine::{Engine, EngineOpts, OrtEngine, TractEngine};
use kestrel_shared::PreprocessSpec;
use kestrel_shared::manifest::RuntimeCheck;
use kestrel_shared::quality::QualityReference;

use super::lower::Lowered;
use super::trained::Trained;
use super::{ExportError, ExportOpts, Quantize};
use crate::data::Split;

/// The runtimes that verify the model, by name; tract first.
pub(super) type Engines = Vec<(String, Box<dyn Engine>)>;

pub(super) struct Verification {
    /// The trainer's own accuracy on the validation split.
    pub f32_accuracy: f64,
    /// One per runtime, in the order of [`Engines`] (`golden_top1_match` is the golden stage's).
    pub checks: Vec<RuntimeCheck>,
    /// The quality reference profile (the reference stage's).
    pub reference: Option<QualityReference>,
}

/// Loads `model.onnx` in tract and, when its library loads, in ONNX Runtime.
pub(super) fn engines(
    lowered: &Lowered,
    threads: usize,
    log: &mut dyn FnMut(String),
) -> Result<Engines, ExportError> {
    let shape = &lowered.input_shape;
    let mut engines: Engines = vec![(
        "tract".into(),
        Box::new(TractEngine::from_onnx(
            &lowered.onnx,
            shape.clone(),
            threads,
        )?),
    )];
    match OrtEngine::from_onnx(&lowered.onnx, shape.clone(), EngineOpts::cpu(threads)) {
        Ok(e) => engines.push(("ort".into(), Box::new(e))),
        Err(e) => log(format!(
            "ONNX Runtime not verified: {}",
            kestrel_shared::Chain(&e)
        )),
    }
    Ok(engines)
}

/// Runs the validation split in every runtime, compares with the trainer and applies the gates;
/// tract's outputs of the same pass (logits and pooled features) make the quality reference.
pub(super) fn verify(
    run: &Trained,
    engines: &Engines,
    o: &ExportOpts,
    log: &mut dyn FnMut(String),
) -> Result<Verification, ExportError> {
    let val = run.pp.indices(Split::Val);
    let truth: Vec<usize> = val.iter().map(|&i| run.pp.labels()[i]).collect();
    let reference = run.reference_logits(&val)?;
    let f32_accuracy = accuracy(&reference, &truth);
    let inputs = run.inputs(&val);
    let mut checks = Vec::new();
    let mut profile = None;
    for (rt, engine) in engines {
        let [rows, features] = engine_outputs(engine.as_ref(), &inputs, &run.net().preprocess)?;
        let max_diff = rows
            .iter()
            .zip(&reference)
            .flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs() as f64))
            .fold(0.0, f64::max);
        let acc = accuracy(&rows, &truth);
        log(format!(
            "{rt}: val accuracy {acc:.4} (reference {f32_accuracy:.4}), max |logit diff| {max_diff:.2e}"
        ));
        checks.push(RuntimeCheck {
            runtime: rt.clone(),
            samples: val.len(),
            accuracy: acc,
            max_abs_logit_diff: max_diff,
            golden_top1_match: true,
        });
        if profile.is_none() {
            profile = Some(super::reference::profile(
                &rows,
                &features,
                run.labels().len(),
                log,
            )?);
        }
    }
    // Logits of a well-separated head reach the hundreds; f32 rounding scales with them.
    let scale = reference
        .iter()
        .flatten()
        .fold(1.0, |m: f64, v| m.max(v.abs() as f64));
    for c in &checks {
        gate(c, f32_accuracy, scale, o)?;
    }
    Ok(Verification {
        f32_accuracy,
        checks,
        reference: profile,
    })
}

/// The share of rows whose top-1 is the true class.
fn accuracy(rows: &[Vec<f32>], truth: &[usize]) -> f64 {
    crate::report::accuracy(rows.iter().map(|r| argmax(r)), truth.iter().copied())
}

/// The tolerance (f32 form; relative to `scale`, the largest |reference logit| and at least 1)
/// and accuracy-drop gates for one runtime.
fn gate(
    c: &RuntimeCheck,
    f32_accuracy: f64,
    scale: f64,
    o: &ExportOpts,
) -> Result<(), ExportError> {
    if o.quantize == Quantize::None && c.max_abs_logit_diff > o.tolerance * scale {
        return Err(ExportError::Disagrees {
            runtime: c.runtime.clone(),
            max_diff: c.max_abs_logit_diff,
            tolerance: o.tolerance,
            scale,
        });
    }
    let drop = (f32_accuracy - c.accuracy) * 100.0;
    if drop > o.max_accuracy_drop {
        return Err(ExportError::AccuracyDrop {
            form: o.quantize.form(),
            runtime: c.runtime.clone(),
            drop,
            f32_accuracy,
            accuracy: c.accuracy,
            max_drop: o.max_accuracy_drop,
        });
    }
    Ok(())
}

/// Runs normalised samples through an engine in batches of 32; one logits row per sample.
pub(super) fn engine_logits(
    engine: &dyn Engine,
    inputs: &[Vec<f32>],
    spec: &PreprocessSpec,
) -> Result<Vec<Vec<f32>>, ExportError> {
    let [logits, _] = engine_outputs(engine, inputs, spec)?;
    Ok(logits)
}

/// [`engine_logits`] and, where the graph has a second output, each sample's pooled features
/// (else none).
fn engine_outputs(
    engine: &dyn Engine,
    inputs: &[Vec<f32>],
    spec: &PreprocessSpec,
) -> Result<[Vec<Vec<f32>>; 2], ExportError> {
    let [h, w] = spec.input_size.map(|v| v as usize);
    let mut out = [Vec::new(), Vec::new()];
    for chunk in inputs.chunks(32) {
        let ys = engine.run_outputs(&Tensor::new(vec![chunk.len(), 3, h, w], chunk.concat()))?;
        for (rows, y) in out.iter_mut().zip(&ys) {
            let per = y.numel() / chunk.len();
            rows.extend(y.data.chunks(per).map(|r| r.to_vec()));
        }
    }
    Ok(out)
}
