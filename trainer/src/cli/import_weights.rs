//! `trainer import-weights`: a PyTorch or safetensors checkpoint into canonical safetensors.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::distributed::Job;
use anyhow::{Context, Result};
use kestrel_models::backbone::{Backbone, pretrained_path};
use kestrel_models::{Arch, torch};

use super::args::parse_arch;

/// Import a PyTorch (.pth, legacy or zip) or safetensors checkpoint into canonical safetensors.
#[derive(clap::Args)]
pub struct Args {
    /// Architecture: efficientnet-lite0 | mobilenetv2.
    #[arg(long, value_parser = parse_arch)]
    arch: Arch,
    /// Source checkpoint.
    #[arg(long)]
    from: PathBuf,
    /// Output file [default: the pretrained cache location for the architecture].
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn run(a: Args, _: &Job) -> Result<ExitCode> {
    let b = Backbone::from_file(&a.from, a.arch)
        .with_context(|| format!("importing {}", a.from.display()))?;
    let out = a.out.unwrap_or_else(|| pretrained_path(a.arch));
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let meta = [
        ("arch".to_string(), a.arch.name().to_string()),
        ("source".to_string(), a.from.display().to_string()),
    ];
    torch::write_safetensors(&out, &b.weights, Some(meta.into_iter().collect()))?;
    outln!(
        "imported {} tensors from {} into {}",
        b.weights.len(),
        a.from.display(),
        out.display()
    );
    Ok(ExitCode::SUCCESS)
}
