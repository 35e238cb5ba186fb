//! A rollout's plan (fleet.toml): its phases, who is in each (a group the plan names, or a share
//! of the fleet), and what each must meet to pass (success and failure thresholds, quality
//! gates, pace); checked as it is read.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::pace;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error("{path}: {reason}")]
    Invalid { path: String, reason: String },
}

fn default_timeout() -> u64 {
    300
}

/// What a phase's devices do with the new model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Activate it.
    #[default]
    Active,
    /// Run it in shadow beside their model, then go on with the next phase.
    Shadow,
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
    /// Fraction of the phase's devices that must report the new model active to promote
    /// [default: 1, or 1 − abort_failure_rate when that is given; filled in by `Plan::parse`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub success: Option<f64>,
    /// Failures (rejected, rolled back, timed out) tolerated: a fraction of the phase's devices...
    #[serde(default)]
    pub failure: Option<f64>,
    /// ...or a count (default 0: the first failure aborts).
    #[serde(default)]
    pub max_failures: Option<usize>,
    /// Seconds the phase may take once every online device of it was given the model; its
    /// devices still pending then fail the phase's success threshold.
    #[serde(default = "default_timeout")]
    pub timeout_s: u64,
    /// Seconds to watch a successful phase before promoting (bake time).
    #[serde(default)]
    pub soak_s: u64,
    #[serde(default)]
    pub mode: Mode,
    /// Quality gate: requests the new model answered (or, in shadow, was compared on) over the
    /// phase's devices before the other gates are judged and the phase may pass.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_requests: Option<u64>,
    /// Quality gate (shadow phases): top-1 agreement with the devices' active model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_shadow_agreement: Option<f64>,
    /// Quality gate: the previous model's mean top-1 confidence minus the new model's, on the
    /// same devices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_confidence_drop: Option<f64>,
    /// Quality gate: the share of the phase's devices whose latest window is flagged as drifted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_drift_devices: Option<f64>,
    /// Devices that must report requests before the phase's gates are judged [default: a
    /// majority of the phase's devices].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_reporting_devices: Option<usize>,
    /// Requests a second a device may claim since the phase started; a device claiming more
    /// is excluded from the gates [default: gates::MAX_REQUEST_RATE].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_request_rate: Option<f64>,
    /// Pace: devices given the new model a minute, at most (spread evenly over the minute)
    /// [default: no limit but `max_in_progress`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_per_minute: Option<f64>,
    /// Pace: devices downloading or installing at once, at most [default:
    /// pace::DEFAULT_MAX_IN_PROGRESS].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_in_progress: Option<usize>,
    /// Pace: an exponential ramp of the rate, up to `max_per_minute`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ramp: Option<pace::Ramp>,
    /// Seconds a device may take from its desired state to the new model active before it
    /// counts as timed out [default: timeout_s].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_timeout_s: Option<u64>,
    /// Abort once the failed share of the phase's finished devices (active, failed, timed out)
    /// exceeds this fraction...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abort_failure_rate: Option<f64>,
    /// ...and at least this many of its devices finished [default: 1].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abort_min_finished: Option<usize>,
}

impl PhaseSpec {
    /// The share of the phase's devices that must have the new model active to promote.
    pub fn success(&self) -> f64 {
        self.success
            .unwrap_or_else(|| self.abort_failure_rate.map_or(1.0, |r| 1.0 - r))
    }

    pub(super) fn allowed_failures(&self, n: usize) -> usize {
        match (self.failure, self.max_failures) {
            (Some(f), _) => (f * n as f64).floor() as usize,
            (None, Some(m)) => m,
            // A failure rate given alone judges the failures.
            (None, None) if self.abort_failure_rate.is_some() => usize::MAX,
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
    /// Group membership for phases with a `group` (`[groups]`: `canary = ["pi-01", ...]`): the
    /// operator's word. The groups a device lists in its own status choose only which group
    /// desired states it follows, never which phase of a rollout it is in.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub groups: BTreeMap<String, Vec<String>>,
    /// After the last phase, keep serving the devices that appear or come back (the controller
    /// runs on until it is stopped); without it a completed rollout's controller exits.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dynamic: bool,
    pub phases: Vec<PhaseSpec>,
}

impl Plan {
    pub fn parse(text: &str, path: &str) -> Result<Self, PlanError> {
        let bad = |reason: String| PlanError::Invalid {
            path: path.to_string(),
            reason,
        };
        let mut p: Plan = toml::from_str(text).map_err(|e| bad(e.to_string()))?;
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
            let fractions = [
                ph.success,
                ph.failure,
                ph.min_shadow_agreement,
                ph.max_drift_devices,
            ];
            if fractions.iter().flatten().any(|f| !(0.0..=1.0).contains(f))
                || ph
                    .max_confidence_drop
                    .is_some_and(|d| !(-1.0..=1.0).contains(&d))
            {
                return Err(bad(format!(
                    "{what}: success, failure, min_shadow_agreement and max_drift_devices are \
                     fractions in [0, 1], max_confidence_drop is in [-1, 1]"
                )));
            }
            if let Some(g) = &ph.group
                && !p.groups.contains_key(g)
            {
                return Err(bad(format!(
                    "{what}: group `{g}` is not listed in the plan's [groups] (a rollout takes \
                     group membership from the plan, never from what devices say of themselves)"
                )));
            }
            if ph
                .max_request_rate
                .is_some_and(|r| !(r > 0.0 && r.is_finite()))
                || ph.min_reporting_devices == Some(0)
            {
                return Err(bad(format!(
                    "{what}: max_request_rate must be a positive number and min_reporting_devices at least 1"
                )));
            }
            pace::check(ph).map_err(|reason| bad(format!("{what}: {reason}")))?;
            if ph.min_shadow_agreement.is_some() && ph.mode != Mode::Shadow {
                return Err(bad(format!(
                    "{what}: min_shadow_agreement needs mode = \"shadow\""
                )));
            }
        }
        for ph in &mut p.phases {
            // Written out, so the saved state says what was judged.
            ph.success = Some(ph.success());
        }
        if p.phases.last().is_some_and(|ph| ph.mode == Mode::Shadow) {
            return Err(bad(
                "the last phase is in shadow mode: a phase that activates must follow".into(),
            ));
        }
        Ok(p)
    }
}
