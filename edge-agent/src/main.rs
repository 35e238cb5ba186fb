//! `edge-agent`: the device side of Kestrel.
//!
//! `run` is the agent: signed models over MQTT, atomic activation after a health check, rollback,
//! inference requests over MQTT and from a watched directory. `predict`, `check` and `preprocess`
//! do the same work on local files.

use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;
use edge_agent::cli::{Cli, Cmd};
use kestrel_shared::PreprocessSpec;

fn main() -> ExitCode {
    let cli = Cli::parse();
    cli.verbosity.init();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            tracing::error!("{}", kestrel_shared::Chain(e.as_ref()));
            // 78 (EX_CONFIG): a configuration systemd should not restart into
            // (RestartPreventExitStatus=78 in deploy/debian/kestrel-agent.service).
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
            share_part_files,
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
            let simulate = simulate.map(|devices| edge_agent::agent::Simulation {
                devices,
                share_part_files,
            });
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
                        tracing::error!("{}", kestrel_shared::Chain(e.as_ref()));
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
