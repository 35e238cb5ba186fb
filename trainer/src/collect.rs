//! Collecting captures from the fleet (`trainer collect`): each appended once to a Delta table,
//! with the commit-then-acknowledge protocol that loses none. The broker keeps a capture for the
//! collector's persistent session until it is acknowledged, and it is acknowledged only after the
//! commit that stored it: a collector that dies loses nothing, and what it stored but had not
//! acknowledged comes again and is recognised by its path. After the commit each device is
//! told which of its captures are stored (it keeps them until then); a device over its hourly
//! quota has its captures neither stored nor acknowledged ([`kestrel_fleet::collect::Gate`]).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use kestrel_fleet::FleetError;
use kestrel_fleet::collect::{CaptureFeed, Gate, Quota, Received, Verdict};
use kestrel_shared::capture::Capture;
use kestrel_shared::mqtt::BrokerConfig;

use crate::data::DataError;
use crate::data::source::delta_write::{self, CaptureRow};

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
    /// Per-device quota and how many stored paths are remembered.
    pub quota: Quota,
}

/// What a run did.
#[derive(Debug, Default, serde::Serialize)]
pub struct CollectSummary {
    pub table: String,
    pub stored: u64,
    pub duplicates: u64,
    pub rejected: u64,
    /// Captures not stored because their device was over its hourly quota, in all and by
    /// device.
    pub over_quota: u64,
    pub over_quota_devices: BTreeMap<String, u64>,
    /// Capture ids acknowledged to their devices (stored now or before).
    pub acknowledged: u64,
    pub commits: u64,
    pub version: Option<u64>,
}

/// Captures received but not yet committed; their messages are acknowledged after the commit,
/// and their devices told which are stored (`acks`: device -> capture ids).
#[derive(Default)]
struct Pending {
    rows: Vec<CaptureRow>,
    messages: Vec<Received>,
    acks: BTreeMap<String, BTreeSet<String>>,
    since: Option<Instant>,
}

