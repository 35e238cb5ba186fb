//! A rollout's state as text (`trainer rollout`, `trainer rollout status`): devices per phase
//! and state, bytes fetched, gates, and the devices excluded, late or offline.

use kestrel_shared::human_bytes;

use super::{Controller, DeviceState, Mode, RolloutState};

/// One line per phase: devices per state.
pub fn table(c: &Controller) -> String {
    let mut out = format!(
        "rollout {}: {} v{} — {}\n{:<4}{:<16}{:>8}{:>8}{:>8}{:>8}{:>10}{:>12}\n",
        c.name,
        c.model,
        c.version,
        match &c.state {
            RolloutState::Running if c.paused => format!("running phase {}, paused", c.phase),
            RolloutState::Running => format!("running phase {}", c.phase),
            RolloutState::Completed => "completed".into(),
            RolloutState::Aborted(r) => format!("aborted: {r}"),
        },
        "#",
        "phase",
        "devices",
        "waiting",
        "moved",
        "active",
        "failed",
        "rolled-back"
    );
    // Shadow-phase devices that passed show under the phase they went on with; `active` counts
    // a shadow phase's devices running the model in shadow.
    for (i, ph) in c.plan.phases.iter().enumerate() {
        let mut n = [0usize; 5];
        for d in c.phase_devices(i) {
            n[match d.state {
                DeviceState::Waiting => 0,
                DeviceState::Moved => 1,
                DeviceState::Active | DeviceState::Shadowing => 2,
                DeviceState::Failed(_) | DeviceState::TimedOut => 3,
                DeviceState::RolledBack => 4,
            }] += 1;
        }
        let name = match ph.mode {
            Mode::Shadow => format!("{} (shadow)", ph.name),
            Mode::Active => ph.name.clone(),
        };
        out.push_str(&format!(
            "{i:<4}{:<16}{:>8}{:>8}{:>8}{:>8}{:>10}{:>12}\n",
            name,
            n.iter().sum::<usize>(),
            n[0],
            n[1],
            n[2],
            n[3],
            n[4]
        ));
    }
    if c.artifact_bytes > 0 {
        let n = c.devices.len().max(1) as u64;
        out.push_str(&format!(
            "fetched {} in all, {} per device (the whole artifact: {} per device)\n",
            human_bytes(c.bytes_fetched()),
            human_bytes(c.bytes_fetched() / n),
            human_bytes(c.artifact_bytes)
        ));
    }
    let late: Vec<&str> = c
        .devices
        .values()
        .filter(|d| d.late)
        .map(|d| d.id.as_str())
        .collect();
    let offline: Vec<&str> = c
        .devices
        .values()
        .filter(|d| d.offline)
        .map(|d| d.id.as_str())
        .collect();
    for (what, ids) in [("joined late", late), ("offline", offline)] {
        if let Some(first) = ids.first() {
            out.push_str(&format!("{what}: {} devices (first: {first})\n", ids.len()));
        }
    }
    for g in &c.gates {
        let verdict = match g.passed {
            Some(true) => "ok",
            Some(false) => "BREACHED",
            None => "waiting",
        };
        out.push_str(&format!(
            "gate (phase {}) {}: {verdict}\n",
            g.phase,
            g.describe()
        ));
    }
    for d in c.devices.values() {
        if let Some(why) = d.quality.as_ref().and_then(|q| q.excluded.as_ref()) {
            out.push_str(&format!(
                "excluded from the quality gates: {}: {why}\n",
                d.id
            ));
        }
    }
    out
}
