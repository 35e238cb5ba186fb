//! The command line of `edge-agent` (also read by `edge-agent-docs` for the man pages and shell
//! completions the Debian package ships).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use kestrel_runtime::EngineKind;
use kestrel_runtime::artifact::LoadedModel;

#[derive(Parser)]
#[command(
    name = "edge-agent",
    version,
    about = "Kestrel edge agent: verified models over MQTT, inference with tract",
    after_help = "Exit status: 0 done; 1 failed (a check did not pass, a bad image or artifact, \
                  any other error); 2 usage; 78 configuration (agent.toml), which the systemd \
                  unit does not restart into."
)]
pub struct Cli {
    #[command(flatten)]
    pub verbosity: kestrel_shared::logging::Verbosity,
    /// Inference threads.
    #[arg(long, global = true, default_value_t = 1)]
    pub threads: usize,
    /// Inference engine for predict and check: tract (built in), or ort (ONNX Runtime from
    /// ORT_DYLIB_PATH; needs an agent built with the cargo feature `ort`). `run` takes it
    /// from `[inference] engine` in agent.toml.
    #[arg(long, global = true, default_value = "tract", value_parser = parse_engine)]
    pub engine: EngineKind,
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(clap::Args)]
pub struct ModelArgs {
    /// Artifact directory (manifest.json, model.onnx, golden/), or a version in an agent's
    /// store (`STORE/active`), whose model is composed from the store's parts.
    #[arg(long)]
    pub model: PathBuf,
    /// The part store a version without a model.onnx of its own is composed from [default:
    /// MODEL/../../parts, an agent store's, when it exists].
    #[arg(long, value_name = "DIR")]
    pub parts: Option<PathBuf>,
    /// Largest artifact accepted, in bytes (sum of the manifest's files).
    #[arg(long, default_value_t = 64 << 20)]
    pub max_bytes: u64,
    /// Trusted public key file (`trainer keygen`'s kestrel.pub); repeatable. With any given, the
    /// artifact's manifest.sig must verify with one of them.
    #[arg(long = "trusted-key")]
    pub trusted_keys: Vec<PathBuf>,
}

impl ModelArgs {
    pub fn load(&self, engine: EngineKind, threads: usize) -> Result<LoadedModel> {
        let ctx = || format!("model {}", self.model.display());
        if !self.trusted_keys.is_empty() {
            let keys = self
                .trusted_keys
                .iter()
                .map(|p| {
                    let text = std::fs::read_to_string(p)
                        .with_context(|| format!("reading {}", p.display()))?;
                    Ok(kestrel_shared::signing::public_key(
                        &text,
                        &p.display().to_string(),
                    )?)
                })
                .collect::<Result<Vec<_>>>()?;
            kestrel_runtime::artifact::verify_signature(&self.model, &keys).with_context(ctx)?;
        }
        let parts = (self.parts.clone())
            .or_else(|| Some(self.model.join("../../parts")).filter(|p| p.is_dir()));
        LoadedModel::load_parts(
            &self.model,
            parts.as_deref(),
            self.max_bytes,
            engine,
            threads,
        )
        .with_context(ctx)
    }
}

#[derive(Subcommand)]
pub enum Cmd {
    /// Run the agent: follow the desired state over MQTT, install signed models, serve inference.
    Run {
        /// Agent configuration (see edge-agent/agent.toml).
        #[arg(long)]
        config: PathBuf,
        /// Also classify images dropped into this directory (results in DIR/results.jsonl,
        /// images moved to DIR/done/).
        #[arg(long)]
        watch: Option<PathBuf>,
        /// Simulate N devices in this process (ids <device_id>-000..., stores under <store>/),
        /// sharing one model cache: for fleet tests and benchmarks.
        #[arg(long, value_name = "N", conflicts_with = "watch")]
        simulate: Option<usize>,
        /// --simulate: keep one file on disk per part the devices hold (<store>/shared-parts,
        /// hard-linked into each device's part store), so a fleet of thousands fits the disk;
        /// each device still fetches and checks every byte it lacks.
        #[arg(long, requires = "simulate")]
        share_part_files: bool,
        /// Live traffic from a directory of images, as a camera would send it: answered and
        /// judged by quality telemetry like MQTT requests, not published. Repeatable with
        /// --simulate: device i gets the (i mod count)-th feed and, with GROUP=, joins GROUP.
        #[arg(long, value_name = "[GROUP=]DIR", value_parser = parse_feed)]
        feed: Vec<(Option<String>, PathBuf)>,
        /// Requests per second of each fed device.
        #[arg(long, value_name = "HZ", default_value_t = 5.0, requires = "feed")]
        feed_rate: f64,
        /// Feed each image once (never dropped for a full queue), then stop feeding.
        #[arg(long, requires = "feed")]
        feed_once: bool,
    },
    /// Classify images with an artifact (verified and health-checked first), as the agent serves them.
    Predict {
        #[command(flatten)]
        model: ModelArgs,
        /// Number of classes to report per image.
        #[arg(long, default_value_t = 3)]
        top_k: usize,
        /// One JSON object per line: {"image", "top": [{"class", "label", "score"}], "model", "version", "latency_ms"}.
        #[arg(long)]
        json: bool,
        #[arg(required = true)]
        images: Vec<PathBuf>,
    },
    /// Verify an artifact's files against its manifest and run its golden samples.
    Check {
        #[command(flatten)]
        model: ModelArgs,
    },
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

fn parse_feed(s: &str) -> Result<(Option<String>, PathBuf), String> {
    match s.split_once('=') {
        Some((g, dir)) if !g.contains('/') => Ok((Some(g.to_string()), dir.into())),
        _ => Ok((None, s.into())),
    }
}

fn parse_engine(s: &str) -> Result<EngineKind, String> {
    match s.parse() {
        Ok(EngineKind::Candle) => Err("the agent runs tract or ort".into()),
        Ok(k) => Ok(k),
        Err(e) => Err(kestrel_shared::chain(&e)),
    }
}
