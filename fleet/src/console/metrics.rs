//! `/metrics`: the view in Prometheus' text exposition format (version 0.0.4), named by
//! Prometheus' naming guide: base units (seconds), `_total` counters, `_info` gauges of 1 whose
//! labels carry text (the console's build, a device's model), state sets whose series stay the
//! same when the state changes (a rollout's state is a label of value 0 or 1, every state
//! listed), and the devices' latency as a histogram of the bucket counts they publish.
//!
//! The devices' counters count from the start of their agent process, as counters of a
//! scraped process do; Prometheus' `rate()` and `increase()` take the restarts in their stride.
//!
//! Cardinality: the `kestrel_fleet_*` families aggregate the fleet (devices by state, online,
//! per model version; requests, updates and artifact bytes summed) in a few dozen series
//! whatever its size; the `kestrel_device_*` families (about 30 series a device) are written
//! only while the fleet has at most `per_device_max` devices (`trainer console
//! --per-device-metrics-max`, default [`PER_DEVICE_MAX`]): 10,000 devices would be 300,000
//! series a scrape. `kestrel_console_per_device_metrics` says which.

use std::fmt::Write;

use kestrel_shared::protocol::LATENCY_BUCKETS_S;

use super::DeviceRow;
use super::view::{DeviceFilter, FleetView, RolloutStatus};

/// A label value escaped as the format asks (backslash, double quote, newline).
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// `{a="x",b="y"}` from label pairs (values escaped); empty without labels.
fn labels(pairs: &[(&str, &str)]) -> String {
    if pairs.is_empty() {
        return String::new();
    }
    let inner: Vec<String> = pairs
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
        .collect();
    format!("{{{}}}", inner.join(","))
}

/// A sample value as the format writes it (`+Inf`, `-Inf`, `NaN` for the non-finite).
fn value(v: f64) -> String {
    match v {
        v if v.is_nan() => "NaN".into(),
        v if v == f64::INFINITY => "+Inf".into(),
        v if v == f64::NEG_INFINITY => "-Inf".into(),
        v => v.to_string(),
    }
}

/// The text being written: one family (HELP, TYPE, samples) at a time.
struct Exposition(String);

impl Exposition {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels_: &str, v: f64) {
        let _ = writeln!(self.0, "{name}{labels_} {}", value(v));
    }

    /// A family with one sample per device that has a value.
    fn per_device(
        &mut self,
        (name, kind, help): (&str, &str, &str),
        devices: &[&DeviceRow],
        f: impl Fn(&DeviceRow) -> Option<f64>,
    ) {
        self.family(name, kind, help);
        for d in devices {
            if let Some(v) = f(d) {
                self.sample(name, &labels(&[("device", &d.id)]), v);
            }
        }
    }

    /// A counter family with an `outcome` label: per device, one sample per outcome.
    fn outcomes(
        &mut self,
        (name, help): (&str, &str),
        devices: &[&DeviceRow],
        f: impl Fn(&DeviceRow) -> Option<Vec<(&'static str, u64)>>,
    ) {
        self.family(name, "counter", help);
        for d in devices {
            for (outcome, n) in f(d).unwrap_or_default() {
                let l = labels(&[("device", &d.id), ("outcome", outcome)]);
                self.sample(name, &l, n as f64);
            }
        }
    }
}

/// Fleets up to this size get per-device series by default.
pub const PER_DEVICE_MAX: usize = 1000;

pub fn render(view: &FleetView, connected: bool, per_device_max: usize) -> String {
    let mut out = Exposition(String::new());
    out.family(
        "kestrel_build_info",
        "gauge",
        "The console's build: its version as a label, value 1.",
    );
    out.sample(
        "kestrel_build_info",
        &labels(&[("version", env!("CARGO_PKG_VERSION"))]),
        1.0,
    );
    out.family(
        "kestrel_console_broker_connected",
        "gauge",
        "1 when the console is connected to the broker.",
    );
    out.sample(
        "kestrel_console_broker_connected",
        "",
        f64::from(u8::from(connected)),
    );
    let devices = view.devices(&DeviceFilter::default());
    out.family(
        "kestrel_devices",
        "gauge",
        "Devices with a retained status or presence.",
    );
    out.sample("kestrel_devices", "", devices.len() as f64);
    fleet(&mut out, &devices);
    let per_device = devices.len() <= per_device_max;
    out.family(
        "kestrel_console_per_device_metrics",
        "gauge",
        "1 when the kestrel_device_* series are written (the fleet has at most \
         --per-device-metrics-max devices).",
    );
    out.sample(
        "kestrel_console_per_device_metrics",
        "",
        f64::from(u8::from(per_device)),
    );
    if per_device {
        device_gauges(&mut out, &devices);
        latency(&mut out, &devices);
        device_counters(&mut out, &devices);
    }
    rollouts(&mut out, view);
    out.0
}

