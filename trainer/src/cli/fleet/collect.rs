//! `trainer collect`: captures from the fleet appended to a Delta table, each stored once
//! ([`crate::collect`]).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use crate::collect::{CollectOpts, collect};
use anyhow::{Result, bail};
use kestrel_fleet::collect::Quota;

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
    /// Captures stored per device in any rolling hour (the device is the one its topic names).
    /// More are neither stored nor acknowledged to the device: an honest one keeps them and
    /// sends them again later; they are counted, by device, in the summary.
    #[arg(long, value_name = "N", default_value_t = Quota::DEFAULT_CAPTURES_PER_HOUR)]
    quota_per_hour: u64,
    /// Bytes of capture messages stored per device in any rolling hour (at least 2 MiB, the
    /// largest message a broker forwards).
    #[arg(long, value_name = "BYTES", default_value_t = Quota::DEFAULT_BYTES_PER_HOUR)]
    quota_bytes_per_hour: u64,
    /// Capture paths remembered to store a capture delivered twice once (the newest kept; a
    /// capture delivered again after this many newer ones would be stored again).
    #[arg(long, value_name = "N", default_value_t = Quota::DEFAULT_MAX_SEEN)]
    max_seen: usize,
    /// A JSON summary on stdout at the end.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<ExitCode> {
    let largest = kestrel_shared::mqtt::MAX_PAYLOAD_BYTES as u64;
    if a.quota_bytes_per_hour < largest {
        bail!(
            "--quota-bytes-per-hour {} is below {largest}, the largest capture a broker \
             forwards: such a capture would never be stored",
            a.quota_bytes_per_hour
        );
    }
    if a.quota_per_hour == 0 || a.max_seen == 0 {
        bail!("--quota-per-hour and --max-seen must be at least 1");
    }
    let opts = CollectOpts {
        out: a.out,
        client_id: a.client_id,
        until_idle: a.until_idle.map(Duration::from_secs),
        max: a.max,
        commit_every: a.commit_every,
        quota: Quota {
            captures_per_hour: a.quota_per_hour,
            bytes_per_hour: a.quota_bytes_per_hour,
            max_seen: a.max_seen,
        },
    };
    let s = collect(&a.broker.config(), &opts)?;
    if a.json {
        outln!("{}", serde_json::to_string(&s)?);
    }
    Ok(ExitCode::SUCCESS)
}
