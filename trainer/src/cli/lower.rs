//! `trainer lower`: a backbone as an ONNX graph.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::distributed::Job;
use anyhow::{Context, Result};
use kestrel_models::onnx::{self, LowerOpts};

use super::args::BackboneArgs;

/// Write a backbone as an ONNX graph (features or pretrained logits).
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    backbone: BackboneArgs,
    /// Graph output: features (pooled, [N, 1280]) or logits (pretrained head).
    #[arg(long, default_value = "features", value_parser = ["features", "logits"])]
    output: String,
    /// ONNX file to write.
    #[arg(long)]
    out: PathBuf,
}

pub fn run(a: Args, _: &Job) -> Result<ExitCode> {
    let b = a.backbone.load()?;
    if let Some(g) = &b.graph {
        anyhow::ensure!(
            a.output == "features",
            "an ONNX backbone is lowered to its features only (--output features)"
        );
        std::fs::write(&a.out, g.bytes())
            .with_context(|| format!("writing {}", a.out.display()))?;
        outln!(
            "wrote {} (the feature graph of {}: `{}` [N, {}], from {:?} input `{}`)",
            a.out.display(),
            g.path.display(),
            g.feature_output,
            g.feature_dim,
            g.layout,
            g.input
        );
        return Ok(ExitCode::SUCCESS);
    }
    let opts = match a.output.as_str() {
        "logits" => LowerOpts::logits(
            &b.net,
            b.classifier()
                .context("this backbone has no classifier weights")?,
        ),
        _ => LowerOpts::features(&b.net),
    };
    let model = onnx::lower(&b.net, &b.folded()?, &opts);
    std::fs::write(&a.out, onnx::to_bytes(&model))
        .with_context(|| format!("writing {}", a.out.display()))?;
    outln!(
        "wrote {} ({} graph, output `{}`)",
        a.out.display(),
        b.net.arch,
        opts.output_name
    );
    Ok(ExitCode::SUCCESS)
}
