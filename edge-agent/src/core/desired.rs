//! Which signed desired states a device follows, as sans-IO logic: fed the desired states that
//! arrived (signature already checked) and the time, it says whether each is accepted, clears its
//! topic, or is refused and why. The IO layer persists [`DesiredStates::newest`] in the journal, so
//! the rules hold across restarts.
//!
//! The rules (docs/protocol.md names the threat each one answers):
//! - **replay / rollback**: a state whose `issued` is older than the newest accepted on the same
//!   topic is refused. The same state delivered again (a retained message after a reconnect) has
//!   the same `issued` and is accepted as it was.
//! - **freeze**: a state whose `expires` has passed is refused; the model already active keeps
//!   serving.
//! - **future**: a state issued more than [`MAX_CLOCK_SKEW_MS`] after the device's clock is
//!   refused: taken, it would make every later (correctly dated) state on its topic look like a
//!   replay.
//! - **clear**: only a signed state with `clear: true` removes a topic's desired state; an empty
//!   (unsigned) payload is refused.

use std::collections::BTreeMap;

use kestrel_shared::protocol::Desired;
use serde::{Deserialize, Serialize};

/// How far ahead of the device's clock a state's `issued` may be (the publisher's clock and the
/// device's disagree by that much at most).
pub const MAX_CLOCK_SKEW_MS: u64 = 10 * 60 * 1000;

/// What became of a desired state that arrived.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Accepted,
    Cleared,
    Refused(String),
}

/// The desired states held, by topic, and the newest `issued` accepted per topic.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
pub struct DesiredStates {
    /// Not journaled: the broker delivers the retained states again after a restart.
    #[serde(skip)]
    states: BTreeMap<String, Desired>,
    /// The newest `issued` accepted on each topic (journaled).
    #[serde(default)]
    pub newest: BTreeMap<String, u64>,
}

impl DesiredStates {
    /// A desired state (signature checked) arrived on `topic` at `now` (Unix seconds).
    pub fn receive(&mut self, topic: &str, d: Desired, now: u64) -> Verdict {
        if let Some(&newest) = self.newest.get(topic)
            && d.issued < newest
        {
            return Verdict::Refused(format!(
                "{topic}: replayed or stale desired state (issued {} ms, older than the {newest} \
                 ms already accepted here)",
                d.issued
            ));
        }
        if d.issued > now.saturating_mul(1000) + MAX_CLOCK_SKEW_MS {
            return Verdict::Refused(format!(
                "{topic}: desired state issued {} s ahead of this device's clock (at most {} s \
                 allowed); refused so it cannot lock the topic",
                (d.issued / 1000).saturating_sub(now),
                MAX_CLOCK_SKEW_MS / 1000
            ));
        }
        if let Some(expires) = d.expires
            && now >= expires
        {
            return Verdict::Refused(format!(
                "{topic}: desired state for {} v{} expired at {}",
                d.name,
                d.version,
                kestrel_shared::manifest::rfc3339(expires)
            ));
        }
        self.newest.insert(topic.to_string(), d.issued);
        if d.clear {
            self.states.remove(topic);
            Verdict::Cleared
        } else {
            self.states.insert(topic.to_string(), d);
            Verdict::Accepted
        }
    }

    /// An empty payload on `topic`: the unsigned clear, refused (the state held stays).
    pub fn unsigned_clear(&self, topic: &str) -> Verdict {
        Verdict::Refused(format!(
            "{topic}: empty payload ignored (an unsigned clear; clearing takes a signed state \
             with \"clear\": true)"
        ))
    }

    /// The state to pursue at `now`: the one on `own` (the device's topic), else the newest of
    /// the others (groups'); expired states are skipped.
    pub fn pick(&self, own: &str, now: u64) -> Option<&Desired> {
        let live = |d: &&Desired| d.expires.is_none_or(|e| now < e);
        self.states
            .get(own)
            .filter(live)
            .or_else(|| self.states.values().filter(live).max_by_key(|d| d.issued))
    }
}

#[cfg(test)]
mod tests {
    use kestrel_shared::protocol::Target;

    use super::*;

