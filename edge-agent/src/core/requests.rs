//! Inference requests and what they leave behind: admission (size, a full queue), replies,
//! counters and latencies; quality telemetry over the requests the active model answered (a
//! window judged against the reference profile in its signed manifest, published retained on
//! `P/devices/<id>/quality` every `[quality] period_s` while requests come in, with the shadow
//! model's comparison); and input capture (`[capture]`: the requests the policy picks keep their
//! image, queued for upload within the hourly limit and the disk budget).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kestrel_shared::capture::{Capture, CaptureStats};
use kestrel_shared::protocol::{DeviceCounters, InferReply, LatencyHistogram, LatencyStats};
use kestrel_shared::quality::{DeviceQuality, QualityWindow};
use kestrel_shared::stats::quantile;

use super::{Core, Effect, How, Model, Now, Observed};
use crate::core::Message;
use crate::core::capture::{CaptureState, Capturer};
use crate::core::settings::Config;

/// Recent latencies the status's percentiles are taken over.
const LATENCIES: usize = 1000;

pub(super) struct Requests<M> {
    pub(super) counters: DeviceCounters,
    latencies: VecDeque<f64>,
    /// Every answered request's latency since the process started.
    histogram: LatencyHistogram,
    /// The window of the model that answered last.
    quality: Option<Telemetry<M>>,
    last_quality: Instant,
    /// `[capture]`'s decisions, when it is on.
    pub(super) capturer: Option<Capturer>,
}

/// The quality window of one active model.
struct Telemetry<M> {
    model: Arc<M>,
    /// None when the model cannot be judged; `note` says why.
    window: Option<QualityWindow>,
    note: Option<String>,
    /// Requests came in since the last report.
    dirty: bool,
}

impl<M: Model> Requests<M> {
    pub(super) fn new(cfg: &Config, capture: Option<(CaptureState, u64)>, now: Now) -> Self {
        Self {
            counters: DeviceCounters::default(),
            latencies: VecDeque::new(),
            histogram: LatencyHistogram::default(),
            quality: None,
            last_quality: now.mono,
            capturer: capture
                .filter(|_| cfg.capture.enabled)
                .map(|(state, seed)| Capturer::new(cfg.capture.clone(), state, seed)),
        }
    }

    pub(super) fn latency(&self) -> LatencyStats {
        let mut sorted: Vec<f64> = self.latencies.iter().copied().collect();
        sorted.sort_by(f64::total_cmp);
        let mean = match sorted.len() {
            0 => 0.0,
            n => sorted.iter().sum::<f64>() / n as f64,
        };
        LatencyStats {
            count: self.counters.requests_answered,
            mean_ms: mean,
            p50_ms: quantile(&sorted, 0.5),
            p95_ms: quantile(&sorted, 0.95),
            histogram: self.histogram.clone(),
        }
    }

    /// The capture counters, with the queue's (messages, bytes) and those waiting for a
    /// collector's acknowledgement.
    pub(super) fn capture_stats(&self, (queued, queued_bytes): (u64, u64)) -> Option<CaptureStats> {
        self.capturer.as_ref().map(|c| {
            let (awaiting_ack, awaiting_ack_bytes) = c.state.unacked_totals();
            CaptureStats {
                queued,
                queued_bytes,
                awaiting_ack,
                awaiting_ack_bytes,
                ..c.state.stats.clone()
            }
        })
    }

    pub(super) fn may_send_capture(&mut self, bytes: usize, now_ms: u64) -> bool {
        self.capturer
            .as_mut()
            .is_some_and(|c| c.may_send(bytes, now_ms))
    }

    /// A fresh window for `model`.
    fn telemetry(model: Arc<M>, size: usize) -> Telemetry<M> {
        let m = model.manifest();
        let (window, note) = match &m.reference {
            Some(r) => (Some(QualityWindow::new(r.clone(), size)), None),
            None => (
                None,
                Some(format!(
                    "{} v{} has no quality reference in its manifest (exported without one)",
                    m.name, m.version
                )),
            ),
        };
        Telemetry {
            model,
            window,
            note,
            dirty: false,
        }
    }
}

