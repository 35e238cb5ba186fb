//! Input capture without IO: which answered requests the `[capture]` policy keeps, the hourly
//! limit (its memory survives restarts through [`CaptureState`]) and the upload cap (a token
//! bucket). The agent's glue ([`crate::agent`]) stores the captures in a budgeted outbox.

use std::collections::VecDeque;

use kestrel_shared::capture::CaptureStats;
use kestrel_shared::protocol::Class;
use serde::{Deserialize, Serialize};

use crate::config::{Capture as CaptureConfig, CapturePolicy};

const HOUR_MS: u64 = 3_600_000;

/// What survives a restart: the counters and the times of the last hour's captures.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CaptureState {
    pub stats: CaptureStats,
    /// Unix milliseconds of the captures taken in the last hour, oldest first.
    pub recent: VecDeque<u64>,
    /// The last capture id's sequence number.
    pub seq: u64,
}

/// The decisions of `[capture]`.
#[derive(Debug)]
pub struct Capturer {
    cfg: CaptureConfig,
    pub state: CaptureState,
    rng: u64,
    /// Upload tokens (bytes) and when they were last filled (unix ms).
    tokens: f64,
    filled_ms: u64,
}

impl Capturer {
    pub fn new(cfg: CaptureConfig, state: CaptureState, seed: u64) -> Self {
        Self {
            cfg,
            state,
            rng: seed | 1,
            tokens: 0.0,
            filled_ms: 0,
        }
    }

    /// Why the policy keeps a request with these top-k scores (`drifting`: the quality window's
    /// last judgement), if it does.
    pub fn reason(&mut self, top: &[Class], drifting: bool) -> Option<&'static str> {
        let c = &self.cfg;
        match c.policy {
            CapturePolicy::LowConfidence => {
                let s1 = top.first().map_or(0.0, |t| f64::from(t.score));
                let s2 = top.get(1).map_or(0.0, |t| f64::from(t.score));
                (s1 < c.min_confidence || s1 - s2 < c.min_margin).then_some("low-confidence")
            }
            CapturePolicy::Random => {
                let rate = c.rate;
                (self.uniform() < rate).then_some("random")
            }
            CapturePolicy::Drift => drifting.then_some("drift"),
        }
    }

    /// Admits one capture at `now_ms` under the hourly limit (counted either way); returns its
    /// id (`<unix ms>-<sequence>`) when admitted.
    pub fn admit(&mut self, now_ms: u64) -> Option<String> {
        let s = &mut self.state;
        while s.recent.front().is_some_and(|&t| t + HOUR_MS <= now_ms) {
            s.recent.pop_front();
        }
        if s.recent.len() as u64 >= self.cfg.max_per_hour {
            s.stats.rate_limited += 1;
            return None;
        }
        s.recent.push_back(now_ms);
        s.seq += 1;
        s.stats.taken += 1;
        Some(format!("{now_ms}-{:06}", s.seq))
    }

    /// Whether a capture of `bytes` may be sent at `now_ms` under the upload cap; takes its
    /// tokens when it may. The bucket holds one second's worth, or one message if larger.
    pub fn may_send(&mut self, bytes: usize, now_ms: u64) -> bool {
        let rate = self.cfg.max_upload_bytes_per_s as f64;
        if rate == 0.0 {
            return true;
        }
        let elapsed = now_ms.saturating_sub(self.filled_ms) as f64 / 1000.0;
        self.filled_ms = now_ms;
        self.tokens = (self.tokens + elapsed * rate).min(rate.max(bytes as f64));
        if self.tokens >= bytes as f64 {
            self.tokens -= bytes as f64;
            true
        } else {
            false
        }
    }

    pub fn max_disk_bytes(&self) -> u64 {
        self.cfg.max_disk_bytes
    }

    /// A uniform draw in [0, 1) (xorshift64*; statistical, not secret).
    fn uniform(&mut self) -> f64 {
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn top(scores: &[f32]) -> Vec<Class> {
        scores
            .iter()
            .enumerate()
            .map(|(i, &score)| Class {
                class: i,
                label: i.to_string(),
                score,
            })
            .collect()
    }

    fn capturer(policy: CapturePolicy, f: impl FnOnce(&mut CaptureConfig)) -> Capturer {
        let mut cfg = CaptureConfig {
            enabled: true,
            policy,
            ..Default::default()
        };
        f(&mut cfg);
        Capturer::new(cfg, CaptureState::default(), 7)
    }

    #[test]
    fn policies_choose_by_confidence_margin_share_and_drift() {
        let mut c = capturer(CapturePolicy::LowConfidence, |c| {
            c.min_confidence = 0.6;
            c.min_margin = 0.3;
        });
        assert_eq!(c.reason(&top(&[0.55, 0.45]), false), Some("low-confidence"));
        assert_eq!(c.reason(&top(&[0.62, 0.38]), false), Some("low-confidence")); // margin
        assert_eq!(c.reason(&top(&[0.9, 0.1]), true), None);
        let mut c = capturer(CapturePolicy::Random, |c| c.rate = 0.25);
        let kept = (0..4000)
            .filter(|_| c.reason(&top(&[1.0]), false).is_some())
            .count();
        assert!((850..1150).contains(&kept), "{kept} of 4000 at rate 0.25");
        let mut c = capturer(CapturePolicy::Drift, |_| {});
        assert_eq!(c.reason(&top(&[0.1]), false), None);
        assert_eq!(c.reason(&top(&[0.99]), true), Some("drift"));
    }

    #[test]
    fn the_hourly_limit_holds_across_a_restart_and_frees_after_an_hour() {
        let mut c = capturer(CapturePolicy::Random, |c| c.max_per_hour = 3);
        let t0 = 1_000_000;
        let ids: Vec<_> = (0..5).map(|i| c.admit(t0 + i)).collect();
        assert_eq!(ids.iter().flatten().count(), 3);
        assert_eq!(ids[0].as_deref(), Some("1000000-000001"));
        let saved = c.state.clone();
        let mut c = Capturer::new(c.cfg.clone(), saved, 1); // restarted
        assert_eq!(c.admit(t0 + 10), None);
        assert_eq!(c.admit(t0 + HOUR_MS).as_deref(), Some("4600000-000004"));
        assert_eq!((c.state.stats.taken, c.state.stats.rate_limited), (4, 3));
    }

    #[test]
    fn the_upload_cap_spreads_sends_over_time() {
        let mut c = capturer(CapturePolicy::Random, |c| c.max_upload_bytes_per_s = 1000);
        let mut sent = 0;
        for ms in (0..10_000).step_by(10) {
            if c.may_send(400, ms) {
                sent += 400;
            }
        }
        assert!(
            (9_000..=11_000).contains(&sent),
            "{sent} bytes in 10 s at 1000 B/s"
        );
        let mut c = capturer(CapturePolicy::Random, |c| c.max_upload_bytes_per_s = 100);
        assert!(!c.may_send(5000, 1000)); // one message larger than a second's worth
        assert!(c.may_send(5000, 51_000), "it goes once its time has come");
    }
}
