//! `trainer console`: the fleet console, a web page and JSON API over what the broker holds
//! (the server and its state are `kestrel_fleet::console`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};

use super::{BrokerArgs, secret_key};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    broker: BrokerArgs,
    /// Address to serve the page and the API on. Anything but a loopback address needs
    /// --token-file.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// File holding the access token (first line, 16 characters or more): every request must
    /// carry it (Authorization: Bearer TOKEN; a browser opens /?token=TOKEN once).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Allow actions: pausing, resuming and aborting a rollout (after typing its name), as
    /// commands signed with --key that the rollout's controller checks. Read-only without it.
    #[arg(long, requires = "key")]
    allow_actions: bool,
    /// Secret key file written by `trainer keygen` (signs manifests, desired states and rollout
    /// commands).
    #[arg(long, requires = "allow_actions")]
    key: Option<PathBuf>,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let token = match &args.token_file {
        Some(p) => Some(
            std::fs::read_to_string(p)
                .with_context(|| format!("reading {}", p.display()))?
                .lines()
                .next()
                .unwrap_or_default()
                .trim()
                .to_string(),
        ),
        None => None,
    };
    let actions = match &args.key {
        Some(k) => Some(secret_key(k)?),
        None => None,
    };
    let opts = kestrel_fleet::console::Options {
        broker: args.broker.config(),
        listen: args.listen,
        token,
        actions,
    };
    let mode = if opts.actions.is_some() {
        "actions allowed"
    } else {
        "read-only"
    };
    let url = opts.broker.url.clone();
    let served = kestrel_fleet::console::serve(opts, |addr| {
        // One line on stdout, for scripts: where the console listens.
        println!("console: http://{addr}/ ({mode}) following {url}");
    });
    if let Err(e) = served {
        bail!("{e}");
    }
    Ok(ExitCode::SUCCESS)
}
