//! The agent's paths without a broker: signed desired states and offers go in as messages on
//! their topics, a fake shell answers the core's effects as a store and the workers would
//! (or fails them on purpose), and the tests read what came out: events, subscriptions, the
//! effects' order, the status.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ed25519_dalek::SigningKey;
use kestrel_shared::manifest::{Composition, Manifest, PartEntry};
use kestrel_shared::mqtt::BrokerConfig;
use kestrel_shared::protocol::{
    ArtifactOffer, Class, Desired, DeviceEvent, InferReply, ModelRef, SignedDesired, Target,
    sha256_hex,
};
use kestrel_shared::signing::{PayloadType, sign};
use kestrel_shared::topics::Topics;
use kestrel_shared::wire::{DeviceState, ShadowState};

use super::*;
use crate::core::settings::CapturePolicy;

/// A model as the fake shell loads it: its manifest only.
struct Fake(Manifest);

impl Model for Fake {
    fn manifest(&self) -> &Manifest {
        &self.0
    }
}

const DEVICE: &str = "dev-1";

fn key() -> SigningKey {
    SigningKey::from_bytes(&[7; 32])
}

fn config() -> Config {
    Config {
        device_id: DEVICE.into(),
        groups: vec![],
        store: "/nonexistent".into(),
        trusted_keys: vec![],
        trusted_root: None,
        broker: BrokerConfig::new("mqtt://127.0.0.1:1883"),
        limits: Default::default(),
        inference: Default::default(),
        quality: Default::default(),
        capture: Default::default(),
    }
}

fn manifest(name: &str, version: u64, size: u64) -> Manifest {
    serde_json::from_value(serde_json::json!({
        "format_version": 1, "name": name, "version": version, "arch": "test",
        "labels": ["cat", "dog"],
        "preprocess": kestrel_shared::PreprocessSpec::imagenet(),
        "input": {"name": "input", "dtype": "f32", "shape": ["N", 3, 224, 224]},
        "output": {"name": "logits", "dtype": "f32", "shape": ["N", 2]},
        "quantization": {"form": "none", "int8_ops": [], "calibration_samples": 0,
            "f32_accuracy": 1.0, "accuracy": 1.0, "accuracy_delta_pt": 0.0},
        "training": {}, "verification": [], "golden": [],
        "files": [{"path": "model.onnx", "sha256": "00", "size": size}],
        "created": "2026-12-06T00:00:00Z",
    }))
    .expect("a manifest")
}

/// What a fake shell does with a lane's work.
#[derive(Clone, Copy, PartialEq)]
enum Outcome {
    Pass,
    FailVerify,
    FailHealth,
    FailWrite,
}

struct Rig {
    core: Core<Fake>,
    topics: Topics,
    now: Now,
    /// Every effect carried out, in order.
    log: Vec<Effect<Fake>>,
    outcome: Outcome,
    /// What a health check loads, when not the manifest offered (a model of another name).
    loads: Option<Manifest>,
    manifests: Vec<Manifest>,
    /// The part store as the fake shell keeps it: the pieces of every verified offer.
    parts: Vec<String>,
    /// Part checks not answered yet (answered at once unless `defer_checks`).
    defer_checks: bool,
    checks: Vec<Input<Fake>>,
}

impl Rig {
    fn new(cfg: Config) -> Self {
        let trust =
            crate::core::trust::Trust::new(None, vec![key().verifying_key()], None).unwrap();
        let now = Now {
            mono: Instant::now(),
            unix_ms: 1_796_000_000_000,
        };
        let saved = Saved {
            trust,
            journal: Journal::default(),
            offer: None,
            installed: (None, None),
            active_manifest: None,
            shadow: ShadowJournal::default(),
            shadow_offer: None,
            capture: Some((Default::default(), 42)),
        };
        Self {
            topics: Topics::new(&cfg.broker.prefix),
            core: Core::new(cfg, saved, now),
            now,
            log: vec![],
            outcome: Outcome::Pass,
            loads: None,
            manifests: vec![],
            parts: vec![],
            defer_checks: false,
            checks: vec![],
        }
    }

    fn send(&mut self, topic: String, payload: Vec<u8>) {
        self.input(Input::Message { topic, payload });
    }

    /// Hands `input` to the core and answers the effects as the shell would, to completion.
    fn input(&mut self, input: Input<Fake>) {
        let mut inputs = VecDeque::from([input]);
        while let Some(i) = inputs.pop_front() {
            for e in self.core.handle(i, self.now) {
                inputs.extend(self.answer(&e));
                self.log.push(e);
            }
        }
    }

    fn answer(&mut self, e: &Effect<Fake>) -> Option<Input<Fake>> {
        let o = self.outcome;
        if let Effect::Verify {
            offer: Some((offer, _)),
            ..
        } = e
            && o == Outcome::Pass
        {
            self.parts
                .extend(offer.pieces.iter().map(|p| p.sha256.clone()));
        }
        Some(match e {
            Effect::CheckParts {
                lane,
                version,
                pieces,
            } => {
                let held = Input::PartsHeld {
                    lane: *lane,
                    version: *version,
                    held: (pieces.iter())
                        .filter(|p| self.parts.contains(p))
                        .cloned()
                        .collect(),
                };
                if self.defer_checks {
                    self.checks.push(held);
                    return None;
                }
                held
            }
            Effect::WriteChunk {
                lane,
                version,
                index,
                ..
            } => Input::ChunkWritten {
                lane: *lane,
                version: *version,
                index: *index,
                ok: o != Outcome::FailWrite,
            },
            Effect::Verify { lane, version, .. } => Input::Verified {
                lane: *lane,
                version: *version,
                result: match o {
                    Outcome::FailVerify => Err("model.onnx: sha256 mismatch".into()),
                    _ => Ok(()),
                },
            },
            Effect::Stage { lane, version } => Input::Staged {
                lane: *lane,
                version: *version,
                result: Ok(()),
            },
            Effect::Load { lane, version } => Input::Loaded {
                lane: *lane,
                version: *version,
                result: match o {
                    Outcome::FailHealth => Err("golden sample 0: top-1 1, expected 0".into()),
                    _ => Ok(Arc::new(Fake(self.loads.clone().unwrap_or_else(|| {
                        self.manifests
                            .iter()
                            .find(|m| m.version == *version)
                            .expect("offered")
                            .clone()
                    })))),
                },
            },
            Effect::Activate { version, .. } => Input::Activated { version: *version },
            _ => return None,
        })
    }

