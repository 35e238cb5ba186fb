//! The console's state without a broker: messages in, rows, deltas and metrics out.

use kestrel_shared::protocol::{DeviceCounters, LatencyHistogram, LatencyStats, Status};
use kestrel_shared::quality::{DeviceQuality, Drift, QualityReport};

use super::view::{DeviceFilter, FleetView, RolloutStatus};
use crate::rollout::{Controller, Plan};
use kestrel_shared::wire::{DeviceState, EventKind};

const NOW: &str = "2026-12-03T09:00:00Z";

fn status(id: &str, group: &str, active: Option<u64>, error: Option<&str>) -> Vec<u8> {
    serde_json::to_vec(&Status {
        device: id.into(),
        groups: vec![group.into()],
        state: DeviceState::Idle,
        model: active.map(|_| "lfw".into()),
        active,
        previous: None,
        target: None,
        manifest_sha256: None,
        progress: None,
        last_error: error.map(String::from),
        failed_version: None,
        latency: LatencyStats {
            count: 3,
            mean_ms: 30.0,
            p50_ms: 29.5,
            p95_ms: 35.0,
            histogram: {
                let mut h = LatencyHistogram::default();
                for ms in [29.0, 29.5, 35.0] {
                    h.observe(ms / 1000.0);
                }
                h
            },
        },
        updated: NOW.into(),
        started: 0,
        seq: 0,
        source: None,
        refused: None,
        keys_version: None,
        shadow: None,
        captures: None,
        counters: DeviceCounters {
            requests_answered: 3,
            requests_failed: 1,
            ..Default::default()
        },
    })
    .unwrap()
}

fn quality(id: &str, total: u64, confidence: f64, z: f64) -> Vec<u8> {
    serde_json::to_vec(&DeviceQuality {
        device: id.into(),
        model: "lfw".into(),
        version: 1,
        window: Some(QualityReport {
            requests: 10,
            total_requests: total,
            mean_confidence: confidence,
            confidence_histogram: vec![],
            class_distribution: vec![],
            class_distance: 0.0,
            reference_confidence: 0.98,
            drift: Drift {
                max_z: z,
                p_value: 1.0,
                flagged: z > 4.0,
            },
            windows: 1,
            flagged_windows: 0,
            latency_p50_ms: 30.0,
            latency_p99_ms: 40.0,
        }),
        note: None,
        shadow: None,
        updated: NOW.into(),
    })
    .unwrap()
}

#[test]
fn a_device_speaks_only_for_itself() {
    let mut v = FleetView::new("k");
    // pi-02's topic carrying a status that says it is pi-01's: refused, and no row made.
    let forged = status("pi-01", "all", Some(3), None);
    assert!(v.apply("k/devices/pi-02/status", &forged, NOW).is_err());
    assert!(v.apply("k/devices/pi-01/status", &forged, NOW).unwrap());
    let ids: Vec<String> = v
        .devices(&DeviceFilter::default())
        .into_iter()
        .map(|d| d.id.clone())
        .collect();
    assert_eq!(ids, vec!["pi-01".to_string()]);
    // Not the console's topics, or not the protocol's.
    assert!(!v.apply("k/rollouts/r1/command", b"{}", NOW).unwrap());
    assert!(!v.apply("other/devices/pi-01/status", &forged, NOW).unwrap());
    assert!(!v.apply("kx/devices/pi-01/status", &forged, NOW).unwrap());
}

