//! `trainer collect`: captures from the fleet appended to a Delta table, each stored once
//! ([`crate::collect`]).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use crate::collect::{CollectOpts, collect};
use anyhow::Result;

use super::BrokerArgs;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    broker: BrokerArgs,
    /// The capture table (a Delta table; created on the first capture): a path, or an object URL
    /// (`s3://`, `az://`, `abfss://`, `gs://`; credentials from the environment as for `--data`).
    #[arg(long, value_name = "TABLE")]
    out: PathBuf,
    /// The persistent session's client id: the broker keeps captures for it while it is away
    /// (start it once before devices capture). One collector per id.
    #[arg(long, default_value = "kestrel-collect")]
    client_id: String,
    /// Stop after this many seconds without a capture.
    #[arg(long, value_name = "S")]
    until_idle: Option<u64>,
    /// Stop after storing this many new captures.
    #[arg(long, value_name = "N")]
    max: Option<u64>,
    /// Commit to the table after this many new captures (and at least every 2 s).
    #[arg(long, value_name = "N", default_value_t = 64)]
    commit_every: usize,
    /// A JSON summary on stdout at the end.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<ExitCode> {
    let opts = CollectOpts {
        out: a.out,
        client_id: a.client_id,
        until_idle: a.until_idle.map(Duration::from_secs),
        max: a.max,
        commit_every: a.commit_every,
    };
    let s = collect(&a.broker.config(), &opts)?;
    if a.json {
        outln!("{}", serde_json::to_string(&s)?);
    }
    Ok(ExitCode::SUCCESS)
}
