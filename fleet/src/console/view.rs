//! [`FleetView`]: the console's picture of the fleet, a sans-IO state fed the broker's messages
//! (retained statuses, quality reports, presence, events and rollout controllers) and read as
//! JSON rows. Every change gets a sequence number, so a client that saw `seq` asks for what
//! changed since ([`FleetView::delta`]) instead of the whole fleet.

use std::collections::{BTreeMap, VecDeque};

use kestrel_shared::capture::CaptureStats;
use kestrel_shared::protocol::{DeviceCounters, DeviceEvent, LatencyHistogram, Status};
use kestrel_shared::quality::DeviceQuality;
use kestrel_shared::topics::{self, DeviceTopic, Route, Topics};
use kestrel_shared::wire;
use serde::Serialize;

use crate::rollout::gates::Gate;
use crate::rollout::{Controller, DeviceState, Mode, RolloutState};

/// Points kept per device for the confidence and drift sparklines.
pub const HISTORY: usize = 30;
/// Events kept for the feed, per source: a fleet's device chatter never pushes a rollout's
/// transitions out.
pub const EVENTS: usize = 500;

/// The topic filters the console subscribes to.
pub fn filters(topics: &Topics) -> Vec<String> {
    vec![
        topics.status_filter(),
        topics.quality_filter(),
        topics.online_filter(),
        topics.events_filter(),
        topics.rollout_states_filter(),
    ]
}

/// One device as the console shows it (`/api/devices`).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DeviceRow {
    pub id: String,
    pub groups: Vec<String>,
    /// From `P/devices/<id>/online` (None: never said).
    pub online: Option<bool>,
    /// The update machine's state (None: no status yet).
    pub state: Option<wire::DeviceState>,
    pub model: Option<String>,
    pub active: Option<u64>,
    pub previous: Option<u64>,
    pub target: Option<u64>,
    pub progress: Option<(u32, u32)>,
    pub last_error: Option<String>,
    pub p50_ms: Option<f64>,
    pub shadow: Option<String>,
    /// The latest quality window: mean top-1 confidence, the reference's, and the drift test.
    pub confidence: Option<f64>,
    pub reference_confidence: Option<f64>,
    pub drift_z: Option<f64>,
    pub drift_flagged: Option<bool>,
    pub requests: Option<u64>,
    /// The last [`HISTORY`] windows' confidence and drift z, oldest first.
    pub confidence_history: VecDeque<f64>,
    pub drift_history: VecDeque<f64>,
    pub updated: Option<String>,
    /// The registry version of the active model (`models:/NAME/VERSION`).
    pub source: Option<String>,
    /// Requests and updates since the device's agent process started.
    pub counters: DeviceCounters,
    pub captures: Option<CaptureStats>,
    /// Latency histogram since the agent process started (for `/metrics` only).
    #[serde(skip)]
    pub latency: LatencyHistogram,
    /// Sequence number of the last change.
    pub seq: u64,
}

impl DeviceRow {
    fn take_status(&mut self, s: Status) {
        self.groups = s.groups;
        self.state = Some(s.state);
        self.model = s.model;
        self.active = s.active;
        self.previous = s.previous;
        self.target = s.target;
        self.progress = s.progress;
        self.last_error = s.last_error;
        self.p50_ms = (s.latency.count > 0).then_some(s.latency.p50_ms);
        self.latency = s.latency.histogram;
        self.source = s.source;
        self.counters = s.counters;
        self.captures = s.captures;
        self.shadow = s
            .shadow
            .map(|sh| format!("{} v{}: {}", sh.name, sh.version, sh.state));
        self.updated = Some(s.updated);
    }

    /// A new window goes into the history; the same one delivered again (retained, after a
    /// reconnect) does not.
    fn take_quality(&mut self, q: DeviceQuality) {
        let Some(w) = q.window else {
            return;
        };
        let push = |h: &mut VecDeque<f64>, x: f64| {
            if h.len() == HISTORY {
                h.pop_front();
            }
            h.push_back(x);
        };
        if self.requests != Some(w.total_requests) || self.confidence_history.is_empty() {
            push(&mut self.confidence_history, w.mean_confidence);
            push(&mut self.drift_history, w.drift.max_z);
        }
        self.confidence = Some(w.mean_confidence);
        self.reference_confidence = Some(w.reference_confidence);
        self.drift_z = Some(w.drift.max_z);
        self.drift_flagged = Some(w.drift.flagged);
        self.requests = Some(w.total_requests);
    }

    /// The version the device runs, as a filter value: `v3`, or `none`.
    pub fn version_label(&self) -> String {
        match (&self.model, self.active) {
            (Some(m), Some(v)) => format!("{m} v{v}"),
            _ => "none".into(),
        }
    }
}

