//! Input capture without IO: which answered requests the `[capture]` policy keeps, the hourly
//! limit (its memory survives restarts through [`CaptureState`]), the upload cap (a token
//! bucket), and the captures sent but not yet acknowledged by a collector ([`Unacked`]: kept,
//! sent again after a growing wait, deleted on the collector's acknowledgement or given up after
//! `max_resends`). The agent's glue ([`crate::agent`]) stores the captures in a budgeted outbox
//! and their files while they wait for the acknowledgement.

use std::collections::VecDeque;

use kestrel_shared::capture::CaptureStats;
use kestrel_shared::wire::{CaptureReason, Class};
use serde::{Deserialize, Serialize};

use crate::core::settings::{Capture as CaptureConfig, CapturePolicy};

const HOUR_MS: u64 = 3_600_000;
/// Captures waiting for a collector's acknowledgement at most (the oldest are given up beyond).
pub const MAX_UNACKED: usize = 4096;

/// What survives a restart: the counters, the times of the last hour's captures and the
/// captures waiting for a collector's acknowledgement.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CaptureState {
    pub stats: CaptureStats,
    /// Unix milliseconds of the captures taken in the last hour, oldest first.
    pub recent: VecDeque<u64>,
    /// The last capture id's sequence number.
    pub seq: u64,
    /// Captures the broker acknowledged and no collector yet, oldest first.
    #[serde(default)]
    pub unacked: VecDeque<Unacked>,
}

/// A capture sent and not yet acknowledged by a collector (its file waits on the device).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Unacked {
    pub id: String,
    /// Its file's size.
    pub bytes: u64,
    /// When it is sent again (unix ms).
    pub due_ms: u64,
    pub resends: u32,
}

/// What to do about a capture whose wait for an acknowledgement is over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Due {
    /// Send it again.
    Resend(String),
    /// `max_resends` went unanswered: delete it.
    GiveUp(String),
}

impl CaptureState {
    /// The waiting captures as the store has them (`on_disk`: id and file size): those the state
    /// knows keep their resends, files it does not know (written just before a crash) are due
    /// now, and what has no file is forgotten. Oldest first, by capture id.
    pub fn reconcile(&mut self, on_disk: &[(String, u64)], now_ms: u64) {
        let known: std::collections::HashMap<String, Unacked> =
            self.unacked.drain(..).map(|u| (u.id.clone(), u)).collect();
        let mut all: Vec<Unacked> = on_disk
            .iter()
            .map(|(id, bytes)| Unacked {
                bytes: *bytes,
                ..known.get(id).cloned().unwrap_or(Unacked {
                    id: id.clone(),
                    bytes: 0,
                    due_ms: now_ms,
                    resends: 0,
                })
            })
            .collect();
        all.sort_by_key(|u| id_order(&u.id));
        self.unacked = all.into();
    }

    /// (captures, bytes) waiting for a collector's acknowledgement.
    pub fn unacked_totals(&self) -> (u64, u64) {
        let bytes = self.unacked.iter().map(|u| u.bytes).sum();
        (self.unacked.len() as u64, bytes)
    }
}

