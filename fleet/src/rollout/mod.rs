//! Staged fleet rollouts. The controller is a sans-IO state machine: fed device statuses and
//! clock ticks, it returns what to publish (desired states) and when to save itself. The MQTT
//! loop around it is [`driver`]; its whole state is serializable and kept retained on the
//! broker, so a restarted controller continues where it stopped.
//!
//! ```text
//! start ─▶ phase 0 (desired → its devices) ─▶ success ≥ threshold and soak over ─▶ phase 1 ─▶ … ─▶ completed
//!                    │ failures > threshold, or timeout with success < threshold
//!                    ▼
//!                 aborted: every device already moved gets its previous model back (rollback)
//! ```

pub mod driver;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;

use kestrel_shared::protocol::{Status, sha256_hex};
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error("{path}: {reason}")]
    Invalid { path: String, reason: String },
}

fn one() -> f64 {
    1.0
}
fn default_timeout() -> u64 {
    300
}

/// One phase of a plan (`[[phases]]` in fleet.toml).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PhaseSpec {
    pub name: String,
    /// Devices of this group (not already in an earlier phase)...
    #[serde(default)]
    pub group: Option<String>,
    /// ...or this cumulative share of the fleet, in percent (devices in a stable pseudo-random
    /// order keyed by the rollout name).
    #[serde(default)]
    pub percent: Option<f64>,
    /// Fraction of the phase's devices that must report the new model active to promote.
    #[serde(default = "one")]
    pub success: f64,
    /// Failures (rejected, rolled back, timed out) tolerated: a fraction of the phase's devices...
    #[serde(default)]
    pub failure: Option<f64>,
    /// ...or a count (default 0: the first failure aborts).
    #[serde(default)]
    pub max_failures: Option<usize>,
    /// Seconds the phase may take; devices still pending then count as timed out.
    #[serde(default = "default_timeout")]
    pub timeout_s: u64,
    /// Seconds to watch a successful phase before promoting (bake time).
    #[serde(default)]
    pub soak_s: u64,
}

impl PhaseSpec {
    fn allowed_failures(&self, n: usize) -> usize {
        match (self.failure, self.max_failures) {
            (Some(f), _) => (f * n as f64).floor() as usize,
            (None, Some(m)) => m,
            (None, None) => 0,
        }
    }
}

/// A rollout plan (fleet.toml).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// Rollout id (a topic level) [default: <model>-v<version>].
    #[serde(default)]
    pub name: Option<String>,
    /// The fleet; [default: every device with a retained status].
    #[serde(default)]
    pub devices: Option<Vec<String>>,
    pub phases: Vec<PhaseSpec>,
}

impl Plan {
    pub fn parse(text: &str, path: &str) -> Result<Self, PlanError> {
        let bad = |reason: String| PlanError::Invalid {
            path: path.to_string(),
            reason,
        };
        let p: Plan = toml::from_str(text).map_err(|e| bad(e.to_string()))?;
        if p.phases.is_empty() {
            return Err(bad("no [[phases]]".into()));
        }
        for ph in &p.phases {
            let what = format!("phase `{}`", ph.name);
            match (&ph.group, ph.percent) {
                (Some(_), None) => {}
                (None, Some(x)) if x > 0.0 && x <= 100.0 => {}
                (None, Some(x)) => {
                    return Err(bad(format!("{what}: percent {x} is not in (0, 100]")));
                }
                _ => return Err(bad(format!("{what}: give exactly one of group or percent"))),
            }
            if !(0.0..=1.0).contains(&ph.success)
                || ph.failure.is_some_and(|f| !(0.0..=1.0).contains(&f))
            {
                return Err(bad(format!(
                    "{what}: success and failure are fractions in [0, 1]"
                )));
            }
        }
        Ok(p)
    }
}

/// What a device is doing in this rollout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "state", content = "detail")]
pub enum DeviceState {
    /// In a later phase; not told anything yet.
    Waiting,
    /// Desired state published; not yet active.
    Moved,
    Active,
    Failed(String),
    TimedOut,
    /// Sent back to its previous model after an abort.
    RolledBack,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Device {
    pub id: String,
    pub phase: usize,
    pub state: DeviceState,
    /// The model it ran when the rollout started (name, version), to go back to on abort.
    pub previous: Option<(String, u64)>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "state", content = "reason")]
pub enum RolloutState {
    Running,
    Completed,
    Aborted(String),
}

