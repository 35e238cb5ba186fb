//! A phase's pace: how many devices are given the new model when. Like AWS IoT Jobs' rollout
//! configuration: a maximum rate (devices a minute, spread evenly over it), optionally ramped
//! up exponentially as devices succeed, and a maximum number of devices downloading or
//! installing at once (hawkBit's and Mender's bound on concurrent deployments). The last is
//! what keeps a broker's memory bounded whatever the fleet's size: each device fetching an
//! artifact has the broker queue its chunks, so the queued bytes grow with the devices in
//! progress, not with the fleet. A device in progress for longer than its timeout counts as
//! failed ([`Controller::time_out`]).
//!
//! ```toml
//! [[phases]]
//! name = "everyone"
//! percent = 100
//! max_per_minute = 1000        # at most 1000 devices a minute
//! max_in_progress = 200        # at most 200 fetching or installing at once
//! ramp = { start_per_minute = 50, factor = 2, every = 100 }   # ×2 per 100 successes
//! device_timeout_s = 600
//! abort_failure_rate = 0.05    # abort when over 5% of the finished devices failed...
//! abort_min_finished = 100     # ...once at least 100 finished
//! success = 0.95
//! ```

use serde::{Deserialize, Serialize};

use super::{Controller, Device, DeviceState, Output, PhaseSpec, RolloutState};

/// Devices downloading or installing at once when a phase does not say: at 3.6 MB (a whole
/// int8-weights MobileNetV2 artifact) the broker queues at most ~360 MB of chunks for them.
pub const DEFAULT_MAX_IN_PROGRESS: usize = 100;

/// An exponential ramp: the rate starts at `start_per_minute` and is multiplied by `factor`
/// each time `every` more devices of the phase have the new model active, up to the phase's
/// `max_per_minute` (AWS IoT Jobs' `exponentialRate` with `numberOfSucceededThings`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Ramp {
    pub start_per_minute: f64,
    pub factor: f64,
    pub every: usize,
}

/// Whether a phase's pace makes sense.
pub(super) fn check(ph: &PhaseSpec) -> Result<(), String> {
    let positive = |x: f64| x > 0.0 && x.is_finite();
    if ph.max_per_minute.is_some_and(|r| !positive(r)) {
        return Err("max_per_minute must be a positive number".into());
    }
    if ph.max_in_progress == Some(0) || ph.device_timeout_s == Some(0) {
        return Err("max_in_progress and device_timeout_s must be at least 1".into());
    }
    if let Some(r) = &ph.ramp
        && !(positive(r.start_per_minute) && r.factor >= 1.0 && r.factor.is_finite() && r.every > 0)
    {
        return Err(
            "ramp needs start_per_minute > 0, factor >= 1 and every >= 1 (devices succeeded)"
                .into(),
        );
    }
    if ph
        .abort_failure_rate
        .is_some_and(|f| !(0.0..=1.0).contains(&f))
    {
        return Err("abort_failure_rate is a fraction in [0, 1]".into());
    }
    if ph.abort_min_finished.is_some() && ph.abort_failure_rate.is_none() {
        return Err("abort_min_finished needs abort_failure_rate".into());
    }
    Ok(())
}

/// The devices a phase may give the model now: a token bucket filled at the phase's rate, that
/// holds at most one second's worth and one device, reckoned at `at` (unix s).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Credit {
    pub devices: f64,
    pub at: u64,
}

impl Credit {
    /// A phase's bucket at its start: one second's worth.
    pub(super) fn starting(spec: &PhaseSpec, now: u64) -> Self {
        Self {
            devices: rate(spec, 0).map_or(0.0, |r| (r / 60.0).max(1.0)),
            at: now,
        }
    }

    /// Filled at `rate` for the seconds since it was last reckoned.
    fn refilled(mut self, rate: Option<f64>, now: u64) -> Self {
        if let Some(r) = rate {
            let since = now.saturating_sub(self.at) as f64;
            self.devices = (self.devices + r / 60.0 * since).min(r / 60.0 + 1.0);
        }
        self.at = now;
        self
    }
}

/// The highest rate a ramp reaches, in devices a minute: a ramp with no `max_per_minute` stops
/// here rather than at infinity (which a saved state could not hold).
pub const MAX_RATE: f64 = 1_000_000.0;