    const OWN: &str = "k/devices/pi/desired";
    const GROUP: &str = "k/groups/g/desired";

    fn d(version: u64, issued: u64) -> Desired {
        Desired {
            target: Target::Device("pi".into()),
            name: "m".into(),
            version,
            rollback: false,
            issued,
            expires: None,
            clear: false,
            rollout: None,
            source: None,
            shadow: None,
        }
    }

    #[test]
    fn an_older_state_is_refused_and_the_same_one_again_accepted() {
        let mut s = DesiredStates::default();
        assert_eq!(s.receive(OWN, d(1, 100), 0), Verdict::Accepted);
        assert_eq!(s.receive(OWN, d(2, 200), 0), Verdict::Accepted);
        let v = s.receive(OWN, d(1, 100), 0);
        assert!(
            matches!(&v, Verdict::Refused(r) if r.contains("replayed") && r.contains(OWN)),
            "{v:?}"
        );
        assert_eq!(s.pick(OWN, 0).map(|d| d.version), Some(2));
        // Redelivered after a reconnect: same issued, accepted.
        assert_eq!(s.receive(OWN, d(2, 200), 0), Verdict::Accepted);
        // Topics are independent.
        assert_eq!(s.receive(GROUP, d(1, 50), 0), Verdict::Accepted);
    }

    #[test]
    fn a_state_from_the_future_is_refused_and_locks_nothing() {
        let mut s = DesiredStates::default();
        let now = 1_800_000_000; // seconds
        let ahead = d(9, now * 1000 + MAX_CLOCK_SKEW_MS + 1);
        assert!(matches!(s.receive(OWN, ahead, now), Verdict::Refused(r) if r.contains("ahead")));
        // Within the skew: accepted; and a correctly dated state after it is still taken.
        assert_eq!(s.receive(OWN, d(2, now * 1000 - 5), now), Verdict::Accepted);
        assert_eq!(s.receive(OWN, d(3, now * 1000), now), Verdict::Accepted);
    }

    #[test]
    fn the_high_water_mark_survives_a_restart() {
        let mut s = DesiredStates::default();
        s.receive(OWN, d(2, 200), 0);
        let journaled = serde_json::to_string(&s).unwrap();
        let mut back: DesiredStates = serde_json::from_str(&journaled).unwrap();
        assert_eq!(back.pick(OWN, 0), None, "states come from the broker again");
        assert!(matches!(
            back.receive(OWN, d(1, 100), 0),
            Verdict::Refused(_)
        ));
        assert_eq!(back.receive(OWN, d(2, 200), 0), Verdict::Accepted);
    }

    #[test]
    fn expired_states_are_refused_and_not_pursued() {
        let mut s = DesiredStates::default();
        let mut late = d(3, 300);
        late.expires = Some(1000);
        let v = s.receive(OWN, late.clone(), 1000);
        assert!(
            matches!(&v, Verdict::Refused(r) if r.contains("expired")),
            "{v:?}"
        );
        assert_eq!(s.pick(OWN, 1000), None);
        assert_eq!(s.receive(OWN, late, 999), Verdict::Accepted);
        assert_eq!(s.pick(OWN, 999).map(|d| d.version), Some(3));
        assert_eq!(s.pick(OWN, 1000), None, "expired while held");
    }

    #[test]
    fn only_a_signed_clear_clears() {
        let mut s = DesiredStates::default();
        s.receive(OWN, d(1, 100), 0);
        assert!(matches!(s.unsigned_clear(OWN), Verdict::Refused(_)));
        assert_eq!(s.pick(OWN, 0).map(|d| d.version), Some(1));
        let mut clear = d(0, 150);
        clear.clear = true;
        assert_eq!(s.receive(OWN, clear, 0), Verdict::Cleared);
        assert_eq!(s.pick(OWN, 0), None);
        // The cleared state cannot be replayed back.
        assert!(matches!(s.receive(OWN, d(1, 100), 0), Verdict::Refused(_)));
    }

