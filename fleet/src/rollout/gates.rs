//! Quality gates of a rollout phase, over the devices' quality reports
//! ([`kestrel_shared::quality::DeviceQuality`]): enough requests seen, shadow agreement, the drop
//! in mean confidence against the same devices' previous model, and the share of devices whose
//! inputs drifted from the training reference. A breached gate aborts the rollout like a failure
//! threshold does.

use kestrel_shared::quality::DeviceQuality;
use serde::{Deserialize, Serialize};

use super::{Device, PhaseSpec};

/// A device's request counter may grow at most this fast (requests a second) [default for a
/// phase's `max_request_rate`]: a Raspberry Pi answers one request in 10-30 ms.
pub const MAX_REQUEST_RATE: f64 = 100.0;

/// Seconds added to the time a phase has run when a device's claimed requests are judged
/// against `max_request_rate` (the clocks of the device and of the controller, and a report in
/// flight when the phase started).
pub const RATE_GRACE_S: u64 = 30;

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
    /// Why this device's reports no longer count (an implausible claim): set once, for the
    /// rest of the rollout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub excluded: Option<String>,
    /// The device's agent start (its status's `started`) when `requests` was taken: a counter
    /// lower than before is a restarted agent's only when the agent started since.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counted_in: Option<u64>,
}

/// The bounds a device's claims are judged against ([`QualitySample::update`]).
#[derive(Debug, Clone, Copy)]
pub struct Plausible {
    /// The controller's clock (unix s) now, and when the current phase started.
    pub now: u64,
    pub phase_started: u64,
    /// Requests a second a device may claim.
    pub max_rate: f64,
    /// When the device's agent started, by its latest status.
    pub device_started: Option<u64>,
}

/// A report's numbers that must be fractions, by name.
fn fractions(q: &DeviceQuality) -> Vec<(&'static str, f64)> {
    let mut v = Vec::new();
    if let Some(w) = &q.window {
        v.push(("mean_confidence", w.mean_confidence));
    }
    if let Some(s) = &q.shadow {
        v.push(("agreement", s.agreement));
        v.push(("active_mean_confidence", s.active_mean_confidence));
        v.push(("shadow_mean_confidence", s.shadow_mean_confidence));
    }
    v
}

impl QualitySample {
    /// Takes in a device's report: about its previous model (the baseline, and the shadow's
    /// comparison when it runs the rolled-out model in shadow) or about the rolled-out model.
    /// A report whose claims the controller cannot believe (a fraction outside [0, 1], a
    /// counter that went back, or more requests than the time since the phase started allows)
    /// excludes the device from the gates instead; returns the reason when it does.
    pub fn update(
        &mut self,
        q: &DeviceQuality,
        previous: Option<&(String, u64)>,
        model: (&str, u64),
        bounds: Plausible,
    ) -> Option<String> {
        if self.excluded.is_some() {
            return None;
        }
        if let Some(reason) = self.implausible(q, previous, model, bounds) {
            self.excluded = Some(reason.clone());
            return Some(reason);
        }
        let on = |name: &str, version: u64| name == model.0 && version == model.1;
        self.counted_in = bounds.device_started;
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
        None
    }

    /// Why `q` cannot be believed, if it cannot.
    fn implausible(
        &self,
        q: &DeviceQuality,
        previous: Option<&(String, u64)>,
        model: (&str, u64),
        b: Plausible,
    ) -> Option<String> {
        if let Some((name, v)) = fractions(q)
            .into_iter()
            .find(|(_, v)| !(0.0..=1.0).contains(v))
        {
            return Some(format!("claims {name} {v}, outside [0, 1]"));
        }
        let on = |name: &str, version: u64| name == model.0 && version == model.1;
        let counter = if on(&q.model, q.version) {
            q.window.as_ref().map(|w| w.total_requests)
        } else if previous.is_some_and(|(n, v)| *n == q.model && *v == q.version) {
            q.shadow
                .as_ref()
                .filter(|s| on(&s.name, s.version))
                .map(|s| s.compared)
        } else {
            None
        }?;
        let restarted = b.device_started > self.counted_in;
        if counter < self.requests && !restarted {
            return Some(format!(
                "its request counter went back from {} to {counter}",
                self.requests
            ));
        }
        let seconds = b.now.saturating_sub(b.phase_started) + RATE_GRACE_S;
        let most = b.max_rate * seconds as f64;
        (counter as f64 > most).then(|| {
            format!(
                "claims {counter} requests {seconds} s into the phase (at most {most:.0} at {} a second)",
                b.max_rate
            )
        })
    }

    /// Forgets what was measured of the new model (a phase starts), keeping the baseline and
    /// an exclusion.
    pub fn restart(&mut self) {
        *self = QualitySample {
            baseline_confidence: self.baseline_confidence,
            excluded: self.excluded.take(),
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

/// The devices whose reports a phase's gates need before they are judged: the phase's
/// `min_reporting_devices`, else a majority of its `n` devices.
pub fn reporting_needed(spec: &PhaseSpec, n: usize) -> usize {
    spec.min_reporting_devices
        .unwrap_or(n / 2 + 1)
        .clamp(1, n.max(1))
}

/// The median of `values` (None when empty): each device one vote, and a value that fewer
/// than half of the devices report cannot move it past the others' range.
fn median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(values[n / 2]),
        _ => Some((values[n / 2 - 1] + values[n / 2]) / 2.0),
    }
}

/// The phase's gates over its `n` devices' samples. Each device counts once: the value gates
/// are medians over the devices that reported requests, a device's share of `min_requests` is
/// capped at what the needed number of reporting devices would each bring, and devices excluded
/// for implausible claims count for nothing. `min_reporting_devices` comes last.
pub fn evaluate<'a>(
    phase: usize,
    spec: &PhaseSpec,
    n: usize,
    devices: impl Iterator<Item = &'a Device>,
) -> Vec<Gate> {
    let samples: Vec<&QualitySample> = devices
        .filter_map(|d| d.quality.as_ref())
        .filter(|q| q.excluded.is_none())
        .collect();
    let reporting: Vec<&QualitySample> =
        samples.iter().copied().filter(|s| s.requests > 0).collect();
    let needed = reporting_needed(spec, n);
    let over = |f: &dyn Fn(&QualitySample) -> Option<f64>| {
        median(reporting.iter().filter_map(|s| f(s)).collect())
    };
    let mut gates = Vec::new();
    if let Some(m) = spec.min_requests {
        let share = m.div_ceil(needed as u64);
        let requests = reporting
            .iter()
            .fold(0u64, |sum, s| sum.saturating_add(s.requests.min(share)));
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
            over(&|s| s.agreement),
            m,
            true,
        ));
    }
    if let Some(m) = spec.max_confidence_drop {
        let drop = over(&|s| Some(s.baseline_confidence? - s.confidence?));
        gates.push(Gate::new(phase, "max_confidence_drop", drop, m, false));
    }
    if let Some(m) = spec.max_drift_devices {
        let judged: Vec<bool> = samples.iter().filter_map(|s| s.drifted).collect();
        let share = (!judged.is_empty())
            .then(|| judged.iter().filter(|&&f| f).count() as f64 / judged.len() as f64);
        gates.push(Gate::new(phase, "max_drift_devices", share, m, false));
    }
    gates.push(Gate::new(
        phase,
        "min_reporting_devices",
        Some(reporting.len() as f64),
        needed as f64,
        true,
    ));
    gates
}