/// What the IO layer must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// Publish this device's desired state.
    Desired {
        device: String,
        name: String,
        version: u64,
        rollback: bool,
    },
    /// Clear this device's desired state (it had no model before the rollout).
    Clear {
        device: String,
    },
    /// Persist the controller (retained) after the outputs before it are published.
    Save,
    Log(String),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Controller {
    pub name: String,
    pub model: String,
    pub version: u64,
    pub plan: Plan,
    pub devices: BTreeMap<String, Device>,
    pub phase: usize,
    /// When the current phase started, and when it first met its success threshold (unix s).
    pub phase_started: u64,
    pub phase_succeeded: Option<u64>,
    pub state: RolloutState,
}

impl Controller {
    /// Assigns the fleet to phases. `fleet`: each device's current status.
    pub fn new(
        name: &str,
        model: &str,
        version: u64,
        plan: Plan,
        fleet: &[Status],
    ) -> Result<Self, PlanError> {
        let bad = |reason: String| PlanError::Invalid {
            path: format!("rollout {name}"),
            reason,
        };
        if fleet.is_empty() {
            return Err(bad(
                "the fleet is empty (no device has reported a status)".into()
            ));
        }
        // A stable pseudo-random order, different per rollout.
        let mut order: Vec<&Status> = fleet.iter().collect();
        order.sort_by_key(|s| sha256_hex(format!("{name}/{}", s.device).as_bytes()));
        let n = fleet.len();
        let mut devices = BTreeMap::new();
        let mut assigned = 0usize;
        for (i, ph) in plan.phases.iter().enumerate() {
            let chosen: Vec<&Status> = match (&ph.group, ph.percent) {
                (Some(g), _) => order
                    .iter()
                    .filter(|s| !devices.contains_key(&s.device) && s.groups.contains(g))
                    .copied()
                    .collect(),
                (None, Some(p)) => {
                    let upto = ((p / 100.0 * n as f64).ceil() as usize).clamp(1, n);
                    order
                        .iter()
                        .filter(|s| !devices.contains_key(&s.device))
                        .take(upto.saturating_sub(assigned))
                        .copied()
                        .collect()
                }
                _ => unreachable!("validated plan"),
            };
            if chosen.is_empty() {
                return Err(bad(format!("phase `{}` selects no device", ph.name)));
            }
            for s in chosen {
                let previous = s.model.clone().zip(s.active);
                devices.insert(
                    s.device.clone(),
                    Device {
                        id: s.device.clone(),
                        phase: i,
                        state: DeviceState::Waiting,
                        previous,
                    },
                );
                assigned += 1;
            }
        }
        let left: Vec<&str> = fleet
            .iter()
            .filter(|s| !devices.contains_key(&s.device))
            .map(|s| s.device.as_str())
            .collect();
        if !left.is_empty() {
            return Err(bad(format!(
                "{} devices are in no phase (first: {}); end the plan with percent = 100",
                left.len(),
                left[0]
            )));
        }
        Ok(Self {
            name: name.to_string(),
            model: model.to_string(),
            version,
            plan,
            devices,
            phase: 0,
            phase_started: 0,
            phase_succeeded: None,
            state: RolloutState::Running,
        })
    }

    pub fn phase_devices(&self, phase: usize) -> impl Iterator<Item = &Device> {
        self.devices.values().filter(move |d| d.phase == phase)
    }

    /// Starts (or, after a restart, re-announces) the current phase.
    pub fn start(&mut self, now: u64) -> Vec<Output> {
        if self.state != RolloutState::Running {
            return vec![];
        }
        if self.phase_started == 0 {
            self.phase_started = now;
        }
        let mut out = vec![Output::Log(format!(
            "phase {} `{}`: {} devices",
            self.phase,
            self.plan.phases[self.phase].name,
            self.phase_devices(self.phase).count()
        ))];
        let (model, version, phase) = (self.model.clone(), self.version, self.phase);
        for d in self.devices.values_mut().filter(|d| d.phase == phase) {
            if d.state == DeviceState::Waiting {
                d.state = DeviceState::Moved;
            }
            out.push(Output::Desired {
                device: d.id.clone(),
                name: model.clone(),
                version,
                rollback: false,
            });
        }
        out.push(Output::Save);
        out
    }

