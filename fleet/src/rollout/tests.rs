use super::*;
use kestrel_shared::protocol::LatencyStats;
use kestrel_shared::wire::{self, ShadowState};

pub(super) fn status(
    id: &str,
    groups: &[&str],
    active: Option<u64>,
    failed: Option<u64>,
) -> Status {
    Status {
        device: id.into(),
        groups: groups.iter().map(|g| g.to_string()).collect(),
        state: wire::DeviceState::Idle,
        model: active.map(|_| "m".into()),
        active,
        previous: None,
        target: None,
        manifest_sha256: None,
        progress: None,
        last_error: failed.map(|v| format!("v{v} health check failed")),
        failed_version: failed,
        latency: LatencyStats::default(),
        updated: String::new(),
        started: 0,
        seq: 0,
        source: None,
        refused: None,
        keys_version: None,
        shadow: None,
        captures: None,
        counters: Default::default(),
    }
}

pub(super) fn fleet(n: usize) -> Vec<Status> {
    (0..n)
        .map(|i| {
            status(
                &format!("d{i:03}"),
                if i < 3 { &["canary"] } else { &[] },
                Some(1),
                None,
            )
        })
        .collect()
}

const PLAN: &str = r#"
[[phases]]
name = "canary"
percent = 5
[[phases]]
name = "half"
percent = 50
failure = 0.1
[[phases]]
name = "all"
percent = 100
soak_s = 10
"#;

