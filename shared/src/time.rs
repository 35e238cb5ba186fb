//! Wall-clock helpers shared by the edge agent and the fleet tools.

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