/// The fleet in aggregate: a bounded number of series whatever its size.
fn fleet(out: &mut Exposition, devices: &[&DeviceRow]) {
    use std::collections::BTreeMap;
    let mut states: BTreeMap<&str, usize> = BTreeMap::new();
    let mut models: BTreeMap<(&str, u64), usize> = BTreeMap::new();
    let (mut online, mut errors) = (0usize, 0usize);
    let mut sums = [0u64; 8];
    for d in devices {
        *states
            .entry(d.state.as_ref().map_or("unknown", |s| s.as_str()))
            .or_default() += 1;
        if let (Some(m), Some(v)) = (&d.model, d.active) {
            *models.entry((m, v)).or_default() += 1;
        }
        online += usize::from(d.online == Some(true));
        errors += usize::from(d.last_error.is_some());
        let c = &d.counters;
        for (s, n) in sums.iter_mut().zip([
            c.requests_answered,
            c.requests_failed,
            c.requests_refused,
            c.updates_active,
            c.updates_rejected,
            c.updates_rolled_back,
            c.bytes_fetched,
            c.bytes_reused,
        ]) {
            *s += n;
        }
    }
    let name = "kestrel_fleet_devices_by_state";
    out.family(
        name,
        "gauge",
        "Devices by the state of their latest status.",
    );
    for (state, n) in &states {
        out.sample(name, &labels(&[("state", state)]), *n as f64);
    }
    for (name, help, n) in [
        ("kestrel_fleet_devices_online", "Devices connected.", online),
        (
            "kestrel_fleet_devices_with_error",
            "Devices that report a last error.",
            errors,
        ),
    ] {
        out.family(name, "gauge", help);
        out.sample(name, "", n as f64);
    }
    let name = "kestrel_fleet_model_devices";
    out.family(name, "gauge", "Devices per active model and version.");
    for ((model, version), n) in &models {
        let version = version.to_string();
        out.sample(
            name,
            &labels(&[("model", model), ("version", &version)]),
            *n as f64,
        );
    }
    let counters = [
        (
            "kestrel_fleet_requests_total",
            "Inference requests of every device, by outcome.",
            &["answered", "failed", "refused"][..],
            &sums[0..3],
        ),
        (
            "kestrel_fleet_updates_total",
            "Model updates of every device, by outcome.",
            &["active", "rejected", "rolled_back"][..],
            &sums[3..6],
        ),
    ];
    for (name, help, outcomes, values) in counters {
        out.family(name, "counter", help);
        for (o, v) in outcomes.iter().zip(values) {
            out.sample(name, &labels(&[("outcome", o)]), *v as f64);
        }
    }
    for (name, help, v) in [
        (
            "kestrel_fleet_artifact_bytes_fetched_total",
            "Artifact bytes every device downloaded.",
            sums[6],
        ),
        (
            "kestrel_fleet_artifact_bytes_reused_total",
            "Artifact bytes the devices did not download because they held those parts.",
            sums[7],
        ),
    ] {
        out.family(name, "counter", help);
        out.sample(name, "", v as f64);
    }
}

fn device_gauges(out: &mut Exposition, devices: &[&DeviceRow]) {
    out.per_device(
        (
            "kestrel_device_online",
            "gauge",
            "1 when the device is connected.",
        ),
        devices,
        |d| d.online.map(|o| f64::from(u8::from(o))),
    );
    let info = "kestrel_device_model_info";
    out.family(
        info,
        "gauge",
        "The device's active model: name, version and registry version as labels, value 1.",
    );
    for d in devices {
        if let (Some(model), Some(version)) = (&d.model, d.active) {
            let version = version.to_string();
            let source = d.source.as_deref().unwrap_or("");
            let l = labels(&[
                ("device", &d.id),
                ("model", model),
                ("version", &version),
                ("source", source),
            ]);
            out.sample(info, &l, 1.0);
        }
    }
    out.per_device(
        (
            "kestrel_device_error",
            "gauge",
            "1 when the device reports a last error.",
        ),
        devices,
        |d| {
            d.state
                .as_ref()
                .map(|_| f64::from(u8::from(d.last_error.is_some())))
        },
    );
    out.per_device(
        (
            "kestrel_device_confidence_ratio",
            "gauge",
            "Mean top-1 confidence (0 to 1) of the latest quality window.",
        ),
        devices,
        |d| d.confidence,
    );
    out.per_device(
        (
            "kestrel_device_drift_z",
            "gauge",
            "Largest feature mean shift (standard scores) of the latest quality window.",
        ),
        devices,
        |d| d.drift_z,
    );
    out.per_device(
        (
            "kestrel_device_capture_queue",
            "gauge",
            "Captured inputs waiting to be sent.",
        ),
        devices,
        |d| d.captures.as_ref().map(|c| c.queued as f64),
    );
    out.per_device(
        (
            "kestrel_device_capture_queue_bytes",
            "gauge",
            "Bytes on disk of the captured inputs waiting to be sent.",
        ),
        devices,
        |d| d.captures.as_ref().map(|c| c.queued_bytes as f64),
    );
}

