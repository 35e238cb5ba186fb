//! What the device is told to run: desired states and key lists through the replay, expiry,
//! clear and trust rules (crate::desired, crate::trust), and the choice of the state to pursue.

use anyhow::Result;
use kestrel_shared::fsutil::write_atomic;
use kestrel_shared::protocol::{DeviceEvent, SignedDesired, SignedKeyList, Target, parse};
use kestrel_shared::{now_rfc3339, now_unix};
use rumqttc::QoS;

use super::{Agent, KEYS_FILE};
use crate::desired::Verdict;
use crate::trust::KeysVerdict;
use crate::update::Phase;

impl Agent {
    /// A desired state arrived on one of our desired topics, for `target` (an empty payload is
    /// an unsigned clear, refused). One that does not verify, or names another target than its
    /// topic, is reported and changes nothing: no field of its body is read.
    pub(super) async fn on_desired(
        &mut self,
        topic: &str,
        target: &Target,
        payload: &[u8],
    ) -> Result<()> {
        if payload.is_empty() {
            let verdict = self.desired.unsigned_clear(topic);
            return self.on_verdict(verdict, 0).await;
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
        let verdict = match d {
            Ok(d) => {
                let version = d.version;
                (self.desired.receive(topic, d, now_unix()), version)
            }
            Err(reason) => (
                Verdict::Refused(format!("desired state refused: {reason}")),
                0,
            ),
        };
        self.on_verdict(verdict.0, verdict.1).await
    }

    /// A key list arrived: a newer one is saved and in force at once, and the desired states
    /// are asked for again (one signed by a key it adds may have been refused before).
    pub(super) async fn on_keys(&mut self, topic: &str, payload: &[u8]) -> Result<()> {
        let verdict = match parse::<SignedKeyList>(topic, payload) {
            Ok(signed) => self.trust.receive(signed, topic),
            Err(e) => KeysVerdict::Refused(e.to_string()),
        };
        match verdict {
            KeysVerdict::Same => Ok(()),
            KeysVerdict::Refused(reason) => self.on_verdict(Verdict::Refused(reason), 0).await,
            KeysVerdict::Updated(version) => {
                let path = self.cfg.store.join(KEYS_FILE);
                let saved = serde_json::to_vec(self.trust.saved().expect("just updated"))?;
                // Not written (a full disk): in force until a restart, which falls back to the
                // last list saved; the retained list on the broker is verified again then.
                self.stored(write_atomic(&path, &saved), &path);
                tracing::info!("{}: key list v{version} in force", self.cfg.device_id);
                self.publish_status();
                self.subscribe_all().await
            }
        }
    }

    /// Journals what the replay and expiry rules decided, reports a refusal (status and event),
    /// and pursues whatever is now wanted.
    pub(super) async fn on_verdict(&mut self, verdict: Verdict, version: u64) -> Result<()> {
        if let Verdict::Refused(reason) = verdict {
            tracing::warn!("{}: {reason}", self.cfg.device_id);
            let ev = DeviceEvent {
                device: self.cfg.device_id.clone(),
                kind: "refused".into(),
                version,
                reason: Some(reason.clone()),
                time: now_rfc3339(),
            };
            let topic = self.topics.events(&self.cfg.device_id);
            self.publish_durable(topic, serde_json::to_string(&ev).expect("serializable"));
            self.refused = Some(reason);
            self.publish_status();
            return Ok(());
        }
        self.save_journal();
        self.choose().await
    }

    /// Pursues the device's own desired state, else the newest of its groups' (unexpired).
    pub(super) async fn choose(&mut self) -> Result<()> {
        let own = self
            .topics
            .desired(&Target::Device(self.cfg.device_id.clone()));
        let pick = self.desired.pick(&own, now_unix()).cloned();
        let Some(d) = pick else {
            return self.set_shadow(None).await;
        };
        let shadow = d.shadow.clone();
        let same = self.pursued.as_ref().is_some_and(|w| {
            w.name == d.name && w.version == d.version && w.rollback == d.rollback
        });
        if same && self.updater.phase != Phase::Idle {
            return self.set_shadow(shadow).await;
        }
        if let Some(old) = &self.pursued
            && (old.name != d.name || old.version != d.version)
        {
            let t = self.topics.artifact_manifest(&old.name, old.version);
            self.client.unsubscribe(t).await?;
        }
        let t = self.topics.artifact_manifest(&d.name, d.version);
        self.pursued = Some(d);
        self.save_journal();
        // The shadow first: a shadow that becomes the wanted model unsubscribes its offer's topic,
        // and a broker may not resend a retained message on a subscription that already exists
        // (rumqttd does not), so the wanted model's subscription comes after, fresh.
        self.set_shadow(shadow).await?;
        self.client.subscribe(t, QoS::AtLeastOnce).await?;
        Ok(())
    }
}
