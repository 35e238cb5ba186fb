//! `trainer export`: a run as a self-describing, verified artifact directory (the stages are in
//! `crate::export`).

use std::path::PathBuf;
use std::process::ExitCode;

use crate::distributed::{Job, JobOpts};
use crate::export::{ExportOpts, Quantize};
use crate::track::registry::version_uri;
use crate::track::{Registration, TrackedExport, tracked_export};
use anyhow::{Result, bail};

use super::args::{CacheArgs, ThreadArgs, TrackArgs};

/// Export a run as a self-describing, verified artifact directory.
///
/// Writes model.onnx, manifest.json, safetensors and golden samples, verified in tract and ONNX
/// Runtime against the trainer (and the quantized forms against the accuracy gate).
#[derive(clap::Args)]
pub struct Args {
    /// Run directory written by `trainer fit`.
    #[arg(long, value_name = "RUN_DIR")]
    run: PathBuf,
    /// Artifact directory to write (replaced if it exists).
    #[arg(long)]
    out: PathBuf,
    /// none: f32; int8-weights: int8 per-channel weights, float activations (rollout default);
    /// int8: static int8 (weights + calibrated activations, QDQ).
    #[arg(long, value_enum, default_value = "none")]
    quantize: Quantize,
    /// Training samples for calibration: activation ranges (int8) and bias correction (both
    /// quantized forms).
    #[arg(long, default_value_t = 200)]
    calibration: usize,
    /// Keep f32 weights (and in static int8 float activations) in the stem and this many leading
    /// blocks; the layers nearest the input are the most sensitive to quantization.
    #[arg(long, default_value_t = 1)]
    float_blocks: usize,
    /// int8-weights: round the frozen backbone's weights without the bias correction (which is
    /// computed from this run's samples), so that every run on the same backbone exports the same
    /// backbone part and devices that hold it fetch only the new head. Costs fidelity: on LFW the
    /// largest logit error against the trainer rose from 0.09 to 0.44 (accuracy unchanged).
    #[arg(long)]
    shared_backbone: bool,
    /// Precision of model.safetensors: f32 | f16.
    #[arg(long, default_value = "f32", value_parser = ["f32", "f16"])]
    dtype: String,
    /// Fail when a quantized form loses more validation accuracy than this (percentage points).
    #[arg(long, default_value_t = 1.0)]
    max_accuracy_drop: f64,
    /// Fail when the f32 graph's logits differ from the trainer's by more than this in any runtime,
    /// relative to the largest |logit| on the validation split (when above 1).
    #[arg(long, default_value_t = 1e-3)]
    tolerance: f64,
    /// Model name in the manifest [default: run directory name + form].
    #[arg(long)]
    model_name: Option<String>,
    /// Monotonic model version [default: the registry's version with --register, else 1].
    #[arg(long)]
    model_version: Option<u64>,
    /// Golden samples kept for on-device health checks.
    #[arg(long, default_value_t = 4)]
    golden: usize,
    #[command(flatten)]
    cache: CacheArgs,
    #[command(flatten)]
    threads: ThreadArgs,
    #[command(flatten)]
    track: TrackArgs,
    /// Register the artifact in the MLflow model registry as a new version of NAME (its files are
    /// the run's LoggedModel on MLflow 3, else the run's `model/` artifacts; the manifest names
    /// the version). Needs --mlflow.
    #[arg(long, value_name = "NAME")]
    register: Option<String>,
    /// Point this alias of the registered model at the new version (e.g. staging).
    #[arg(long, requires = "register")]
    alias: Option<String>,
    /// Print the manifest as JSON.
    #[arg(long)]
    json: bool,
}

pub fn job_opts(a: &Args) -> Result<JobOpts> {
    Ok(JobOpts {
        cache_root: a.cache.root(),
        ..a.threads.job_opts()
    })
}

pub fn run(a: Args, job: &Job) -> Result<ExitCode> {
    let to = a.track.to();
    if a.register.is_some() && to.is_none() {
        bail!("--register needs an MLflow server: --mlflow URI or MLFLOW_TRACKING_URI")
    }
    let opts = ExportOpts {
        quantize: a.quantize,
        calibration: a.calibration,
        float_blocks: a.float_blocks,
        shared_backbone: a.shared_backbone,
        f16: a.dtype == "f16",
        max_accuracy_drop: a.max_accuracy_drop,
        tolerance: a.tolerance,
        name: a.model_name,
        version: 1,
        golden: a.golden,
        registry: None,
    };
    let register = Registration {
        name: a.register.as_deref(),
        alias: a.alias.as_deref(),
    };
    let TrackedExport {
        manifest: m,
        registered,
        pending,
    } = tracked_export(
        &a.run,
        &a.out,
        opts,
        a.model_version,
        job,
        to.as_ref(),
        register,
    )?;
    if a.json {
        outln!("{}", serde_json::to_string(&m)?);
        return Ok(ExitCode::SUCCESS);
    }
    let size: u64 = m
        .files
        .iter()
        .find(|f| f.path == "model.onnx")
        .map_or(0, |f| f.size);
    outln!(
        "{} v{} ({}): model.onnx {:.1} MB, val accuracy {:.4} (f32 {:.4}) -> {}",
        m.name,
        m.version,
        m.quantization.form,
        size as f64 / 1e6,
        m.quantization.accuracy,
        m.quantization.f32_accuracy,
        a.out.display()
    );
    if let Some(c) = &m.composition {
        let parts: Vec<String> = c
            .parts
            .iter()
            .map(|p| {
                format!(
                    "{} {} ({:.1} KB)",
                    p.role,
                    &p.sha256[..12],
                    p.size as f64 / 1e3
                )
            })
            .collect();
        outln!("parts: {}", parts.join(", "));
    }
    if let Some(v) = &registered {
        outln!(
            "registered {}{}",
            version_uri(&v.name, v.version),
            a.alias
                .map(|al| format!(" (alias {al})"))
                .unwrap_or_default()
        );
    }
    if let Some(line) = pending {
        tracing::info!("{line}");
    }
    Ok(ExitCode::SUCCESS)
}
