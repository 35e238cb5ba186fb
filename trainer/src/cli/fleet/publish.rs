//! `trainer publish`: a signed artifact made the desired model of a device or group.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use kestrel_fleet::{Bundle, PublishOptions, Published};
use kestrel_shared::protocol::{DEFAULT_CHUNK_BYTES, Target};

use super::{ArtifactArgs, BrokerArgs, secret_key};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    broker: BrokerArgs,
    #[command(flatten)]
    artifact: ArtifactArgs,
    /// Secret key file written by `trainer keygen` (signs manifests, desired states and rollout
    /// commands).
    #[arg(long)]
    key: PathBuf,
    /// device/<id> or group/<name>.
    #[arg(long)]
    target: Target,
    /// Allow a version older than the target's current desired one.
    #[arg(long)]
    rollback: bool,
    /// Devices refuse the desired state once this many seconds have passed (freeze protection:
    /// a state withheld and replayed later, or a recorded one shown to a device that joins, is
    /// reported instead of followed); publish again before then. 0: never expires.
    #[arg(long, value_name = "SECONDS", default_value_t = kestrel_shared::protocol::DEFAULT_VALIDITY_S)]
    expires_in: u64,
    /// Chunk size of the delivery, in bytes.
    #[arg(long, default_value_t = DEFAULT_CHUNK_BYTES)]
    chunk_bytes: usize,
    /// Offer only the whole bundle, as publishers before parts did: every device fetches all of
    /// it, whatever parts it holds (for comparison; agents from before parts fetch this anyway).
    #[arg(long)]
    whole: bool,
    /// Print the result as one JSON object.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let sk = secret_key(&args.key)?;
    let dir = args.artifact.dir()?;
    let mut bundle = Bundle::from_dir(&dir, &sk, args.chunk_bytes)
        .with_context(|| format!("artifact {}", dir.display()))?;
    if args.whole {
        bundle = bundle.without_pieces();
    }
    let p = kestrel_fleet::publish(
        &args.broker.config(),
        &bundle,
        &sk,
        &args.target,
        PublishOptions {
            rollback: args.rollback,
            rollout: None,
            expires: (args.expires_in > 0).then(|| kestrel_shared::now_unix() + args.expires_in),
        },
    )?;
    if args.json {
        outln!("{}", serde_json::to_string(&p)?);
    } else {
        outln!("{}", line(&p));
    }
    Ok(ExitCode::SUCCESS)
}

fn line(p: &Published) -> String {
    let update = match p.replaced {
        Some(v) => format!(
            "; a device at v{v} fetches {} of them, in parts",
            kestrel_shared::human_bytes(p.bytes_update)
        ),
        None => String::new(),
    };
    format!(
        "published {} v{} to {} ({} chunks, {} per device{update}) in {:.1} s",
        p.name,
        p.version,
        p.target,
        p.chunks,
        kestrel_shared::human_bytes(p.bytes),
        p.seconds
    )
}