pub(super) fn capture_state_bytes(c: &Capturer) -> Vec<u8> {
    serde_json::to_vec(&c.state).expect("serializable")
}

impl<M: Model> Core<M> {
    /// A request on `P/devices/<id>/infer/<request>`: queued for the workers, or refused.
    pub(super) fn on_infer(&mut self, topic: &str, request: &str, payload: Vec<u8>) {
        let max = self.cfg.limits.max_image_bytes;
        if payload.len() > max {
            let why = format!(
                "{topic}: image of {} bytes is over the limit of {max}",
                payload.len()
            );
            return self.refuse(request.to_string(), why);
        }
        self.out.push(Effect::Infer {
            request: request.to_string(),
            bytes: payload,
        });
    }

    /// The queue did not take `request`.
    pub(super) fn not_queued(&mut self, request: String, busy: bool) {
        let why = match busy {
            true => format!(
                "busy: {} requests queued, try again later",
                self.cfg.limits.queue
            ),
            false => "inference worker stopped".into(),
        };
        self.refuse(request, why);
    }

    fn refuse(&mut self, request: String, error: String) {
        self.requests.counters.requests_refused += 1;
        self.status_dirty = true;
        self.reply(InferReply {
            request,
            device: self.cfg.device_id.clone(),
            prediction: None,
            error: Some(error),
        });
    }

    fn reply(&mut self, reply: InferReply) {
        let topic = self.topics.result(&self.cfg.device_id, &reply.request);
        self.publish(
            How::Reply,
            topic,
            serde_json::to_string(&reply).expect("serializable"),
        );
    }

    /// A request answered (or failed): the reply goes out, what the active model did is counted.
    pub(super) fn answered(&mut self, reply: Option<InferReply>, observed: Option<Observed<M>>) {
        match observed {
            Some(o) => self.observed(o),
            None => {
                self.requests.counters.requests_failed += 1;
                self.status_dirty = true;
            }
        }
        if let Some(reply) = reply {
            self.reply(reply);
        }
    }

    /// A request the active model answered: capture, latency statistics, the quality window.
    fn observed(&mut self, mut o: Observed<M>) {
        self.maybe_capture(&mut o);
        let r = &mut self.requests;
        r.counters.requests_answered += 1;
        r.histogram.observe(o.latency_ms / 1000.0);
        r.latencies.push_back(o.latency_ms);
        if r.latencies.len() > LATENCIES {
            r.latencies.pop_front();
        }
        self.status_dirty = true;
        if !self.cfg.quality.enabled {
            return;
        }
        let version = o.model.manifest().version;
        if self.install.updater.active != Some(version) {
            return; // answered by a model swapped out meanwhile
        }
        let same = r.quality.as_ref().map(|t| t.model.manifest().version) == Some(version);
        if !same {
            let size = self.cfg.quality.window;
            r.quality = Some(Requests::telemetry(o.model.clone(), size));
        }
        let t = r.quality.as_mut().expect("just set");
        t.dirty = true;
        let Some(w) = t.window.as_mut() else { return };
        match &o.features {
            Some(f) if f.len() == w.reference().features.dim => {
                w.push(&o.logits, f, o.latency_ms);
            }
            _ => {
                t.note = Some(format!(
                    "the graph's second output is not {} pooled features",
                    w.reference().features.dim
                ));
                t.window = None;
            }
        }
    }

