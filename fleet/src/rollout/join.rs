//! Dynamic rollouts: devices that appear after the rollout began, and devices that go offline and
//! come back. A device that reports for the first time joins the phase the plan gives it (the
//! first phase of a group the plan lists it in, else the last phase that takes a share of the
//! fleet; none, when every phase is a group's and none lists it) or, when that phase is over,
//! the current one, and is given the model at the current phase's pace; after the last phase, a
//! `dynamic` rollout's controller goes on giving it to such devices. A device whose retained
//! `online` says `0` before it was given the model is left out of its phase's counts until it is
//! back. One still offline when a plain rollout completes is given the model then (its retained
//! desired state waits for it on the broker, valid for DEFAULT_VALIDITY_S); a dynamic rollout's
//! controller gives it the model at the last phase's pace when it is back.

use kestrel_shared::protocol::Status;

use super::{Controller, Device, DeviceState, Mode, Output, RolloutState};

impl Controller {
    /// The phase a device that joins now belongs to, if any takes it.
    fn phase_for(&self, s: &Status) -> Option<usize> {
        let phases = &self.plan.phases;
        let member = |g: &String| {
            self.plan
                .groups
                .get(g)
                .is_some_and(|m| m.contains(&s.device))
        };
        let by_plan = phases
            .iter()
            .position(|ph| ph.group.as_ref().is_some_and(member))
            .or_else(|| phases.iter().rposition(|ph| ph.percent.is_some()))?;
        let mut phase = by_plan.max(self.phase);
        // A shadow phase runs the new model beside the device's own: one without a model goes
        // on with the next phase (the last phase activates: `Plan::parse`).
        while phases[phase].mode == Mode::Shadow && s.active.is_none() {
            phase += 1;
        }
        Some(phase)
    }

    /// A status from a device the rollout does not know: it joins, if the plan takes it.
    pub(super) fn join(&mut self, s: &Status) -> Vec<Output> {
        let open = match self.state {
            RolloutState::Running => true,
            RolloutState::Completed => self.plan.dynamic,
            RolloutState::Aborted(_) => false,
        };
        if !open
            || self
                .plan
                .devices
                .as_ref()
                .is_some_and(|list| !list.contains(&s.device))
        {
            return vec![];
        }
        let Some(phase) = self.phase_for(s) else {
            return vec![];
        };
        self.devices
            .insert(s.device.clone(), Device::waiting(s, phase, true));
        vec![Output::Log(format!(
            "{}: joined late, in phase {phase} `{}`",
            s.device, self.plan.phases[phase].name
        ))]
    }

    /// A device's retained `online` changed (from its topic: `1` online, `0` offline).
    pub fn on_online(&mut self, device: &str, online: bool, now: u64) -> Vec<Output> {
        let Some(d) = self.devices.get_mut(device) else {
            return vec![];
        };
        if d.offline != online {
            return vec![];
        }
        d.offline = !online;
        let mut out = vec![Output::Log(format!(
            "{device}: {}",
            if online { "back online" } else { "offline" }
        ))];
        out.extend(self.evaluate(now));
        out.push(Output::Save);
        out
    }

    /// The rollout completed: the devices not given the model yet (offline ones) are given it
    /// now, to fetch when they are back (all at once, unpaced: no controller runs then). A
    /// dynamic rollout's controller goes on, and gives it to each at the last phase's pace when
    /// it is back.
    pub(super) fn give_the_rest(&mut self, now: u64) -> Vec<Output> {
        if self.plan.dynamic {
            return vec![];
        }
        let rest: Vec<String> = self
            .devices
            .values()
            .filter(|d| d.state == DeviceState::Waiting)
            .map(|d| d.id.clone())
            .collect();
        let mut out = Vec::with_capacity(rest.len() + 1);
        if !rest.is_empty() {
            out.push(Output::Log(format!(
                "{} devices not given the model yet (offline) are given it now",
                rest.len()
            )));
        }
        for id in rest {
            let d = self.devices.get_mut(&id).expect("listed above");
            d.state = DeviceState::Moved;
            d.moved_at = Some(now);
            out.push(self.desired_for(&self.devices[&id]));
        }
        out
    }
}
