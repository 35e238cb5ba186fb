//! Stage 4b: the quality reference profile. The exported graph itself, in tract (the edge's
//! runtime), ran the validation split in the verification stage; its predicted classes, top-1
//! confidences and pooled features (the graph's second output) become the manifest's `reference`
//! ([`kestrel_shared::quality`]), against which a device judges its live inputs without labels.

use kestrel_shared::quality::QualityReference;

use super::ExportError;
use super::lower::FEATURES_OUTPUT;

/// The seed of the feature projection written into every reference (any fixed value would do:
/// the device draws the projection from the seed it reads).
const PROJECTION_SEED: u64 = 0x4b65_7374_7265_6c31;

/// The profile of the validation split's `logits` and `features` rows (tract's, one per sample)
/// over `classes` classes.
pub(super) fn profile(
    logits: &[Vec<f32>],
    features: &[Vec<f32>],
    classes: usize,
    log: &mut dyn FnMut(String),
) -> Result<QualityReference, ExportError> {
    if features.len() != logits.len() {
        return Err(ExportError::RunLacks(format!(
            "the `{FEATURES_OUTPUT}` output in the lowered graph"
        )));
    }
    let reference = QualityReference::build(
        logits
            .iter()
            .zip(features)
            .map(|(l, f)| (l.as_slice(), f.as_slice())),
        classes,
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
