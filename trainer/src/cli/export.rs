//! `trainer export`: a run as a self-describing, verified artifact directory (the stages are in
//! `kestrel_trainer::export`).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use kestrel_trainer::distributed::{Job, JobOpts};
use kestrel_trainer::export::{self, ExportOpts, QuantForm};

use super::args::{CacheArgs, ThreadArgs};

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
    quantize: QuantForm,
    /// Training samples for calibration: activation ranges (int8) and bias correction (both
    /// quantized forms).
    #[arg(long, default_value_t = 200)]
    calibration: usize,
    /// Static int8 only: keep float activations in the stem and this many leading blocks
    /// (their weights stay int8); the layers nearest the input are the most sensitive.
    #[arg(long, default_value_t = 2)]
    float_blocks: usize,
    /// Precision of model.safetensors: f32 | f16.
    #[arg(long, default_value = "f32", value_parser = ["f32", "f16"])]
    dtype: String,
    /// Fail when a quantized form loses more validation accuracy than this (percentage points).
    #[arg(long, default_value_t = 1.0)]
    max_accuracy_drop: f64,
    /// Fail when the f32 graph's logits differ from the trainer's by more than this in any runtime.
    #[arg(long, default_value_t = 1e-3)]
    tolerance: f64,
    /// Model name in the manifest [default: run directory name + form].
    #[arg(long)]
    model_name: Option<String>,
    /// Monotonic model version.
    #[arg(long, default_value_t = 1)]
    model_version: u64,
    /// Golden samples kept for on-device health checks.
    #[arg(long, default_value_t = 4)]
    golden: usize,
    #[command(flatten)]
    cache: CacheArgs,
    #[command(flatten)]
    threads: ThreadArgs,
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
    let opts = ExportOpts {
        quantize: a.quantize,
        calibration: a.calibration,
        float_blocks: a.float_blocks,
        f16: a.dtype == "f16",
        max_accuracy_drop: a.max_accuracy_drop,
        tolerance: a.tolerance,
        name: a.model_name,
        version: a.model_version,
        golden: a.golden,
    };
    let m = export::export(&a.run, &a.out, &opts, job)
        .with_context(|| format!("exporting {} to {}", a.run.display(), a.out.display()))?;
    if a.json {
        println!("{}", serde_json::to_string(&m)?);
        return Ok(ExitCode::SUCCESS);
    }
    let size: u64 = m
        .files
        .iter()
        .find(|f| f.path == "model.onnx")
        .map_or(0, |f| f.size);
    println!(
        "{} v{} ({}): model.onnx {:.1} MB, val accuracy {:.4} (f32 {:.4}) -> {}",
        m.name,
        m.version,
        m.quantization.form,
        size as f64 / 1e6,
        m.quantization.accuracy,
        m.quantization.f32_accuracy,
        a.out.display()
    );
    Ok(ExitCode::SUCCESS)
}
