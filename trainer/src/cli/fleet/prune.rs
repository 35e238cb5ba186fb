//! `trainer prune` and `trainer unpublish`: clear retained artifact versions nothing needs.

use std::process::ExitCode;

use anyhow::Result;

use super::BrokerArgs;

#[derive(clap::Args)]
pub struct PruneArgs {
    #[command(flatten)]
    broker: BrokerArgs,
    /// Versions of each model kept besides those still needed (by a retained desired state or
    /// a running rollout).
    #[arg(long, value_name = "N", default_value_t = 2)]
    keep: usize,
    /// Print the result as one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct UnpublishArgs {
    #[command(flatten)]
    broker: BrokerArgs,
    /// The model's name (the artifact manifest's `name`).
    name: String,
    /// The version to clear.
    version: u64,
    /// Print the result as one JSON object.
    #[arg(long)]
    json: bool,
}

/// One cleared version, as a line.
fn removed(r: &kestrel_fleet::prune::Removed) -> String {
    let (name, v, chunks, parts) = (&r.name, r.version, r.chunks, r.parts);
    format!("removed {name} v{v} ({chunks} chunks, {parts} parts no kept version lists)")
}

fn warn(line: String) {
    tracing::warn!("{line}");
}

pub fn prune(args: PruneArgs) -> Result<ExitCode> {
    let p = kestrel_fleet::prune::prune(&args.broker.config(), args.keep, &mut warn)?;
    if args.json {
        outln!("{}", serde_json::to_string(&p)?);
        return Ok(ExitCode::SUCCESS);
    }
    for r in &p.removed {
        outln!("{}", removed(r));
    }
    for k in &p.kept {
        let why = if k.needed_by.is_empty() {
            format!("one of the {} newest", args.keep)
        } else {
            k.needed_by.join("; ")
        };
        outln!("kept {} v{}: {why}", k.name, k.version);
    }
    Ok(ExitCode::SUCCESS)
}

pub fn unpublish(args: UnpublishArgs) -> Result<ExitCode> {
    let cfg = args.broker.config();
    let r = kestrel_fleet::prune::unpublish(&cfg, &args.name, args.version, &mut warn)?;
    if args.json {
        outln!("{}", serde_json::to_string(&r)?);
    } else {
        outln!("{}", removed(&r));
    }
    Ok(ExitCode::SUCCESS)
}