#[test]
fn statuses_quality_and_presence_make_device_rows() {
    let mut v = FleetView::new("k");
    assert!(
        v.apply(
            "k/devices/a/status",
            &status("a", "east", Some(1), None),
            NOW
        )
        .unwrap()
    );
    v.apply(
        "k/devices/b/status",
        &status("b", "west", None, Some("health check failed")),
        NOW,
    )
    .unwrap();
    v.apply("k/devices/a/online", b"1", NOW).unwrap();
    v.apply("k/devices/b/online", b"0", NOW).unwrap();
    // Quality windows build the history; the same window delivered again does not.
    v.apply("k/devices/a/quality", &quality("a", 10, 0.9, 1.0), NOW)
        .unwrap();
    v.apply("k/devices/a/quality", &quality("a", 10, 0.9, 1.0), NOW)
        .unwrap();
    v.apply("k/devices/a/quality", &quality("a", 20, 0.8, 5.0), NOW)
        .unwrap();
    let a = v.device_row("a").unwrap();
    assert_eq!(a.confidence_history, [0.9, 0.8]);
    assert_eq!(a.drift_history, [1.0, 5.0]);
    assert_eq!(a.drift_flagged, Some(true));
    assert_eq!(a.p50_ms, Some(29.5));
    assert_eq!((a.online, a.active), (Some(true), Some(1)));
    let b = v.device_row("b").unwrap();
    assert_eq!(b.last_error.as_deref(), Some("health check failed"));
    assert_eq!(b.online, Some(false));

    let ids =
        |f: DeviceFilter| -> Vec<String> { v.devices(&f).iter().map(|d| d.id.clone()).collect() };
    let group = |g: &str| DeviceFilter {
        group: Some(g.into()),
        ..DeviceFilter::default()
    };
    assert_eq!(ids(group("east")), ["a"]);
    assert_eq!(ids(group("north")), Vec::<String>::new());
    for version in ["lfw v1", "v1", "1"] {
        let f = DeviceFilter {
            version: Some(version.into()),
            ..DeviceFilter::default()
        };
        assert_eq!(ids(f), ["a"], "{version}");
    }
    let none = DeviceFilter {
        version: Some("none".into()),
        online: Some(false),
        ..DeviceFilter::default()
    };
    assert_eq!(ids(none), ["b"]);
    // Search by id and pages, as a fleet of thousands is read.
    let q = |q: &str| DeviceFilter {
        q: Some(q.into()),
        ..DeviceFilter::default()
    };
    assert_eq!(ids(q("B")), ["b"]);
    let page = |offset, limit| {
        let (total, rows) = v.devices_page(
            &DeviceFilter::default(),
            super::view::Page { offset, limit },
        );
        (total, rows.iter().map(|d| d.id.clone()).collect::<Vec<_>>())
    };
    assert_eq!(page(1, Some(1)), (2, vec!["b".to_string()]));
    assert_eq!(page(0, None), (2, vec!["a".to_string(), "b".to_string()]));
    assert_eq!(page(5, Some(10)), (2, vec![]));
    // A cleared status forgets the device; a bad payload is an error naming the topic.
    v.apply("k/devices/b/status", b"", NOW).unwrap();
    assert!(v.device_row("b").is_none());
    let e = v.apply("k/devices/c/status", b"{", NOW).unwrap_err();
    assert!(e.to_string().starts_with("k/devices/c/status: "), "{e}");
}

