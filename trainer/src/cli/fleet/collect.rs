//! `trainer collect`: captures from the fleet appended to a Delta table, each stored once.

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use crate::data::delta_write::{self, CaptureRow};
use anyhow::{Context, Result};
use kestrel_fleet::collect::{CaptureFeed, Received};
use kestrel_shared::capture::Capture;

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

/// What a run did.
#[derive(Default, serde::Serialize)]
struct Summary {
    table: String,
    stored: u64,
    duplicates: u64,
    rejected: u64,
    commits: u64,
    version: Option<u64>,
}

/// Captures received but not yet committed; their messages are acknowledged after the commit.
struct Pending {
    rows: Vec<CaptureRow>,
    messages: Vec<Received>,
    since: Option<Instant>,
}

pub fn run(a: Args) -> Result<ExitCode> {
    let (mut seen, version) = delta_write::read_paths(&a.out)?;
    let mut feed = CaptureFeed::connect(&a.broker.config(), &a.client_id)?;
    tracing::info!(
        "collect: {} rows in {} (version {}); session {}",
        seen.len(),
        a.out.display(),
        version.map_or("none".into(), |v| v.to_string()),
        if feed.resumed { "resumed" } else { "new" }
    );
    let mut s = Summary {
        table: a.out.display().to_string(),
        version,
        ..Default::default()
    };
    let mut p = Pending {
        rows: Vec::new(),
        messages: Vec::new(),
        since: None,
    };
    let idle = a.until_idle.map(Duration::from_secs);
    let mut last = Instant::now();
    while a.max.is_none_or(|m| s.stored + (p.rows.len() as u64) < m) {
        if idle.is_some_and(|i| last.elapsed() >= i) {
            break;
        }
        let wait = Duration::from_millis(200);
        if let Some(r) = feed.next(wait)? {
            last = Instant::now();
            take(r, &mut seen, &mut p, &mut s);
        }
        let due = p
            .since
            .is_some_and(|t| t.elapsed() >= Duration::from_secs(2));
        if p.rows.len() >= a.commit_every || due {
            commit(&a, &mut feed, &mut p, &mut s)?;
        }
    }
    commit(&a, &mut feed, &mut p, &mut s)?;
    feed.close();
    tracing::info!(
        "collect: stored {}, duplicates {}, rejected {} ({} commits)",
        s.stored,
        s.duplicates,
        s.rejected,
        s.commits
    );
    if a.json {
        outln!("{}", serde_json::to_string(&s)?);
    }
    Ok(ExitCode::SUCCESS)
}

/// Files a received message: a new capture to store, a duplicate, or a message that is not a
/// capture (named on stderr, acknowledged so it is not redelivered forever).
fn take(r: Received, seen: &mut HashSet<String>, p: &mut Pending, s: &mut Summary) {
    match &r.capture {
        Err(e) => {
            tracing::warn!("collect: {}: refused: {e}", r.topic);
            s.rejected += 1;
        }
        Ok((c, _)) if seen.contains(&c.path()) => s.duplicates += 1,
        Ok((c, bytes)) => match row(c, bytes.clone()) {
            Ok(row) => {
                seen.insert(row.path.clone());
                p.rows.push(row);
                p.since.get_or_insert_with(Instant::now);
            }
            Err(e) => {
                tracing::warn!("collect: {}: refused: {e}", r.topic);
                s.rejected += 1;
            }
        },
    }
    p.messages.push(r);
}

fn row(c: &Capture, content: Vec<u8>) -> Result<CaptureRow> {
    let at = chrono::DateTime::parse_from_rfc3339(&c.captured_at)
        .with_context(|| format!("captured_at `{}`", c.captured_at))?;
    let top = c.top.first().context("no top-k scores")?;
    Ok(CaptureRow {
        content,
        path: c.path(),
        device: c.device.clone(),
        model: c.model.clone(),
        version: c.version as i64,
        predicted: top.label.clone(),
        score: f64::from(top.score),
        reason: c.reason.clone(),
        captured_at: at.timestamp_micros(),
        label: None,
    })
}

/// Commits the pending rows (if any), then acknowledges every pending message.
fn commit(a: &Args, feed: &mut CaptureFeed, p: &mut Pending, s: &mut Summary) -> Result<()> {
    if !p.rows.is_empty() {
        s.version = Some(delta_write::append(&a.out, &p.rows, Some(&a.client_id))?);
        s.stored += p.rows.len() as u64;
        s.commits += 1;
    }
    for m in p.messages.drain(..) {
        feed.ack(&m)?;
    }
    p.rows.clear();
    p.since = None;
    Ok(())
}
