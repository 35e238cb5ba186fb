//! `trainer status`: the fleet's retained statuses, or waiting for one device.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use kestrel_shared::protocol::Status;
use kestrel_shared::quality::DeviceQuality;
use kestrel_shared::wire::DeviceState;

use super::BrokerArgs;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    broker: BrokerArgs,
    /// Device id (as in its agent.toml) [default: every device].
    #[arg(long)]
    device: Option<String>,
    /// Wait until --device reports this version active and idle (exit 3 on timeout).
    #[arg(long, requires = "device")]
    wait_active: Option<u64>,
    /// Wait until --device reports this error text in last_error, or in refused (a desired
    /// state, offer or key list it refused and did not act on) (exit 3 on timeout).
    #[arg(long, requires = "device", conflicts_with = "wait_active")]
    wait_error: Option<String>,
    /// Seconds to wait for the device before giving up.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
    /// Quality telemetry instead (P/devices/<id>/quality): each device's window of live
    /// requests against its model's reference, and its shadow model's agreement.
    #[arg(long, conflicts_with_all = ["wait_active", "wait_error"])]
    quality: bool,
    /// One JSON object per device.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let cfg = args.broker.config();
    if args.quality {
        let list = kestrel_fleet::qualities(&cfg, args.device.as_deref())?;
        if args.json {
            for q in &list {
                outln!("{}", serde_json::to_string(q)?);
            }
        } else {
            out!("{}", quality_table(&list));
        }
        return Ok(ExitCode::SUCCESS);
    }
    let timeout = Duration::from_secs(args.timeout);
    let list = match (&args.device, args.wait_active, &args.wait_error) {
        (Some(d), Some(v), _) => vec![kestrel_fleet::wait_status(&cfg, d, timeout, |s| {
            s.active == Some(v) && s.state == DeviceState::Idle
        })?],
        (Some(d), None, Some(text)) => vec![kestrel_fleet::wait_status(&cfg, d, timeout, |s| {
            [&s.last_error, &s.refused]
                .iter()
                .any(|e| e.as_deref().is_some_and(|e| e.contains(text.as_str())))
        })?],
        _ => kestrel_fleet::statuses(&cfg, args.device.as_deref())?,
    };
    if args.json {
        for s in &list {
            outln!("{}", serde_json::to_string(s)?);
        }
    } else {
        out!("{}", table(&list));
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

/// One line per device: the window's size, confidence against the reference, class distance,
/// drift, judged windows flagged, latency and the shadow's agreement.
fn quality_table(list: &[DeviceQuality]) -> String {
    let mut out = format!(
        "{:<20} {:<16} {:>9} {:>12} {:>7} {:>7} {:>8} {:>9} {:>8}  shadow\n",
        "device",
        "model",
        "requests",
        "conf (ref)",
        "class d",
        "drift z",
        "p-value",
        "flagged",
        "p50 ms"
    );
    for q in list {
        let model = format!("{} v{}", q.model, q.version);
        let shadow = q.shadow.as_ref().map_or(String::new(), |s| {
            format!(
                "v{}: {:.1}% agree over {}, conf {:.3}",
                s.version,
                100.0 * s.agreement,
                s.compared,
                s.shadow_mean_confidence
            )
        });
        match &q.window {
            Some(w) => out.push_str(&format!(
                "{:<20} {:<16} {:>9} {:>12} {:>7.3} {:>7.2} {:>8.1e} {:>9} {:>8.1}  {shadow}\n",
                q.device,
                model,
                format!("{}/{}", w.requests, w.total_requests),
                format!("{:.3} ({:.3})", w.mean_confidence, w.reference_confidence),
                w.class_distance,
                w.drift.max_z,
                w.drift.p_value,
                format!("{}/{}", w.flagged_windows, w.windows),
                w.latency_p50_ms,
            )),
            None => out.push_str(&format!(
                "{:<20} {:<16} {}  {shadow}\n",
                q.device,
                model,
                q.note.as_deref().unwrap_or("no requests yet")
            )),
        }
    }
    out
}
