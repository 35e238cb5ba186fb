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
//!
//! A phase in `mode = "shadow"` leaves its devices on their model and has them run the new one
//! in shadow (the desired state's `shadow`); when it passes, its devices go on with the next
//! phase. A phase's quality [`gates`] (requests seen, shadow agreement, confidence drop, drifted
//! devices) must hold, over its devices' quality reports, before it is promoted; a breach
//! aborts.

pub mod command;
pub mod driver;
pub mod gates;
mod join;
pub mod pace;
mod plan;
pub mod saved;
mod table;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_scale;

use std::collections::BTreeMap;

use kestrel_shared::protocol::Status;
use kestrel_shared::quality::DeviceQuality;
use kestrel_shared::wire::{self, ShadowState};
use serde::{Deserialize, Serialize};

use gates::{Gate, QualitySample};
pub use plan::{Mode, PhaseSpec, Plan, PlanError};
pub use table::table;

/// What a device is doing in this rollout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "state", content = "detail")]
pub enum DeviceState {
    /// In a later phase; not told anything yet.
    Waiting,
    /// Desired state published; not yet active (or, in a shadow phase, not yet running it).
    Moved,
    /// Running the new model in shadow (a shadow phase).
    Shadowing,
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
    /// What its quality reports say (phases with gates).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quality: Option<QualitySample>,
    /// When its agent started, by its latest status (a quality counter may restart then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started: Option<u64>,
    /// The artifact bytes it fetched during the rollout (its `bytes_fetched` counter since the
    /// rollout began, or since its agent restarted), by its latest status.
    #[serde(default)]
    pub bytes_fetched: u64,
    /// Its `bytes_fetched` counter when the rollout began (0 after its agent restarted).
    #[serde(default)]
    pub fetched_base: u64,
    /// When it was given the new model (its desired state published; unix s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moved_at: Option<u64>,
    /// Its agent is offline (its retained `online` says `0`): not given the model, not timed
    /// out, and not counted in its phase's thresholds until it is back.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub offline: bool,
    /// Joined after the rollout began (a new device, or one of a group the plan names that
    /// first reported then).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub late: bool,
}

impl Device {
    /// A device of `phase` not yet given the model, as its status `s` describes it.
    fn waiting(s: &Status, phase: usize, late: bool) -> Self {
        Device {
            id: s.device.clone(),
            phase,
            state: DeviceState::Waiting,
            previous: s.model.clone().zip(s.active),
            quality: None,
            started: Some(s.started),
            bytes_fetched: 0,
            fetched_base: s.counters.bytes_fetched,
            moved_at: None,
            offline: false,
            late,
        }
    }
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
        /// Also run the rolled-out model in shadow (a shadow phase: `name`/`version` are the
        /// device's own model).
        shadow: bool,
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
    /// sha256 of the rolled-out artifact's signed manifest: a device whose status names
    /// another manifest at this version runs another model, and does not count as active.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest_sha256: Option<String>,
    /// The artifact's device files: what a device holding none of its parts fetches.
    #[serde(default)]
    pub artifact_bytes: u64,
    pub plan: Plan,
    pub devices: BTreeMap<String, Device>,
    pub phase: usize,
    /// When the current phase started, and when it first met its success threshold (unix s).
    pub phase_started: u64,
    pub phase_succeeded: Option<u64>,
    pub state: RolloutState,
    /// Every phase's quality gates, as last evaluated.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gates: Vec<Gate>,
    /// Paused by an operator: the current phase goes on (its devices finish, failures still
    /// abort), but it is not promoted until resumed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
    /// The nonces of the operators' commands honoured lately (a replay is refused, across a
    /// restart of the controller too).
    #[serde(default, skip_serializing_if = "command::Nonces::is_empty")]
    pub commands: command::Nonces,
    /// The pace's state: devices it may give the model now, and when that was reckoned.
    #[serde(default)]
    pub pace: pace::Credit,
    /// When every online device of the current phase had been given the model: its timeout
    /// counts from then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase_released: Option<u64>,
}

