//! What the device is told to run: desired states and key lists through the replay, expiry,
//! clear and trust rules ([`crate::core::desired`], [`crate::core::trust`]), and the choice of the state to
//! pursue.

use kestrel_shared::protocol::{SignedDesired, SignedKeyList, Target, parse};
use kestrel_shared::wire::EventKind;

use super::{Core, Effect, Lane, Model};
use crate::core::desired::Verdict;
use crate::core::trust::KeysVerdict;
use crate::core::update::Phase;

impl<M: Model> Core<M> {
    /// A desired state arrived on one of our desired topics, for `target` (an empty payload is
    /// an unsigned clear, refused). One that does not verify, or names another target than its
    /// topic, is reported and changes nothing: no field of its body is read.
    pub(super) fn on_desired(&mut self, topic: &str, target: &Target, payload: &[u8]) {
        if payload.is_empty() {
            let verdict = self.desired.unsigned_clear(topic);
            return self.on_verdict(verdict, 0);
        }
        let d = parse::<SignedDesired>(topic, payload)
            .and_then(|s| s.open(self.trust.keys(), topic))
            .map_err(|e| e.to_string())
            .and_then(|d| {
                if &d.target == target {
                    Ok(d)
                } else {
                    Err(format!(
                        "{topic}: desired state for {} on the wrong topic",
                        d.target
                    ))
                }
            });
        match d {
            Ok(d) => {
                let version = d.version;
                let verdict = self.desired.receive(topic, d, self.now.unix_s());
                self.on_verdict(verdict, version)
            }
            Err(reason) => {
                let lapsed = self.trust.lapsed().map(|l| format!(" ({l})"));
                let reason = format!(
                    "desired state refused: {reason}{}",
                    lapsed.unwrap_or_default()
                );
                self.on_verdict(Verdict::Refused(reason), 0)
            }
        }
    }

    /// A key list arrived: a newer one is saved and in force at once, and the desired states
    /// are asked for again (one signed by a key it adds may have been refused before).
    pub(super) fn on_keys(&mut self, topic: &str, payload: &[u8]) {
        let verdict = match parse::<SignedKeyList>(topic, payload) {
            Ok(signed) => self.trust.receive(signed, topic, self.now.unix_s()),
            Err(e) => KeysVerdict::Refused(e.to_string()),
        };
        match verdict {
            KeysVerdict::Same => {}
            KeysVerdict::Refused(reason) => self.on_verdict(Verdict::Refused(reason), 0),
            KeysVerdict::Updated(version) => {
                let saved = self.trust.saved().expect("just updated");
                // Not written (a full disk): in force until a restart, which falls back to the
                // last list saved; the retained list on the broker is verified again then.
                let saved = serde_json::to_vec(saved).expect("serializable");
                self.out.push(Effect::SaveKeys(saved));
                tracing::info!("{}: key list v{version} in force", self.id());
                self.publish_status();
                self.ask_again();
            }
        }
    }

    /// Asks the broker again for the retained desired states (own and groups') and the pursued
    /// model's offer, after a key list that may verify what was refused before: unsubscribed and
    /// subscribed, since a broker resends retained messages only on a new subscription (rumqttd
    /// 0.20 never on one it already has).
    fn ask_again(&mut self) {
        let mut topics = vec![
            self.topics
                .desired(&Target::Device(self.cfg.device_id.clone())),
        ];
        for g in &self.cfg.groups {
            topics.push(self.topics.desired(&Target::Group(g.clone())));
        }
        if let Some(p) = &self.pursued {
            topics.push(self.topics.artifact_manifest(&p.name, p.version));
        }
        self.out.extend(topics.into_iter().map(Effect::Resubscribe));
    }

    /// At every input: once the key list held expires, its publishing keys are no longer
    /// trusted ([`crate::core::trust`]). Reported like a refusal (status, event, log), and the key
    /// list is asked for again (a newer one may be retained).
    pub(super) fn expire_keys(&mut self) {
        let Some(why) = self.trust.lapse(self.now.unix_s()) else {
            return;
        };
        let topic = self.topics.keys();
        self.out.push(Effect::Resubscribe(topic.clone()));
        self.on_verdict(Verdict::Refused(format!("{topic}: {why}")), 0);
    }

    /// Journals what the replay and expiry rules decided, reports a refusal (status and event),
    /// and pursues whatever is now wanted.
    pub(super) fn on_verdict(&mut self, verdict: Verdict, version: u64) {
        if let Verdict::Refused(reason) = verdict {
            self.event(EventKind::Refused, version, Some(reason.clone()));
            self.refused = Some(reason);
            self.publish_status();
            return;
        }
        self.journal_dirty[Lane::Install as usize] = true;
        self.choose();
    }

    /// Pursues the device's own desired state, else the newest of its groups' (unexpired).
    pub(super) fn choose(&mut self) {
        let own = self
            .topics
            .desired(&Target::Device(self.cfg.device_id.clone()));
        let Some(d) = self.desired.pick(&own, self.now.unix_s()).cloned() else {
            return self.set_shadow(None);
        };
        let shadow = d.shadow.clone();
        let same = self.pursued.as_ref().is_some_and(|w| {
            w.name == d.name && w.version == d.version && w.rollback == d.rollback
        });
        if same && self.install.updater.phase != Phase::Idle {
            return self.set_shadow(shadow);
        }
        if let Some(old) = &self.pursued
            && (old.name != d.name || old.version != d.version)
        {
            let t = self.topics.artifact_manifest(&old.name, old.version);
            self.out.push(Effect::Unsubscribe(t));
        }
        let t = self.topics.artifact_manifest(&d.name, d.version);
        self.pursued = Some(d);
        self.journal_dirty[Lane::Install as usize] = true;
        // The shadow first: a shadow that becomes the wanted model unsubscribes its offer's topic,
        // and a broker may not resend a retained message on a subscription that already exists
        // (rumqttd does not), so the wanted model's subscription comes after, fresh.
        self.set_shadow(shadow);
        self.out.push(Effect::Subscribe(t));
    }
}
