//! Collecting captures from the fleet (`trainer collect`): each appended once to a Delta table,
//! with the commit-then-acknowledge protocol that loses none. The broker keeps a capture for the
//! collector's persistent session until it is acknowledged, and it is acknowledged only after the
//! commit that stored it: a collector that dies loses nothing, and what it stored but had not
//! acknowledged comes again and is recognised by its path.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use kestrel_fleet::FleetError;
use kestrel_fleet::collect::{CaptureFeed, Received};
use kestrel_shared::capture::Capture;
use kestrel_shared::mqtt::BrokerConfig;

use crate::data::DataError;
use crate::data::delta_write::{self, CaptureRow};

#[derive(Debug, thiserror::Error)]
pub enum CollectError {
    #[error(transparent)]
    Broker(#[from] FleetError),
    #[error(transparent)]
    Table(#[from] DataError),
}

/// What to collect, where, and when to stop.
#[derive(Debug, Clone)]
pub struct CollectOpts {
    /// The capture table (a path or an object URL); created on the first capture.
    pub out: PathBuf,
    /// The persistent session's client id (also the table's transaction app id).
    pub client_id: String,
    /// Stop after this long without a capture.
    pub until_idle: Option<Duration>,
    /// Stop after storing this many new captures.
    pub max: Option<u64>,
    /// Commit after this many new captures (and at least every 2 s).
    pub commit_every: usize,
}

/// What a run did.
#[derive(Debug, Default, serde::Serialize)]
pub struct CollectSummary {
    pub table: String,
    pub stored: u64,
    pub duplicates: u64,
    pub rejected: u64,
    pub commits: u64,
    pub version: Option<u64>,
}

/// Captures received but not yet committed; their messages are acknowledged after the commit.
struct Pending {
    rows: Vec<CaptureRow>,
    messages: Vec<Received>,
    since: Option<Instant>,
}

/// Collects from the broker `cfg` into `o.out` until `o` says to stop.
pub fn collect(cfg: &BrokerConfig, o: &CollectOpts) -> Result<CollectSummary, CollectError> {
    let (mut seen, version) = delta_write::read_paths(&o.out)?;
    let mut feed = CaptureFeed::connect(cfg, &o.client_id)?;
    tracing::info!(
        "collect: {} rows in {} (version {}); session {}",
        seen.len(),
        o.out.display(),
        version.map_or("none".into(), |v| v.to_string()),
        if feed.resumed { "resumed" } else { "new" }
    );
    let mut s = CollectSummary {
        table: o.out.display().to_string(),
        version,
        ..Default::default()
    };
    let mut p = Pending {
        rows: Vec::new(),
        messages: Vec::new(),
        since: None,
    };
    let mut last = Instant::now();
    while o.max.is_none_or(|m| s.stored + (p.rows.len() as u64) < m) {
        if o.until_idle.is_some_and(|i| last.elapsed() >= i) {
            break;
        }
        if let Some(r) = feed.next(Duration::from_millis(200))? {
            last = Instant::now();
            take(r, &mut seen, &mut p, &mut s);
        }
        let due = p
            .since
            .is_some_and(|t| t.elapsed() >= Duration::from_secs(2));
        if p.rows.len() >= o.commit_every || due {
            commit(o, &mut feed, &mut p, &mut s)?;
        }
    }
    commit(o, &mut feed, &mut p, &mut s)?;
    feed.close();
    tracing::info!(
        "collect: stored {}, duplicates {}, rejected {} ({} commits)",
        s.stored,
        s.duplicates,
        s.rejected,
        s.commits
    );
    Ok(s)
}

/// Files a received message: a new capture to store, a duplicate, or a message that is not a
/// capture (named on stderr, acknowledged so it is not redelivered forever).
fn take(r: Received, seen: &mut HashSet<String>, p: &mut Pending, s: &mut CollectSummary) {
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

fn row(c: &Capture, content: Vec<u8>) -> Result<CaptureRow, String> {
    let at = chrono::DateTime::parse_from_rfc3339(&c.captured_at)
        .map_err(|e| format!("captured_at `{}`: {e}", c.captured_at))?;
    let top = c.top.first().ok_or("no top-k scores")?;
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
fn commit(
    o: &CollectOpts,
    feed: &mut CaptureFeed,
    p: &mut Pending,
    s: &mut CollectSummary,
) -> Result<(), CollectError> {
    if !p.rows.is_empty() {
        s.version = Some(delta_write::append(&o.out, &p.rows, Some(&o.client_id))?);
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
