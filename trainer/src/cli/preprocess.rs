//! `trainer preprocess`: images through a preprocessing spec, as raw tensors.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::distributed::Job;
use anyhow::{Result, bail};
use kestrel_models::Arch;

use super::args::{parse_arch, read_spec};

/// Decode + preprocess images and write each tensor as raw little-endian f32 (CHW).
#[derive(clap::Args)]
pub struct Args {
    /// Preprocessing spec as JSON (as in an artifact manifest); default: the architecture's.
    #[arg(long, conflicts_with = "arch")]
    spec: Option<PathBuf>,
    /// Architecture: efficientnet-lite0 | mobilenetv2.
    #[arg(long, value_parser = parse_arch)]
    arch: Option<Arch>,
    /// Output directory: one <file name>.f32 per image.
    #[arg(long)]
    out: PathBuf,
    #[arg(required = true)]
    images: Vec<PathBuf>,
}

pub fn run(a: Args, _: &Job) -> Result<ExitCode> {
    let spec = match (a.spec, a.arch) {
        (Some(p), _) => read_spec(&p)?,
        (None, Some(arch)) => kestrel_models::Network::new(arch).preprocess,
        (None, None) => bail!("pass --spec FILE or --arch NAME"),
    };
    kestrel_shared::preprocess::dump_tensors(&spec, &a.images, &a.out)?;
    Ok(ExitCode::SUCCESS)
}