    /// A device's status arrived.
    pub fn on_status(&mut self, s: &Status, now: u64) -> Vec<Output> {
        let (model, version) = (self.model.clone(), self.version);
        let Some(d) = self.devices.get_mut(&s.device) else {
            return vec![];
        };
        let new = match &d.state {
            DeviceState::Moved | DeviceState::TimedOut
                if s.active == Some(version) && s.model.as_deref() == Some(model.as_str()) =>
            {
                Some(DeviceState::Active)
            }
            DeviceState::Moved if s.failed_version == Some(version) && s.state == "idle" => Some(
                DeviceState::Failed(s.last_error.clone().unwrap_or_else(|| "failed".into())),
            ),
            _ => None,
        };
        match new {
            Some(st) if st != d.state => {
                let line = format!("{}: {st:?}", d.id);
                d.state = st;
                let mut out = vec![Output::Log(line)];
                out.extend(self.evaluate(now));
                out.push(Output::Save);
                out
            }
            _ => vec![],
        }
    }

    /// The clock: phase timeouts and soak times.
    pub fn on_tick(&mut self, now: u64) -> Vec<Output> {
        if self.state != RolloutState::Running {
            return vec![];
        }
        let spec = &self.plan.phases[self.phase];
        let mut out = Vec::new();
        if now >= self.phase_started + spec.timeout_s {
            let phase = self.phase;
            for d in self.devices.values_mut().filter(|d| d.phase == phase) {
                if d.state == DeviceState::Moved {
                    d.state = DeviceState::TimedOut;
                    out.push(Output::Log(format!("{}: timed out", d.id)));
                }
            }
        }
        let ev = self.evaluate(now);
        if !out.is_empty() || !ev.is_empty() {
            out.extend(ev);
            out.push(Output::Save);
        }
        out
    }

    /// (active, failed, pending) in the current phase.
    pub fn counts(&self, phase: usize) -> (usize, usize, usize) {
        let mut c = (0, 0, 0);
        for d in self.phase_devices(phase) {
            match d.state {
                DeviceState::Active => c.0 += 1,
                DeviceState::Failed(_) | DeviceState::TimedOut => c.1 += 1,
                _ => c.2 += 1,
            }
        }
        c
    }

    fn evaluate(&mut self, now: u64) -> Vec<Output> {
        if self.state != RolloutState::Running {
            return vec![];
        }
        let spec = self.plan.phases[self.phase].clone();
        let (active, failed, pending) = self.counts(self.phase);
        let n = active + failed + pending;
        if failed > spec.allowed_failures(n) {
            return self.abort(format!(
                "phase {} `{}`: {failed} of {n} devices failed (allowed {})",
                self.phase,
                spec.name,
                spec.allowed_failures(n)
            ));
        }
        let ok = active as f64 >= spec.success * n as f64 - 1e-9;
        if !ok {
            if pending == 0 {
                return self.abort(format!(
                    "phase {} `{}`: {active} of {n} devices active, below the success threshold {}",
                    self.phase, spec.name, spec.success
                ));
            }
            return vec![];
        }
        // Promote once the threshold has held for the soak time (devices still pending keep
        // their desired state and finish on their own).
        let since = *self.phase_succeeded.get_or_insert(now);
        if now < since + spec.soak_s {
            return vec![];
        }
        let mut out = vec![Output::Log(format!(
            "phase {} `{}` done: {active} of {n} active",
            self.phase, spec.name
        ))];
        if self.phase + 1 == self.plan.phases.len() {
            self.state = RolloutState::Completed;
            out.push(Output::Log(format!("rollout {} completed", self.name)));
            return out;
        }
        self.phase += 1;
        self.phase_started = now;
        self.phase_succeeded = None;
        out.extend(self.start(now));
        out
    }

    /// Stops the rollout and sends every device already moved back to its previous model.
    fn abort(&mut self, reason: String) -> Vec<Output> {
        let mut out = vec![Output::Log(format!("aborting: {reason}"))];
        for d in self.devices.values_mut() {
            if matches!(d.state, DeviceState::Waiting) {
                continue;
            }
            out.push(match &d.previous {
                Some((name, version)) => Output::Desired {
                    device: d.id.clone(),
                    name: name.clone(),
                    version: *version,
                    rollback: true,
                },
                None => Output::Clear {
                    device: d.id.clone(),
                },
            });
            if !matches!(d.state, DeviceState::Failed(_)) {
                d.state = DeviceState::RolledBack;
            }
        }
        self.state = RolloutState::Aborted(reason);
        out
    }
}