/// A capture id's place in time: `<unix ms>-<sequence>`.
fn id_order(id: &str) -> (u64, u64) {
    let mut parts = id.splitn(2, '-').map(|n| n.parse().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
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
    /// The capture being sent again, until the broker has it (one at a time).
    resending: Option<String>,
}

impl Capturer {
    pub fn new(cfg: CaptureConfig, state: CaptureState, seed: u64) -> Self {
        Self {
            cfg,
            state,
            rng: seed | 1,
            tokens: 0.0,
            filled_ms: 0,
            resending: None,
        }
    }

    /// Why the policy keeps a request with these top-k scores (`drifting`: the quality window's
    /// last judgement), if it does.
    pub fn reason(&mut self, top: &[Class], drifting: bool) -> Option<CaptureReason> {
        let c = &self.cfg;
        match c.policy {
            CapturePolicy::LowConfidence => {
                let s1 = top.first().map_or(0.0, |t| f64::from(t.score));
                let s2 = top.get(1).map_or(0.0, |t| f64::from(t.score));
                (s1 < c.min_confidence || s1 - s2 < c.min_margin)
                    .then_some(CaptureReason::LowConfidence)
            }
            CapturePolicy::Random => {
                let rate = c.rate;
                (self.uniform() < rate).then_some(CaptureReason::Random)
            }
            CapturePolicy::Drift => drifting.then_some(CaptureReason::Drift),
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

    /// The wait after send number `resends` (0: the first) before the next.
    fn backoff_ms(&self, resends: u32) -> u64 {
        let base = self.cfg.resend_after_s.saturating_mul(1000);
        let max = self.cfg.resend_max_s.saturating_mul(1000);
        base.saturating_mul(1u64 << resends.min(32)).min(max)
    }

    /// The broker acknowledged the first send of capture `id` (its file `bytes` long) at
    /// `now_ms`. Returns the captures to delete: this one when no collector acknowledges
    /// (`collector_acks = false`), else the oldest waiting beyond [`MAX_UNACKED`].
    pub fn delivered(&mut self, id: &str, bytes: u64, now_ms: u64) -> Vec<String> {
        self.state.stats.sent += 1;
        if !self.cfg.collector_acks {
            return vec![id.to_string()];
        }
        let due_ms = now_ms.saturating_add(self.backoff_ms(0));
        self.state.unacked.push_back(Unacked {
            id: id.to_string(),
            bytes,
            due_ms,
            resends: 0,
        });
        let over = self.state.unacked.len().saturating_sub(MAX_UNACKED);
        (0..over).filter_map(|_| self.drop_oldest()).collect()
    }

    /// The broker acknowledged a resend of `id`: the next may go.
    pub fn redelivered(&mut self, id: &str) {
        if self.resending.as_deref() == Some(id) {
            self.resending = None;
        }
    }

    /// A collector acknowledged `ids`: those waiting are done (returned, to delete); others
    /// (not sent yet, or already deleted) are ignored.
    pub fn acked(&mut self, ids: &[String]) -> Vec<String> {
        let mut done = Vec::new();
        for id in ids {
            if let Some(i) = self.state.unacked.iter().position(|u| &u.id == id) {
                self.state.unacked.remove(i);
                self.state.stats.acked += 1;
                self.redelivered(id);
                done.push(id.clone());
            }
        }
        done
    }

    /// The file of waiting capture `id` is gone: forgotten.
    pub fn gone(&mut self, id: &str) {
        if let Some(i) = self.state.unacked.iter().position(|u| u.id == id) {
            self.state.unacked.remove(i);
            self.state.stats.unacked_dropped += 1;
        }
        self.redelivered(id);
    }

    /// Makes room for a new capture of `bytes` in the disk budget by giving up the oldest
    /// waiting captures (returned, to delete); returns them and what the queue may use.
    pub fn make_room(&mut self, bytes: u64) -> (Vec<String>, u64) {
        let max = self.cfg.max_disk_bytes;
        let mut dropped = Vec::new();
        while self.state.unacked_totals().1.saturating_add(bytes) > max {
            match self.drop_oldest() {
                Some(id) => dropped.push(id),
                None => break,
            }
        }
        (dropped, max.saturating_sub(self.state.unacked_totals().1))
    }

    fn drop_oldest(&mut self) -> Option<String> {
        let u = self.state.unacked.pop_front()?;
        self.state.stats.unacked_dropped += 1;
        self.redelivered(&u.id);
        Some(u.id)
    }

    /// The oldest waiting capture whose wait is over at `now_ms`: sent again (one at a time:
    /// none while a resend is on its way to the broker), or given up after `max_resends`.
    pub fn next_due(&mut self, now_ms: u64) -> Option<Due> {
        if self.resending.is_some() {
            return None;
        }
        let i = self.state.unacked.iter().position(|u| u.due_ms <= now_ms)?;
        if self.state.unacked[i].resends >= self.cfg.max_resends {
            let u = self.state.unacked.remove(i).expect("found");
            self.state.stats.unacked_dropped += 1;
            return Some(Due::GiveUp(u.id));
        }
        let resends = self.state.unacked[i].resends + 1;
        let due_ms = now_ms.saturating_add(self.backoff_ms(resends));
        let u = &mut self.state.unacked[i];
        (u.resends, u.due_ms) = (resends, due_ms);
        self.state.stats.resent += 1;
        self.resending = Some(u.id.clone());
        Some(Due::Resend(u.id.clone()))
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
        assert_eq!(
            c.reason(&top(&[0.55, 0.45]), false),
            Some(CaptureReason::LowConfidence)
        );
        assert_eq!(
            c.reason(&top(&[0.62, 0.38]), false),
            Some(CaptureReason::LowConfidence)
        ); // margin
        assert_eq!(c.reason(&top(&[0.9, 0.1]), true), None);
        let mut c = capturer(CapturePolicy::Random, |c| c.rate = 0.25);
        let kept = (0..4000)
            .filter(|_| c.reason(&top(&[1.0]), false).is_some())
            .count();
        assert!((850..1150).contains(&kept), "{kept} of 4000 at rate 0.25");
        let mut c = capturer(CapturePolicy::Drift, |_| {});
        assert_eq!(c.reason(&top(&[0.1]), false), None);
        assert_eq!(c.reason(&top(&[0.99]), true), Some(CaptureReason::Drift));
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

    #[test]
    fn what_waits_for_an_acknowledgement_is_what_the_store_holds() {
        let u = |id: &str, resends| Unacked {
            id: id.into(),
            bytes: 1,
            due_ms: 500,
            resends,
        };
        let mut st = CaptureState {
            unacked: [u("20-000002", 3), u("10-000001", 1)].into(),
            ..Default::default()
        };
        // 10-1 was deleted before the state was saved; 30-3 written just before a crash.
        let on_disk = [("30-000003".to_string(), 70), ("20-000002".to_string(), 50)];
        st.reconcile(&on_disk, 9000);
        let got: Vec<_> = st
            .unacked
            .iter()
            .map(|u| (u.id.as_str(), u.bytes, u.due_ms, u.resends))
            .collect();
        assert_eq!(got, [("20-000002", 50, 500, 3), ("30-000003", 70, 9000, 0)]);
        assert_eq!(st.unacked_totals(), (2, 120));
        // A state file from before acknowledgements reads as nothing waiting.
        let old: CaptureState =
            serde_json::from_str(r#"{"stats":{"taken":1,"rate_limited":0,"evicted":0,"sent":1,"queued":0,"queued_bytes":0},"recent":[],"seq":1}"#)
                .unwrap();
        assert!(old.unacked.is_empty());
    }

    #[test]
    fn the_hourly_window_slides_capture_by_capture_across_a_journaled_restart() {
        let mut c = capturer(CapturePolicy::Random, |c| c.max_per_hour = 2);
        let t0 = 10_000_000;
        assert!(c.admit(t0).is_some());
        assert!(c.admit(t0 + HOUR_MS / 2).is_some());
        // Restarted from the state as written to disk (JSON).
        let json = serde_json::to_string(&c.state).unwrap();
        let mut c = Capturer::new(c.cfg.clone(), serde_json::from_str(&json).unwrap(), 3);
        assert_eq!(c.admit(t0 + HOUR_MS - 1), None, "both within the hour");
        assert!(
            c.admit(t0 + HOUR_MS).is_some(),
            "the first has left the window"
        );
        assert_eq!(c.admit(t0 + HOUR_MS + 1), None, "the second has not");
        assert_eq!((c.state.stats.taken, c.state.stats.rate_limited), (3, 2));
    }

    #[test]
    fn making_room_gives_up_the_oldest_waiting_captures_until_the_new_one_fits() {
        let mut c = capturer(CapturePolicy::Random, |c| c.max_disk_bytes = 250);
        for id in ["1-000001", "2-000002", "3-000003"] {
            assert!(c.delivered(id, 100, 0).is_empty());
        }
        let (dropped, room) = c.make_room(100);
        assert_eq!(dropped, ["1-000001", "2-000002"]);
        assert_eq!(room, 150);
        assert_eq!(c.state.unacked_totals(), (1, 100));
        assert_eq!(c.state.stats.unacked_dropped, 2);
        // Larger than the whole budget: everything waiting goes, and no more than that.
        let (dropped, room) = c.make_room(300);
        assert_eq!((dropped, room), (vec!["3-000003".to_string()], 250));
        assert_eq!(c.state.stats.unacked_dropped, 3);
    }

    #[test]
    fn acknowledging_the_capture_being_resent_deletes_it_and_lets_the_next_resend_go() {
        let mut c = capturer(CapturePolicy::Random, |c| c.resend_after_s = 10);
        c.delivered("1-000001", 10, 0);
        c.delivered("2-000002", 10, 0);
        assert_eq!(c.next_due(10_000), Some(Due::Resend("1-000001".into())));
        assert_eq!(c.next_due(10_000), None, "one resend on its way at a time");
        let acked = c.acked(&["1-000001".to_string(), "9-000009".to_string()]);
        assert_eq!(
            acked,
            vec!["1-000001".to_string()],
            "only what waits is deleted"
        );
        assert_eq!(c.next_due(10_000), Some(Due::Resend("2-000002".into())));
        assert_eq!(c.state.unacked_totals(), (1, 10));
        assert_eq!((c.state.stats.acked, c.state.stats.resent), (1, 2));
    }

    #[test]
    fn with_no_resends_allowed_a_due_capture_is_given_up_at_once() {
        let mut c = capturer(CapturePolicy::Random, |c| {
            c.resend_after_s = 10;
            c.max_resends = 0;
        });
        c.delivered("1-000001", 10, 0);
        assert_eq!(c.next_due(9_999), None, "not due yet");
        assert_eq!(c.next_due(10_000), Some(Due::GiveUp("1-000001".into())));
        assert_eq!(c.state.unacked_totals(), (0, 0));
        assert_eq!(
            (c.state.stats.resent, c.state.stats.unacked_dropped),
            (0, 1)
        );
        assert_eq!(c.next_due(u64::MAX), None);
    }

    #[test]
    fn beyond_max_unacked_the_oldest_waiting_capture_is_given_up() {
        let mut c = capturer(CapturePolicy::Random, |_| {});
        for i in 0..MAX_UNACKED {
            assert!(c.delivered(&format!("{i}-000001"), 1, 0).is_empty());
        }
        assert_eq!(c.delivered("new-1", 1, 0), vec!["0-000001".to_string()]);
        assert_eq!(c.state.unacked.len(), MAX_UNACKED);
        assert_eq!(c.state.unacked.back().map(|u| u.id.as_str()), Some("new-1"));
        assert_eq!(c.state.stats.unacked_dropped, 1);
    }
}