/// The devices' inference latency histograms (devices whose histogram is malformed are left out).
fn latency(out: &mut Exposition, devices: &[&DeviceRow]) {
    let name = "kestrel_device_inference_duration_seconds";
    out.family(
        name,
        "histogram",
        "Inference time of the requests the active model answered, since the agent started.",
    );
    for d in devices {
        let Some(cumulative) = d.latency.cumulative() else {
            continue;
        };
        let bounds = LATENCY_BUCKETS_S.iter().map(|b| value(*b));
        for (le, n) in bounds.chain(["+Inf".to_string()]).zip(&cumulative) {
            let l = labels(&[("device", &d.id), ("le", &le)]);
            out.sample(&format!("{name}_bucket"), &l, *n as f64);
        }
        let l = labels(&[("device", &d.id)]);
        out.sample(&format!("{name}_sum"), &l, d.latency.sum_s);
        let count = cumulative.last().copied().unwrap_or(0);
        out.sample(&format!("{name}_count"), &l, count as f64);
    }
}

fn device_counters(out: &mut Exposition, devices: &[&DeviceRow]) {
    let reported = |d: &DeviceRow| d.state.is_some();
    out.outcomes(
        (
            "kestrel_device_requests_total",
            "Inference requests by outcome: answered, failed (no answer), refused (too big, queue full).",
        ),
        devices,
        |d| {
            let c = &d.counters;
            reported(d).then(|| {
                vec![
                    ("answered", c.requests_answered),
                    ("failed", c.requests_failed),
                    ("refused", c.requests_refused),
                ]
            })
        },
    );
    out.outcomes(
        (
            "kestrel_device_updates_total",
            "Model updates by outcome: active, rejected, rolled_back.",
        ),
        devices,
        |d| {
            let c = &d.counters;
            reported(d).then(|| {
                vec![
                    ("active", c.updates_active),
                    ("rejected", c.updates_rejected),
                    ("rolled_back", c.updates_rolled_back),
                ]
            })
        },
    );
    out.outcomes(
        (
            "kestrel_device_captures_total",
            "Inputs the capture policy chose, by outcome: taken, rate_limited.",
        ),
        devices,
        |d| {
            let c = d.captures.as_ref()?;
            Some(vec![("taken", c.taken), ("rate_limited", c.rate_limited)])
        },
    );
    out.per_device(
        (
            "kestrel_device_chunks_corrupt_total",
            "counter",
            "Artifact chunks that failed their sha256 (dropped and asked for again).",
        ),
        devices,
        |d| reported(d).then_some(d.counters.chunks_corrupt as f64),
    );
    out.per_device(
        (
            "kestrel_device_artifact_bytes_fetched_total",
            "counter",
            "Artifact bytes the device downloaded.",
        ),
        devices,
        |d| reported(d).then_some(d.counters.bytes_fetched as f64),
    );
    out.per_device(
        (
            "kestrel_device_artifact_bytes_reused_total",
            "counter",
            "Artifact bytes the device did not download because it held those parts.",
        ),
        devices,
        |d| reported(d).then_some(d.counters.bytes_reused as f64),
    );
    out.per_device(
        (
            "kestrel_device_captures_sent_total",
            "counter",
            "Captured inputs the broker acknowledged.",
        ),
        devices,
        |d| d.captures.as_ref().map(|c| c.sent as f64),
    );
    out.per_device(
        (
            "kestrel_device_captures_evicted_total",
            "counter",
            "Captured inputs dropped from the queue, oldest first, to stay within the disk budget.",
        ),
        devices,
        |d| d.captures.as_ref().map(|c| c.evicted as f64),
    );
}

/// A rollout's states, each one a series of its own (a state set).
const ROLLOUT_STATES: [&str; 4] = ["running", "paused", "completed", "aborted"];
/// A device's states within a rollout phase.
const PHASE_STATES: [&str; 5] = ["waiting", "moved", "active", "failed", "rolled_back"];

fn rollouts(out: &mut Exposition, view: &FleetView) {
    let rollouts = view.rollouts();
    out.family(
        "kestrel_rollout_phase",
        "gauge",
        "Index of the rollout's current phase (0 is the first).",
    );
    for r in &rollouts {
        out.sample(
            "kestrel_rollout_phase",
            &labels(&[("rollout", &r.name)]),
            r.phase as f64,
        );
    }
    out.family(
        "kestrel_rollout_state",
        "gauge",
        "1 for the rollout's state (running, paused, completed, aborted), 0 for the others.",
    );
    for r in &rollouts {
        let now = if r.paused && r.state == RolloutStatus::Running {
            "paused"
        } else {
            r.state.as_str()
        };
        for state in ROLLOUT_STATES {
            let l = labels(&[("rollout", &r.name), ("state", state)]);
            out.sample(
                "kestrel_rollout_state",
                &l,
                f64::from(u8::from(now == state)),
            );
        }
    }
    out.family(
        "kestrel_rollout_devices",
        "gauge",
        "Devices of a rollout phase in each state.",
    );
    for r in &rollouts {
        for p in &r.phases {
            let counts = [p.waiting, p.moved, p.active, p.failed, p.rolled_back];
            for (state, n) in PHASE_STATES.into_iter().zip(counts) {
                let l = labels(&[("rollout", &r.name), ("phase", &p.name), ("state", state)]);
                out.sample("kestrel_rollout_devices", &l, n as f64);
            }
        }
    }
}