/// One entry of the event feed (`/api/events`): a device's event, or a rollout's transition.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventRow {
    pub seq: u64,
    /// RFC 3339 UTC (the device's clock for device events; the console's for the others).
    pub time: String,
    pub source: EventSource,
    /// Device id or rollout name.
    pub subject: String,
    pub kind: String,
    pub text: String,
}

/// Who an event is about (`device` or `rollout` in JSON); each has its own [`EVENTS`] ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EventSource {
    Device,
    Rollout,
}

/// One phase of a rollout: its devices counted per state.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PhaseRow {
    pub index: usize,
    pub name: String,
    pub mode: Mode,
    /// `done`, `current` or `pending` (`current` is the phase where an ended rollout stopped).
    pub progress: String,
    pub devices: usize,
    pub waiting: usize,
    pub moved: usize,
    pub active: usize,
    pub failed: usize,
    pub rolled_back: usize,
    /// Devices that joined after the rollout began...
    pub late: usize,
    /// ...the first 20 of them (in id order).
    pub late_devices: Vec<String>,
    /// Devices whose agent is offline.
    pub offline: usize,
    pub timeout_s: u64,
    pub soak_s: u64,
    /// Up to 20 failed devices with their reason.
    pub failures: Vec<(String, String)>,
    /// Up to 20 devices excluded from the quality gates for implausible claims, with why.
    pub excluded: Vec<(String, String)>,
}

/// A rollout as the console shows it (`/api/rollouts`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RolloutRow {
    pub name: String,
    pub model: String,
    pub version: u64,
    pub state: RolloutStatus,
    pub reason: Option<String>,
    pub phase: usize,
    /// Held in its phase by an operator (`trainer console --allow-actions`).
    pub paused: bool,
    /// Unix seconds when the current phase started.
    pub phase_started: u64,
    pub phases: Vec<PhaseRow>,
    pub gates: Vec<Gate>,
    pub seq: u64,
}

/// A rollout's state as the console shows it (`running`, `completed` or `aborted`; a held one is
/// `running` with `paused`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RolloutStatus {
    Running,
    Completed,
    Aborted,
}

impl RolloutStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Completed => "completed",
            Self::Aborted => "aborted",
        }
    }
}

impl std::fmt::Display for RolloutStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

impl RolloutRow {
    fn new(c: &Controller, seq: u64) -> Self {
        let (state, reason) = match &c.state {
            RolloutState::Running => (RolloutStatus::Running, None),
            RolloutState::Completed => (RolloutStatus::Completed, None),
            RolloutState::Aborted(r) => (RolloutStatus::Aborted, Some(r.clone())),
        };
        let phases = (0..c.plan.phases.len()).map(|i| phase_row(c, i)).collect();
        Self {
            name: c.name.clone(),
            model: c.model.clone(),
            version: c.version,
            state,
            reason,
            phase: c.phase,
            paused: c.paused,
            phase_started: c.phase_started,
            phases,
            gates: c.gates.clone(),
            seq,
        }
    }
}

fn phase_row(c: &Controller, i: usize) -> PhaseRow {
    let spec = &c.plan.phases[i];
    let progress = if i < c.phase || c.state == RolloutState::Completed {
        "done"
    } else if i == c.phase {
        "current"
    } else {
        "pending"
    };
    let mut row = PhaseRow {
        index: i,
        name: spec.name.clone(),
        mode: spec.mode,
        progress: progress.into(),
        devices: 0,
        waiting: 0,
        moved: 0,
        active: 0,
        failed: 0,
        rolled_back: 0,
        late: 0,
        late_devices: Vec::new(),
        offline: 0,
        timeout_s: spec.timeout_s,
        soak_s: spec.soak_s,
        failures: Vec::new(),
        excluded: Vec::new(),
    };
    for d in c.phase_devices(i) {
        row.devices += 1;
        row.late += usize::from(d.late);
        if d.late && row.late_devices.len() < 20 {
            row.late_devices.push(d.id.clone());
        }
        row.offline += usize::from(d.offline);
        if let Some(why) = d.quality.as_ref().and_then(|q| q.excluded.as_ref())
            && row.excluded.len() < 20
        {
            row.excluded.push((d.id.clone(), why.clone()));
        }
        match &d.state {
            DeviceState::Waiting => row.waiting += 1,
            DeviceState::Moved => row.moved += 1,
            DeviceState::Active | DeviceState::Shadowing => row.active += 1,
            DeviceState::RolledBack => row.rolled_back += 1,
            DeviceState::Failed(why) => {
                row.failed += 1;
                if row.failures.len() < 20 {
                    row.failures.push((d.id.clone(), why.clone()));
                }
            }
            DeviceState::TimedOut => {
                row.failed += 1;
                if row.failures.len() < 20 {
                    row.failures.push((d.id.clone(), "timed out".into()));
                }
            }
        }
    }
    row
}