    fn desired(&mut self, name: &str, version: u64, shadow: Option<(&str, u64)>) {
        self.desired_signed_by(&key(), name, version, shadow);
    }

    fn desired_signed_by(
        &mut self,
        key: &SigningKey,
        name: &str,
        version: u64,
        shadow: Option<(&str, u64)>,
    ) {
        let target = Target::Device(DEVICE.into());
        self.now.unix_ms += 1;
        let d = Desired {
            target: target.clone(),
            name: name.into(),
            version,
            rollback: false,
            issued: self.now.unix_ms,
            expires: None,
            clear: false,
            rollout: None,
            source: None,
            shadow: shadow.map(|(name, version)| ModelRef {
                name: name.into(),
                version,
            }),
        };
        let payload = serde_json::to_vec(&SignedDesired::new(key, &d)).unwrap();
        self.send(self.topics.desired(&target), payload);
    }

    /// Publishes `name` v`version` (`bytes` long, in 3 chunks) signed by `key`: the offer, then
    /// the chunks (`corrupt`: the chunks' bytes changed after hashing).
    fn publish(&mut self, key: &SigningKey, name: &str, version: u64, bytes: u64, corrupt: bool) {
        let m = manifest(name, version, bytes);
        let text = serde_json::to_string(&m).unwrap();
        let sig = sign(key, PayloadType::Manifest, text.as_bytes());
        let bundle: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
        let chunk = (bytes as usize).div_ceil(3).max(1);
        let mut offer = ArtifactOffer::new(&m, text, sig, &bundle, chunk);
        offer.pieces.clear(); // whole-bundle delivery (pieces: `publish_parts`)
        self.manifests.push(m);
        let payload = serde_json::to_vec(&offer).unwrap();
        self.send(self.topics.artifact_manifest(name, version), payload);
        for (i, c) in bundle.chunks(chunk).enumerate() {
            let mut c = c.to_vec();
            if corrupt {
                c[0] ^= 0xff;
            }
            self.send(self.topics.chunk(name, version, i as u32), c);
        }
    }

    /// Publishes `name` v`version` made of `parts` (model.onnx is their concatenation) in pieces
    /// of at most `chunk` bytes: the offer, then every piece's chunks on its own topics.
    /// `tamper`: the last piece's first chunk changed after hashing.
    fn publish_parts(&mut self, (name, version): (&str, u64), parts: &[&[u8]], tamper: bool) {
        let chunk = 1000;
        let bundle = parts.concat();
        let mut m = manifest(name, version, bundle.len() as u64);
        m.files[0].sha256 = sha256_hex(&bundle);
        m.composition = Some(Composition {
            file: "model.onnx".into(),
            parts: (parts.iter())
                .map(|p| PartEntry {
                    role: "part".into(),
                    sha256: sha256_hex(p),
                    size: p.len() as u64,
                    reads: vec![],
                    after: None,
                })
                .collect(),
        });
        let text = serde_json::to_string(&m).unwrap();
        let sig = sign(&key(), PayloadType::Manifest, text.as_bytes());
        let offer = ArtifactOffer::new(&m, text, sig, &bundle, chunk);
        assert_eq!(offer.pieces.len(), parts.len());
        self.manifests.push(m);
        self.send(
            self.topics.artifact_manifest(name, version),
            serde_json::to_vec(&offer).unwrap(),
        );
        for (k, p) in parts.iter().enumerate() {
            for (i, c) in p.chunks(chunk).enumerate() {
                let topic = self
                    .topics
                    .part_chunk(&sha256_hex(p), chunk as u64, i as u32);
                let mut c = c.to_vec();
                if tamper && k + 1 == parts.len() && i == 0 {
                    c[0] ^= 0xff;
                }
                self.send(topic, c);
            }
        }
    }

    /// The device events published, as (kind, version).
    fn events(&self) -> Vec<(String, u64)> {
        self.published(How::Durable)
            .map(|p| serde_json::from_str::<DeviceEvent>(p).unwrap())
            .map(|e| (e.kind.to_string(), e.version))
            .collect()
    }

    fn published(&self, how: How) -> impl Iterator<Item = &str> {
        self.log.iter().filter_map(move |e| match e {
            Effect::Publish(h, m) if *h == how => Some(m.payload.as_str()),
            _ => None,
        })
    }

    fn replies(&self) -> Vec<InferReply> {
        self.published(How::Reply)
            .map(|p| serde_json::from_str(p).unwrap())
            .collect()
    }

    fn subscribed(&self) -> Vec<&str> {
        self.log
            .iter()
            .filter_map(|e| match e {
                Effect::Subscribe(t) => Some(t.as_str()),
                _ => None,
            })
            .collect()
    }

    fn resubscribed(&self) -> Vec<&str> {
        self.log
            .iter()
            .filter_map(|e| match e {
                Effect::Resubscribe(t) => Some(t.as_str()),
                _ => None,
            })
            .collect()
    }

    fn count(&self, f: impl Fn(&Effect<Fake>) -> bool) -> usize {
        self.log.iter().filter(|e| f(e)).count()
    }

    fn status(&mut self) -> kestrel_shared::protocol::Status {
        self.core.status(None, (0, 0))
    }

    /// A request the active model answered, with `score` as its top-1 score.
    fn answered(&mut self, request: &str, model: &Manifest, score: f32) {
        let top = vec![
            Class {
                class: 0,
                label: "cat".into(),
                score,
            },
            Class {
                class: 1,
                label: "dog".into(),
                score: 1.0 - score,
            },
        ];
        let observed = Observed {
            request: request.into(),
            model: Arc::new(Fake(model.clone())),
            top,
            image: Some(vec![0xff, 0xd8, 0xff]),
            logits: vec![1.0, 0.0],
            features: None,
            latency_ms: 4.0,
        };
        self.input(Input::Answered {
            reply: None,
            observed: Some(observed),
        });
    }
}