    /// Keeps the request's image when the policy picks it and the hourly limit allows.
    fn maybe_capture(&mut self, o: &mut Observed<M>) {
        let drifting = self
            .requests
            .quality
            .as_ref()
            .and_then(|t| t.window.as_ref())
            .is_some_and(|w| w.drifting());
        let Some(c) = self.requests.capturer.as_mut() else {
            return;
        };
        let (Some(bytes), Some(reason)) = (o.image.take(), c.reason(&o.top, drifting)) else {
            return;
        };
        let admitted = c.admit(self.now.unix_ms);
        // Saved before the capture is stored: a crash in between costs a slot, never exceeds
        // the limit.
        self.out
            .push(Effect::SaveCaptureState(capture_state_bytes(c)));
        self.status_dirty = true;
        let Some(id) = admitted else { return };
        let m = o.model.manifest();
        let capture = Capture {
            id: id.clone(),
            device: self.cfg.device_id.clone(),
            request: o.request.clone(),
            model: m.name.clone(),
            version: m.version,
            top: o.top.clone(),
            reason,
            captured_at: self.now.rfc3339(),
            content: Capture::encode_content(&bytes),
        };
        let topic = self.topics.capture(&self.cfg.device_id, &id);
        let payload = serde_json::to_string(&capture).expect("serializable");
        let max = self.cfg.broker.max_packet_bytes;
        let broker_max = kestrel_shared::mqtt::MAX_PAYLOAD_BYTES;
        if payload.len() + topic.len() + 16 > max || payload.len() > broker_max {
            let why = format!(
                "{topic}: {} bytes are over the broker's packet limit of {max} or its payload \
                 limit of {broker_max}",
                payload.len()
            );
            return self.capture_queued(&id, Err(why));
        }
        let message = Message {
            topic,
            retain: false,
            payload,
        };
        // The budget holds the captures waiting for a collector's acknowledgement too: the
        // oldest of those go first.
        let size = serde_json::to_vec(&message).map_or(0, |b| b.len() as u64);
        let (dropped, max_disk_bytes) = c.make_room(size);
        self.out
            .extend(dropped.into_iter().map(|id| Effect::ForgetCapture { id }));
        self.out.push(Effect::Capture {
            id,
            message,
            max_disk_bytes,
        });
    }

    /// A capture stored (evicting `dropped` older ones), or dropped.
    pub(super) fn capture_queued(&mut self, id: &str, result: Result<u64, String>) {
        let device = self.cfg.device_id.clone();
        let Some(c) = self.requests.capturer.as_mut() else {
            return;
        };
        match result {
            Ok(dropped) => c.state.stats.evicted += dropped,
            Err(e) => {
                c.state.stats.evicted += 1;
                tracing::warn!("{device}: capture {id} dropped: {e}");
            }
        }
        self.out
            .push(Effect::SaveCaptureState(capture_state_bytes(c)));
        self.status_dirty = true;
    }

    /// Publishes the quality report if requests (or shadow comparisons) came in and the period
    /// has passed since the last one.
    pub(super) fn publish_quality_when_due(&mut self) {
        let period = Duration::from_secs(self.cfg.quality.period_s);
        let r = &mut self.requests;
        let due = self.now.mono.duration_since(r.last_quality) >= period;
        let dirty = r.quality.as_ref().is_some_and(|t| t.dirty) || self.shadow.dirty;
        if !due || !dirty || !self.cfg.quality.enabled {
            return;
        }
        r.last_quality = self.now.mono;
        self.shadow.dirty = false;
        let Some(t) = r.quality.as_mut() else {
            return; // nothing answered yet: no model to report on
        };
        t.dirty = false;
        let m = t.model.manifest();
        let q = DeviceQuality {
            device: self.cfg.device_id.clone(),
            model: m.name.clone(),
            version: m.version,
            window: t.window.as_ref().and_then(QualityWindow::report),
            note: t.note.clone(),
            shadow: self.shadow.report(),
            updated: self.now.rfc3339(),
        };
        let topic = self.topics.quality(&self.cfg.device_id);
        self.publish(
            How::Latest,
            topic,
            serde_json::to_string(&q).expect("serializable"),
        );
    }
}