/// `/metrics` by the naming guide: a latency histogram in seconds from the devices' bucket
/// counts, `_total` counters by outcome, the model as an `_info` gauge; a device whose
/// histogram is malformed is left out of that family, not of the page.
#[test]
fn metrics_are_histograms_counters_and_info() {
    let mut v = FleetView::new("k");
    v.apply(
        "k/devices/a/status",
        &status("a", "east", Some(1), None),
        NOW,
    )
    .unwrap();
    let mut liar: Status = serde_json::from_slice(&status("z", "east", None, None)).unwrap();
    liar.latency.histogram.counts = vec![5; 3];
    v.apply(
        "k/devices/z/status",
        &serde_json::to_vec(&liar).unwrap(),
        NOW,
    )
    .unwrap();
    let m = super::metrics::render(&v, true, super::metrics::PER_DEVICE_MAX);
    let lines = [
        "# TYPE kestrel_device_inference_duration_seconds histogram",
        // 29 ms and 29.5 ms are under 50 ms, 35 ms too; none under 25 ms.
        "kestrel_device_inference_duration_seconds_bucket{device=\"a\",le=\"0.025\"} 0",
        "kestrel_device_inference_duration_seconds_bucket{device=\"a\",le=\"0.05\"} 3",
        "kestrel_device_inference_duration_seconds_bucket{device=\"a\",le=\"+Inf\"} 3",
        "kestrel_device_inference_duration_seconds_count{device=\"a\"} 3",
        "# TYPE kestrel_device_requests_total counter",
        "kestrel_device_requests_total{device=\"a\",outcome=\"answered\"} 3",
        "kestrel_device_requests_total{device=\"a\",outcome=\"failed\"} 1",
        "kestrel_device_updates_total{device=\"a\",outcome=\"rolled_back\"} 0",
        "kestrel_device_model_info{device=\"a\",model=\"lfw\",version=\"1\",source=\"\"} 1",
        "kestrel_devices 2",
    ];
    for line in lines {
        assert!(m.contains(&format!("{line}\n")), "{line} in {m}");
    }
    let sum = m
        .lines()
        .find_map(|l| {
            l.strip_prefix("kestrel_device_inference_duration_seconds_sum{device=\"a\"} ")
        })
        .unwrap();
    assert!((sum.parse::<f64>().unwrap() - 0.0935).abs() < 1e-9, "{sum}");
    assert!(!m.contains("duration_seconds_bucket{device=\"z\""), "{m}");
    assert!(m.contains("kestrel_device_requests_total{device=\"z\",outcome=\"answered\"} 3"));
    assert!(!m.contains("_ms"), "no milliseconds: {m}");
    assert!(m.starts_with("# HELP kestrel_build_info "), "{m}");
    // The fleet's aggregates always; past the bound, no per-device series.
    for line in [
        "kestrel_fleet_requests_total{outcome=\"answered\"} 6",
        "kestrel_fleet_model_devices{model=\"lfw\",version=\"1\"} 1",
        "kestrel_console_per_device_metrics 1",
    ] {
        assert!(m.contains(&format!("{line}\n")), "{line} in {m}");
    }
    let bounded = super::metrics::render(&v, true, 1);
    assert!(
        bounded.contains("kestrel_console_per_device_metrics 0\n"),
        "{bounded}"
    );
    assert!(!bounded.contains("device=\""), "{bounded}");
    assert!(bounded.contains("kestrel_fleet_requests_total{outcome=\"answered\"} 6\n"));
}

#[test]
fn deltas_hold_only_what_changed() {
    let mut v = FleetView::new("k");
    v.apply(
        "k/devices/a/status",
        &status("a", "east", Some(1), None),
        NOW,
    )
    .unwrap();
    v.apply(
        "k/devices/b/status",
        &status("b", "east", Some(1), None),
        NOW,
    )
    .unwrap();
    let seen = v.seq();
    let full = v.delta(0);
    assert!(full.full);
    assert_eq!(full.devices.len(), 2);
    v.apply("k/devices/b/online", b"1", NOW).unwrap();
    let d = v.delta(seen);
    assert!(!d.full);
    assert_eq!(d.devices.len(), 1);
    assert_eq!(d.devices[0].id, "b");
    assert!(v.delta(v.seq()).devices.is_empty());
}

/// A rollout state as a controller retains it (signed; the console shows it unverified).
fn sealed(c: &Controller) -> Vec<u8> {
    crate::rollout::saved::seal(&ed25519_dalek::SigningKey::from_bytes(&[3; 32]), c)
}