#[test]
fn install_goes_from_desired_state_to_active_journaling_before_activating() {
    let mut r = Rig::new(config());
    r.input(Input::Connected);
    r.desired("faces", 1, None);
    assert!(
        r.subscribed()
            .contains(&r.topics.artifact_manifest("faces", 1).as_str())
    );
    r.publish(&key(), "faces", 1, 3000, false);
    assert_eq!(
        r.events(),
        [("downloading".to_string(), 1), ("active".to_string(), 1)]
    );
    assert_eq!(r.core.updater().active, Some(1));
    assert_eq!(r.count(|e| matches!(e, Effect::WriteChunk { .. })), 3);
    // The health-checked model is the one activated (not loaded again), and the journal that
    // says "activating" is written before the switch.
    let at = r
        .log
        .iter()
        .position(|e| matches!(e, Effect::Activate { model: Some(_), .. }))
        .expect("activated with the checked model");
    assert!(matches!(r.log[at - 1], Effect::Journal(Lane::Install)));
    let s = r.status();
    assert_eq!(
        (s.state.as_str(), s.active, s.counters.updates_active),
        ("idle", Some(1), 1)
    );
    // The same offer again changes nothing.
    let before = r.log.len();
    r.publish(&key(), "faces", 1, 3000, false);
    assert_eq!(r.count(|e| matches!(e, Effect::WriteChunk { .. })), 3);
    assert!(
        r.log[before..]
            .iter()
            .all(|e| !matches!(e, Effect::Verify { .. }))
    );
    let installed = r
        .status()
        .manifest_sha256
        .expect("the installed manifest's sha256");
    assert_eq!(
        installed,
        sha256_hex(serde_json::to_string(&r.manifests[0]).unwrap().as_bytes())
    );
    // Another model (another manifest) at the installed version: a conflict, reported, never
    // taken as installed or downloaded.
    r.publish(&key(), "faces", 1, 2000, false);
    assert_eq!(r.events().last().unwrap(), &("refused".to_string(), 1));
    let s = r.status();
    assert!(
        s.refused.as_deref().unwrap().contains("conflict: faces v1"),
        "{s:?}"
    );
    assert_eq!(
        (s.active, s.manifest_sha256.as_deref()),
        (Some(1), Some(installed.as_str()))
    );
    assert_eq!(r.count(|e| matches!(e, Effect::WriteChunk { .. })), 3);
}

#[test]
fn a_failed_health_check_rolls_back_to_the_active_version() {
    let mut r = Rig::new(config());
    r.desired("faces", 1, None);
    r.publish(&key(), "faces", 1, 3000, false);
    r.outcome = Outcome::FailHealth;
    r.desired("faces", 2, None);
    r.publish(&key(), "faces", 2, 3000, false);
    let events = r.events();
    assert_eq!(events.last().unwrap(), &("rolled-back".to_string(), 2));
    assert!(r.log.iter().any(|e| matches!(
        e,
        Effect::Discard {
            lane: Lane::Install,
            version: 2
        }
    )));
    assert_eq!(r.count(|e| matches!(e, Effect::Activate { .. })), 1);
    let s = r.status();
    assert_eq!((s.active, s.failed_version), (Some(1), Some(2)));
    assert!(s.last_error.unwrap().contains("golden sample 0"));
    assert_eq!(s.counters.updates_rolled_back, 1);
}

#[test]
fn unsigned_or_foreign_states_and_offers_are_refused_and_change_nothing() {
    let mut r = Rig::new(config());
    let stranger = SigningKey::from_bytes(&[9; 32]);
    r.desired_signed_by(&stranger, "faces", 1, None);
    assert_eq!(r.events(), [("refused".to_string(), 0)]);
    assert!(r.subscribed().is_empty());
    r.send(r.topics.desired(&Target::Device(DEVICE.into())), vec![]); // an unsigned clear
    assert_eq!(r.events().len(), 2);
    // A trusted state, then an offer signed by a stranger: refused, nothing written.
    r.desired("faces", 1, None);
    r.publish(&stranger, "faces", 1, 3000, false);
    assert_eq!(r.events().last().unwrap().0, "refused");
    assert_eq!(r.count(|e| matches!(e, Effect::WriteOffer { .. })), 0);
    let s = r.status();
    assert!(
        s.refused.as_deref().unwrap().contains("offer refused"),
        "status: {s:?}"
    );
    // Chunks that fail their sha256 (garbage anyone could publish): dropped and asked for
    // again, nothing written, and the version not failed; the good chunks then complete it.
    let before = r.events().len();
    r.publish(&key(), "faces", 1, 3000, true);
    assert_eq!(r.events().len(), before + 1, "{:?}", r.events());
    assert_eq!(r.events().last().unwrap(), &("downloading".to_string(), 1));
    assert_eq!(r.count(|e| matches!(e, Effect::WriteChunk { .. })), 0);
    let s = r.status();
    assert_eq!((s.state.as_str(), s.failed_version), ("downloading", None));
    assert!(s.last_error.unwrap().contains("failed its sha256 check"));
    assert!(r.count(|e| matches!(e, Effect::Resubscribe(t) if t.contains("/chunks/"))) >= 3);
    r.publish(&key(), "faces", 1, 3000, false);
    assert_eq!(r.events().last().unwrap(), &("active".to_string(), 1));
    // Over the artifact limit: rejected before a chunk is fetched, the offer removed.
    let mut cfg = config();
    cfg.limits.max_artifact_bytes = 1000;
    let mut r = Rig::new(cfg);
    r.desired("faces", 1, None);
    r.publish(&key(), "faces", 1, 3000, false);
    assert_eq!(r.events(), [("rejected".to_string(), 1)]);
    assert_eq!(r.count(|e| matches!(e, Effect::RemoveDownload { .. })), 1);
    assert!(!r.subscribed().iter().any(|t| t.contains("/chunks")));
}

