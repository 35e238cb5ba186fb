//! Stage 4b: the quality reference profile. The exported graph itself, in tract (the edge's
//! runtime), runs the validation split; its predicted classes, top-1 confidences and pooled
//! features (the graph's second output) become the manifest's `reference`
//! ([`kestrel_shared::quality`]), against which a device judges its live inputs without labels.

use kestrel_models::Tensor;
use kestrel_models::engine::TractEngine;
use kestrel_shared::quality::QualityReference;

use super::ExportError;
use super::lower::{FEATURES_OUTPUT, Lowered};
use super::trained::Trained;
use crate::data::Split;

/// The seed of the feature projection written into every reference (any fixed value would do:
/// the device draws the projection from the seed it reads).
const PROJECTION_SEED: u64 = 0x4b65_7374_7265_6c31;

/// Runs the validation split through `model.onnx` one sample at a time (both outputs).
pub(super) fn profile(
    run: &Trained,
    lowered: &Lowered,
    threads: usize,
    log: &mut dyn FnMut(String),
) -> Result<QualityReference, ExportError> {
    let val = run.pp.indices(Split::Val);
    let engine = TractEngine::from_onnx(&lowered.onnx, lowered.input_shape.clone(), threads)?;
    let mut shape = vec![1];
    shape.extend(&lowered.input_shape);
    let mut rows = Vec::with_capacity(val.len());
    for x in run.inputs(&val) {
        let mut outs = engine
            .run_all_outputs(&Tensor::new(shape.clone(), x))?
            .into_iter();
        let (Some(logits), Some(features)) = (outs.next(), outs.next()) else {
            return Err(ExportError::RunLacks(format!(
                "the `{FEATURES_OUTPUT}` output in the lowered graph"
            )));
        };
        rows.push((logits.data, features.data));
    }
    let reference = QualityReference::build(
        rows.iter().map(|(l, f)| (l.as_slice(), f.as_slice())),
        run.labels().len(),
        FEATURES_OUTPUT,
        PROJECTION_SEED,
    )
    .ok_or_else(|| ExportError::RunLacks("validation samples".into()))?;
    log(format!(
        "quality reference: {} validation samples, mean top-1 confidence {:.3}",
        reference.samples, reference.mean_confidence
    ));
    Ok(reference)
}