/// What changed since a sequence number (`full`: everything, for a new client).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Delta {
    pub seq: u64,
    pub full: bool,
    pub devices: Vec<DeviceRow>,
    pub rollouts: Vec<RolloutRow>,
    pub events: Vec<EventRow>,
}

/// Device filters of `/api/devices` (and of the page): all given must hold.
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct DeviceFilter {
    pub group: Option<String>,
    pub state: Option<String>,
    /// `MODEL vN`, `vN`, `N` or `none`.
    pub version: Option<String>,
    pub online: Option<bool>,
    /// Device ids that contain this text (ignoring case).
    pub q: Option<String>,
}

/// A page of `/api/devices`: `offset` rows skipped, at most `limit` returned [all].
#[derive(Debug, Clone, Copy, Default, serde::Deserialize)]
pub struct Page {
    #[serde(default)]
    pub offset: usize,
    pub limit: Option<usize>,
}

impl DeviceFilter {
    pub fn accepts(&self, d: &DeviceRow) -> bool {
        let version_ok = |want: &str| {
            let label = d.version_label();
            let want = want.trim();
            label == want
                || d.active
                    .is_some_and(|v| want.trim_start_matches('v').parse::<u64>().ok() == Some(v))
        };
        self.group.as_ref().is_none_or(|g| d.groups.contains(g))
            && self
                .state
                .as_ref()
                .is_none_or(|s| d.state == Some(wire::DeviceState::parse(s)))
            && self.version.as_deref().is_none_or(version_ok)
            && self.online.is_none_or(|o| d.online == Some(o))
            && self
                .q
                .as_ref()
                .is_none_or(|q| d.id.to_lowercase().contains(&q.to_lowercase()))
    }
}

/// The console's state: every device, rollout and recent event seen on the broker.
#[derive(Debug, Default)]
pub struct FleetView {
    topics: Topics,
    devices: BTreeMap<String, DeviceRow>,
    rollouts: BTreeMap<String, RolloutRow>,
    /// Device events, then rollout transitions: one ring each, so neither evicts the other.
    events: [VecDeque<EventRow>; 2],
    seq: u64,
}

/// A message the console could not read (it is skipped, and said on stderr).
#[derive(Debug, thiserror::Error)]
#[error("{topic}: {reason}")]
pub struct BadMessage {
    pub topic: String,
    pub reason: String,
}