#[test]
fn a_failed_verification_rejects_and_a_full_disk_stalls_then_fetches_again() {
    let mut r = Rig::new(config());
    r.outcome = Outcome::FailVerify;
    r.desired("faces", 1, None);
    r.publish(&key(), "faces", 1, 3000, false);
    assert_eq!(r.events().last().unwrap(), &("rejected".to_string(), 1));
    // Chunks not written (the store full) are asked for again once the download stalls.
    let mut r = Rig::new(config());
    r.outcome = Outcome::FailWrite;
    r.desired("faces", 2, None);
    r.publish(&key(), "faces", 2, 3000, false);
    assert_eq!(r.status().progress, Some((0, 3)));
    let asked =
        |r: &Rig| r.count(|e| matches!(e, Effect::Resubscribe(t) if t.ends_with("/chunks/+")));
    r.input(Input::Tick);
    assert_eq!(asked(&r), 1);
    r.now.mono += Duration::from_secs(config().limits.download_stall_s + 1);
    r.input(Input::Tick);
    assert_eq!(asked(&r), 2);
}

#[test]
fn a_shadow_passes_every_check_runs_beside_and_is_never_activated() {
    let mut r = Rig::new(config());
    r.desired("faces", 1, Some(("faces-next", 2)));
    let subscribed = r.subscribed();
    assert!(subscribed.contains(&r.topics.artifact_manifest("faces-next", 2).as_str()));
    r.publish(&key(), "faces", 1, 3000, false);
    r.publish(&key(), "faces-next", 2, 3000, false);
    assert_eq!(r.core.updater().active, Some(1));
    assert_eq!(r.count(|e| matches!(e, Effect::Activate { .. })), 1);
    let ran = r
        .log
        .iter()
        .any(|e| matches!(e, Effect::RunShadow(Some((m, _))) if m.0.version == 2));
    assert!(ran, "the shadow runs");
    // Its files went to the shadow's store, and its steps are not the device's update events.
    assert_eq!(
        r.count(|e| matches!(
            e,
            Effect::WriteChunk {
                lane: Lane::Shadow,
                ..
            }
        )),
        3
    );
    assert!(r.events().iter().all(|(_, v)| *v == 1));
    let shadow = r.status().shadow.unwrap();
    assert_eq!((shadow.state.as_str(), shadow.version), ("running", 2));
    // Its comparisons go into the quality report when it is due.
    let active = r.manifests[0].clone();
    r.answered("r1", &active, 0.9);
    let run = ShadowRun {
        active: (vec![1.0, 0.0], 4.0),
        shadow: (vec![1.0, 0.0], 5.0),
    };
    r.input(Input::ShadowRan {
        version: 2,
        run: Some(run),
    });
    r.now.mono += Duration::from_secs(config().quality.period_s + 1);
    r.input(Input::Tick);
    let q = r.published(How::Latest).last().unwrap().to_string();
    let q: kestrel_shared::quality::DeviceQuality = serde_json::from_str(&q).unwrap();
    assert_eq!(q.shadow.expect("a shadow report").compared, 1);
    // No longer named: stopped, its files discarded.
    r.desired("faces", 1, None);
    assert!(matches!(
        r.log
            .iter()
            .rev()
            .find(|e| matches!(e, Effect::RunShadow(_))),
        Some(Effect::RunShadow(None))
    ));
    assert!(r.status().shadow.is_none());
}

#[test]
fn a_shadow_of_another_name_fails_its_health_check_and_the_active_model_stays() {
    let mut r = Rig::new(config());
    r.desired("faces", 1, Some(("faces-next", 2)));
    r.publish(&key(), "faces", 1, 3000, false);
    r.loads = Some(manifest("other", 2, 3000));
    r.publish(&key(), "faces-next", 2, 3000, false);
    let shadow = r.status().shadow.unwrap();
    assert_eq!(shadow.state, ShadowState::Failed);
    assert!(shadow.error.unwrap().contains("the model is other"));
    assert!(
        !r.log
            .iter()
            .any(|e| matches!(e, Effect::RunShadow(Some(_))))
    );
    assert_eq!(r.core.updater().active, Some(1));
}

#[test]
fn a_shadow_needs_quality_telemetry() {
    let mut cfg = config();
    cfg.quality.enabled = false;
    let mut r = Rig::new(cfg);
    r.desired("faces", 1, Some(("faces-next", 2)));
    assert!(!r.subscribed().iter().any(|t| t.contains("faces-next")));
    let shadow = r.status().shadow.unwrap();
    assert_eq!(shadow.state, ShadowState::Failed);
    assert!(shadow.error.unwrap().contains("quality telemetry"));
}

