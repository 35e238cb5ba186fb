//! What `trainer collect` stores of what the devices send: each capture once (a bounded memory
//! of the paths stored, oldest forgotten first) and, from each device, at most a quota of
//! captures and bytes in any rolling hour. The device is the one the topic names (the broker's
//! ACL lets a device write only its own topics), never what a payload says. Nothing here does IO
//! or reads the clock: the caller passes the time.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

const HOUR: Duration = Duration::from_secs(3600);
/// Admissions between two sweeps of the devices whose hour holds nothing.
const SWEEP_EVERY: u64 = 1024;

/// The limits: per device and rolling hour, and how many paths are remembered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    /// Captures stored per device in any hour.
    pub captures_per_hour: u64,
    /// Bytes of capture messages stored per device in any hour.
    pub bytes_per_hour: u64,
    /// Capture paths remembered to recognise a capture delivered again.
    pub max_seen: usize,
}

impl Quota {
    pub const DEFAULT_CAPTURES_PER_HOUR: u64 = 120;
    pub const DEFAULT_BYTES_PER_HOUR: u64 = 64 << 20;
    pub const DEFAULT_MAX_SEEN: usize = 200_000;
}

impl Default for Quota {
    fn default() -> Self {
        Self {
            captures_per_hour: Self::DEFAULT_CAPTURES_PER_HOUR,
            bytes_per_hour: Self::DEFAULT_BYTES_PER_HOUR,
            max_seen: Self::DEFAULT_MAX_SEEN,
        }
    }
}

/// What to do with one capture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Store it (remembered from now on, and counted in its device's hour).
    New,
    /// Stored before: store nothing, acknowledge it to the device again.
    Duplicate,
    /// Over its device's quota: not stored, not acknowledged to the device (an honest device
    /// keeps it and sends it again later). `first`: the first since the device was last within
    /// its quota (worth a log line; the rest are only counted).
    OverQuota { first: bool },
}

/// Paths remembered, the oldest forgotten first beyond `max`.
#[derive(Debug, Default)]
pub struct Seen {
    set: HashSet<Arc<str>>,
    order: VecDeque<Arc<str>>,
    max: usize,
}

impl Seen {
    pub fn new(max: usize) -> Self {
        Self {
            max: max.max(1),
            ..Default::default()
        }
    }

    /// The newest `max` of `paths` (a capture table's), by the time in their capture ids
    /// (`<device>/<unix ms>-<sequence>`).
    pub fn from_paths(paths: impl IntoIterator<Item = String>, max: usize) -> Self {
        let mut all: Vec<String> = paths.into_iter().collect();
        all.sort_by(|a, b| age(a).cmp(&age(b)));
        let mut seen = Self::new(max);
        let skip = all.len().saturating_sub(seen.max);
        for p in all.into_iter().skip(skip) {
            seen.insert(&p);
        }
        seen
    }

    pub fn contains(&self, path: &str) -> bool {
        self.set.contains(path)
    }