/// Collects from the broker `cfg` into `o.out` until `o` says to stop.
pub fn collect(cfg: &BrokerConfig, o: &CollectOpts) -> Result<CollectSummary, CollectError> {
    let (paths, version) = delta_write::read_paths(&o.out)?;
    let rows = paths.len();
    let mut gate = Gate::new(o.quota, paths);
    let mut feed = CaptureFeed::connect(cfg, &o.client_id)?;
    tracing::info!(
        "collect: {rows} rows in {} (version {}; {} paths remembered); session {}",
        o.out.display(),
        version.map_or("none".into(), |v| v.to_string()),
        gate.seen(),
        if feed.resumed { "resumed" } else { "new" }
    );
    let mut s = CollectSummary {
        table: o.out.display().to_string(),
        version,
        ..Default::default()
    };
    let mut p = Pending::default();
    let mut last = Instant::now();
    while o.max.is_none_or(|m| s.stored + (p.rows.len() as u64) < m) {
        if o.until_idle.is_some_and(|i| last.elapsed() >= i) {
            break;
        }
        if let Some(r) = feed.next(Duration::from_millis(200))? {
            last = Instant::now();
            take(r, &mut gate, &mut p, &mut s);
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
    s.over_quota_devices = gate.over_quota.clone();
    tracing::info!(
        "collect: stored {}, duplicates {}, rejected {}, over quota {} {:?} ({} commits)",
        s.stored,
        s.duplicates,
        s.rejected,
        s.over_quota,
        s.over_quota_devices,
        s.commits
    );
    Ok(s)
}

/// Files a received message: a new capture to store, a duplicate (acknowledged again), one over
/// its device's quota, or a message that is not a capture (named on stderr, acknowledged to the
/// broker so it is not redelivered forever). Every message is acknowledged to the broker at the
/// next commit (within 2 s); only the rows keep their image until then.
fn take(mut r: Received, gate: &mut Gate, p: &mut Pending, s: &mut CollectSummary) {
    p.since.get_or_insert_with(Instant::now);
    let (size, content) = (r.size() as u64, r.take_content());
    let row = match &r.capture {
        Ok((c, _)) => row(c, content),
        Err(e) => Err(e.clone()),
    };
    match row {
        Ok(row) => admit(row, size, gate, p, s),
        Err(e) => {
            tracing::warn!("collect: {}: refused: {e}", r.topic);
            s.rejected += 1;
        }
    }
    p.messages.push(r);
}

/// A capture that parsed: stored (and acknowledged to its device after the commit), a
/// duplicate (acknowledged again), or over its device's quota (neither).
fn admit(row: CaptureRow, size: u64, gate: &mut Gate, p: &mut Pending, s: &mut CollectSummary) {
    match gate.admit(&row.device, &row.path, size, Instant::now()) {
        Verdict::Duplicate => {
            s.duplicates += 1;
            p.ack(&row);
        }
        Verdict::OverQuota { first } => {
            s.over_quota += 1;
            if first {
                log_over_quota(gate.quota(), &row.device);
            }
        }
        Verdict::New => {
            p.ack(&row);
            p.rows.push(row);
        }
    }
}

fn log_over_quota(q: &Quota, device: &str) {
    tracing::warn!(
        "collect: device `{device}` is over its quota ({} captures or {} bytes an hour): its \
         captures are not stored (nor acknowledged to it) until its hour has room",
        q.captures_per_hour,
        q.bytes_per_hour
    );
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
        reason: c.reason.to_string(),
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
    for (device, ids) in std::mem::take(&mut p.acks) {
        let ids: Vec<String> = ids.into_iter().collect();
        feed.acknowledge(&device, &ids)?;
        s.acknowledged += ids.len() as u64;
    }
    for m in p.messages.drain(..) {
        feed.ack(&m)?;
    }
    p.rows.clear();
    p.since = None;
    Ok(())
}

impl Pending {
    /// The device of `row` is to be told, after the commit, that it is stored.
    fn ack(&mut self, row: &CaptureRow) {
        let id = row.path.rsplit('/').next().unwrap_or(&row.path);
        self.acks
            .entry(row.device.clone())
            .or_default()
            .insert(id.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kestrel_shared::wire::{CaptureReason, Class};

    fn capture(top: Vec<Class>, captured_at: &str) -> Capture {
        Capture {
            id: "1700000000000-000001".into(),
            device: "cam-1".into(),
            request: "r1".into(),
            model: "gate".into(),
            version: 7,
            top,
            reason: CaptureReason::LowConfidence,
            captured_at: captured_at.into(),
            content: String::new(),
        }
    }

    fn class(label: &str, score: f32) -> Class {
        Class {
            class: 0,
            label: label.into(),
            score,
        }
    }

    #[test]
    fn a_capture_becomes_a_row_of_its_top_class_at_its_utc_microsecond() {
        let c = capture(
            vec![class("cat", 0.75), class("dog", 0.25)],
            "1970-01-01T02:00:00.000002+02:00",
        );
        let want = CaptureRow {
            content: vec![1, 2, 3],
            path: "cam-1/1700000000000-000001".into(),
            device: "cam-1".into(),
            model: "gate".into(),
            version: 7,
            predicted: "cat".into(),
            score: 0.75,
            reason: "low-confidence".into(),
            captured_at: 2,
            label: None,
        };
        assert_eq!(row(&c, vec![1, 2, 3]).unwrap(), want);
        let none = capture(vec![], "1970-01-01T00:00:00Z");
        assert_eq!(row(&none, vec![]).unwrap_err(), "no top-k scores");
        let e = row(&capture(vec![class("cat", 0.5)], "yesterday"), vec![]).unwrap_err();
        assert!(e.starts_with("captured_at `yesterday`: "), "{e}");
    }

    #[test]
    fn admit_stores_new_captures_acknowledges_duplicates_and_holds_back_those_over_quota() {
        let quota = Quota {
            captures_per_hour: 1,
            bytes_per_hour: 1 << 20,
            max_seen: 10,
        };
        let mut gate = Gate::new(quota, ["cam/1-1".to_string()]);
        let (mut p, mut s) = (Pending::default(), CollectSummary::default());
        let capture_row = |path: &str| CaptureRow {
            path: path.into(),
            device: "cam".into(),
            ..row(
                &capture(vec![class("cat", 0.5)], "1970-01-01T00:00:00Z"),
                vec![0; 4],
            )
            .unwrap()
        };
        admit(capture_row("cam/1-1"), 10, &mut gate, &mut p, &mut s); // stored by an earlier run
        admit(capture_row("cam/2-1"), 10, &mut gate, &mut p, &mut s); // new
        admit(capture_row("cam/3-1"), 10, &mut gate, &mut p, &mut s); // the hour's second: over quota
        assert_eq!((s.duplicates, s.over_quota, s.stored), (1, 1, 0));
        let pending: Vec<&str> = p.rows.iter().map(|r| r.path.as_str()).collect();
        assert_eq!(pending, ["cam/2-1"]);
        let acked: Vec<&str> = p.acks["cam"].iter().map(String::as_str).collect();
        assert_eq!(
            acked,
            ["1-1", "2-1"],
            "a capture over quota is not acknowledged to its device"
        );
        assert_eq!(gate.over_quota.get("cam"), Some(&1));
    }
}
