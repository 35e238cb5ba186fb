//! `trainer status`: the fleet's retained statuses, or waiting for one device.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use kestrel_shared::protocol::Status;

use super::BrokerArgs;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    broker: BrokerArgs,
    /// Device id (as in its agent.toml) [default: every device].
    #[arg(long)]
    device: Option<String>,
    /// Wait until --device reports this version active and idle (exit 1 on timeout).
    #[arg(long, requires = "device")]
    wait_active: Option<u64>,
    /// Wait until --device reports this error text in last_error (exit 1 on timeout).
    #[arg(long, requires = "device", conflicts_with = "wait_active")]
    wait_error: Option<String>,
    /// Seconds to wait for the device before giving up.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
    /// One JSON object per device.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let cfg = args.broker.config();
    let timeout = Duration::from_secs(args.timeout);
    let list = match (&args.device, args.wait_active, &args.wait_error) {
        (Some(d), Some(v), _) => vec![kestrel_fleet::wait_status(&cfg, d, timeout, |s| {
            s.active == Some(v) && s.state == "idle"
        })?],
        (Some(d), None, Some(text)) => vec![kestrel_fleet::wait_status(&cfg, d, timeout, |s| {
            s.last_error
                .as_deref()
                .is_some_and(|e| e.contains(text.as_str()))
        })?],
        _ => kestrel_fleet::statuses(&cfg, args.device.as_deref())?,
    };
    if args.json {
        for s in &list {
            println!("{}", serde_json::to_string(s)?);
        }
    } else {
        print!("{}", table(&list));
    }
    Ok(ExitCode::SUCCESS)
}

/// One line per device, under a header.
fn table(list: &[Status]) -> String {
    let mut out = format!(
        "{:<20} {:<13} {:<24} {:>7} {:>8} {:<20} {:>9}  last error\n",
        "device", "state", "model", "active", "previous", "registry", "p50 ms"
    );
    let v = |x: Option<u64>| x.map_or("-".into(), |v| format!("v{v}"));
    for s in list {
        out.push_str(&format!(
            "{:<20} {:<13} {:<24} {:>7} {:>8} {:<20} {:>9.1}  {}\n",
            s.device,
            s.state,
            s.model.as_deref().unwrap_or("-"),
            v(s.active),
            v(s.previous),
            s.source.as_deref().unwrap_or("-"),
            s.latency.p50_ms,
            s.last_error.as_deref().unwrap_or("")
        ));
    }
    out
}