pub(super) fn desired_devices(out: &[Output]) -> Vec<String> {
    out.iter()
        .filter_map(|o| match o {
            Output::Desired { device, .. } => Some(device.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn phases_cut_the_fleet_cumulatively_and_stably() {
    let plan = Plan::parse(PLAN, "fleet.toml").unwrap();
    let c = Controller::new("r1", "m", 2, plan.clone(), &fleet(100)).unwrap();
    let sizes: Vec<usize> = (0..3).map(|p| c.phase_devices(p).count()).collect();
    assert_eq!(sizes, [5, 45, 50]);
    assert_eq!(
        c,
        Controller::new("r1", "m", 2, plan.clone(), &fleet(100)).unwrap()
    );
    let other = Controller::new("r2", "m", 2, plan, &fleet(100)).unwrap();
    assert_ne!(
        c.phase_devices(0).map(|d| &d.id).collect::<Vec<_>>(),
        other.phase_devices(0).map(|d| &d.id).collect::<Vec<_>>(),
        "the order depends on the rollout name"
    );
    // A group phase takes exactly the group, as the plan lists it (d000..d002 also say they
    // are in `canary`, and d009 does not: the plan's word counts).
    let g = Plan::parse("[groups]\ncanary = [\"d000\", \"d001\", \"d009\"]\n[[phases]]\nname = \"c\"\ngroup = \"canary\"\n[[phases]]\nname = \"rest\"\npercent = 100\n", "f").unwrap();
    let c = Controller::new("r", "m", 2, g, &fleet(10)).unwrap();
    let mut canary: Vec<&str> = c.phase_devices(0).map(|d| d.id.as_str()).collect();
    canary.sort();
    assert_eq!(canary, ["d000", "d001", "d009"]);
    assert_eq!(c.phase_devices(1).count(), 7);
}

#[test]
fn promotes_phase_by_phase_to_completion_with_soak() {
    let plan = Plan::parse(PLAN, "fleet.toml").unwrap();
    let mut c = Controller::new("r1", "m", 2, plan, &fleet(20)).unwrap();
    let out = c.start(100);
    let first = desired_devices(&out);
    assert_eq!(first.len(), 1);
    assert_eq!(out.last(), Some(&Output::Save));
    let mut t = 100;
    for phase in 0..3 {
        let ids: Vec<String> = c.phase_devices(phase).map(|d| d.id.clone()).collect();
        assert!(
            ids.iter()
                .all(|id| c.devices[id].state == DeviceState::Moved),
            "phase {phase}"
        );
        let mut out = Vec::new();
        for id in &ids {
            t += 1;
            out.extend(c.on_status(&status(id, &[], Some(2), None), t));
        }
        if phase == 2 {
            assert_eq!(c.state, RolloutState::Running, "soaking");
            assert!(c.on_tick(t + 5).is_empty());
            c.on_tick(t + 10);
            assert_eq!(c.state, RolloutState::Completed);
        } else {
            let next = desired_devices(&out);
            assert_eq!(next.len(), c.phase_devices(phase + 1).count());
            assert_eq!(c.phase, phase + 1);
        }
    }
    assert!(c.devices.values().all(|d| d.state == DeviceState::Active));
}

#[test]
fn a_failing_canary_aborts_and_sends_moved_devices_back() {
    let plan = Plan::parse(PLAN, "fleet.toml").unwrap();
    let mut c = Controller::new("r1", "m", 2, plan, &fleet(40)).unwrap();
    let canary = desired_devices(&c.start(0));
    assert_eq!(canary.len(), 2);
    // One canary device activates, the other fails its health check.
    c.on_status(&status(&canary[0], &[], Some(2), None), 1);
    let out = c.on_status(&status(&canary[1], &[], Some(1), Some(2)), 2);
    assert!(matches!(c.state, RolloutState::Aborted(ref r) if r.contains("1 of 2 devices failed")));
    let back: Vec<(String, u64, bool)> = out
        .iter()
        .filter_map(|o| match o {
            Output::Desired {
                device,
                version,
                rollback,
                ..
            } => Some((device.clone(), *version, *rollback)),
            _ => None,
        })
        .collect();
    let mut expect: Vec<(String, u64, bool)> =
        canary.iter().map(|d| (d.clone(), 1, true)).collect();
    expect.sort();
    assert_eq!(back, expect, "only canary devices, back to v1");
    assert!(
        c.devices
            .values()
            .filter(|d| d.phase > 0)
            .all(|d| d.state == DeviceState::Waiting)
    );
    // Nothing more happens after an abort.
    assert!(c.on_tick(10_000).is_empty());
    // A device sent back while still installing, whose own health check then fails, is recorded
    // as failed; its being back on v1 changes nothing, and nothing is sent again.
    assert_eq!(c.devices[&canary[0]].state, DeviceState::RolledBack);
    assert!(
        c.on_status(&status(&canary[0], &[], Some(1), None), 10_001)
            .is_empty()
    );
    let out = c.on_status(&status(&canary[0], &[], Some(1), Some(2)), 10_002);
    assert!(
        matches!(c.devices[&canary[0]].state, DeviceState::Failed(ref e) if e.contains("health check"))
    );
    assert!(desired_devices(&out).is_empty());
    assert_eq!(out.last(), Some(&Output::Save));
    assert!(matches!(c.state, RolloutState::Aborted(ref r) if r.contains("1 of 2 devices failed")));
}

#[test]
fn silent_devices_time_out_and_fail_the_phase() {
    let plan = Plan::parse(
        "[[phases]]\nname = \"all\"\npercent = 100\ntimeout_s = 30\nmax_failures = 1\n",
        "f",
    )
    .unwrap();
    let mut c = Controller::new("r", "m", 2, plan, &fleet(4)).unwrap();
    let ids = desired_devices(&c.start(0));
    c.on_status(&status(&ids[0], &[], Some(2), None), 1);
    c.on_status(&status(&ids[1], &[], Some(2), None), 1);
    assert!(c.on_tick(29).is_empty());
    c.on_tick(30);
    assert!(
        matches!(c.state, RolloutState::Aborted(ref r) if r.contains("2 of 4 devices failed (allowed 1)")),
        "{:?}",
        c.state
    );
}

#[test]
fn plans_are_validated() {
    for (text, want) in [
        ("", "phases"),
        (
            "[[phases]]\nname = \"a\"\n",
            "exactly one of group or percent",
        ),
        ("[[phases]]\nname = \"a\"\npercent = 150\n", "percent 150"),
        (
            "[[phases]]\nname = \"a\"\npercent = 50\nsuccess = 2.0\n",
            "fractions",
        ),
        (
            "[[phases]]\nname = \"a\"\npercent = 50\nbogus = 1\n",
            "bogus",
        ),
    ] {
        let e = Plan::parse(text, "fleet.toml").unwrap_err().to_string();
        assert!(e.contains("fleet.toml") && e.contains(want), "{e}");
    }
    let p = Plan::parse("[[phases]]\nname = \"a\"\npercent = 50\n", "f").unwrap();
    let e = Controller::new("r", "m", 2, p, &fleet(10))
        .unwrap_err()
        .to_string();
    assert!(e.contains("in no phase"), "{e}");
    let p = Plan::parse(
        "[groups]\nnobody = [\"d999\"]\n[[phases]]\nname = \"a\"\ngroup = \"nobody\"\n",
        "f",
    )
    .unwrap();
    assert!(
        Controller::new("r", "m", 2, p, &fleet(3))
            .unwrap_err()
            .to_string()
            .contains("no device of the fleet is in group `nobody`")
    );
}

/// One Pi in the canary group, then "everyone": the second phase is left with no device and
/// passes (with its quality gates too: no device, nothing to judge), and the rollout completes.
#[test]
fn a_phase_left_empty_by_earlier_ones_passes() {
    let plan = Plan::parse(
        "[groups]\ncanary = [\"d000\", \"d001\", \"d002\"]\n\
         [[phases]]\nname = \"canary\"\ngroup = \"canary\"\n\
         [[phases]]\nname = \"everyone\"\npercent = 100\nmin_requests = 30\n",
        "fleet.toml",
    )
    .unwrap();
    let mut c = Controller::new("r", "m", 2, plan, &fleet(3)).unwrap();
    assert_eq!(c.phase_devices(1).count(), 0);
    let moved = desired_devices(&c.start(0));
    assert_eq!(moved.len(), 3);
    for (t, id) in moved.iter().enumerate() {
        c.on_status(&status(id, &["canary"], Some(2), None), t as u64 + 1);
    }
    c.on_tick(10);
    assert_eq!(c.state, RolloutState::Completed, "{c:?}");
}

/// A quality report of device `id` on `m` v`version`: `requests` answered at mean confidence
/// `conf`, the latest window flagged or not, and a shadow comparison (version, agreement,
/// compared, shadow confidence).
fn quality(
    id: &str,
    version: u64,
    (conf, requests, flagged): (f64, u64, bool),
    shadow: Option<(u64, f64, u64, f64)>,
) -> DeviceQuality {
    use kestrel_shared::quality::{Drift, QualityReport, ShadowReport};
    DeviceQuality {
        device: id.into(),
        model: "m".into(),
        version,
        window: Some(QualityReport {
            requests: requests.min(100) as usize,
            total_requests: requests,
            mean_confidence: conf,
            confidence_histogram: vec![],
            class_distribution: vec![],
            class_distance: 0.0,
            reference_confidence: 0.9,
            drift: Drift {
                max_z: 0.0,
                p_value: if flagged { 0.0 } else { 1.0 },
                flagged,
            },
            windows: 1,
            flagged_windows: u64::from(flagged),
            latency_p50_ms: 1.0,
            latency_p99_ms: 1.0,
        }),
        note: None,
        shadow: shadow.map(|(v, agreement, compared, sconf)| ShadowReport {
            name: "m".into(),
            version: v,
            compared,
            agreement,
            active_mean_confidence: conf,
            shadow_mean_confidence: sconf,
            disagreements: vec![0, 0],
            active_latency_p50_ms: 1.0,
            shadow_latency_p50_ms: 1.0,
            skipped: 0,
        }),
        updated: String::new(),
    }
}

fn running_shadow(id: &str, version: u64) -> Status {
    let mut s = status(id, &[], Some(1), None);
    s.shadow = Some(kestrel_shared::protocol::ShadowStatus {
        name: "m".into(),
        version,
        state: ShadowState::Running,
        error: None,
    });
    s
}

const SHADOW_PLAN: &str = r#"
[[phases]]
name = "shadow"
percent = 50
mode = "shadow"
min_requests = 100
min_shadow_agreement = 0.9
[[phases]]
name = "all"
percent = 100
"#;

/// A shadow phase keeps its devices on v1 with v2 in shadow; with agreement below the gate it
/// aborts before any device is told to activate v2, with enough agreement its devices go on
/// with the next phase and activate.
#[test]
fn a_shadow_phase_gates_on_agreement_before_anything_activates() {
    for (agreement, passes) in [(0.5, false), (0.95, true)] {
        let plan = Plan::parse(SHADOW_PLAN, "fleet.toml").unwrap();
        let mut c = Controller::new("r", "m", 2, plan, &fleet(4)).unwrap();
        let out = c.start(0);
        let shadowed: Vec<(String, u64, bool)> = out
            .iter()
            .filter_map(|o| match o {
                Output::Desired {
                    device,
                    version,
                    shadow,
                    ..
                } => Some((device.clone(), *version, *shadow)),
                _ => None,
            })
            .collect();
        assert_eq!(shadowed.len(), 2);
        assert!(
            shadowed.iter().all(|(_, v, s)| *v == 1 && *s),
            "{shadowed:?}"
        );
        for (d, ..) in &shadowed {
            c.on_status(&running_shadow(d, 2), 1);
            assert_eq!(c.devices[d].state, DeviceState::Shadowing);
        }
        // 60 comparisons on the first device: under min_requests (each of the two devices brings
        // at most half of it) and one reporting device of the two needed: nothing is judged yet.
        let first = quality(
            &shadowed[0].0,
            1,
            (0.9, 500, false),
            Some((2, agreement, 60, 0.8)),
        );
        assert!(c.on_quality(&first, 2).is_empty());
        assert_eq!(c.state, RolloutState::Running);
        assert_eq!(c.gates[0].value, Some(50.0));
        assert_eq!(c.gates[1].passed, Some(agreement >= 0.9));
        assert_eq!(c.gates[2].name, "min_reporting_devices");
        assert_eq!(
            (c.gates[2].value, c.gates[2].passed),
            (Some(1.0), Some(false))
        );
        let second = quality(
            &shadowed[1].0,
            1,
            (0.9, 500, false),
            Some((2, agreement, 60, 0.8)),
        );
        let out = c.on_quality(&second, 3);
        let desired: Vec<(String, u64, bool, bool)> = out
            .iter()
            .filter_map(|o| match o {
                Output::Desired {
                    device,
                    version,
                    rollback,
                    shadow,
                    ..
                } => Some((device.clone(), *version, *rollback, *shadow)),
                _ => None,
            })
            .collect();
        if passes {
            assert_eq!(c.phase, 1);
            assert_eq!(desired.len(), 4, "the shadow devices go on with phase 1");
            assert!(desired.iter().all(|(_, v, r, s)| *v == 2 && !r && !s));
            for (d, ..) in &desired {
                c.on_status(&status(d, &[], Some(2), None), 4);
            }
            assert_eq!(c.state, RolloutState::Completed);
        } else {
            let RolloutState::Aborted(reason) = &c.state else {
                panic!("{:?}", c.state)
            };
            assert!(
                reason.contains("phase 0 `shadow`: quality gate min_shadow_agreement 0.5000"),
                "{reason}"
            );
            assert_eq!(desired.len(), 2);
            assert!(desired.iter().all(|(_, v, r, s)| *v == 1 && *r && !s));
            assert_eq!(c.gates[1].passed, Some(false));
        }
    }
}

/// Gates of an active phase: the confidence drop is against the same devices' previous model
/// (their reports before the move), drift is the share of flagged devices, and gates not met by
/// the timeout abort.
#[test]
fn active_gates_judge_confidence_drop_drift_and_time_out() {
    let plan = |gates: &str| {
        Plan::parse(
            &format!(
                "[[phases]]\nname = \"all\"\npercent = 100\ntimeout_s = 60\nsoak_s = 10\n{gates}"
            ),
            "f",
        )
        .unwrap()
    };
    let ids: Vec<String> = (0..4).map(|i| format!("d{i:03}")).collect();
    let run = |gates: &str, conf: f64, flagged: usize, requests: u64| {
        let mut c = Controller::new("r", "m", 2, plan(gates), &fleet(4)).unwrap();
        for id in &ids {
            c.on_quality(&quality(id, 1, (0.9, 1000, false), None), 0);
        }
        c.start(1);
        for (i, id) in ids.iter().enumerate() {
            c.on_status(&status(id, &[], Some(2), None), 2);
            c.on_quality(&quality(id, 2, (conf, requests, i + flagged >= 4), None), 3);
        }
        c.on_tick(61);
        c
    };
    let gates = "min_requests = 100\nmax_confidence_drop = 0.05\nmax_drift_devices = 0.25\n";
    let ok = run(gates, 0.88, 1, 50);
    assert_eq!(ok.state, RolloutState::Completed, "{:?}", ok.gates);
    let drop = (ok.gates[1].value.unwrap() - 0.02).abs();
    assert!(drop < 1e-9, "{:?}", ok.gates);
    let low = run(gates, 0.7, 0, 50);
    assert!(
        matches!(&low.state, RolloutState::Aborted(r) if r.contains("max_confidence_drop 0.2000")),
        "{:?}",
        low.state
    );
    let drifted = run(gates, 0.9, 3, 50);
    assert!(
        matches!(&drifted.state, RolloutState::Aborted(r) if r.contains("max_drift_devices 0.6667")),
        "{:?}",
        drifted.state
    );
    let idle = run(gates, 0.9, 0, 10);
    assert!(
        matches!(&idle.state, RolloutState::Aborted(r) if r.contains("not met within 60 s: min_requests 40.0000")),
        "{:?}",
        idle.state
    );
}

#[test]
fn shadow_plans_are_validated() {
    for (text, want) in [
        (
            "[[phases]]\nname = \"a\"\npercent = 100\nmode = \"shadow\"\n",
            "last phase",
        ),
        (
            "[[phases]]\nname = \"a\"\npercent = 100\nmin_shadow_agreement = 0.9\n",
            "needs mode",
        ),
        (
            "[[phases]]\nname = \"a\"\npercent = 100\nmax_drift_devices = 2\n",
            "fractions",
        ),
    ] {
        let e = Plan::parse(text, "fleet.toml").unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
    }
    let p = Plan::parse(SHADOW_PLAN, "f").unwrap();
    let mut f = fleet(4);
    for s in &mut f {
        s.active = None;
        s.model = None;
    }
    let e = Controller::new("r", "m", 2, p, &f).unwrap_err().to_string();
    assert!(e.contains("no model to run beside it"), "{e}");
}

#[test]
fn an_operator_abort_rolls_back_the_moved_devices_once() {
    let plan = Plan::parse(PLAN, "fleet.toml").unwrap();
    let mut c = Controller::new("r1", "m", 2, plan, &fleet(100)).unwrap();
    let started = desired_devices(&c.start(10));
    assert_eq!(started.len(), 5);
    let out = c.on_abort("drift on the canary", "console@127.0.0.1:8080");
    let RolloutState::Aborted(reason) = &c.state else {
        panic!("{:?}", c.state)
    };
    assert!(
        reason.contains("phase 0 `canary`: aborted by console@127.0.0.1:8080: drift on the canary"),
        "{reason}"
    );
    // The canary goes back to v1 (rollback), nobody else is told anything, and the state is saved.
    let mut back = desired_devices(&out);
    back.sort();
    let mut expected = started.clone();
    expected.sort();
    assert_eq!(back, expected);
    assert!(out.iter().any(|o| matches!(
        o,
        Output::Desired {
            version: 1,
            rollback: true,
            ..
        }
    )));
    assert_eq!(out.last(), Some(&Output::Save));
    assert_eq!(
        c.counts(0),
        (0, 0, 5),
        "rolled back devices count as pending"
    );
    // An ended rollout ignores a second abort.
    assert!(c.on_abort("again", "x").is_empty());
}

#[test]
fn a_paused_rollout_holds_its_phase_until_resumed() {
    let plan = Plan::parse(PLAN, "fleet.toml").unwrap();
    let mut c = Controller::new("r1", "m", 2, plan, &fleet(100)).unwrap();
    let canary = desired_devices(&c.start(10));
    let out = c.on_pause(true, "console@x", 11);
    assert!(c.paused && out.last() == Some(&Output::Save));
    assert!(
        c.on_pause(true, "console@x", 11).is_empty(),
        "already paused"
    );
    // The canary finishes while paused, but the next phase does not start.
    for d in &canary {
        c.on_status(&status(d, &[], Some(2), None), 12);
    }
    assert_eq!(c.counts(0), (5, 0, 0));
    assert!(desired_devices(&c.on_tick(100)).is_empty());
    assert_eq!(c.phase, 0);
    // Resumed, a ready phase is promoted at once.
    let out = c.on_pause(false, "console@x", 101);
    assert!(!c.paused);
    assert_eq!(c.phase, 1);
    assert_eq!(desired_devices(&out).len(), 45);
    // The saved state says paused only while it is.
    let json = serde_json::to_value(&c).unwrap();
    assert!(json.get("paused").is_none(), "{json}");
}

#[test]
fn renewal_signs_again_what_every_moved_device_runs() {
    let plan = Plan::parse(PLAN, "fleet.toml").unwrap();
    let mut c = Controller::new("r1", "m", 2, plan, &fleet(20)).unwrap();
    c.start(100);
    let canary: Vec<String> = c.phase_devices(0).map(|d| d.id.clone()).collect();
    for id in &canary {
        c.on_status(&status(id, &[], Some(2), None), 101);
    }
    assert_eq!(c.phase, 1);
    let moved: Vec<String> = c
        .devices
        .values()
        .filter(|d| d.phase <= 1)
        .map(|d| d.id.clone())
        .collect();
    let out = c.renew();
    assert_eq!(desired_devices(&out), moved);
    assert!(out.iter().all(|o| match o {
        Output::Desired {
            name,
            version,
            rollback,
            shadow,
            ..
        } => name == "m" && *version == 2 && !rollback && !shadow,
        _ => true,
    }));
    // Devices of later phases are told nothing; a finished rollout renews nothing.
    assert!(
        c.phase_devices(2)
            .all(|d| !desired_devices(&out).contains(&d.id))
    );
    c.on_abort("test", "tester");
    assert!(c.renew().is_empty());
}

/// Two honest canary devices whose shadow agrees 2% of the time, and a liar: however it lies
/// (agreement 1.0 on a huge request count, u64::MAX requests, agreement outside [0, 1], a
/// counter that goes back), the gate is the honest devices' verdict, and the liar is named.
#[test]
fn a_lying_device_neither_outweighs_the_honest_ones_nor_passes_the_gate() {
    let plan = "[[phases]]\nname = \"shadow\"\npercent = 100\nmode = \"shadow\"\n\
                min_requests = 60\nmin_shadow_agreement = 0.9\ntimeout_s = 600\n\
                [[phases]]\nname = \"all\"\npercent = 100\n";
    let lies: [&[(f64, u64)]; 5] = [
        &[(1.0, 3_000)],         // plausible numbers, a false agreement
        &[(1.0, u64::MAX)],      // more requests than the time allows (and overflow)
        &[(1.0, 10_000_000)],    // a jump
        &[(7.5, 40)],            // not a fraction
        &[(1.0, 50), (1.0, 20)], // a counter that goes back
    ];
    for lie in lies {
        let mut c =
            Controller::new("r", "m", 2, Plan::parse(plan, "f").unwrap(), &fleet(3)).unwrap();
        c.start(1_000);
        for id in ["d000", "d001", "d002"] {
            c.on_status(&running_shadow(id, 2), 1_001);
        }
        for &(agreement, compared) in lie {
            c.on_quality(
                &quality(
                    "d002",
                    1,
                    (0.9, 900, false),
                    Some((2, agreement, compared, 0.9)),
                ),
                1_010,
            );
        }
        for id in ["d000", "d001"] {
            c.on_quality(
                &quality(id, 1, (0.9, 900, false), Some((2, 0.02, 40, 0.3))),
                1_020,
            );
        }
        let RolloutState::Aborted(reason) = &c.state else {
            panic!(
                "lie {lie:?}: the bad model must not pass: {:?} {:?}",
                c.state, c.gates
            )
        };
        assert!(
            reason.contains("quality gate min_shadow_agreement"),
            "{lie:?}: {reason}"
        );
        let agreement = c
            .gates
            .iter()
            .find(|g| g.name == "min_shadow_agreement")
            .unwrap();
        let value = agreement.value.unwrap();
        assert!(
            value < 0.6,
            "lie {lie:?}: one device moved the gate to {value}"
        );
        let liar = c.devices["d002"].quality.as_ref().unwrap();
        if lie.len() > 1 || lie[0].1 > 1_000_000 || lie[0].0 > 1.0 {
            let why = liar
                .excluded
                .as_deref()
                .unwrap_or_else(|| panic!("{lie:?}: not excluded"));
            assert!(
                why.contains("outside [0, 1]")
                    || why.contains("went back")
                    || why.contains("requests"),
                "{why}"
            );
            // The exclusion is in the saved state (the rollout's JSON).
            let json = serde_json::to_value(&c).unwrap();
            assert!(
                json["devices"]["d002"]["quality"]["excluded"].is_string(),
                "{json}"
            );
        }
    }
}

/// One honest device's report is not enough for a gate that needs a majority of reporting
/// devices, however many requests it claims.
#[test]
fn gates_need_a_majority_of_devices_reporting() {
    let plan = "[[phases]]\nname = \"a\"\npercent = 100\nmode = \"shadow\"\nmin_requests = 10\n\
                min_shadow_agreement = 0.5\ntimeout_s = 600\n[[phases]]\nname = \"b\"\npercent = 100\n";
    let mut c = Controller::new("r", "m", 2, Plan::parse(plan, "f").unwrap(), &fleet(5)).unwrap();
    c.start(0);
    for i in 0..5 {
        c.on_status(&running_shadow(&format!("d{i:03}"), 2), 1);
    }
    for i in 0..3 {
        assert_eq!(c.phase, 0, "promoted with {i} reporting devices");
        c.on_quality(
            &quality(
                &format!("d{i:03}"),
                1,
                (0.9, 900, false),
                Some((2, 0.99, 500, 0.9)),
            ),
            100,
        );
    }
    assert_eq!(c.phase, 1, "{:?}", c.gates);
}

/// A device's clean claim after a restart of its agent (its counter starts again) is believed.
#[test]
fn a_restarted_agent_counter_is_not_a_lie() {
    let plan = "[[phases]]\nname = \"a\"\npercent = 100\nmode = \"shadow\"\nmin_requests = 1000\n\
                timeout_s = 600\n[[phases]]\nname = \"b\"\npercent = 100\n";
    let mut c = Controller::new("r", "m", 2, Plan::parse(plan, "f").unwrap(), &fleet(1)).unwrap();
    c.start(0);
    c.on_status(&running_shadow("d000", 2), 1);
    c.on_quality(
        &quality("d000", 1, (0.9, 9, false), Some((2, 0.99, 500, 0.9))),
        100,
    );
    let mut restarted = running_shadow("d000", 2);
    restarted.started = 150;
    c.on_status(&restarted, 150);
    c.on_quality(
        &quality("d000", 1, (0.9, 9, false), Some((2, 0.99, 20, 0.9))),
        160,
    );
    let q = c.devices["d000"].quality.as_ref().unwrap();
    assert_eq!((q.excluded.as_deref(), q.requests), (None, 20));
    // Without a restart, the same drop is a lie.
    c.on_quality(
        &quality("d000", 1, (0.9, 9, false), Some((2, 0.99, 10, 0.9))),
        170,
    );
    assert!(
        c.devices["d000"]
            .quality
            .as_ref()
            .unwrap()
            .excluded
            .is_some()
    );
}

/// A plan's group must be listed in its [groups]; what devices say of themselves does not count.
#[test]
fn group_membership_comes_from_the_plan() {
    let e = Plan::parse(
        "[[phases]]\nname = \"c\"\ngroup = \"canary\"\n",
        "fleet.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("group `canary` is not listed in the plan's [groups]"),
        "{e}"
    );
    // A device that claims the canary group in its status is not in a canary the plan lists.
    let p = Plan::parse(
        "[groups]\ncanary = [\"d005\"]\n[[phases]]\nname = \"c\"\ngroup = \"canary\"\n\
         [[phases]]\nname = \"rest\"\npercent = 100\n",
        "f",
    )
    .unwrap();
    let c = Controller::new("r", "m", 2, p, &fleet(10)).unwrap();
    let canary: Vec<&str> = c.phase_devices(0).map(|d| d.id.as_str()).collect();
    assert_eq!(canary, ["d005"]);
}

/// The saved state opens only with the rollout's key, for its own name and plan; anything
/// else (another key, a plain controller, an edited body, another plan) is refused.
#[test]
fn a_saved_state_resumes_only_when_signed_by_the_rollout_key() {
    use ed25519_dalek::SigningKey;
    let plan = Plan::parse(PLAN, "fleet.toml").unwrap();
    let mut c = Controller::new("r1", "m", 2, plan.clone(), &fleet(20)).unwrap();
    c.start(100);
    let key = SigningKey::from_bytes(&[1; 32]);
    let topic = "k/rollouts/r1/state";
    let sealed = saved::seal(&key, &c);
    let back = saved::open(topic, &sealed, "r1", &key.verifying_key(), &plan).unwrap();
    assert_eq!(back, c);
    assert_eq!(saved::read(topic, &sealed).unwrap(), c);
    let other = SigningKey::from_bytes(&[2; 32]);
    let refused = |payload: &[u8], name: &str, plan: &Plan| {
        let e = saved::open(topic, payload, name, &key.verifying_key(), plan).unwrap_err();
        kestrel_shared::chain(&e)
    };
    let e = refused(&saved::seal(&other, &c), "r1", &plan);
    assert!(
        e.contains("k/rollouts/r1/state: the saved state does not verify"),
        "{e}"
    );
    let e = refused(&serde_json::to_vec(&c).unwrap(), "r1", &plan);
    assert!(e.contains("not a signed rollout state"), "{e}");
    // Another state under the genuine signature: deflated, or as plain JSON.
    let mut done = c.clone();
    done.state = RolloutState::Completed;
    let forged: saved::SignedState = serde_json::from_slice(&saved::seal(&other, &done)).unwrap();
    let mut planted: saved::SignedState = serde_json::from_slice(&sealed).unwrap();
    planted.body = forged.body;
    let e = refused(&serde_json::to_vec(&planted).unwrap(), "r1", &plan);
    assert!(e.contains("does not verify"), "{e}");
    planted.body = serde_json::to_string(&done).unwrap();
    planted.encoding = None;
    let e = refused(&serde_json::to_vec(&planted).unwrap(), "r1", &plan);
    assert!(e.contains("does not verify"), "{e}");
    let e = refused(&sealed, "r2", &plan);
    assert!(e.contains("is of rollout `r1`"), "{e}");
    let mut other_plan = plan.clone();
    other_plan.phases[0].timeout_s += 1;
    let e = refused(&sealed, "r1", &other_plan);
    assert!(e.contains("plan differs"), "{e}");
}

#[test]
fn a_plan_that_only_adds_group_members_resumes_and_they_join_their_phase() {
    use ed25519_dalek::SigningKey;
    let text = "[groups]\ncanary = [\"d000\"]\n[[phases]]\nname = \"canary\"\ngroup = \"canary\"\n\
                [[phases]]\nname = \"rest\"\npercent = 100\n";
    let plan = Plan::parse(text, "f").unwrap();
    let mut c = Controller::new("r1", "m", 2, plan.clone(), &fleet(4)).unwrap();
    c.start(100);
    let key = SigningKey::from_bytes(&[1; 32]);
    let topic = "k/rollouts/r1/state";
    let sealed = saved::seal(&key, &c);
    let mut grown = plan.clone();
    grown
        .groups
        .get_mut("canary")
        .unwrap()
        .push("pi-new".into());
    let mut back = saved::open(topic, &sealed, "r1", &key.verifying_key(), &grown).unwrap();
    assert_eq!(back.plan, grown);
    back.on_status(&status("pi-new", &[], Some(1), None), 101);
    assert_eq!(
        back.devices["pi-new"].phase, 0,
        "joins the canary it was added to"
    );
    assert_eq!(desired_devices(&back.on_tick(102)), ["pi-new"]);
    // Removing a member, adding a group or changing anything else is another plan.
    let mut shrunk = plan.clone();
    shrunk.groups.get_mut("canary").unwrap().clear();
    let mut more = plan.clone();
    more.groups.insert("other".into(), vec![]);
    let mut edited = grown.clone();
    edited.phases[1].soak_s = 5;
    for p in [shrunk, more, edited] {
        let e = saved::open(topic, &sealed, "r1", &key.verifying_key(), &p).unwrap_err();
        assert!(kestrel_shared::chain(&e).contains("plan differs"), "{e}");
    }
}
