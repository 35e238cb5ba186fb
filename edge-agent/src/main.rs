//! `edge-agent`: the device side of Kestrel.
//!
//! This first cut carries the shared preprocessing (the same implementation the trainer uses);
//! model delivery, activation and inference over MQTT build on it.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use kestrel_shared::PreprocessSpec;

#[derive(Parser)]
#[command(
    name = "edge-agent",
    version,
    about = "Kestrel edge agent: verified models over MQTT, inference with tract"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Decode + preprocess images exactly as inference does; writes raw little-endian f32 (CHW).
    Preprocess {
        /// Preprocessing spec as JSON (the `preprocess` object of an artifact manifest).
        #[arg(long)]
        spec: PathBuf,
        /// Output directory: one <file name>.f32 per image.
        #[arg(long)]
        out: PathBuf,
        #[arg(required = true)]
        images: Vec<PathBuf>,
    },
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Preprocess { spec, out, images } => {
            let text = std::fs::read_to_string(&spec)
                .with_context(|| format!("reading {}", spec.display()))?;
            let spec: PreprocessSpec = serde_json::from_str(&text)
                .with_context(|| format!("parsing spec {}", spec.display()))?;
            kestrel_shared::preprocess::dump_tensors(&spec, &images, &out)?;
            Ok(())
        }
    }
}
