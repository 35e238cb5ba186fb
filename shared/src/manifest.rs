//! The artifact manifest: everything needed to use a model without guessing — preprocessing,
//! labels, tensor names and shapes, quantization, training and verification results, golden
//! samples for on-device health checks, and the sha256 and size of every file.

use serde::{Deserialize, Serialize};

use crate::PreprocessSpec;

pub const MANIFEST_FILE: &str = "manifest.json";
/// The most bytes a `manifest.json` is read to: exported manifests are some KiB to some hundreds
/// of KiB (labels, golden samples, file list and quality reference of a thousand classes), far
/// below this; a larger file is refused, not read.
pub const MAX_MANIFEST_BYTES: u64 = 4 << 20;
pub const FORMAT_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    pub name: String,
    /// Monotonic model version (rollouts compare it).
    pub version: u64,
    pub arch: String,
    pub labels: Vec<String>,
    pub preprocess: PreprocessSpec,
    pub input: TensorSpec,
    pub output: TensorSpec,
    pub quantization: Quantization,
    /// Training results of the run the model came from (best epoch, accuracies, parameters).
    pub training: serde_json::Value,
    /// How each runtime ran this file at export.
    pub verification: Vec<RuntimeCheck>,
    pub golden: Vec<Golden>,
    /// Every file of the artifact except `manifest.json`, with sha256 and size.
    pub files: Vec<FileEntry>,
    /// RFC 3339, UTC.
    pub created: String,
    /// The MLflow registry version this artifact was registered as (`models:/NAME/VERSION`), when
    /// it was (`trainer export --register`); devices report it with their active model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registry: Option<String>,
    /// What the model does on its validation split (predicted classes, top-1 confidences, pooled
    /// features), for label-free quality telemetry on the device; absent in artifacts exported
    /// before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<crate::quality::QualityReference>,
    /// `model.onnx` as parts named by content (see [`Composition`]); absent in artifacts exported
    /// before parts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub composition: Option<Composition>,
}

/// How `model.onnx` is made of parts: its bytes are the parts' bytes one after another (a
/// protobuf message that appears again is merged, so each part adds its graph nodes and
/// initializers). The frame (opset, metadata, the graph's inputs and outputs: small, and
/// particular to a version) comes first; then the frozen backbone, each trained block, the head.
/// A part is named by the sha256 of its bytes, which depend only on what it computes and on its
/// quantization: versions that share a backbone share that part, and a device that holds it
/// fetches only the rest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Composition {
    /// The file the parts make (`model.onnx`).
    pub file: String,
    pub parts: Vec<PartEntry>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PartEntry {
    /// `frame`, `backbone`, `block:<name>`, `head`.
    pub role: String,
    pub sha256: String,
    pub size: u64,
    /// The tensors that join it to the parts before it: what it reads that they compute (or the
    /// graph's input).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reads: Vec<String>,
    /// The sha256 of the part it was cut to follow (a block or head reads that part's tensors:
    /// it was trained on them); none for the frame and the first computing part.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<String>,
}

/// Why parts do not make a manifest's model.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum CompositionError {
    #[error("part {index} ({role}, sha256 {sha256}) of the model: {reason}")]
    Part {
        index: usize,
        role: String,
        sha256: String,
        reason: String,
    },
    #[error(
        "the parts make {size} bytes with sha256 {sha256}, and the manifest's {file} is {expect_size} bytes with sha256 {expect_sha256}"
    )]
    Whole {
        file: String,
        size: u64,
        sha256: String,
        expect_size: u64,
        expect_sha256: String,
    },
}

impl Composition {
    /// The model's bytes from its parts' (`bytes[i]` for part `i`), checked: each part against
    /// its hash and size, each against the part it was cut to follow (a head trained on another
    /// backbone is refused, naming it), and the whole against the manifest's entry for the file.
    pub fn compose(
        &self,
        files: &[FileEntry],
        bytes: &[&[u8]],
    ) -> Result<Vec<u8>, CompositionError> {
        let mut out = Vec::with_capacity(self.parts.iter().map(|p| p.size as usize).sum());
        for (index, part) in self.parts.iter().enumerate() {
            let fail = |reason: String| CompositionError::Part {
                index,
                role: part.role.clone(),
                sha256: part.sha256.clone(),
                reason,
            };
            let b = bytes.get(index).ok_or_else(|| fail("missing".into()))?;
            if b.len() as u64 != part.size || crate::wire::sha256_hex(b) != part.sha256 {
                return Err(fail(format!(
                    "its {} bytes are not the part (sha256 {})",
                    b.len(),
                    crate::wire::sha256_hex(b)
                )));
            }
            let before = index.checked_sub(1).map(|i| self.parts[i].sha256.as_str());
            if let Some(a) = &part.after
                && Some(a.as_str()) != before
            {
                return Err(fail(format!(
                    "it was cut to follow part {a} (it reads {}), and here follows {}: a part of another model",
                    part.reads.join(", "),
                    before.unwrap_or("nothing")
                )));
            }
            out.extend_from_slice(b);
        }
        let whole = files.iter().find(|f| f.path == self.file);
        let sha256 = crate::wire::sha256_hex(&out);
        match whole {
            Some(f) if f.sha256 == sha256 && f.size == out.len() as u64 => Ok(out),
            _ => Err(CompositionError::Whole {
                file: self.file.clone(),
                size: out.len() as u64,
                sha256,
                expect_size: whole.map_or(0, |f| f.size),
                expect_sha256: whole.map_or_else(|| "(not listed)".into(), |f| f.sha256.clone()),
            }),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: String,
    /// Dimensions; the batch is the symbolic `"N"`.
    pub shape: Vec<serde_json::Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Quantization {
    pub form: crate::wire::QuantForm,
    pub int8_ops: Vec<String>,
    /// Calibration samples (static int8 only).
    pub calibration_samples: usize,
    /// Validation accuracy of the f32 model and of this form (tract), and the difference in points.
    pub f32_accuracy: f64,
    pub accuracy: f64,
    pub accuracy_delta_pt: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RuntimeCheck {
    pub runtime: String,
    pub samples: usize,
    pub accuracy: f64,
    /// Largest |logit − trainer reference| over the validation samples.
    pub max_abs_logit_diff: f64,
    pub golden_top1_match: bool,
}

/// A sample the device runs after installing the model: its image file in the artifact, the
/// sha256 of the preprocessed tensor (f32 little-endian), and what the model must answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Golden {
    pub file: String,
    pub input_sha256: String,
    pub expected_top1: usize,
    /// The outputs tract gives.
    pub logits: Vec<f32>,
    /// Another runtime's outputs, where they differ from tract's by more than the health
    /// check's tolerance (static int8 in ONNX Runtime's integer kernels rounds otherwise than
    /// tract's float execution of the same Q/DQ graph); keyed by engine name (`ort`).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub runtime_logits: std::collections::BTreeMap<String, Vec<f32>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    pub path: String,
    pub sha256: String,
    pub size: u64,
}

/// Formats seconds since the Unix epoch as RFC 3339 UTC (`2026-11-30T06:07:08Z`).
pub fn rfc3339(unix_seconds: u64) -> String {
    let days = (unix_seconds / 86_400) as i64;
    let secs = unix_seconds % 86_400;
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_022_428), "2026-11-30T07:07:08Z");
    }
}