#[test]
fn rollouts_show_phases_and_their_transitions_in_the_feed() {
    let plan = Plan::parse(
        "[[phases]]\nname = \"canary\"\npercent = 50\n[[phases]]\nname = \"all\"\npercent = 100\n",
        "f",
    )
    .unwrap();
    let fleet: Vec<Status> = ["a", "b"]
        .iter()
        .map(|d| serde_json::from_slice(&status(d, "east", Some(1), None)).unwrap())
        .collect();
    let mut c = Controller::new("r1", "lfw", 2, plan, &fleet).unwrap();
    c.start(100);
    let mut v = FleetView::new("k");
    let topic = "k/rollouts/r1/state";
    v.apply(topic, &sealed(&c), NOW).unwrap();
    let r = v.rollout_row("r1").unwrap();
    assert_eq!((r.state.as_str(), r.phase), ("running", 0));
    assert_eq!(r.phases[0].progress, "current");
    assert_eq!((r.phases[0].devices, r.phases[0].moved), (1, 1));
    assert_eq!(r.phases[1].waiting, 1);
    // A fleet's chatter in between does not push the rollout's transitions out of the feed.
    let chatter = super::view::EVENTS + 100;
    for i in 0..chatter {
        let e = kestrel_shared::protocol::DeviceEvent {
            device: "a".into(),
            kind: EventKind::Downloading,
            version: i as u64,
            reason: None,
            time: NOW.into(),
        };
        v.apply("k/devices/a/events", &serde_json::to_vec(&e).unwrap(), NOW)
            .unwrap();
    }
    let late: Status = serde_json::from_slice(&status("z-late", "east", Some(1), None)).unwrap();
    c.on_status(&late, 101);
    c.on_abort("operator", "console@test");
    v.apply(topic, &sealed(&c), NOW).unwrap();
    let r = v.rollout_row("r1").unwrap();
    assert_eq!(r.state, RolloutStatus::Aborted);
    assert_eq!(r.phases[0].rolled_back, 1);
    assert_eq!(
        (r.phases[1].late, r.phases[1].late_devices.as_slice()),
        (1, ["z-late".to_string()].as_slice()),
        "which devices joined late"
    );
    let events = v.events(0);
    let kinds: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(kinds.len(), super::view::EVENTS + 2);
    assert_eq!((kinds[0], kinds[kinds.len() - 1]), ("seen", "aborted"));
    // The device ring kept the newest, and the merge is in order.
    assert_eq!(
        events[1].text,
        format!("v{}", chatter - super::view::EVENTS)
    );
    assert!(events.windows(2).all(|w| w[0].seq < w[1].seq));
    let m = super::metrics::render(&v, true, super::metrics::PER_DEVICE_MAX);
    // A state set: every state a series of its own, so a state change keeps the series.
    for (state, on) in [
        ("running", 0),
        ("paused", 0),
        ("completed", 0),
        ("aborted", 1),
    ] {
        let line = format!("kestrel_rollout_state{{rollout=\"r1\",state=\"{state}\"}} {on}\n");
        assert!(m.contains(&line), "{line} in {m}");
    }
    assert!(
        m.contains("kestrel_rollout_phase{rollout=\"r1\"} 0\n"),
        "{m}"
    );
    assert!(
        m.contains(
            "kestrel_rollout_devices{rollout=\"r1\",phase=\"canary\",state=\"rolled_back\"} 1"
        ),
        "{m}"
    );
    assert!(m.contains("kestrel_console_broker_connected 1\n"), "{m}");
}

/// The page builds its elements with the DOM and never parses a string as HTML; it has no inline
/// script, style or handler for the Content-Security-Policy to forbid.
#[test]
fn the_page_never_parses_strings_as_html() {
    let js = include_str!("assets/app.js");
    for sink in [
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "eval(",
        "new Function",
        "setAttribute(\"on",
    ] {
        assert!(!js.contains(sink), "app.js uses {sink}");
    }
    let html = include_str!("assets/index.html");
    assert_eq!(html.matches("<script").count(), 1, "only app.js");
    assert!(html.contains("<script src=\"app.js\"></script>"));
    for inline in ["<style", " style=", " onclick=", " onload=", "javascript:"] {
        assert!(!html.contains(inline), "index.html has {inline}");
    }
}
