//! `trainer classify`: images through a backbone's pretrained ImageNet head.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::classify::Classifier;
use crate::distributed::{Job, JobOpts};
use anyhow::Result;

use super::args::{BackboneArgs, EngineArgs};

/// Classify images with a backbone's pretrained 1000-class ImageNet head.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    backbone: BackboneArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// Number of classes to report per image.
    #[arg(long, default_value_t = 5)]
    top_k: usize,
    /// One JSON object per line: {"image": PATH, "top": [{"class": N, "score": P}, ...]}.
    #[arg(long)]
    json: bool,
    #[arg(required = true)]
    images: Vec<PathBuf>,
}

pub fn job_opts(a: &Args) -> Result<JobOpts> {
    Ok(a.engine.job_opts())
}

pub fn run(a: Args, job: &Job) -> Result<ExitCode> {
    let classifier = Classifier::new(a.backbone.load()?, a.engine.engine, job.engine_opts())?;
    let mut failed = 0;
    for r in classifier.classify(&a.images, a.top_k)? {
        match r {
            Ok(p) if a.json => outln!("{}", serde_json::to_string(&p)?),
            Ok(p) => {
                let top: Vec<String> = p
                    .top
                    .iter()
                    .map(|c| format!("{} ({:.3})", c.class, c.score))
                    .collect();
                outln!("{}: {}", p.image, top.join(", "));
            }
            Err(e) => {
                failed += 1;
                tracing::error!("{}", kestrel_shared::Chain(&e));
            }
        }
    }
    if failed > 0 {
        tracing::error!(
            "{failed} of {} images could not be classified",
            a.images.len()
        );
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}
