//! `trainer keys`: publish the root-signed list of the keys devices accept.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use kestrel_shared::protocol::DEFAULT_KEYS_VALIDITY_S;

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
    /// Devices stop trusting the list's publishing keys once this many seconds have passed
    /// (freeze protection: a device whose key-list updates are withheld does not trust a
    /// revoked key forever; it keeps only the root). Publish the list again (the next version)
    /// before then. At least 1: devices refuse a list without expiry.
    #[arg(long, value_name = "SECONDS", default_value_t = DEFAULT_KEYS_VALIDITY_S,
          value_parser = clap::value_parser!(u64).range(1..))]
    expires_in: u64,
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
    let cfg = args.broker.config();
    let p = kestrel_fleet::publish_keys(&cfg, &root, &keys, args.list_version, args.expires_in)?;
    if args.json {
        outln!("{}", serde_json::to_string(&p)?);
    } else {
        outln!(
            "key list v{} in force until {}: {}{}",
            p.version,
            kestrel_shared::manifest::rfc3339(p.expires),
            p.keys.join(", "),
            p.replaced
                .map(|v| format!(" (was v{v})"))
                .unwrap_or_default()
        );
    }
    Ok(ExitCode::SUCCESS)
}
