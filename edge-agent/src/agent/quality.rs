//! Quality telemetry: every request the active model answers goes into a window judged against
//! the reference profile in its signed manifest ([`kestrel_shared::quality`]); the window, and
//! the shadow model's comparison when there is one, are published retained on
//! `P/devices/<id>/quality` every `[quality] period_s` while requests come in.

use std::time::{Duration, Instant};

use kestrel_shared::now_rfc3339;
use kestrel_shared::quality::{DeviceQuality, QualityWindow};

use super::{Agent, Observed};
use crate::outbox::Message;

/// Recent latencies the status's percentiles are taken over.
const LATENCIES: usize = 1000;

/// The window of one active model.
pub(super) struct Telemetry {
    model: String,
    version: u64,
    /// None when the model cannot be judged; `note` says why.
    pub(super) window: Option<QualityWindow>,
    note: Option<String>,
    /// Requests came in since the last report.
    dirty: bool,
}

impl Agent {
    /// A request the active model answered: latency statistics, and the quality window.
    pub(super) fn on_observed(&mut self, mut o: Observed) {
        self.maybe_capture(&mut o);
        self.counters.requests_answered += 1;
        self.histogram.observe(o.latency_ms / 1000.0);
        self.latencies.push_back(o.latency_ms);
        if self.latencies.len() > LATENCIES {
            self.latencies.pop_front();
        }
        self.status_dirty = true;
        if !self.cfg.quality.enabled {
            return;
        }
        if self.quality.as_ref().map(|t| t.version) != Some(o.version) {
            let Some(t) = self.telemetry_for(o.version) else {
                return; // answered by a model swapped out meanwhile
            };
            self.quality = Some(t);
        }
        let t = self.quality.as_mut().expect("just set");
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

    /// A fresh window for the active model, if it is `version`.
    fn telemetry_for(&self, version: u64) -> Option<Telemetry> {
        let model = self.model.read().expect("lock").clone()?;
        let m = &model.manifest;
        if m.version != version {
            return None;
        }
        let (window, note) = match &m.reference {
            Some(r) => (
                Some(QualityWindow::new(r.clone(), self.cfg.quality.window)),
                None,
            ),
            None => (
                None,
                Some(format!(
                    "{} v{} has no quality reference in its manifest (exported without one)",
                    m.name, m.version
                )),
            ),
        };
        Some(Telemetry {
            model: m.name.clone(),
            version,
            window,
            note,
            dirty: false,
        })
    }

    /// Publishes the quality report if requests (or shadow comparisons) came in and the period
    /// has passed since the last one.
    pub(super) fn publish_quality_when_due(&mut self) {
        let due = self.last_quality.elapsed() >= Duration::from_secs(self.cfg.quality.period_s);
        let dirty = self.quality.as_ref().is_some_and(|t| t.dirty) || self.shadow.dirty;
        if !due || !dirty || !self.cfg.quality.enabled {
            return;
        }
        self.publish_quality();
    }

    fn publish_quality(&mut self) {
        self.last_quality = Instant::now();
        self.shadow.dirty = false;
        let Some(t) = self.quality.as_mut() else {
            return; // nothing answered yet: no model to report on
        };
        t.dirty = false;
        let q = DeviceQuality {
            device: self.cfg.device_id.clone(),
            model: t.model.clone(),
            version: t.version,
            window: t.window.as_ref().and_then(QualityWindow::report),
            note: t.note.clone(),
            shadow: self.shadow.report(),
            updated: now_rfc3339(),
        };
        self.outbox.push_latest(Message {
            topic: self.topics.quality(&self.cfg.device_id),
            retain: true,
            payload: serde_json::to_string(&q).expect("serializable"),
        });
    }
}
