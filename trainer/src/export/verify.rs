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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::artifact_name;
    use kestrel_shared::wire::QuantForm;
    use std::path::Path;

    fn opts(quantize: Quantize) -> ExportOpts {
        ExportOpts {
            quantize,
            calibration: 200,
            float_blocks: 1,
            shared_backbone: false,
            f16: false,
            max_accuracy_drop: 1.0,
            tolerance: 1e-3,
            name: None,
            version: 1,
            golden: 4,
            registry: None,
        }
    }

    fn check(runtime: &str, accuracy: f64, max_abs_logit_diff: f64) -> RuntimeCheck {
        RuntimeCheck {
            runtime: runtime.into(),
            samples: 10,
            accuracy,
            max_abs_logit_diff,
            golden_top1_match: true,
        }
    }

    #[test]
    fn the_tolerance_gate_scales_with_the_logits_and_judges_the_f32_form_only() {
        let f32_form = opts(Quantize::None);
        // A diff of 0.05 is within 1e-3 of a logit scale of 100, not of 10.
        assert!(matches!(
            gate(&check("ort", 0.9, 0.05), 0.9, 100.0, &f32_form),
            Ok(())
        ));
        let e = gate(&check("ort", 0.9, 0.05), 0.9, 10.0, &f32_form).unwrap_err();
        assert!(
            matches!(&e, ExportError::Disagrees { runtime, scale, tolerance, .. }
                if runtime == "ort" && *scale == 10.0 && *tolerance == 1e-3),
            "{e}"
        );
        assert_eq!(
            e.to_string(),
            "ort disagrees with the trainer: max |logit diff| 5.000e-2 > --tolerance 1e-3 x logit scale 10.000"
        );
        // A quantized form's logits may differ: only its accuracy is gated.
        let int8_weights = opts(Quantize::Int8Weights);
        assert!(matches!(
            gate(&check("ort", 0.9, 0.05), 0.9, 10.0, &int8_weights),
            Ok(())
        ));
    }

    #[test]
    fn the_accuracy_gate_refuses_a_drop_beyond_the_limit_in_points() {
        let int8 = opts(Quantize::Int8);
        let e = gate(&check("tract", 0.88, 0.5), 0.9, 1.0, &int8).unwrap_err();
        let ExportError::AccuracyDrop {
            form,
            runtime,
            drop,
            max_drop,
            ..
        } = &e
        else {
            panic!("not an accuracy drop: {e}");
        };
        assert_eq!(
            (form, runtime.as_str(), *max_drop),
            (&QuantForm::Int8, "tract", 1.0)
        );
        assert!((drop - 2.0).abs() < 1e-9, "{drop}");
        assert_eq!(
            e.to_string(),
            "int8 form loses 2.00 accuracy points in tract (f32 0.9000 → 0.8800), more than --max-accuracy-drop 1"
        );
        // Half a point lost, or accuracy gained: within the gate.
        assert!(matches!(
            gate(&check("tract", 0.895, 0.5), 0.9, 1.0, &int8),
            Ok(())
        ));
        assert!(matches!(
            gate(&check("tract", 0.95, 0.5), 0.9, 1.0, &int8),
            Ok(())
        ));
    }

    #[test]
    fn artifact_names_default_to_the_run_directory_and_the_form() {
        let name = |dir: &str, quantize: Quantize, given: Option<&str>| {
            let o = ExportOpts {
                name: given.map(String::from),
                ..opts(quantize)
            };
            artifact_name(Path::new(dir), &o)
        };
        assert_eq!(
            name("runs/cats", Quantize::Int8Weights, None),
            "cats-int8-weights"
        );
        assert_eq!(name("runs/cats/", Quantize::Int8, None), "cats-int8");
        assert_eq!(name("/", Quantize::None, None), "model-none");
        assert_eq!(
            name("runs/cats", Quantize::Int8, Some("gate-cam")),
            "gate-cam"
        );
        // The flag's three values are the manifest's three forms, spelled alike.
        let all = [Quantize::None, Quantize::Int8Weights, Quantize::Int8];
        assert_eq!(
            all.map(Quantize::form),
            [QuantForm::None, QuantForm::Int8Weights, QuantForm::Int8]
        );
        for q in all {
            assert_eq!(
                serde_json::to_string(&q).unwrap(),
                format!("\"{}\"", q.form())
            );
        }
    }
}
