//! `trainer rollout`: a staged rollout across the fleet; `trainer rollout status`: one's state.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Subcommand;
use kestrel_fleet::Bundle;
use kestrel_fleet::rollout::{Controller, Plan, RolloutState, driver};
use kestrel_shared::protocol::DEFAULT_CHUNK_BYTES;

use super::{ArtifactArgs, BrokerArgs, public_key, secret_key};

/// The flags of a rollout (required unless the `status` subcommand is given).
#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    status: Option<RolloutCmd>,
    #[command(flatten)]
    broker: BrokerArgs,
    #[command(flatten)]
    artifact: ArtifactArgs,
    /// Secret key file written by `trainer keygen` (signs manifests, desired states and rollout
    /// commands).
    #[arg(long, required = true)]
    key: Option<PathBuf>,
    /// Public key file of an operator (`trainer keygen --operator`) whose commands (pause,
    /// resume, abort, as a console sends them) this rollout obeys; repeatable. The --key's own
    /// commands are obeyed too.
    #[arg(long = "operator-pub", value_name = "PUB")]
    operator_key: Vec<PathBuf>,
    /// Rollout plan (TOML): [[phases]] with group or percent, success, failure or
    /// max_failures, timeout_s, soak_s, mode ("active" or "shadow"), quality gates
    /// (min_requests, min_shadow_agreement, max_confidence_drop, max_drift_devices) and pace
    /// (max_per_minute, max_in_progress [100], ramp, device_timeout_s, abort_failure_rate with
    /// abort_min_finished); optional name, devices, [groups] and dynamic (keep serving devices
    /// that appear after the last phase) (docs/fleet.md).
    #[arg(long, required = true)]
    fleet: Option<PathBuf>,
    /// Chunk size of the delivery, in bytes.
    #[arg(long, default_value_t = DEFAULT_CHUNK_BYTES)]
    chunk_bytes: usize,
    /// Print the final state as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
pub enum RolloutCmd {
    /// A rollout's state: devices per phase and state (from the broker).
    Status(StatusArgs),
}

#[derive(clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    broker: BrokerArgs,
    /// Rollout name (fleet.toml's name, default <model>-v<version>).
    #[arg(long)]
    name: String,
    /// Keep printing the table as it changes, until the rollout ends.
    #[arg(long)]
    follow: bool,
    /// Print the state as JSON (one object per change with --follow).
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<ExitCode> {
    if let Some(RolloutCmd::Status(s)) = args.status {
        return status(s);
    }
    let (Some(key), Some(plan_path)) = (args.key, args.fleet) else {
        unreachable!("clap requires --key and --fleet without a subcommand")
    };
    let text = std::fs::read_to_string(&plan_path)
        .with_context(|| format!("reading {}", plan_path.display()))?;
    let plan = Plan::parse(&text, &plan_path.display().to_string())?;
    let sk = secret_key(&key)?;
    let operators = args
        .operator_key
        .iter()
        .map(|p| public_key(p))
        .collect::<Result<Vec<_>>>()?;
    let artifact = args.artifact.dir()?;
    let bundle = Bundle::from_dir(&artifact, &sk, args.chunk_bytes)
        .with_context(|| format!("artifact {}", artifact.display()))?;
    let start = Instant::now();
    let c = driver::run(
        &args.broker.config(),
        &bundle,
        &sk,
        &operators,
        plan,
        &mut |l| tracing::info!("{l}"),
    )?;
    if args.json {
        outln!("{}", serde_json::to_string(&c)?);
    } else {
        out!("{}", kestrel_fleet::rollout::table(&c));
    }
    tracing::info!(
        "rollout {} ended after {:.1} s",
        c.name,
        start.elapsed().as_secs_f64()
    );
    Ok(if c.state == RolloutState::Completed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn status(args: StatusArgs) -> Result<ExitCode> {
    let cfg = args.broker.config();
    let mut show = |c: &Controller| {
        if args.json {
            outln!("{}", serde_json::to_string(c).expect("serializable"));
        } else {
            outln!("{}", kestrel_fleet::rollout::table(c));
        }
    };
    if driver::watch(&cfg, &args.name, args.follow, &mut show)?.is_none() {
        bail!("no rollout named {} on {}", args.name, cfg.url);
    }
    Ok(ExitCode::SUCCESS)
}
