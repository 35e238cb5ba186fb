//! Quality gates of a rollout phase, over the devices' quality reports
//! ([`kestrel_shared::quality::DeviceQuality`]): enough requests seen, shadow agreement, the drop
//! in mean confidence against the same devices' previous model, and the share of devices whose
//! inputs drifted from the training reference. A breached gate aborts the rollout like a failure
//! threshold does.

use kestrel_shared::quality::DeviceQuality;
use serde::{Deserialize, Serialize};

use super::{Device, PhaseSpec};

/// What one device's reports say about the model being rolled out.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct QualitySample {
    /// Requests the new model answered (active phases) or was compared on (shadow phases), in
    /// the current phase.
    pub requests: u64,
    /// The new model's mean top-1 confidence on them.
    pub confidence: Option<f64>,
    /// The previous model's mean top-1 confidence on this device (in a shadow phase: on the
    /// very same requests).
    pub baseline_confidence: Option<f64>,
    /// Top-1 agreement of the shadow with the active model.
    pub agreement: Option<f64>,
    /// Whether the device's latest window was flagged as drifted.
    pub drifted: Option<bool>,
}

impl QualitySample {
    /// Takes in a device's report: about its previous model (the baseline, and the shadow's
    /// comparison when it runs the rolled-out model in shadow) or about the rolled-out model.
    pub fn update(
        &mut self,
        q: &DeviceQuality,
        previous: Option<&(String, u64)>,
        model: (&str, u64),
    ) {
        let on = |name: &str, version: u64| name == model.0 && version == model.1;
        if let Some(w) = &q.window {
            self.drifted = Some(w.drift.flagged);
        }
        if on(&q.model, q.version) {
            if let Some(w) = &q.window {
                self.requests = w.total_requests;
                self.confidence = Some(w.mean_confidence);
            }
        } else if previous.is_some_and(|(n, v)| *n == q.model && *v == q.version) {
            if let Some(w) = &q.window {
                self.baseline_confidence = Some(w.mean_confidence);
            }
            if let Some(s) = q.shadow.as_ref().filter(|s| on(&s.name, s.version)) {
                self.requests = s.compared;
                self.agreement = Some(s.agreement);
                self.confidence = Some(s.shadow_mean_confidence);
                self.baseline_confidence = Some(s.active_mean_confidence);
            }
        }
    }

    /// Forgets what was measured of the new model (a phase starts), keeping the baseline.
    pub fn restart(&mut self) {
        *self = QualitySample {
            baseline_confidence: self.baseline_confidence,
            ..Default::default()
        };
    }
}

/// One gate's value over the phase's devices and its limit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gate {
    /// The phase whose gate it is.
    pub phase: usize,
    pub name: String,
    /// None until a device reported what the gate needs.
    pub value: Option<f64>,
    pub limit: f64,
    /// `min` (the value must be at least the limit) or `max` (at most).
    pub bound: String,
    pub passed: Option<bool>,
}

impl Gate {
    fn new(phase: usize, name: &str, value: Option<f64>, limit: f64, min: bool) -> Self {
        Gate {
            phase,
            name: name.into(),
            value,
            limit,
            bound: if min { "min" } else { "max" }.into(),
            passed: value.map(|v| {
                if min {
                    v >= limit - 1e-12
                } else {
                    v <= limit + 1e-12
                }
            }),
        }
    }

    pub fn describe(&self) -> String {
        let op = if self.bound == "min" { ">=" } else { "<=" };
        let value = self.value.map_or("no data".into(), |v| format!("{v:.4}"));
        format!("{} {value} (limit {op} {})", self.name, self.limit)
    }
}

/// Whether the phase has any quality gate.
pub fn any(spec: &PhaseSpec) -> bool {
    spec.min_requests.is_some()
        || spec.min_shadow_agreement.is_some()
        || spec.max_confidence_drop.is_some()
        || spec.max_drift_devices.is_some()
}

/// The phase's gates over its devices' samples (request-weighted where a device's share of the
/// evidence is its requests).
pub fn evaluate<'a>(
    phase: usize,
    spec: &PhaseSpec,
    devices: impl Iterator<Item = &'a Device>,
) -> Vec<Gate> {
    let samples: Vec<&QualitySample> = devices.filter_map(|d| d.quality.as_ref()).collect();
    let requests: u64 = samples.iter().map(|s| s.requests).sum();
    let weighted = |f: &dyn Fn(&QualitySample) -> Option<f64>| {
        let (mut sum, mut n) = (0.0, 0u64);
        for s in samples.iter().filter(|s| s.requests > 0) {
            if let Some(v) = f(s) {
                sum += v * s.requests as f64;
                n += s.requests;
            }
        }
        (n > 0).then(|| sum / n as f64)
    };
    let mut gates = Vec::new();
    if let Some(m) = spec.min_requests {
        gates.push(Gate::new(
            phase,
            "min_requests",
            Some(requests as f64),
            m as f64,
            true,
        ));
    }
    if let Some(m) = spec.min_shadow_agreement {
        gates.push(Gate::new(
            phase,
            "min_shadow_agreement",
            weighted(&|s| s.agreement),
            m,
            true,
        ));
    }
    if let Some(m) = spec.max_confidence_drop {
        let drop = weighted(&|s| Some(s.baseline_confidence? - s.confidence?));
        gates.push(Gate::new(phase, "max_confidence_drop", drop, m, false));
    }
    if let Some(m) = spec.max_drift_devices {
        let judged: Vec<bool> = samples.iter().filter_map(|s| s.drifted).collect();
        let share = (!judged.is_empty())
            .then(|| judged.iter().filter(|&&f| f).count() as f64 / judged.len() as f64);
        gates.push(Gate::new(phase, "max_drift_devices", share, m, false));
    }
    gates
}