/// A phase's rate now, in devices a minute (`None`: no limit), after `succeeded` of its devices
/// have the new model.
pub fn rate(spec: &PhaseSpec, succeeded: usize) -> Option<f64> {
    let ramped = spec.ramp.as_ref().map(|r| {
        let steps = (succeeded / r.every).min(1_000) as i32;
        (r.start_per_minute * r.factor.powi(steps)).min(MAX_RATE)
    });
    match (ramped, spec.max_per_minute) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The strict form of a rate of `r` devices a minute: at most `count` devices given the model
/// in any `window_s` seconds. At 1 or more a minute, ⌊r⌋ in any minute; below that, one device
/// in any 60/r seconds (0.5 a minute: one every two minutes).
pub fn window(r: f64) -> (usize, u64) {
    if r >= 1.0 {
        (r.floor() as usize, 60)
    } else {
        (1, (60.0 / r).ceil() as u64)
    }
}

/// The order [`Controller::new`] cuts the fleet into phases in: stable and pseudo-random per
/// rollout.
pub(super) fn order_key(rollout: &str, device: &str) -> String {
    kestrel_shared::wire::sha256_hex(format!("{rollout}/{device}").as_bytes())
}

/// The order a phase's devices are given the model in: stable and pseudo-random per rollout, so
/// the first devices to finish are not all of one site whose ids sort together. FNV-1a, not a
/// digest: it is reckoned for every waiting device on every tick (10,000 of them in well under a
/// millisecond), and nothing depends on it being hard to predict.
fn release_key(rollout: &str, device: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in rollout.bytes().chain([b'/']).chain(device.bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

impl Controller {
    /// The spec whose pace governs now: the current phase's (after a dynamic rollout's last
    /// phase, the last one's).
    fn pacing(&self) -> Option<&PhaseSpec> {
        match self.state {
            RolloutState::Running if !self.paused => Some(&self.plan.phases[self.phase]),
            RolloutState::Completed if self.plan.dynamic => self.plan.phases.last(),
            _ => None,
        }
    }

    /// Gives the model to as many waiting online devices of the current phase (or an earlier
    /// one: a device that came back, or joined late) as the pace allows at `now`.
    pub(super) fn release(&mut self, now: u64) -> Vec<Output> {
        let Some(spec) = self.pacing().cloned() else {
            return vec![];
        };
        let phase = self.phase;
        let succeeded = self
            .phase_devices(phase)
            .filter(|d| matches!(d.state, DeviceState::Active | DeviceState::Shadowing))
            .count();
        let rate = rate(&spec, succeeded);
        self.pace = std::mem::take(&mut self.pace).refilled(rate, now);
        // A device given the model that went offline is still in progress: it may come back
        // to fetch, and a model that crashes its device must not free the device's place.
        let in_progress = self
            .devices
            .values()
            .filter(|d| d.state == DeviceState::Moved)
            .count();
        let mut allowed = spec
            .max_in_progress
            .unwrap_or(DEFAULT_MAX_IN_PROGRESS)
            .saturating_sub(in_progress);
        if let Some(r) = rate {
            // Strictly at most `count` in any `window_s`, whatever the bucket holds.
            let (count, window_s) = window(r);
            let recent = self
                .devices
                .values()
                .filter(|d| d.moved_at.is_some_and(|t| t + window_s > now))
                .count();
            allowed = allowed
                .min(self.pace.devices.floor() as usize)
                .min(count.saturating_sub(recent));
        }
        let mut waiting: Vec<&Device> = self
            .devices
            .values()
            .filter(|d| d.state == DeviceState::Waiting && !d.offline && d.phase <= phase)
            .collect();
        if waiting.len() > allowed {
            let key = |d: &&Device| release_key(&self.name, &d.id);
            if allowed > 0 {
                waiting.select_nth_unstable_by_key(allowed - 1, key);
            }
            waiting.truncate(allowed);
            waiting.sort_unstable_by_key(key);
        }
        let chosen: Vec<String> = waiting.into_iter().map(|d| d.id.clone()).collect();
        if rate.is_some() {
            self.pace.devices -= chosen.len() as f64;
        }
        let mut out = Vec::with_capacity(chosen.len());
        for id in &chosen {
            let d = self.devices.get_mut(id).expect("chosen above");
            d.state = DeviceState::Moved;
            d.moved_at = Some(now);
            if let Some(q) = d.quality.as_mut() {
                q.restart();
            }
            out.push(self.desired_for(&self.devices[id]));
        }
        if self.phase_released.is_none()
            && !self
                .devices
                .values()
                .any(|d| d.state == DeviceState::Waiting && !d.offline && d.phase <= phase)
        {
            self.phase_released = Some(now);
        }
        out
    }

    /// Devices in progress for longer than their phase's device timeout count as timed out,
    /// offline or not: a device that went offline after it was given the model (a model that
    /// crashes it, a power cut) has not succeeded, and a late success still counts when it
    /// reports one.
    pub(super) fn time_out(&mut self, now: u64) -> Vec<Output> {
        let phases = &self.plan.phases;
        let since = self.phase_started;
        let mut out = Vec::new();
        for d in self.devices.values_mut() {
            let limit = phases[d.phase]
                .device_timeout_s
                .unwrap_or(phases[d.phase].timeout_s);
            if d.state == DeviceState::Moved && now >= d.moved_at.unwrap_or(since) + limit {
                d.state = DeviceState::TimedOut;
                out.push(Output::Log(format!("{}: timed out", d.id)));
            }
        }
        out
    }

    /// The current phase's deadline: its timeout after every online device was given the model.
    pub(super) fn deadline(&self) -> Option<u64> {
        self.phase_released
            .map(|t| t + self.plan.phases[self.phase].timeout_s)
    }
}
