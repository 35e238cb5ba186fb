use super::*;
use kestrel_shared::protocol::LatencyStats;

fn status(id: &str, groups: &[&str], active: Option<u64>, failed: Option<u64>) -> Status {
    Status {
        device: id.into(),
        groups: groups.iter().map(|g| g.to_string()).collect(),
        state: "idle".into(),
        model: active.map(|_| "m".into()),
        active,
        previous: None,
        target: None,
        progress: None,
        last_error: failed.map(|v| format!("v{v} health check failed")),
        failed_version: failed,
        latency: LatencyStats::default(),
        updated: String::new(),
        source: None,
        refused: None,
        keys_version: None,
    }
}

fn fleet(n: usize) -> Vec<Status> {
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

fn desired_devices(out: &[Output]) -> Vec<String> {
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
    // A group phase takes exactly the group.
    let g = Plan::parse("[[phases]]\nname = \"c\"\ngroup = \"canary\"\n[[phases]]\nname = \"rest\"\npercent = 100\n", "f").unwrap();
    let c = Controller::new("r", "m", 2, g, &fleet(10)).unwrap();
    let mut canary: Vec<&str> = c.phase_devices(0).map(|d| d.id.as_str()).collect();
    canary.sort();
    assert_eq!(canary, ["d000", "d001", "d002"]);
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
    let p = Plan::parse("[[phases]]\nname = \"a\"\ngroup = \"nobody\"\n", "f").unwrap();
    assert!(
        Controller::new("r", "m", 2, p, &fleet(3))
            .unwrap_err()
            .to_string()
            .contains("selects no device")
    );
}