impl FleetView {
    pub fn new(prefix: &str) -> Self {
        Self {
            topics: Topics::new(prefix),
            ..Self::default()
        }
    }

    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Takes in one message; `now` (RFC 3339) stamps the console's own events. Returns whether
    /// anything changed.
    /// A device's message is taken only from the topic of the device it names: one whose
    /// payload names another is refused like a malformed one.
    pub fn apply(&mut self, topic: &str, payload: &[u8], now: &str) -> Result<bool, BadMessage> {
        let topics = self.topics.clone();
        let bad = |e: &dyn std::fmt::Display| BadMessage {
            topic: topic.to_string(),
            reason: e.to_string(),
        };
        match topics.parse(topic) {
            Some(Route::Device { device, kind }) => {
                if payload.is_empty() {
                    // A cleared retained status: the device is forgotten.
                    return Ok(kind == DeviceTopic::Status && self.forget_device(device));
                }
                match kind {
                    DeviceTopic::Status => {
                        let s: Status = topics::from_device(&topics, kind, topic, payload)
                            .map_err(|e| bad(&e))?;
                        self.device(device).take_status(s);
                    }
                    DeviceTopic::Quality => {
                        let q: DeviceQuality = topics::from_device(&topics, kind, topic, payload)
                            .map_err(|e| bad(&e))?;
                        self.device(device).take_quality(q);
                    }
                    DeviceTopic::Online => self.device(device).online = Some(payload == b"1"),
                    DeviceTopic::Events => {
                        let e: DeviceEvent = topics::from_device(&topics, kind, topic, payload)
                            .map_err(|e| bad(&e))?;
                        self.device_event(e);
                    }
                    _ => return Ok(false),
                }
                Ok(true)
            }
            Some(Route::RolloutState { name }) if payload.is_empty() => {
                self.seq += 1;
                Ok(self.rollouts.remove(name).is_some())
            }
            Some(Route::RolloutState { name }) => {
                let c = crate::rollout::saved::read(topic, payload).map_err(|e| bad(&e))?;
                if c.name != name {
                    return Err(bad(&format!("the state of rollout `{}`", c.name)));
                }
                self.rollout(&c, now);
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// The device's row, marked changed.
    fn device(&mut self, id: &str) -> &mut DeviceRow {
        self.seq += 1;
        let seq = self.seq;
        let d = self
            .devices
            .entry(id.to_string())
            .or_insert_with(|| DeviceRow {
                id: id.to_string(),
                ..DeviceRow::default()
            });
        d.seq = seq;
        d
    }

    fn forget_device(&mut self, id: &str) -> bool {
        self.seq += 1;
        self.devices.remove(id).is_some()
    }

    fn push_event(&mut self, mut e: EventRow) {
        self.seq += 1;
        e.seq = self.seq;
        let ring = &mut self.events[e.source as usize];
        if ring.len() == EVENTS {
            ring.pop_front();
        }
        ring.push_back(e);
    }

    fn device_event(&mut self, e: DeviceEvent) {
        let text = match &e.reason {
            Some(r) => format!("v{}: {r}", e.version),
            None => format!("v{}", e.version),
        };
        self.push_event(EventRow {
            seq: 0,
            time: e.time,
            source: EventSource::Device,
            subject: e.device,
            kind: e.kind.to_string(),
            text,
        });
    }

    /// A rollout's controller: its row replaced, and its transitions (a new rollout, a phase
    /// reached, the end) added to the feed.
    fn rollout(&mut self, c: &Controller, now: &str) {
        self.seq += 1;
        let row = RolloutRow::new(c, self.seq);
        let before = self.rollouts.insert(c.name.clone(), row.clone());
        let event = |kind: &str, text: String| EventRow {
            seq: 0,
            time: now.to_string(),
            source: EventSource::Rollout,
            subject: c.name.clone(),
            kind: kind.into(),
            text,
        };
        let phase_text = |i: usize| format!("phase {i} `{}`", c.plan.phases[i].name);
        let mut out = Vec::new();
        match &before {
            None => out.push(event(
                "seen",
                format!(
                    "{} v{}: {}, {}",
                    c.model,
                    c.version,
                    row.state,
                    phase_text(c.phase)
                ),
            )),
            Some(b) if b.phase != row.phase => out.push(event("phase", phase_text(row.phase))),
            _ => {}
        }
        if let Some(b) = before.as_ref().filter(|b| b.paused != row.paused) {
            let kind = if b.paused { "resumed" } else { "paused" };
            out.push(event(kind, phase_text(row.phase)));
        }
        if before.as_ref().is_some_and(|b| b.state != row.state) {
            let text = match &row.reason {
                Some(r) => r.clone(),
                None => format!("{} v{}", c.model, c.version),
            };
            out.push(event(row.state.as_str(), text));
        }
        for e in out {
            self.push_event(e);
        }
    }

    /// Every device the filter accepts, by id.
    pub fn devices(&self, f: &DeviceFilter) -> Vec<&DeviceRow> {
        self.devices.values().filter(|d| f.accepts(d)).collect()
    }

    /// The devices `f` accepts, in id order: how many, and the page `p` of them.
    pub fn devices_page(&self, f: &DeviceFilter, p: Page) -> (usize, Vec<&DeviceRow>) {
        let all = self.devices(f);
        let page = all
            .iter()
            .skip(p.offset)
            .take(p.limit.unwrap_or(usize::MAX))
            .copied()
            .collect();
        (all.len(), page)
    }

    pub fn device_row(&self, id: &str) -> Option<&DeviceRow> {
        self.devices.get(id)
    }

    pub fn rollouts(&self) -> Vec<&RolloutRow> {
        self.rollouts.values().collect()
    }

    pub fn rollout_row(&self, name: &str) -> Option<&RolloutRow> {
        self.rollouts.get(name)
    }

    /// Events after `since`, oldest first (the two rings merged by sequence number).
    pub fn events(&self, since: u64) -> Vec<&EventRow> {
        let [devices, rollouts] = &self.events;
        let mut out: Vec<&EventRow> = devices
            .iter()
            .chain(rollouts)
            .filter(|e| e.seq > since)
            .collect();
        out.sort_unstable_by_key(|e| e.seq);
        out
    }

    /// What changed after `since` (everything when `since` is 0). Forgotten devices and
    /// rollouts are not announced: a client reloads after a `full` delta.
    pub fn delta(&self, since: u64) -> Delta {
        Delta {
            seq: self.seq,
            full: since == 0,
            devices: self
                .devices
                .values()
                .filter(|d| d.seq > since)
                .cloned()
                .collect(),
            rollouts: self
                .rollouts
                .values()
                .filter(|r| r.seq > since)
                .cloned()
                .collect(),
            events: self.events(since).into_iter().cloned().collect(),
        }
    }
}