    #[test]
    fn the_own_topic_wins_else_the_newest_group_state() {
        let mut s = DesiredStates::default();
        s.receive(GROUP, d(1, 100), 0);
        s.receive("k/groups/h/desired", d(2, 200), 0);
        assert_eq!(s.pick(OWN, 0).map(|d| d.version), Some(2));
        s.receive(OWN, d(3, 50), 0);
        assert_eq!(s.pick(OWN, 0).map(|d| d.version), Some(3));
    }

    #[test]
    fn a_state_issued_exactly_at_the_clock_skew_limit_is_accepted() {
        let mut s = DesiredStates::default();
        let now = 1_800_000_000; // seconds
        let edge = now * 1000 + MAX_CLOCK_SKEW_MS;
        assert_eq!(s.receive(OWN, d(1, edge), now), Verdict::Accepted);
        assert_eq!(s.newest.get(OWN), Some(&edge));
    }

    #[test]
    fn an_expired_state_refused_does_not_raise_the_replay_mark() {
        let mut s = DesiredStates::default();
        assert_eq!(s.receive(OWN, d(1, 100), 5), Verdict::Accepted);
        let mut late = d(3, 300);
        late.expires = Some(5);
        assert!(matches!(s.receive(OWN, late, 5), Verdict::Refused(r) if r.contains("expired")));
        assert_eq!(s.newest.get(OWN), Some(&100));
        // Issued after the state held and before the refused one: still taken.
        assert_eq!(s.receive(OWN, d(2, 200), 5), Verdict::Accepted);
        assert_eq!(s.pick(OWN, 5).map(|d| d.version), Some(2));
    }

    #[test]
    fn a_clear_older_than_the_state_held_is_refused_and_the_state_stays() {
        let mut s = DesiredStates::default();
        s.receive(OWN, d(2, 200), 0);
        let mut clear = d(0, 150);
        clear.clear = true;
        let v = s.receive(OWN, clear, 0);
        assert!(
            matches!(&v, Verdict::Refused(r) if r.contains("replayed")),
            "{v:?}"
        );
        assert_eq!(s.pick(OWN, 0).map(|d| d.version), Some(2));
        assert_eq!(s.newest.get(OWN), Some(&200));
    }

    #[test]
    fn clearing_the_own_topic_falls_back_to_the_newest_group_state() {
        let mut s = DesiredStates::default();
        s.receive(GROUP, d(1, 100), 0);
        s.receive(OWN, d(2, 200), 0);
        assert_eq!(s.pick(OWN, 0).map(|d| d.version), Some(2));
        let mut clear = d(0, 300);
        clear.clear = true;
        assert_eq!(s.receive(OWN, clear, 0), Verdict::Cleared);
        assert_eq!(s.pick(OWN, 0).map(|d| d.version), Some(1));
        assert_eq!(
            s.newest.get(OWN),
            Some(&300),
            "the clear is the topic's new replay mark"
        );
    }

    #[test]
    fn the_same_signed_clear_delivered_again_is_still_a_clear() {
        let mut s = DesiredStates::default();
        s.receive(OWN, d(1, 100), 0);
        let mut clear = d(0, 150);
        clear.clear = true;
        assert_eq!(s.receive(OWN, clear.clone(), 0), Verdict::Cleared);
        // The retained clear again after a reconnect: same `issued`, not a replay.
        assert_eq!(s.receive(OWN, clear, 0), Verdict::Cleared);
        assert_eq!(s.pick(OWN, 0), None);
    }

    #[test]
    fn an_expired_state_yields_to_the_newest_live_one() {
        let mut s = DesiredStates::default();
        let mut own = d(3, 300);
        own.expires = Some(500);
        let mut newer_group = d(2, 200);
        newer_group.expires = Some(1000);
        assert_eq!(s.receive(GROUP, d(1, 100), 0), Verdict::Accepted);
        assert_eq!(
            s.receive("k/groups/h/desired", newer_group, 0),
            Verdict::Accepted
        );
        assert_eq!(s.receive(OWN, own, 0), Verdict::Accepted);
        let picked = |t| s.pick(OWN, t).map(|d| d.version);
        // Own while live; then the newest live group state; then the older group state.
        assert_eq!(
            (picked(499), picked(500), picked(1000)),
            (Some(3), Some(2), Some(1))
        );
    }
}
