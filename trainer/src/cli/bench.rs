//! `trainer bench`: feature-extraction throughput.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::classify::throughput;
use crate::distributed::{Job, JobOpts};
use crate::train::ComputeDevice;
use anyhow::Result;
use kestrel_models::op_timing::time_ops;

use super::args::{BackboneArgs, EngineArgs};

/// Measure feature-extraction throughput (decode + preprocess + backbone), images/s.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    backbone: BackboneArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// Images per batch.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Timed repetitions after one warm-up.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Print the throughput as JSON.
    #[arg(long)]
    json: bool,
    /// Time the trainable convolutions' ops instead (forward + backward, ms): each CPU op against
    /// its composed form, on the CPU and on --compute-device (what a GPU runs; docs/gpu.md).
    #[arg(long)]
    ops: bool,
    /// Where the trainable blocks and the head run: cpu, cuda (each rank on the GPU of its local
    /// rank) or cuda:N. CUDA needs a trainer built with `--features kestrel-trainer/cuda`
    /// (docs/gpu.md).
    #[arg(long, default_value = "cpu", value_name = "WHERE")]
    compute_device: ComputeDevice,
    #[arg(required_unless_present = "ops")]
    images: Vec<PathBuf>,
}

pub fn job_opts(a: &Args) -> Result<JobOpts> {
    Ok(a.engine.job_opts())
}

pub fn run(a: Args, job: &Job) -> Result<ExitCode> {
    if a.ops {
        return ops(&a);
    }
    let b = a.backbone.load()?;
    let t = throughput(
        &b,
        a.engine.engine,
        &a.images,
        a.batch,
        job.engine_opts(),
        a.rounds,
    )?;
    if a.json {
        outln!("{}", serde_json::to_string(&t)?);
    } else {
        outln!(
            "{} {} batch {} threads {}: {:.1} images/s",
            t.engine,
            t.arch,
            t.batch,
            t.threads,
            t.images_per_s
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `--ops`: the custom ops against their composed forms.
fn ops(a: &Args) -> Result<ExitCode> {
    let device = a.compute_device.check_built()?.candle(0)?;
    let timings = time_ops(&device, a.rounds)?;
    if a.json {
        outln!("{}", serde_json::to_string(&timings)?);
        return Ok(ExitCode::SUCCESS);
    }
    outln!(
        "{:<20}{:>18}{:>12}{:>16}{:>10}{:>18}",
        "op (fwd+bwd)",
        "shape [c,n,h,w]",
        "CPU op ms",
        "composed ms",
        "ratio",
        format!("on {} ms", a.compute_device)
    );
    for t in &timings {
        outln!(
            "{:<20}{:>18}{:>12.2}{:>16.2}{:>9.2}x{:>18}",
            t.op,
            format!("{:?}", t.shape),
            t.cpu_op_ms,
            t.composed_cpu_ms,
            t.composed_cpu_ms / t.cpu_op_ms,
            t.composed_device_ms
                .map_or("-".into(), |ms| format!("{ms:.2}"))
        );
    }
    Ok(ExitCode::SUCCESS)
}
