//! `/metrics`: the view in Prometheus' text exposition format (version 0.0.4).

use std::fmt::Write;

use super::view::{DeviceFilter, FleetView};

/// A label value escaped as the format asks (backslash, double quote, newline).
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// One metric family: HELP, TYPE and its samples (`labels`, value).
fn family(out: &mut String, name: &str, help: &str, samples: &[(String, f64)]) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
    for (labels, v) in samples {
        let _ = writeln!(out, "{name}{labels} {v}");
    }
}

/// One per-device metric: its value for a device, if the device reported it.
type PerDevice<'a> = &'a dyn Fn(&super::DeviceRow) -> Option<f64>;

pub fn render(view: &FleetView, connected: bool) -> String {
    let mut out = String::new();
    let devices = view.devices(&DeviceFilter::default());
    let one = |v: f64| vec![(String::new(), v)];
    family(
        &mut out,
        "kestrel_console_broker_connected",
        "1 when the console is connected to the broker.",
        &one(f64::from(u8::from(connected))),
    );
    family(
        &mut out,
        "kestrel_devices",
        "Devices with a retained status or presence.",
        &one(devices.len() as f64),
    );
    let per_device = |f: PerDevice| -> Vec<(String, f64)> {
        devices
            .iter()
            .filter_map(|d| f(d).map(|v| (format!("{{device=\"{}\"}}", label(&d.id)), v)))
            .collect()
    };
    let device_families: [(&str, &str, PerDevice); 6] = [
        (
            "kestrel_device_online",
            "1 when the device is connected.",
            &|d| d.online.map(|o| f64::from(u8::from(o))),
        ),
        (
            "kestrel_device_active_version",
            "Version of the active model.",
            &|d| d.active.map(|v| v as f64),
        ),
        (
            "kestrel_device_error",
            "1 when the device reports a last error.",
            &|d| {
                d.state
                    .as_ref()
                    .map(|_| f64::from(u8::from(d.last_error.is_some())))
            },
        ),
        (
            "kestrel_device_latency_p50_ms",
            "Median inference latency.",
            &|d| d.p50_ms,
        ),
        (
            "kestrel_device_confidence",
            "Mean top-1 confidence of the latest quality window.",
            &|d| d.confidence,
        ),
        (
            "kestrel_device_drift_z",
            "Largest feature mean shift (z) of the latest quality window.",
            &|d| d.drift_z,
        ),
    ];
    for (name, help, f) in device_families {
        family(&mut out, name, help, &per_device(f));
    }
    rollouts(&mut out, view);
    out
}

fn rollouts(out: &mut String, view: &FleetView) {
    let mut phase = Vec::new();
    let mut per_state = Vec::new();
    for r in view.rollouts() {
        let name = label(&r.name);
        phase.push((
            format!("{{rollout=\"{name}\",state=\"{}\"}}", r.state),
            r.phase as f64,
        ));
        for p in &r.phases {
            let counts = [
                ("waiting", p.waiting),
                ("moved", p.moved),
                ("active", p.active),
                ("failed", p.failed),
                ("rolled-back", p.rolled_back),
            ];
            for (state, n) in counts {
                per_state.push((
                    format!(
                        "{{rollout=\"{name}\",phase=\"{}\",state=\"{state}\"}}",
                        label(&p.name)
                    ),
                    n as f64,
                ));
            }
        }
    }
    family(
        out,
        "kestrel_rollout_phase",
        "Index of the rollout's current phase.",
        &phase,
    );
    family(
        out,
        "kestrel_rollout_devices",
        "Devices of a rollout phase in each state.",
        &per_state,
    );
}