    pub fn insert(&mut self, path: &str) {
        if self.set.contains(path) {
            return;
        }
        let p: Arc<str> = Arc::from(path);
        self.set.insert(p.clone());
        self.order.push_back(p);
        while self.order.len() > self.max {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
    }

    pub fn len(&self) -> usize {
        self.order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

/// The order of a capture path in time: (unix ms, sequence) of its id, then the path.
fn age(path: &str) -> (u64, u64, &str) {
    let id = path.rsplit('/').next().unwrap_or(path);
    let mut parts = id.splitn(2, '-').map(|n| n.parse::<u64>().unwrap_or(0));
    let ms = parts.next().unwrap_or(0);
    (ms, parts.next().unwrap_or(0), path)
}

/// One device's captures stored in the last hour.
#[derive(Debug, Default)]
struct Window {
    stored: VecDeque<(Instant, u64)>,
    bytes: u64,
    /// Over its quota since the last capture it had stored.
    throttled: bool,
}

impl Window {
    fn expire(&mut self, now: Instant) {
        while let Some(&(t, b)) = self.stored.front() {
            if now.saturating_duration_since(t) < HOUR {
                break;
            }
            self.stored.pop_front();
            self.bytes -= b;
        }
    }

    fn fits(&self, q: &Quota, bytes: u64) -> bool {
        (self.stored.len() as u64) < q.captures_per_hour
            && self.bytes.saturating_add(bytes) <= q.bytes_per_hour
    }
}

/// The collector's admission of captures: de-duplication and per-device quotas.
#[derive(Debug)]
pub struct Gate {
    quota: Quota,
    seen: Seen,
    devices: HashMap<String, Window>,
    /// Captures refused over quota, by device (since the collector started).
    pub over_quota: BTreeMap<String, u64>,
    admitted: u64,
}

impl Gate {
    /// A gate that remembers `paths` (those already stored; the newest `quota.max_seen`).
    pub fn new(quota: Quota, paths: impl IntoIterator<Item = String>) -> Self {
        Self {
            seen: Seen::from_paths(paths, quota.max_seen),
            quota,
            devices: HashMap::new(),
            over_quota: BTreeMap::new(),
            admitted: 0,
        }
    }

    /// Decides about capture `path` of `device` (`bytes`: its message's size) received `now`.
    pub fn admit(&mut self, device: &str, path: &str, bytes: u64, now: Instant) -> Verdict {
        if self.seen.contains(path) {
            return Verdict::Duplicate;
        }
        let w = self.devices.entry(device.to_string()).or_default();
        w.expire(now);
        if !w.fits(&self.quota, bytes) {
            *self.over_quota.entry(device.to_string()).or_default() += 1;
            let first = !std::mem::replace(&mut w.throttled, true);
            return Verdict::OverQuota { first };
        }
        w.throttled = false;
        w.stored.push_back((now, bytes));
        w.bytes += bytes;
        self.seen.insert(path);
        self.admitted += 1;
        if self.admitted.is_multiple_of(SWEEP_EVERY) {
            self.sweep(now);
        }
        Verdict::New
    }

    /// Forgets the devices that stored nothing in the last hour.
    fn sweep(&mut self, now: Instant) {
        self.devices.retain(|_, w| {
            w.expire(now);
            !w.stored.is_empty()
        });
    }

    pub fn quota(&self) -> &Quota {
        &self.quota
    }

    /// Paths remembered now (at most `max_seen`).
    pub fn seen(&self) -> usize {
        self.seen.len()
    }

    /// Devices whose last hour is tracked now.
    pub fn devices(&self) -> usize {
        self.devices.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quota(n: u64, bytes: u64, seen: usize) -> Quota {
        Quota {
            captures_per_hour: n,
            bytes_per_hour: bytes,
            max_seen: seen,
        }
    }

    #[test]
    fn a_device_is_cut_at_its_quota_and_others_are_not() {
        let mut g = Gate::new(quota(3, 1000, 100), []);
        let t0 = Instant::now();
        let mut flood = vec![];
        for i in 0..10 {
            flood.push(g.admit("flood", &format!("flood/{i}-1"), 100, t0));
        }
        assert_eq!(flood.iter().filter(|v| **v == Verdict::New).count(), 3);
        assert_eq!(flood[3], Verdict::OverQuota { first: true });
        assert_eq!(flood[4], Verdict::OverQuota { first: false });
        assert_eq!(g.over_quota.get("flood"), Some(&7));
        for i in 0..3 {
            let v = g.admit("honest", &format!("honest/{i}-1"), 100, t0);
            assert_eq!(v, Verdict::New, "another device's quota is its own");
        }
        // A resend of a stored capture is a duplicate, over quota or not.
        assert_eq!(g.admit("flood", "flood/0-1", 100, t0), Verdict::Duplicate);
        // An hour later the device has room again, and is logged again when over.
        let later = t0 + HOUR;
        assert_eq!(g.admit("flood", "flood/50-1", 100, later), Verdict::New);
        g.admit("flood", "flood/51-1", 100, later);
        g.admit("flood", "flood/52-1", 100, later);
        let v = g.admit("flood", "flood/53-1", 100, later);
        assert_eq!(v, Verdict::OverQuota { first: true });
    }

    #[test]
    fn bytes_count_against_the_quota_too() {
        let mut g = Gate::new(quota(100, 1000, 100), []);
        let t0 = Instant::now();
        assert_eq!(g.admit("d", "d/1-1", 600, t0), Verdict::New);
        let v = g.admit("d", "d/2-1", 600, t0);
        assert!(matches!(v, Verdict::OverQuota { .. }), "{v:?}");
        assert_eq!(
            g.admit("d", "d/3-1", 400, t0),
            Verdict::New,
            "a smaller one fits"
        );
        // The window rolls: an hour after the first, its bytes are free again.
        let v = g.admit("d", "d/4-1", 600, t0 + HOUR + Duration::from_secs(1));
        assert_eq!(v, Verdict::New);
    }

    #[test]
    fn the_seen_set_is_bounded_and_keeps_the_newest() {
        let paths = (0..50).rev().map(|i| format!("d/{}-000001", 1_000_000 + i));
        let mut g = Gate::new(quota(1_000_000, u64::MAX, 10), paths);
        assert_eq!(g.seen(), 10);
        assert_eq!(
            g.admit("d", "d/1000049-000001", 1, Instant::now()),
            Verdict::Duplicate,
            "the newest loaded is remembered"
        );
        assert_eq!(
            g.admit("d", "d/1000000-000001", 1, Instant::now()),
            Verdict::New,
            "the oldest loaded is forgotten"
        );
        let t0 = Instant::now();
        for i in 0..10_000 {
            g.admit("d", &format!("d/{}-1", 2_000_000 + i), 1, t0);
        }
        assert_eq!(g.seen(), 10, "never more than max_seen");
        assert_eq!(g.admit("d", "d/2009999-1", 1, t0), Verdict::Duplicate);
    }

    #[test]
    fn devices_with_an_empty_hour_are_forgotten() {
        let mut g = Gate::new(quota(10, u64::MAX, 10), []);
        let t0 = Instant::now();
        for i in 0..SWEEP_EVERY - 1 {
            g.admit(&format!("d{i}"), &format!("d{i}/1-1"), 1, t0);
        }
        assert_eq!(g.devices(), (SWEEP_EVERY - 1) as usize);
        g.admit("last", "last/1-1", 1, t0 + HOUR);
        assert_eq!(g.devices(), 1, "only the device of the last hour");
    }
}
