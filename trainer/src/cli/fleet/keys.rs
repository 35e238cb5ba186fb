//! `trainer keys`: publish the root-signed list of the keys devices accept.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;

use super::{BrokerArgs, public_key, secret_key};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    broker: BrokerArgs,
    /// The fleet's root secret key (`trainer keygen --root`: DIR/root.key).
    #[arg(long, value_name = "ROOT_KEY")]
    root_key: PathBuf,
    /// A publishing public key the devices accept from now on (a kestrel.pub); repeat for
    /// several. Publishing keys left out are revoked.
    #[arg(long = "publisher", value_name = "PUB", required = true)]
    keys: Vec<PathBuf>,
    /// The list's version [default: the retained list's + 1, or 1]; must be above the retained one.
    #[arg(long, value_name = "N")]
    list_version: Option<u64>,
    /// Print the result as one JSON object.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let root = secret_key(&args.root_key)?;
    let keys = args
        .keys
        .iter()
        .map(|p| public_key(p))
        .collect::<Result<Vec<_>>>()?;
    let p = kestrel_fleet::publish_keys(&args.broker.config(), &root, &keys, args.list_version)?;
    if args.json {
        outln!("{}", serde_json::to_string(&p)?);
    } else {
        outln!(
            "key list v{} in force: {}{}",
            p.version,
            p.keys.join(", "),
            p.replaced
                .map(|v| format!(" (was v{v})"))
                .unwrap_or_default()
        );
    }
    Ok(ExitCode::SUCCESS)
}
