//! Wall-clock helpers shared by the edge agent and the fleet tools.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The current time as RFC 3339 UTC (`2026-11-30T07:07:08Z`).
pub fn now_rfc3339() -> String {
    crate::manifest::rfc3339(now_unix())
}

/// When this process first asked, in milliseconds since the Unix epoch: the edge agent asks as it
/// starts and puts it in every status (`started`), so a restarted agent's statuses are told from
/// its predecessor's retained one exactly (the second-resolution `updated` cannot).
pub fn process_started_ms() -> u64 {
    static STARTED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *STARTED.get_or_init(now_ms)
}

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Milliseconds since the Unix epoch for a desired state's `issued`, strictly increasing within
/// this process (two states signed in the same millisecond still differ): devices refuse a state
/// whose `issued` is older than one they accepted on the same topic.
pub fn issued_now() -> u64 {
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = now_ms();
    let prev = LAST
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |last| {
            Some(now.max(last + 1))
        })
        .expect("the closure always returns Some");
    now.max(prev + 1)
}

#[cfg(test)]
mod tests {
    #[test]
    fn issued_now_is_strictly_increasing() {
        let a: Vec<u64> = (0..1000).map(|_| super::issued_now()).collect();
        assert!(a.windows(2).all(|w| w[0] < w[1]));
        assert!(a[0] > 1_700_000_000_000, "milliseconds: {}", a[0]);
    }
}
