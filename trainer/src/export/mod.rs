//! `trainer export`: a trained run becomes a self-describing artifact directory —
//! `model.onnx` (backbone + head, one graph, symbolic batch, float logits), `manifest.json`,
//! `model.safetensors`, `head.safetensors` (and `model.int8.safetensors` for int8 forms), and
//! golden images — verified in tract and ONNX Runtime before it is written.
//!
//! [`export`] runs as stages, each a function from one value to the next:
//! `trained` (the run as the trainer sees it) → `calibrate` (quantized forms) → `lower`
//! (the ONNX graph) → `verify` (every runtime against the trainer, with the gates) → `reference`
//! (the quality profile of the exported graph on the validation split) → `golden`
//! (sample images and their expected outputs) → `write` (files and manifest, atomically).
//! `evaluate` runs exported artifacts (`trainer evaluate --model`, `trainer latency`).

use std::path::Path;

use kestrel_shared::manifest::Manifest;
use kestrel_shared::wire::QuantForm;

mod calibrate;
mod evaluate;
mod golden;
mod lower;
mod reference;
mod trained;
mod verify;
mod write;

pub use evaluate::{evaluate_model, latency_ms, read_manifest};

use crate::data::DataError;
use crate::data::cache::CacheError;
use crate::distributed::Job;
use crate::train::TrainError;

/// The quantization `trainer export --quantize` asks for (the manifest records it as a
/// [`QuantForm`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Quantize {
    None,
    Int8Weights,
    Int8,
}

impl Quantize {
    /// The form the artifact's manifest records.
    pub fn form(self) -> QuantForm {
        match self {
            Quantize::None => QuantForm::None,
            Quantize::Int8Weights => QuantForm::Int8Weights,
            Quantize::Int8 => QuantForm::Int8,
        }
    }
}

#[derive(Debug, Clone)]
pub struct ExportOpts {
    pub quantize: Quantize,
    /// Training samples used to calibrate activation ranges (static int8).
    pub calibration: usize,
    /// Static int8: the stem and this many leading blocks keep float activations.
    pub float_blocks: usize,
    /// int8-weights: the frozen blocks without bias correction (the same part in every run).
    pub shared_backbone: bool,
    pub f16: bool,
    /// Largest accepted accuracy drop of a quantized form, in percentage points.
    pub max_accuracy_drop: f64,
    /// Largest accepted |logit − reference| of the f32 form in any runtime.
    pub tolerance: f64,
    pub name: Option<String>,
    pub version: u64,
    pub golden: usize,
    /// `models:/NAME/VERSION` written into the manifest (`--register`).
    pub registry: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// Loading or preparing the run.
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Weights(#[from] kestrel_models::weights::WeightError),
    #[error(transparent)]
    Engine(#[from] kestrel_models::EngineError),
    #[error(transparent)]
    Preprocess(#[from] kestrel_shared::PreprocessError),
    #[error(transparent)]
    Artifact(#[from] kestrel_models::artifact::ArtifactError),
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    #[error("{path}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}")]
    Json {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    /// Serialising a tensor or a safetensors file (`what` names it).
    #[error("{what}")]
    Safetensors {
        what: String,
        #[source]
        source: safetensors::SafeTensorError,
    },
    /// A tensor the exported network needs is not in the run (`what` names it).
    #[error("run lacks {0}")]
    RunLacks(String),
    #[error("golden sample not in the table")]
    GoldenNotInTable,
    /// Gate: the f32 form's logits differ from the trainer's by more than `--tolerance` times
    /// the logits' scale.
    #[error(
        "{runtime} disagrees with the trainer: max |logit diff| {max_diff:.3e} > --tolerance {tolerance:.0e} x logit scale {scale:.3}"
    )]
    Disagrees {
        runtime: String,
        max_diff: f64,
        tolerance: f64,
        /// The largest |reference logit|, at least 1.
        scale: f64,
    },
    /// Gate: a form loses more accuracy than `--max-accuracy-drop`.
    #[error(
        "{form} form loses {drop:.2} accuracy points in {runtime} (f32 {f32_accuracy:.4} → {accuracy:.4}), more than --max-accuracy-drop {max_drop}"
    )]
    AccuracyDrop {
        form: QuantForm,
        runtime: String,
        drop: f64,
        f32_accuracy: f64,
        accuracy: f64,
        max_drop: f64,
    },
    /// Gate: a runtime's top-1 on the golden samples differs from tract's.
    #[error("{runtime} and tract disagree on the golden samples' top-1")]
    GoldenMismatch { runtime: String },
    #[error("not supported: {0}")]
    Unsupported(String),
    #[error("exported models run on tract or ort, not candle")]
    CandleEngine,
    #[error("{data} has label `{label}`, unknown to the model (labels {labels:?})")]
    UnknownLabel {
        data: String,
        label: String,
        labels: Vec<String>,
    },
}

impl ExportError {
    fn io(path: impl AsRef<Path>) -> impl FnOnce(std::io::Error) -> ExportError {
        let path = path.as_ref().display().to_string();
        move |source| ExportError::Io { path, source }
    }
}

/// Exports `run_dir` into `out` (replaced if it exists), with the job's caches and threads.
/// Returns the manifest written.
pub fn export(
    run_dir: &Path,
    out: &Path,
    o: &ExportOpts,
    job: &Job,
) -> Result<Manifest, ExportError> {
    let log = &mut |line: String| job.log(line);
    let run = trained::Trained::load(run_dir, job)?;
    let quantized = calibrate::quantize(&run, o, job.threads(), log)?;
    let lowered = lower::lower(&run, &quantized, o, artifact_name(run_dir, o))?;
    let engines = verify::engines(&lowered, job.threads(), log)?;
    let mut verification = verify::verify(&run, &engines, o, log)?;
    let golden = golden::golden(&run, &engines, o.golden, &mut verification.checks)?;
    write::write(out, &run, &quantized, &lowered, verification, golden, o)
}

/// `--model-name`, or the run directory's name and the quantized form.
fn artifact_name(run_dir: &Path, o: &ExportOpts) -> String {
    o.name.clone().unwrap_or_else(|| {
        format!(
            "{}-{}",
            run_dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or("model".into()),
            o.quantize.form()
        )
    })
}