#[test]
fn capture_keeps_what_the_policy_picks_within_the_hourly_limit() {
    let mut cfg = config();
    cfg.capture.enabled = true;
    cfg.capture.policy = CapturePolicy::LowConfidence;
    cfg.capture.max_per_hour = 1;
    let mut r = Rig::new(cfg);
    let m = manifest("faces", 1, 3000);
    r.answered("sure", &m, 0.95); // confident: not kept
    assert_eq!(r.count(|e| matches!(e, Effect::Capture { .. })), 0);
    r.answered("unsure", &m, 0.4);
    let captured: Vec<_> = r
        .log
        .iter()
        .filter_map(|e| match e {
            Effect::Capture { id, message, .. } => Some((id.clone(), message.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(captured.len(), 1);
    let (id, message) = &captured[0];
    assert_eq!(message.topic, r.topics.capture(DEVICE, id));
    let c: kestrel_shared::capture::Capture = serde_json::from_str(&message.payload).unwrap();
    assert_eq!(
        (c.request.as_str(), c.reason.as_str(), c.version),
        ("unsure", "low-confidence", 1)
    );
    // The state is saved before the capture is queued (a crash in between never exceeds the limit).
    let saved = r
        .log
        .iter()
        .position(|e| matches!(e, Effect::SaveCaptureState(_)));
    let queued = r
        .log
        .iter()
        .position(|e| matches!(e, Effect::Capture { .. }));
    assert!(saved < queued);
    r.answered("unsure-again", &m, 0.4); // over the hourly limit
    assert_eq!(r.count(|e| matches!(e, Effect::Capture { .. })), 1);
    r.input(Input::CaptureDelivered {
        id: id.clone(),
        bytes: 100,
        first: true,
    });
    let stats = r.status().captures.unwrap();
    assert_eq!((stats.taken, stats.rate_limited, stats.sent), (1, 1, 1));
    assert_eq!(r.status().counters.requests_answered, 3);
}

#[test]
fn a_capture_over_the_packet_limit_is_dropped_and_counted() {
    let mut cfg = config();
    cfg.capture.enabled = true;
    cfg.capture.policy = CapturePolicy::Random;
    cfg.capture.rate = 1.0;
    cfg.broker.max_packet_bytes = 100;
    let mut r = Rig::new(cfg);
    r.answered("big", &manifest("faces", 1, 3000), 0.9);
    assert_eq!(r.count(|e| matches!(e, Effect::Capture { .. })), 0);
    assert_eq!(r.status().captures.unwrap().evicted, 1);
}

#[test]
fn requests_are_queued_or_refused_with_a_reason() {
    let mut cfg = config();
    cfg.limits.max_image_bytes = 10;
    let mut r = Rig::new(cfg);
    let infer = |r: &Rig, id: &str| r.topics.infer(DEVICE, id);
    r.send(infer(&r, "a"), vec![1; 5]);
    assert!(matches!(
        r.log.last(),
        Some(Effect::Infer { request, bytes }) if request == "a" && bytes.len() == 5
    ));
    r.send(infer(&r, "big"), vec![1; 11]);
    // A full queue: busy.
    r.input(Input::NotQueued {
        request: "b".into(),
        busy: true,
    });
    // Another device's requests are not ours.
    r.send(
        format!("{}/devices/dev-2/infer/c", r.topics.prefix()),
        vec![1; 5],
    );
    let replies = r.replies();
    let errors: Vec<_> = replies
        .iter()
        .map(|x| (x.request.as_str(), x.error.clone().unwrap_or_default()))
        .collect();
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert_eq!(errors[0].0, "big");
    assert!(errors[0].1.contains("11 bytes is over the limit of 10"));
    assert_eq!(errors[1].0, "b");
    assert!(errors[1].1.starts_with("busy: 16 requests queued"));
    assert_eq!(r.count(|e| matches!(e, Effect::Infer { .. })), 1);
    assert_eq!(r.status().counters.requests_refused, 2);
}

/// A key list signed by `root` naming `key()`, expiring at `expires` (Unix seconds).
fn key_list(root: &SigningKey, version: u64, expires: u64) -> Vec<u8> {
    let list = kestrel_shared::protocol::KeyList {
        version,
        keys: vec![hex::encode(key().verifying_key().as_bytes())],
        issued: 1,
        expires: Some(expires),
    };
    serde_json::to_vec(&kestrel_shared::protocol::SignedKeyList::new(root, &list)).unwrap()
}

/// Key lists expire: a fresh one is in force, an expired one is refused naming its topic and
/// expiry, and once the list held expires its keys sign nothing any more (reported in the
/// status and as an event, the list asked for again) until a newer list arrives.
#[test]
fn an_expired_key_list_is_refused_and_one_that_expires_while_held_drops_its_keys() {
    let mut r = Rig::new(config());
    let root = SigningKey::from_bytes(&[11; 32]);
    r.core.trust =
        crate::core::trust::Trust::new(Some(root.verifying_key()), vec![], None).unwrap();
    let (topic, now_s) = (r.topics.keys(), r.now.unix_ms / 1000);
    r.send(topic.clone(), key_list(&root, 1, now_s));
    let s = r.status();
    let refused = s.refused.unwrap_or_default();
    assert!(
        refused.starts_with(&format!("{topic}: key list v1 refused: it expired at")),
        "{refused}"
    );
    r.send(topic.clone(), key_list(&root, 1, now_s + 60));
    assert_eq!(r.status().keys_version, Some(1));
    r.desired("faces", 1, None);
    assert!(
        r.subscribed()
            .iter()
            .any(|t| t.contains("faces/1/manifest"))
    );

    r.now.unix_ms += 60_000;
    let (events, asked) = (r.events().len(), r.resubscribed().len());
    r.input(Input::Tick);
    assert_eq!(r.events().len(), events + 1, "one refused event");
    assert_eq!(
        r.resubscribed()[asked..],
        [topic.as_str()],
        "asked for again (a new subscription: rumqttd resends retained messages on no other)"
    );
    let s = r.status();
    assert_eq!(s.keys_version, None);
    assert!(s.refused.unwrap().contains("key list v1 expired at"));
    r.desired("faces", 2, None);
    let refused = r.status().refused.unwrap();
    assert!(
        refused.contains("desired state refused") && refused.contains("expired"),
        "{refused}"
    );
    let asked = r.resubscribed().len();
    r.send(topic, key_list(&root, 2, now_s + 3600));
    assert_eq!(r.status().keys_version, Some(2));
    // The desired states and the pursued offer refused meanwhile are asked for again.
    let own = r.topics.desired(&Target::Device(DEVICE.into()));
    let again = &r.resubscribed()[asked..];
    assert!(again.contains(&own.as_str()), "{again:?}");
    assert!(again.iter().any(|t| t.ends_with("/manifest")), "{again:?}");
}

/// A config that captures every request, kept until acknowledged, with resends after 10 s
/// (doubling up to 40 s), at most `max_resends`.
fn acking(max_resends: u32) -> Config {
    let mut cfg = config();
    cfg.capture.enabled = true;
    cfg.capture.policy = CapturePolicy::Random;
    cfg.capture.rate = 1.0;
    cfg.capture.resend_after_s = 10;
    cfg.capture.resend_max_s = 40;
    cfg.capture.max_resends = max_resends;
    cfg
}

impl Rig {
    /// One request captured; its id.
    fn capture(&mut self, request: &str) -> String {
        self.answered(request, &manifest("faces", 1, 3000), 0.9);
        self.log
            .iter()
            .rev()
            .find_map(|e| match e {
                Effect::Capture { id, .. } => Some(id.clone()),
                _ => None,
            })
            .expect("captured")
    }

    fn delivered(&mut self, id: &str, first: bool) {
        self.input(Input::CaptureDelivered {
            id: id.into(),
            bytes: 1000,
            first,
        });
    }

    /// The clock moves `s` seconds and ticks; the ids sent again and forgotten on that tick.
    fn tick_after(&mut self, s: u64) -> (Vec<String>, Vec<String>) {
        self.now.unix_ms += s * 1000;
        self.now.mono += Duration::from_secs(s);
        let before = self.log.len();
        self.input(Input::Tick);
        self.capture_effects(before)
    }

    /// (resent, forgotten) among the effects from `from` on.
    fn capture_effects(&self, from: usize) -> (Vec<String>, Vec<String>) {
        let (mut resent, mut forgot) = (vec![], vec![]);
        for e in &self.log[from..] {
            match e {
                Effect::ResendCapture { id } => resent.push(id.clone()),
                Effect::ForgetCapture { id } => forgot.push(id.clone()),
                _ => {}
            }
        }
        (resent, forgot)
    }

    fn ack(&mut self, device: &str, payload: &[u8]) -> Vec<String> {
        let before = self.log.len();
        self.send(self.topics.capture_ack(device), payload.to_vec());
        self.capture_effects(before).1
    }
}

#[test]
fn a_capture_stays_until_a_collector_acknowledges_it_and_is_sent_again_meanwhile() {
    let mut r = Rig::new(acking(10));
    r.input(Input::Connected);
    assert!(
        r.subscribed()
            .contains(&r.topics.capture_ack(DEVICE).as_str())
    );
    let id = r.capture("a");
    r.delivered(&id, true); // the broker has it: that is not enough
    let st = r.status().captures.unwrap();
    assert_eq!(
        (st.sent, st.awaiting_ack, st.awaiting_ack_bytes),
        (1, 1, 1000)
    );
    assert_eq!(r.count(|e| matches!(e, Effect::ForgetCapture { .. })), 0);
    assert_eq!(r.tick_after(9), (vec![], vec![]), "not yet due");
    assert_eq!(
        r.tick_after(1),
        (vec![id.clone()], vec![]),
        "sent again after 10 s"
    );
    assert_eq!(
        r.tick_after(30),
        (vec![], vec![]),
        "one resend on its way at a time"
    );
    r.delivered(&id, false);
    // The wait doubled (20 s from the resend, 30 s of which have passed): due at once.
    assert_eq!(r.tick_after(0), (vec![id.clone()], vec![]));
    r.delivered(&id, false);
    // Another device's acknowledgement topic, garbage, and ids we do not hold change nothing.
    let ack = |ids: &[&str]| serde_json::to_vec(&serde_json::json!({"ids": ids})).unwrap();
    assert!(r.ack("dev-2", &ack(&[&id])).is_empty());
    assert!(r.ack(DEVICE, b"not json").is_empty());
    assert!(r.ack(DEVICE, &ack(&["1-000009"])).is_empty());
    assert_eq!(r.status().captures.unwrap().awaiting_ack, 1);
    // Our collector's: deleted, counted, never sent again.
    assert_eq!(r.ack(DEVICE, &ack(&[&id])), vec![id.clone()]);
    let st = r.status().captures.unwrap();
    assert_eq!(
        (st.acked, st.resent, st.awaiting_ack, st.unacked_dropped),
        (1, 2, 0, 0)
    );
    assert_eq!(r.tick_after(3600), (vec![], vec![]));
    assert!(r.ack(DEVICE, &ack(&[&id])).is_empty(), "acknowledged twice");
}

#[test]
fn resends_are_bounded_and_their_wait_capped() {
    let mut r = Rig::new(acking(2));
    let id = r.capture("a");
    r.delivered(&id, true);
    assert_eq!(r.tick_after(10).0, vec![id.clone()]);
    r.delivered(&id, false);
    assert_eq!(r.tick_after(19).0, Vec::<String>::new());
    assert_eq!(
        r.tick_after(1).0,
        vec![id.clone()],
        "20 s after the first resend"
    );
    r.delivered(&id, false);
    assert_eq!(r.tick_after(39), (vec![], vec![]), "40 s: the cap");
    // The third wait is over and max_resends (2) were sent: given up and deleted.
    assert_eq!(r.tick_after(1), (vec![], vec![id.clone()]));
    let st = r.status().captures.unwrap();
    assert_eq!((st.resent, st.unacked_dropped, st.awaiting_ack), (2, 1, 0));
    assert_eq!(r.tick_after(3600), (vec![], vec![]));
}

#[test]
fn without_collector_acks_a_capture_is_deleted_once_the_broker_has_it() {
    let mut cfg = acking(10);
    cfg.capture.collector_acks = false;
    let mut r = Rig::new(cfg);
    r.input(Input::Connected);
    assert!(!r.subscribed().iter().any(|t| t.ends_with("capture-ack")));
    let id = r.capture("a");
    let before = r.log.len();
    r.delivered(&id, true);
    assert_eq!(r.capture_effects(before).1, vec![id]);
    let st = r.status().captures.unwrap();
    assert_eq!((st.sent, st.awaiting_ack), (1, 0));
    assert_eq!(r.tick_after(3600), (vec![], vec![]));
}

#[test]
fn the_disk_budget_gives_up_the_oldest_unacknowledged_capture_first() {
    let mut cfg = acking(10);
    cfg.capture.max_disk_bytes = 2200;
    let mut r = Rig::new(cfg);
    let (a, b) = (r.capture("a"), r.capture("b"));
    r.delivered(&a, true);
    r.delivered(&b, true); // 2000 of 2200 bytes wait for an acknowledgement
    let before = r.log.len();
    let c = r.capture("c");
    assert_eq!(
        r.capture_effects(before).1,
        vec![a.clone()],
        "the oldest goes"
    );
    let budget = r.log[before..].iter().find_map(|e| match e {
        Effect::Capture { max_disk_bytes, .. } => Some(*max_disk_bytes),
        _ => None,
    });
    assert_eq!(budget, Some(1200), "what the waiting one leaves the queue");
    let st = r.status().captures.unwrap();
    assert_eq!((st.unacked_dropped, st.awaiting_ack), (1, 1));
    // A resend whose file is gone is forgotten.
    assert_eq!(r.tick_after(10).0, vec![b.clone()]);
    r.input(Input::CaptureGone { id: b });
    let st = r.status().captures.unwrap();
    assert_eq!((st.unacked_dropped, st.awaiting_ack), (2, 0));
    r.delivered(&c, true);
    assert_eq!(r.tick_after(10).0, vec![c], "the next resend may go");
}

#[test]
fn an_offer_in_pieces_fetches_only_the_pieces_the_store_lacks() {
    let mut r = Rig::new(config());
    r.input(Input::Connected);
    let backbone: Vec<u8> = (0..5000).map(|i| (i * 7) as u8).collect();
    let (head1, head2) = (vec![1u8; 300], vec![2u8; 300]);
    r.desired("faces", 1, None);
    r.publish_parts(("faces", 1), &[&backbone, &head1], false);
    assert_eq!(r.core.updater().active, Some(1));
    assert_eq!(r.count(|e| matches!(e, Effect::WriteChunk { .. })), 6);
    let c = r.status().counters;
    assert_eq!((c.bytes_fetched, c.bytes_reused), (5300, 0));

    // v2: the same backbone, a new head. Only the head's topic is asked for; the backbone's
    // chunks, delivered anyway (retained), are not taken.
    r.log.clear();
    r.desired("faces", 2, None);
    r.publish_parts(("faces", 2), &[&backbone, &head2], false);
    assert_eq!(r.core.updater().active, Some(2));
    let asked: Vec<&str> = (r.log.iter())
        .filter_map(|e| match e {
            Effect::Resubscribe(t) => Some(t.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(
        asked,
        [r.topics.part_chunks_filter(&sha256_hex(&head2), 1000)]
    );
    assert_eq!(r.count(|e| matches!(e, Effect::WriteChunk { .. })), 1);
    let c = r.status().counters;
    assert_eq!((c.bytes_fetched, c.bytes_reused), (5600, 5000));

    // v2's head found damaged in the store at load: v2 is installed again from its offer,
    // fetching only that piece.
    r.parts.retain(|p| *p != sha256_hex(&head2));
    r.log.clear();
    r.input(Input::ActiveLoadFailed {
        version: 2,
        reason: "part 2 (head): its 300 bytes are not the part".into(),
    });
    let offer_topic = r.topics.artifact_manifest("faces", 2);
    assert_eq!(
        r.count(|e| matches!(e, Effect::Resubscribe(t) if *t == offer_topic)),
        1
    );
    assert_eq!(r.core.updater().active, None);
    r.publish_parts(("faces", 2), &[&backbone, &head2], false);
    assert_eq!(r.core.updater().active, Some(2));
    assert_eq!(r.core.updater().previous, Some(1));
    let c = r.status().counters;
    assert_eq!((c.bytes_fetched, c.bytes_reused), (5900, 10000));

    // v3: its head's chunk tampered with on its topic: dropped, counted, asked for again;
    // the genuine chunk then completes it.
    r.log.clear();
    let head3 = vec![3u8; 300];
    r.desired("faces", 3, None);
    r.publish_parts(("faces", 3), &[&backbone, &head3], true);
    assert_eq!(r.core.updater().active, Some(2), "v3's head is not in");
    assert_eq!(r.status().counters.chunks_corrupt, 1);
    // Asked for when offered, and again after the corrupt delivery (a one-chunk piece: its
    // topic filter).
    let filter = r.topics.part_chunks_filter(&sha256_hex(&head3), 1000);
    assert_eq!(
        r.count(|e| matches!(e, Effect::Resubscribe(t) if *t == filter)),
        2
    );
    let topic = r.topics.part_chunk(&sha256_hex(&head3), 1000, 0);
    r.send(topic, head3.clone());
    assert_eq!(r.core.updater().active, Some(3));
    assert_eq!(r.status().counters.bytes_fetched, 6200);
}

#[test]
fn a_parts_check_whose_desired_state_moved_back_starts_nothing() {
    let mut r = Rig::new(config());
    r.input(Input::Connected);
    let backbone: Vec<u8> = (0..3000).map(|i| (i * 3) as u8).collect();
    r.desired("faces", 1, None);
    r.publish_parts(("faces", 1), &[&backbone, &[1u8; 100]], false);
    assert_eq!(r.core.updater().active, Some(1));
    // v2 offered; while its parts are checked, the desired state goes back to v1.
    r.defer_checks = true;
    r.desired("faces", 2, None);
    r.publish_parts(("faces", 2), &[&backbone, &[2u8; 100]], false);
    assert_eq!(r.checks.len(), 1, "one check pending");
    r.desired("faces", 1, None);
    r.log.clear();
    let check = r.checks.pop().unwrap();
    r.input(check);
    assert_eq!(r.core.updater().phase, Phase::Idle);
    assert_eq!(r.core.updater().active, Some(1));
    assert_eq!(
        r.count(|e| matches!(e, Effect::Resubscribe(_))),
        0,
        "nothing fetched"
    );
    assert_eq!(
        r.count(|e| matches!(e, Effect::RemoveDownload { version: 2, .. })),
        1,
        "v2's journaled offer removed"
    );
}

/// A new session subscribes to everything the state calls for again, the download in progress
/// included, says it is online (retained), and publishes the status last.
#[test]
fn a_new_session_subscribes_again_to_the_download_in_progress_and_republishes_online() {
    let mut r = Rig::new(config());
    r.outcome = Outcome::FailWrite; // chunks never land: the download stays in progress
    r.desired("faces", 1, None);
    r.publish(&key(), "faces", 1, 3000, false);
    assert_eq!(r.status().state, DeviceState::Downloading);
    r.log.clear();
    r.input(Input::Connected);
    let subs = r.subscribed();
    for t in [
        r.topics.desired(&Target::Device(DEVICE.into())),
        r.topics.infer_filter(DEVICE),
        r.topics.artifact_manifest("faces", 1),
        r.topics.chunks_filter("faces", 1),
    ] {
        assert!(subs.contains(&t.as_str()), "{t} not in {subs:?}");
    }
    let online = r.topics.online(DEVICE);
    assert!(r.log.iter().any(|e| matches!(
        e,
        Effect::Publish(How::Latest, m) if m.topic == online && m.retain && m.payload == "1"
    )));
    assert!(
        matches!(r.log.last(), Some(Effect::Status)),
        "the status goes last"
    );
}

#[test]
fn with_a_root_key_the_key_list_is_subscribed_before_any_desired_state() {
    let mut r = Rig::new(config());
    let root = SigningKey::from_bytes(&[11; 32]);
    r.core.trust = crate::core::trust::Trust::new(
        Some(root.verifying_key()),
        vec![key().verifying_key()],
        None,
    )
    .unwrap();
    r.input(Input::Connected);
    let subs = r.subscribed();
    assert_eq!(subs[0], r.topics.keys().as_str());
    assert_eq!(
        subs[1],
        r.topics.desired(&Target::Device(DEVICE.into())).as_str()
    );
}

#[test]
fn a_damaged_active_model_asks_for_its_offer_now_and_on_the_next_session_only() {
    let mut r = Rig::new(config());
    r.desired("faces", 1, None);
    r.publish(&key(), "faces", 1, 3000, false);
    assert_eq!(r.core.updater().active, Some(1));
    let offer = r.topics.artifact_manifest("faces", 1);
    r.log.clear();
    r.input(Input::ActiveLoadFailed {
        version: 1,
        reason: "model.onnx: truncated".into(),
    });
    assert_eq!(r.resubscribed(), [offer.as_str()], "at once");
    assert_eq!(r.core.updater().active, None);
    r.input(Input::Connected);
    assert_eq!(
        r.resubscribed(),
        [offer.as_str(), offer.as_str()],
        "once connected"
    );
    r.input(Input::Connected);
    assert_eq!(r.resubscribed().len(), 2, "not on every later session");
}

/// The shadow runs on every `shadow_every`-th request, and only its own comparisons count: a
/// turn it skipped is counted as skipped, a result for another shadow version is ignored.
#[test]
fn the_shadow_runs_every_kth_request_and_counts_only_its_own_comparisons() {
    let mut cfg = config();
    cfg.quality.shadow_every = 5;
    let mut r = Rig::new(cfg);
    r.desired("faces", 1, Some(("faces-next", 2)));
    r.publish(&key(), "faces", 1, 3000, false);
    r.publish(&key(), "faces-next", 2, 3000, false);
    let runs = r.log.iter().find_map(|e| match e {
        Effect::RunShadow(Some((m, every))) => Some((m.0.version, *every)),
        _ => None,
    });
    assert_eq!(runs, Some((2, 5)));
    let active = r.manifests[0].clone();
    r.answered("r1", &active, 0.9);
    let run = || ShadowRun {
        active: (vec![1.0, 0.0], 4.0),
        shadow: (vec![0.0, 1.0], 5.0),
    };
    r.input(Input::ShadowRan {
        version: 3,
        run: Some(run()),
    }); // not this shadow's
    r.input(Input::ShadowRan {
        version: 2,
        run: None,
    }); // not its turn
    r.input(Input::ShadowRan {
        version: 2,
        run: Some(run()),
    });
    r.now.mono += Duration::from_secs(config().quality.period_s + 1);
    r.input(Input::Tick);
    let q = r.published(How::Latest).last().unwrap().to_string();
    let q: kestrel_shared::quality::DeviceQuality = serde_json::from_str(&q).unwrap();
    let s = q.shadow.expect("a shadow report");
    assert_eq!((s.version, s.compared, s.skipped), (2, 1, 1));
    assert_eq!(s.agreement, 0.0, "the one comparison disagreed");
}

#[test]
fn a_desired_state_naming_its_own_model_as_shadow_runs_no_shadow() {
    let mut r = Rig::new(config());
    r.desired("faces", 1, Some(("faces", 1)));
    assert!(r.status().shadow.is_none());
    assert_eq!(
        r.subscribed(),
        [r.topics.artifact_manifest("faces", 1).as_str()],
        "the offer once, for the install lane"
    );
    r.publish(&key(), "faces", 1, 3000, false);
    assert_eq!(r.core.updater().active, Some(1));
    let shadow_work = r.count(|e| {
        matches!(
            e,
            Effect::WriteChunk {
                lane: Lane::Shadow,
                ..
            } | Effect::RunShadow(Some(_))
        )
    });
    assert_eq!(shadow_work, 0);
}

#[test]
fn a_replayed_desired_state_is_refused_with_an_event_and_the_newer_one_stays_pursued() {
    let mut r = Rig::new(config());
    let target = Target::Device(DEVICE.into());
    let old = Desired {
        target: target.clone(),
        name: "faces".into(),
        version: 1,
        rollback: false,
        issued: r.now.unix_ms,
        expires: None,
        clear: false,
        rollout: None,
        source: None,
        shadow: None,
    };
    let old = serde_json::to_vec(&SignedDesired::new(&key(), &old)).unwrap();
    r.send(r.topics.desired(&target), old.clone());
    r.desired("faces", 2, None); // issued 1 ms later
    r.log.clear();
    r.send(r.topics.desired(&target), old);
    assert_eq!(r.events(), [("refused".to_string(), 1)]);
    assert!(r.status().refused.unwrap().contains("replayed"));
    assert_eq!(r.core.pursued.as_ref().map(|p| p.version), Some(2));
    let resubscribed = r.count(|e| matches!(e, Effect::Subscribe(_) | Effect::Unsubscribe(_)));
    assert_eq!(resubscribed, 0, "nothing is fetched for the replay");
}

#[test]
fn the_shadow_samples_every_nth_request_and_never_delays_a_waiting_one() {
    let runs = |every, waiting| -> Vec<u64> {
        (0..10)
            .filter(|&t| super::shadow_runs_on(t, every, waiting))
            .collect()
    };
    assert_eq!(runs(3, 0), [0, 3, 6, 9]);
    assert_eq!(runs(1, 0), (0..10).collect::<Vec<_>>());
    assert!(
        runs(1, 1).is_empty(),
        "a request waits: the shadow skips its turn"
    );
    assert!(
        runs(0, 0).is_empty(),
        "an every of 0 (refused by the config) runs nothing"
    );
}
