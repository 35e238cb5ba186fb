//! `edge-agent`: the device side of Kestrel.
//!
//! `run` is the agent: signed models over MQTT, atomic activation after a health check, rollback,
//! inference requests over MQTT and from a watched directory. `predict`, `check` and `preprocess`
//! do the same work on local files.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use kestrel_models::EngineKind;
use kestrel_models::artifact::LoadedModel;
use kestrel_shared::PreprocessSpec;

#[derive(Parser)]
#[command(
    name = "edge-agent",
    version,
    about = "Kestrel edge agent: verified models over MQTT, inference with tract",
    after_help = "Exit status: 0 done; 1 failed (a check did not pass, a bad image or artifact, \
                  any other error); 2 usage; 78 configuration (agent.toml), which the systemd \
                  unit does not restart into."
)]
struct Cli {
    #[command(flatten)]
    verbosity: kestrel_shared::logging::Verbosity,
    /// Inference threads.
    #[arg(long, global = true, default_value_t = 1)]
    threads: usize,
    /// Inference engine for predict and check: tract (built in), or ort (ONNX Runtime from
    /// ORT_DYLIB_PATH; needs an agent built with the cargo feature `ort`). `run` takes it
    /// from `[inference] engine` in agent.toml.
    #[arg(long, global = true, default_value = "tract", value_parser = parse_engine)]
    engine: EngineKind,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args)]
struct ModelArgs {
    /// Artifact directory (manifest.json, model.onnx, golden/).
    #[arg(long)]
    model: PathBuf,
    /// Largest artifact accepted, in bytes (sum of the manifest's files).
    #[arg(long, default_value_t = 64 << 20)]
    max_bytes: u64,
    /// Trusted public key file (`trainer keygen`'s kestrel.pub); repeatable. With any given, the
    /// artifact's manifest.sig must verify with one of them.
    #[arg(long = "trusted-key")]
    trusted_keys: Vec<PathBuf>,
}

impl ModelArgs {
    fn load(&self, engine: EngineKind, threads: usize) -> Result<LoadedModel> {
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
            kestrel_models::artifact::verify_signature(&self.model, &keys).with_context(ctx)?;
        }
        LoadedModel::load(&self.model, self.max_bytes, engine, threads).with_context(ctx)
    }
}

#[derive(Subcommand)]
enum Cmd {
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
        Err(e) => Err(e.to_string()),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    cli.verbosity.init();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            tracing::error!("{e:#}");
            // 78 (EX_CONFIG): a configuration systemd should not restart into
            // (RestartPreventExitStatus=78 in deploy/kestrel-agent.service).
            if e.chain().any(|c| c.is::<edge_agent::config::ConfigError>()) {
                ExitCode::from(78)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode> {
    match cli.cmd {
        Cmd::Run {
            config,
            watch,
            simulate,
            feed,
            feed_rate,
            feed_once,
        } => {
            let cfg = edge_agent::config::Config::load(&config)?;
            anyhow::ensure!(
                feed_rate > 0.0 && feed_rate.is_finite(),
                "--feed-rate {feed_rate}: give requests per second above 0"
            );
            let feeds: Vec<edge_agent::agent::Feed> = feed
                .into_iter()
                .map(|(group, dir)| edge_agent::agent::Feed {
                    dir,
                    rate: feed_rate,
                    once: feed_once,
                    group,
                })
                .collect();
            edge_agent::agent::run(cfg, watch, simulate, &feeds)?;
        }
        Cmd::Predict {
            model,
            top_k,
            json,
            images,
        } => {
            let m = model.load(cli.engine, cli.threads)?;
            let mut failed = 0;
            for img in &images {
                let name = img.display().to_string();
                let r = std::fs::read(img)
                    .map_err(|e| anyhow::anyhow!("{name}: {e}"))
                    .and_then(|b| m.predict(&b, &name, top_k).map_err(anyhow::Error::from));
                match r {
                    Ok(p) if json => println!("{}", serde_json::to_string(&p)?),
                    Ok(p) => {
                        let top: Vec<String> = p
                            .top
                            .iter()
                            .map(|c| format!("{} ({:.3})", c.label, c.score))
                            .collect();
                        println!("{name}: {}  [{:.1} ms]", top.join(", "), p.latency_ms);
                    }
                    Err(e) => {
                        failed += 1;
                        tracing::error!("{e:#}");
                    }
                }
            }
            if failed > 0 {
                tracing::error!(
                    "{failed} of {} images could not be classified",
                    images.len()
                );
                return Ok(ExitCode::FAILURE);
            }
        }
        Cmd::Check { model } => {
            let m = model.load(cli.engine, cli.threads)?;
            println!(
                "{} v{} ({}): {} files verified, {} golden samples pass on {}",
                m.manifest.name,
                m.manifest.version,
                m.manifest.quantization.form,
                m.manifest.files.len(),
                m.manifest.golden.len(),
                m.engine()
            );
        }
        Cmd::Preprocess { spec, out, images } => {
            let text = std::fs::read_to_string(&spec)
                .with_context(|| format!("reading {}", spec.display()))?;
            let spec: PreprocessSpec = serde_json::from_str(&text)
                .with_context(|| format!("parsing spec {}", spec.display()))?;
            kestrel_shared::preprocess::dump_tensors(&spec, &images, &out)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}