impl Controller {
    /// The bytes the devices fetched during the rollout, in all.
    pub fn bytes_fetched(&self) -> u64 {
        self.devices.values().map(|d| d.bytes_fetched).sum()
    }

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
        order.sort_by_cached_key(|s| pace::order_key(name, &s.device));
        let n = fleet.len();
        let mut devices = BTreeMap::new();
        let mut assigned = 0usize;
        let member =
            |g: &str, s: &Status| plan.groups.get(g).is_some_and(|m| m.contains(&s.device));
        for (i, ph) in plan.phases.iter().enumerate() {
            let chosen: Vec<&Status> = match (&ph.group, ph.percent) {
                (Some(g), _) => order
                    .iter()
                    .filter(|s| !devices.contains_key(&s.device) && member(g, s))
                    .copied()
                    .collect(),
                (None, Some(p)) => {
                    // p·n first: 7 / 100 · 100 is 7.000000000000001, and its ceiling 8.
                    let upto = ((p * n as f64 / 100.0).ceil() as usize).clamp(1, n);
                    order
                        .iter()
                        .filter(|s| !devices.contains_key(&s.device))
                        .take(upto.saturating_sub(assigned))
                        .copied()
                        .collect()
                }
                _ => unreachable!("validated plan"),
            };
            // A group no device of the fleet is in is a mistake (a misspelt name); a phase left
            // empty because earlier ones took its devices (one Pi in the canary group, then
            // "everyone") has nothing to do and passes.
            if let Some(g) = &ph.group
                && !fleet.iter().any(|s| member(g, s))
            {
                return Err(bad(format!(
                    "phase `{}` selects no device: no device of the fleet is in group `{g}`",
                    ph.name
                )));
            }
            for s in chosen {
                let d = Device::waiting(s, i, false);
                if ph.mode == Mode::Shadow && d.previous.is_none() {
                    return Err(bad(format!(
                        "phase `{}` is in shadow mode, but device {} has no model to run beside it",
                        ph.name, s.device
                    )));
                }
                devices.insert(s.device.clone(), d);
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
            manifest_sha256: None,
            artifact_bytes: 0,
            plan,
            devices,
            phase: 0,
            phase_started: 0,
            phase_succeeded: None,
            state: RolloutState::Running,
            gates: Vec::new(),
            paused: false,
            commands: command::Nonces::default(),
            pace: pace::Credit::default(),
            phase_released: None,
        })
    }

    pub fn phase_devices(&self, phase: usize) -> impl Iterator<Item = &Device> {
        self.devices.values().filter(move |d| d.phase == phase)
    }

    /// Starts (or, after a restart, re-announces) the current phase: the devices already given
    /// the model get their desired state again, and as many more as the phase's pace allows.
    pub fn start(&mut self, now: u64) -> Vec<Output> {
        if self.state != RolloutState::Running {
            return vec![];
        }
        if self.phase_started == 0 {
            self.phase_started = now;
            self.pace = pace::Credit::starting(&self.plan.phases[self.phase], now);
        }
        let mut out = vec![Output::Log(format!(
            "phase {} `{}`: {} devices",
            self.phase,
            self.plan.phases[self.phase].name,
            self.phase_devices(self.phase).count()
        ))];
        out.extend(
            self.phase_devices(self.phase)
                .filter(|d| d.state != DeviceState::Waiting)
                .map(|d| self.desired_for(d)),
        );
        out.extend(self.release(now));
        out.push(Output::Save);
        out
    }

    /// The desired state device `d` is given: the rolled-out model, or, while its phase runs in
    /// shadow, its own model with the new one in shadow.
    fn desired_for(&self, d: &Device) -> Output {
        let shadow = d.phase == self.phase
            && self.state == RolloutState::Running
            && self.plan.phases[d.phase].mode == Mode::Shadow;
        let (name, version) = match (&d.previous, shadow) {
            (Some((n, v)), true) => (n.clone(), *v),
            _ => (self.model.clone(), self.version),
        };
        Output::Desired {
            device: d.id.clone(),
            name,
            version,
            rollback: false,
            shadow,
        }
    }

    /// Every moved device's desired state again (signed anew, so with a new expiry): what
    /// [`Controller::start`] sent the current phase, and the rolled-out model for the devices of
    /// the phases before it.
    pub fn renew(&self) -> Vec<Output> {
        if self.is_aborted() {
            return vec![];
        }
        let mut out: Vec<Output> = self
            .devices
            .values()
            .filter(|d| d.phase <= self.phase && d.state != DeviceState::Waiting)
            .map(|d| self.desired_for(d))
            .collect();
        out.push(Output::Log(format!(
            "renewed the desired states of {} devices",
            out.len()
        )));
        out
    }

    fn is_aborted(&self) -> bool {
        matches!(self.state, RolloutState::Aborted(_))
    }

    /// A device's status arrived (one the rollout does not know may join it: [`join`]).
    pub fn on_status(&mut self, s: &Status, now: u64) -> Vec<Output> {
        let mut out = if self.devices.contains_key(&s.device) {
            vec![]
        } else {
            self.join(s)
        };
        let (model, version) = (self.model.clone(), self.version);
        let same_model = match (&s.manifest_sha256, &self.manifest_sha256) {
            (Some(a), Some(b)) => a == b,
            _ => true, // an agent that does not report it, or a state from before
        };
        let Some(d) = self.devices.get_mut(&s.device) else {
            return out;
        };
        if d.started != Some(s.started) {
            d.fetched_base = 0; // a new agent process counts from 0
        }
        d.started = Some(s.started);
        d.bytes_fetched = s.counters.bytes_fetched.saturating_sub(d.fetched_base);
        let new = if self.plan.phases[d.phase].mode == Mode::Shadow {
            shadow_state(&d.state, s, (&model, version))
        } else {
            match &d.state {
                // Waiting: it has the model already (given it by a state the controller did
                // not save before it stopped, or by another publisher).
                DeviceState::Moved | DeviceState::TimedOut | DeviceState::Waiting
                    if s.active == Some(version)
                        && s.model.as_deref() == Some(model.as_str())
                        && same_model =>
                {
                    Some(DeviceState::Active)
                }
                // A device sent back by an abort while it was installing may still fail its
                // own health check: that failure is what it reports, and what is recorded.
                DeviceState::Moved | DeviceState::RolledBack
                    if s.failed_version == Some(version) && s.state == wire::DeviceState::Idle =>
                {
                    Some(DeviceState::Failed(
                        s.last_error.clone().unwrap_or_else(|| "failed".into()),
                    ))
                }
                _ => None,
            }
        };
        match new {
            Some(st) if st != d.state => {
                out.push(Output::Log(format!("{}: {st:?}", d.id)));
                d.state = st;
                out.extend(self.evaluate(now));
                out.push(Output::Save);
            }
            _ if !out.is_empty() => out.push(Output::Save),
            _ => {}
        }
        out
    }

    /// A device's quality report arrived: its sample is updated (or, when it claims what
    /// cannot be, the device is excluded from the gates), and the gates judged.
    pub fn on_quality(&mut self, q: &DeviceQuality, now: u64) -> Vec<Output> {
        let (model, version) = (self.model.clone(), self.version);
        let Some(d) = self.devices.get_mut(&q.device) else {
            return vec![];
        };
        let bounds = gates::Plausible {
            now,
            phase_started: self.phase_started,
            max_rate: self.plan.phases[d.phase]
                .max_request_rate
                .unwrap_or(gates::MAX_REQUEST_RATE),
            device_started: d.started,
        };
        let excluded = d.quality.get_or_insert_with(QualitySample::default).update(
            q,
            d.previous.as_ref(),
            (&model, version),
            bounds,
        );
        let mut out: Vec<Output> = excluded
            .map(|why| Output::Log(format!("{}: excluded from the quality gates: {why}", d.id)))
            .into_iter()
            .collect();
        out.extend(self.evaluate(now));
        if !out.is_empty() {
            out.push(Output::Save);
        }
        out
    }

    /// The clock: the pace, device timeouts and soak times.
    pub fn on_tick(&mut self, now: u64) -> Vec<Output> {
        if self.is_aborted() {
            return vec![];
        }
        let mut out = self.time_out(now);
        out.extend(self.release(now));
        let gates = self.gates.clone();
        let ev = self.evaluate(now);
        if !out.is_empty() || !ev.is_empty() || self.gates != gates {
            out.extend(ev);
            out.push(Output::Save);
        }
        out
    }

    /// (active, failed, pending) in a phase; devices offline before they were given the model
    /// are left out (one given it that went offline is pending until it reports or times out).
    pub fn counts(&self, phase: usize) -> (usize, usize, usize) {
        let mut c = (0, 0, 0);
        for d in self.phase_devices(phase) {
            match d.state {
                DeviceState::Active | DeviceState::Shadowing => c.0 += 1,
                DeviceState::Failed(_) | DeviceState::TimedOut => c.1 += 1,
                DeviceState::Waiting if d.offline => {}
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
        let finished = active + failed;
        if let Some(rate) = spec.abort_failure_rate
            && finished >= spec.abort_min_finished.unwrap_or(1)
            && failed as f64 > rate * finished as f64 + 1e-9
        {
            return self.abort(format!(
                "phase {} `{}`: {failed} of {finished} finished devices failed, over the abort \
                 rate {rate}",
                self.phase, spec.name
            ));
        }
        // A phase with devices passes on what some of them did, never on none: a canary whose
        // devices are all offline holds the rollout until they are back or its time is up.
        let members = self.phase_devices(self.phase).count();
        if members > 0 && finished == 0 && pending == 0 {
            if self.deadline().is_some_and(|t| now >= t) {
                return self.abort(format!(
                    "phase {} `{}`: none of its {members} devices was online to take the model \
                     within {} s",
                    self.phase, spec.name, spec.timeout_s
                ));
            }
            return vec![];
        }
        let ok = active as f64 >= spec.success() * n as f64 - 1e-9;
        if !ok {
            if pending == 0 {
                return self.abort(format!(
                    "phase {} `{}`: {active} of {n} devices active, below the success threshold {}",
                    self.phase,
                    spec.name,
                    spec.success()
                ));
            }
            return vec![];
        }
        // Promote once the threshold has held for the soak time (devices still pending keep
        // their desired state and finish on their own) and the quality gates pass.
        let since = *self.phase_succeeded.get_or_insert(now);
        // An empty phase has no devices whose quality could be judged.
        if gates::any(&spec) && n > 0 {
            let current = gates::evaluate(self.phase, &spec, n, self.phase_devices(self.phase));
            let phase = self.phase;
            self.gates.retain(|g| g.phase != phase);
            self.gates.extend(current.iter().cloned());
            let what = format!("phase {} `{}`", self.phase, spec.name);
            // The other gates are judged once enough requests were seen.
            let enough = current.iter().all(|g| {
                !matches!(g.name.as_str(), "min_requests" | "min_reporting_devices")
                    || g.passed == Some(true)
            });
            if let Some(g) = current.iter().find(|g| g.passed == Some(false))
                && enough
            {
                let reason = format!("{what}: quality gate {}", g.describe());
                return self.abort(reason);
            }
            let ready = current.iter().all(|g| g.passed == Some(true));
            if !ready {
                if self.deadline().is_some_and(|t| now >= t) {
                    let unmet: Vec<String> = current
                        .iter()
                        .filter(|g| g.passed != Some(true))
                        .map(Gate::describe)
                        .collect();
                    return self.abort(format!(
                        "{what}: quality gates not met within {} s: {}",
                        spec.timeout_s,
                        unmet.join(", ")
                    ));
                }
                return vec![];
            }
        }
        let last = self.phase + 1 == self.plan.phases.len();
        // The last phase completes once every online device was given the model.
        if now < since + spec.soak_s || self.paused || (last && self.phase_released.is_none()) {
            return vec![];
        }
        let mut out = vec![Output::Log(format!(
            "phase {} `{}` done: {active} of {n} active",
            self.phase, spec.name
        ))];
        if last {
            self.state = RolloutState::Completed;
            out.push(Output::Log(format!("rollout {} completed", self.name)));
            out.extend(self.give_the_rest(now));
            return out;
        }
        if spec.mode == Mode::Shadow {
            // The devices that ran it in shadow go on with the next phase.
            let phase = self.phase;
            for d in self.devices.values_mut().filter(|d| d.phase == phase) {
                d.phase = phase + 1;
                d.state = DeviceState::Waiting;
            }
        }
        self.phase += 1;
        self.phase_started = 0;
        self.phase_succeeded = None;
        self.phase_released = None;
        out.extend(self.start(now));
        out
    }

    /// An operator's abort (a signed [`command::Command`]): stops the rollout as a failure
    /// would and sends every device already moved back.
    pub fn on_abort(&mut self, reason: &str, by: &str) -> Vec<Output> {
        if self.state != RolloutState::Running {
            return vec![];
        }
        let mut out = self.abort(format!(
            "phase {} `{}`: aborted by {by}: {reason}",
            self.phase, self.plan.phases[self.phase].name
        ));
        out.push(Output::Save);
        out
    }

    /// An operator's pause (`true`) or resume (a signed [`command::Command`]); a resumed phase
    /// that is ready is promoted at once.
    pub fn on_pause(&mut self, paused: bool, by: &str, now: u64) -> Vec<Output> {
        if self.state != RolloutState::Running || self.paused == paused {
            return vec![];
        }
        self.paused = paused;
        let what = if paused { "paused" } else { "resumed" };
        let mut out = vec![Output::Log(format!(
            "phase {} `{}`: {what} by {by}",
            self.phase, self.plan.phases[self.phase].name
        ))];
        out.extend(self.evaluate(now));
        out.push(Output::Save);
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
                    shadow: false,
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

/// A shadow phase's device: running the new model in shadow, or failed to.
fn shadow_state(
    now: &DeviceState,
    s: &Status,
    (model, version): (&str, u64),
) -> Option<DeviceState> {
    let sh = s
        .shadow
        .as_ref()
        .filter(|sh| sh.name == model && sh.version == version)?;
    match (now, &sh.state) {
        (DeviceState::Moved | DeviceState::TimedOut, ShadowState::Running) => {
            Some(DeviceState::Shadowing)
        }
        (DeviceState::Moved, ShadowState::Failed) => Some(DeviceState::Failed(
            sh.error.clone().unwrap_or_else(|| "shadow failed".into()),
        )),
        _ => None,
    }
}
