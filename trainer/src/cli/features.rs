//! The backbone and engine flags of `trainer prepare`, for a feature [`Extractor`] made outside a
//! command (the Python package's `kestrel.spark.features`, one per executor's Python worker).

use anyhow::Result;
use clap::Parser;

use crate::data::extract::Extractor;

use super::args::{BackboneArgs, EngineArgs};

#[derive(Parser)]
#[command(name = "features", no_binary_name = true)]
pub struct Args {
    #[command(flatten)]
    backbone: BackboneArgs,
    #[command(flatten)]
    engine: EngineArgs,
}

/// An extractor from flags as `trainer prepare` takes them (`--backbone`, `--engine`, `--threads`...).
pub fn extractor<S: AsRef<str>>(flags: &[S]) -> Result<Extractor> {
    let a = Args::try_parse_from(flags.iter().map(AsRef::as_ref))?;
    Ok(Extractor::new(
        a.backbone.load()?,
        a.engine.engine,
        a.engine.job_opts().engine_opts(),
    )?)
}
