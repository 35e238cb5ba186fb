//! The pace, failure-rate aborts and dynamic rollouts, on simulated fleets and clocks.

use super::tests::{desired_devices, fleet, status};
use super::*;

fn plan(phase: &str) -> Plan {
    Plan::parse(
        &format!("[[phases]]\nname = \"all\"\npercent = 100\n{phase}\n"),
        "fleet.toml",
    )
    .unwrap()
}

/// Runs the clock from `t0` for `seconds`, devices reporting the model active `answer_after`
/// seconds after they were given it (never when `None`); returns when each device was given it.
fn run(
    c: &mut Controller,
    t0: u64,
    seconds: u64,
    answer_after: Option<u64>,
) -> BTreeMap<String, u64> {
    let mut given = BTreeMap::new();
    let note = |out: &[Output], t: u64, given: &mut BTreeMap<String, u64>| {
        for d in desired_devices(out) {
            given.entry(d).or_insert(t);
        }
    };
    let out = c.start(t0);
    note(&out, t0, &mut given);
    for t in t0 + 1..=t0 + seconds {
        if let Some(after) = answer_after {
            let due: Vec<String> = given
                .iter()
                .filter(|(id, at)| **at + after == t && c.devices[*id].state == DeviceState::Moved)
                .map(|(id, _)| id.clone())
                .collect();
            for id in due {
                let out = c.on_status(&status(&id, &[], Some(2), None), t);
                note(&out, t, &mut given);
            }
        }
        let out = c.on_tick(t);
        note(&out, t, &mut given);
    }
    given
}

/// The devices given the model and not yet done.
fn moved(c: &Controller) -> Vec<String> {
    c.devices
        .values()
        .filter(|d| d.state == DeviceState::Moved)
        .map(|d| d.id.clone())
        .collect()
}

/// The most devices given the model within any 60 s.
fn busiest_minute(given: &BTreeMap<String, u64>) -> usize {
    let times: Vec<u64> = given.values().copied().collect();
    times
        .iter()
        .map(|&start| {
            times
                .iter()
                .filter(|&&t| t >= start && t < start + 60)
                .count()
        })
        .max()
        .unwrap_or(0)
}

#[test]
fn the_rate_holds_in_every_minute_and_spreads_over_it() {
    let mut c = Controller::new("r", "m", 2, plan("max_per_minute = 30"), &fleet(200)).unwrap();
    let given = run(&mut c, 1_000, 300, Some(2));
    assert_eq!(busiest_minute(&given), 30);
    // Spread evenly: one device every 2 s, not 30 at once and then a pause.
    let first_10s = given.values().filter(|&&t| t < 1_010).count();
    assert!((4..=6).contains(&first_10s), "{first_10s}");
    assert!(
        (148..=152).contains(&given.len()),
        "{} in 300 s",
        given.len()
    );
    // Faster than a device a second: each second's share at once.
    let mut c = Controller::new("r", "m", 2, plan("max_per_minute = 600"), &fleet(500)).unwrap();
    let given = run(&mut c, 1_000, 30, Some(1));
    assert_eq!(busiest_minute(&given), given.len());
    assert!((295..=310).contains(&given.len()), "{}", given.len());
}

#[test]
fn no_more_than_max_in_progress_download_at_once() {
    let mut c = Controller::new("r", "m", 2, plan("max_in_progress = 5"), &fleet(40)).unwrap();
    let out = c.start(1_000);
    assert_eq!(desired_devices(&out).len(), 5);
    assert!(
        c.on_tick(1_001)
            .iter()
            .all(|o| !matches!(o, Output::Desired { .. }))
    );
    let moved = moved(&c);
    for id in &moved[..2] {
        c.on_status(&status(id, &[], Some(2), None), 1_002);
    }
    assert_eq!(desired_devices(&c.on_tick(1_003)).len(), 2);
    // Devices that never answer hold their places until they time out.
    let mut c = Controller::new(
        "r",
        "m",
        2,
        plan("max_in_progress = 5\ndevice_timeout_s = 30\nsuccess = 0\nmax_failures = 100"),
        &fleet(12),
    )
    .unwrap();
    let given = run(&mut c, 1_000, 100, None);
    let mut times: Vec<u64> = given.values().copied().collect();
    times.sort();
    assert_eq!(
        times,
        [[1_000; 5], [1_030; 5]]
            .concat()
            .into_iter()
            .chain([1_060; 2])
            .collect::<Vec<_>>()
    );
    assert_eq!(
        c.state,
        RolloutState::Completed,
        "success 0: every device timed out"
    );
}

#[test]
fn the_ramp_multiplies_the_rate_as_devices_succeed() {
    let spec = plan(
        "max_per_minute = 48\nramp = { start_per_minute = 6, factor = 2, every = 5 }\nmax_in_progress = 1000",
    )
    .phases[0]
    .clone();
    let rates: Vec<Option<f64>> = [0, 4, 5, 10, 15, 1_000]
        .iter()
        .map(|&n| pace::rate(&spec, n))
        .collect();
    assert_eq!(rates, [6.0, 6.0, 12.0, 24.0, 48.0, 48.0].map(Some));
    let mut c = Controller::new(
        "r",
        "m",
        2,
        Plan {
            phases: vec![spec],
            ..plan("")
        },
        &fleet(300),
    )
    .unwrap();
    let given = run(&mut c, 1_000, 300, Some(1));
    let per_minute: Vec<usize> = (0..5)
        .map(|m| given.values().filter(|&&t| (t - 1_000) / 60 == m).count())
        .collect();
    assert!(
        per_minute[0] < per_minute[1] && per_minute[1] <= per_minute[2],
        "{per_minute:?}"
    );
    assert!(per_minute[0] <= 12, "{per_minute:?}");
    assert!(per_minute.iter().all(|&n| n <= 48), "{per_minute:?}");
    assert!(per_minute[3] >= 46, "{per_minute:?}");
}

#[test]
fn a_failure_rate_aborts_only_once_enough_devices_finished() {
    let spec = "abort_failure_rate = 0.2\nabort_min_finished = 10\nsuccess = 0.5";
    let mut c = Controller::new("r", "m", 2, plan(spec), &fleet(30)).unwrap();
    c.start(1_000);
    let ids: Vec<String> = c.devices.keys().cloned().collect();
    let mut t = 1_000;
    let mut report = |c: &mut Controller, id: &str, ok: bool| {
        t += 1;
        let s = if ok {
            status(id, &[], Some(2), None)
        } else {
            status(id, &[], Some(1), Some(2))
        };
        c.on_status(&s, t);
    };
    for id in &ids[..5] {
        report(&mut c, id, false);
    }
    for id in &ids[5..9] {
        report(&mut c, id, true);
    }
    assert_eq!(
        c.state,
        RolloutState::Running,
        "5 of 9 failed: under the minimum"
    );
    report(&mut c, &ids[9], true);
    let RolloutState::Aborted(why) = &c.state else {
        panic!("{:?}", c.state)
    };
    assert!(why.contains("5 of 10 finished devices failed"), "{why}");
    // At most one in five failed, whenever counted: at the rate, not over it.
    let mut c = Controller::new("r", "m", 2, plan(spec), &fleet(30)).unwrap();
    c.start(1_000);
    for (i, id) in ids.iter().enumerate() {
        report(&mut c, id, i % 5 != 4);
    }
    assert_eq!(c.state, RolloutState::Completed, "6 of 30 failed");
    assert!(
        Plan::parse(
            "[[phases]]\nname = \"a\"\npercent = 100\nabort_min_finished = 3\n",
            "f"
        )
        .is_err()
    );
    assert!(Plan::parse("[[phases]]\nname = \"a\"\npercent = 100\nramp = { start_per_minute = 0, factor = 2, every = 1 }\n", "f").is_err());
}

const GROUPS: &str = r#"
[groups]
canary = ["d000", "d001", "late-canary"]
[[phases]]
name = "canary"
group = "canary"
[[phases]]
name = "rest"
percent = 100
"#;

#[test]
fn devices_that_appear_join_the_phase_the_plan_gives_them() {
    let mut c = Controller::new("r", "m", 2, Plan::parse(GROUPS, "f").unwrap(), &fleet(6)).unwrap();
    c.start(1_000);
    // A new device: the last phase, not given the model during the canary.
    c.on_status(&status("newcomer", &["canary"], Some(1), None), 1_001);
    // A device of the canary group that reports for the first time: the canary.
    c.on_status(&status("late-canary", &[], Some(1), None), 1_001);
    assert_eq!(desired_devices(&c.on_tick(1_002)), ["late-canary"]);
    let (newcomer, canary) = (&c.devices["newcomer"], &c.devices["late-canary"]);
    assert_eq!(
        (newcomer.phase, newcomer.late, &newcomer.state),
        (1, true, &DeviceState::Waiting)
    );
    assert_eq!((canary.phase, canary.late), (0, true));
    let mut t = 1_002;
    for _ in 0..2 {
        for id in moved(&c) {
            t += 1;
            c.on_status(&status(&id, &[], Some(2), None), t);
        }
    }
    assert_eq!(c.state, RolloutState::Completed);
    assert_eq!(c.devices["newcomer"].state, DeviceState::Active);
    // Completed: a plain rollout's controller has stopped taking devices, a dynamic one goes on.
    assert!(
        c.on_status(&status("after", &[], Some(1), None), t + 1)
            .is_empty()
    );
    c.plan.dynamic = true;
    c.on_status(&status("after", &[], None, None), t + 1);
    assert_eq!(desired_devices(&c.on_tick(t + 2)), ["after"]);
    assert!(
        c.on_status(&status("after", &[], Some(2), None), t + 3)
            .contains(&Output::Save)
    );
    assert_eq!(c.devices["after"].state, DeviceState::Active);
    // A plan's device list is the fleet: others never join.
    let mut listed = Plan::parse(GROUPS, "f").unwrap();
    listed.devices = Some(vec!["d000".into(), "d001".into()]);
    a_stranger_stays_out(listed);
}

/// A device the rollout does not know reports during it, and does not join.
fn a_stranger_stays_out(plan: Plan) {
    let mut c = Controller::new("r", "m", 2, plan, &fleet(2)).unwrap();
    c.start(1_000);
    assert!(
        c.on_status(&status("stranger", &[], Some(1), None), 1_001)
            .is_empty()
    );
    assert!(!c.devices.contains_key("stranger"));
}

#[test]
fn offline_devices_wait_and_get_the_final_target_when_back() {
    let start = |c: &mut Controller| {
        c.on_online("d003", false, 999);
        let given = desired_devices(&c.start(1_000));
        assert_eq!(given.len(), 4);
        assert!(!given.contains(&"d003".to_string()));
        // d001 goes offline while it downloads: still in progress, it holds the phase.
        c.on_online("d001", false, 1_001);
        for id in ["d000", "d002", "d004"] {
            c.on_status(&status(id, &[], Some(2), None), 1_002);
        }
        assert_eq!(c.state, RolloutState::Running, "d001 is pending");
        assert_eq!(c.counts(0), (3, 0, 1));
    };
    // Away past its timeout: it failed (a model that crashes its device must not pass).
    let mut c = Controller::new("r", "m", 2, plan("device_timeout_s = 30"), &fleet(5)).unwrap();
    start(&mut c);
    c.on_tick(1_029);
    assert_eq!(c.devices["d001"].state, DeviceState::Moved);
    c.on_tick(1_030);
    let RolloutState::Aborted(why) = &c.state else {
        panic!("{:?}", c.state)
    };
    assert!(why.contains("1 of 4 devices failed"), "{why}");
    // Back in time, it reports the model active: the rollout completes, and the device offline
    // throughout is given the model then.
    let mut c = Controller::new("r", "m", 2, plan("device_timeout_s = 30"), &fleet(5)).unwrap();
    start(&mut c);
    c.on_online("d001", true, 1_010);
    let out = c.on_status(&status("d001", &[], Some(2), None), 1_012);
    assert_eq!(c.state, RolloutState::Completed, "{out:?}");
    assert_eq!(
        desired_devices(&out),
        ["d003"],
        "the offline device is given the model at the end"
    );
    assert!(c.devices["d003"].offline);
    c.on_online("d003", true, 1_200);
    c.on_status(&status("d003", &[], Some(2), None), 1_210);
    assert_eq!(c.devices["d003"].state, DeviceState::Active);
    // A device that had the model before its state was saved counts as active.
    let mut c = Controller::new("r", "m", 2, plan("max_in_progress = 1"), &fleet(3)).unwrap();
    c.start(1_000);
    let waiting = c
        .devices
        .values()
        .find(|d| d.state == DeviceState::Waiting)
        .unwrap()
        .id
        .clone();
    c.on_status(&status(&waiting, &[], Some(2), None), 1_001);
    assert_eq!(c.devices[&waiting].state, DeviceState::Active);
}

#[test]
fn a_ten_thousand_device_state_fits_a_broker_message_and_resumes() {
    let statuses: Vec<Status> = (0..10_000)
        .map(|i| {
            let mut s = status(&format!("sim-{i:05}"), &[], Some(1), None);
            s.started = 1_796_000_000 + i;
            s.counters.bytes_fetched = 3_600_000 + i;
            s
        })
        .collect();
    let plan = Plan::parse(
        "[[phases]]\nname = \"canary\"\npercent = 2\n[[phases]]\nname = \"all\"\npercent = 100\nmax_per_minute = 1000\n",
        "f",
    )
    .unwrap();
    let mut c = Controller::new("big", "m", 2, plan.clone(), &statuses).unwrap();
    c.start(1_796_100_000);
    let ids: Vec<String> = c.phase_devices(0).map(|d| d.id.clone()).collect();
    for id in &ids {
        c.on_status(&status(id, &[], Some(2), None), 1_796_100_010);
    }
    c.on_tick(1_796_100_020);
    assert_eq!(c.phase, 1);
    let key = ed25519_dalek::SigningKey::from_bytes(&[1; 32]);
    let sealed = saved::seal(&key, &c);
    assert!(sealed.len() < 1 << 20, "{} bytes", sealed.len());
    let back = saved::open(
        "k/rollouts/big/state",
        &sealed,
        "big",
        &key.verifying_key(),
        &plan,
    )
    .unwrap();
    assert_eq!(back, c);
}

#[test]
fn rates_below_one_a_minute_give_one_device_per_window() {
    assert_eq!(pace::window(0.5), (1, 120));
    assert_eq!(pace::window(1.5), (1, 60));
    assert_eq!(pace::window(30.0), (30, 60));
    let mut c = Controller::new("r", "m", 2, plan("max_per_minute = 0.5"), &fleet(4)).unwrap();
    let given = run(&mut c, 1_000, 420, Some(1));
    let mut times: Vec<u64> = given.values().copied().collect();
    times.sort();
    assert_eq!(times.len(), 4, "{times:?}");
    assert!(
        times
            .windows(2)
            .all(|w| (120..=122).contains(&(w[1] - w[0]))),
        "one every two minutes: {times:?}"
    );
    assert_eq!(c.state, RolloutState::Completed);
}

#[test]
fn a_steep_ramp_without_a_maximum_stays_finite_and_its_state_resumes() {
    let p =
        plan("ramp = { start_per_minute = 10, factor = 4, every = 1 }\nmax_in_progress = 100000");
    assert_eq!(pace::rate(&p.phases[0], 900), Some(pace::MAX_RATE));
    let mut c = Controller::new("r", "m", 2, p.clone(), &fleet(2_000)).unwrap();
    run(&mut c, 1_000, 40, Some(1));
    assert!(c.pace.devices.is_finite(), "{}", c.pace.devices);
    let key = ed25519_dalek::SigningKey::from_bytes(&[1; 32]);
    let back = saved::open(
        "k/rollouts/r/state",
        &saved::seal(&key, &c),
        "r",
        &key.verifying_key(),
        &p,
    )
    .unwrap();
    assert_eq!(back, c);
}

#[test]
fn a_phase_whose_devices_are_all_offline_holds_the_rollout_until_its_time_is_up() {
    let text = format!("{GROUPS}timeout_s = 60\n").replace(
        "group = \"canary\"\n",
        "group = \"canary\"\ntimeout_s = 60\n",
    );
    let mut c = Controller::new("r", "m", 2, Plan::parse(&text, "f").unwrap(), &fleet(6)).unwrap();
    c.on_online("d000", false, 999);
    c.on_online("d001", false, 999);
    assert!(desired_devices(&c.start(1_000)).is_empty());
    for t in 1_001..1_060 {
        assert!(desired_devices(&c.on_tick(t)).is_empty(), "at {t}");
    }
    assert_eq!(
        (c.phase, &c.state),
        (0, &RolloutState::Running),
        "no canary passes on no device"
    );
    c.on_tick(1_060);
    let RolloutState::Aborted(why) = &c.state else {
        panic!("{:?}", c.state)
    };
    assert!(why.contains("none of its 2 devices was online"), "{why}");
    // One back in time: the canary is judged on it.
    let mut c = Controller::new("r", "m", 2, Plan::parse(&text, "f").unwrap(), &fleet(6)).unwrap();
    c.on_online("d000", false, 999);
    c.on_online("d001", false, 999);
    c.start(1_000);
    c.on_online("d001", true, 1_010);
    assert_eq!(desired_devices(&c.on_tick(1_011)), ["d001"]);
    c.on_status(&status("d001", &[], Some(2), None), 1_020);
    assert_eq!(c.phase, 1);
}

#[test]
fn a_device_no_phase_selects_does_not_join() {
    let text = GROUPS.replace("percent = 100", "group = \"canary\"");
    a_stranger_stays_out(Plan::parse(&text, "f").unwrap());
}

#[test]
fn shares_of_the_fleet_round_up_without_float_error() {
    for (p, n, want) in [
        (7.0, 100, 7),
        (14.0, 100, 14),
        (28.0, 100, 28),
        (55.0, 100, 55),
        (2.0, 10_000, 200),
        (10.0, 15, 2),
    ] {
        let text = format!(
            "[[phases]]\nname = \"a\"\npercent = {p}\n[[phases]]\nname = \"b\"\npercent = 100\n"
        );
        let c = Controller::new("r", "m", 2, Plan::parse(&text, "f").unwrap(), &fleet(n)).unwrap();
        assert_eq!(c.phase_devices(0).count(), want, "{p}% of {n}");
    }
}

#[test]
fn a_failure_rate_alone_sets_the_success_threshold() {
    let p = plan("abort_failure_rate = 0.1");
    assert_eq!(p.phases[0].success, Some(0.9));
    assert_eq!(plan("").phases[0].success, Some(1.0));
    assert_eq!(
        plan("abort_failure_rate = 0.1\nsuccess = 0.5").phases[0].success,
        Some(0.5)
    );
    // 1 of 20 failed: under the rate, so the rollout completes (it used to abort at the end,
    // below a success threshold of 1 that the plan never asked for).
    let mut c = Controller::new("r", "m", 2, p, &fleet(20)).unwrap();
    c.start(1_000);
    let ids: Vec<String> = c.devices.keys().cloned().collect();
    for (i, id) in ids.iter().enumerate() {
        let failed = (i + 1 == ids.len()).then_some(2);
        c.on_status(
            &status(id, &[], Some(if failed.is_some() { 1 } else { 2 }), failed),
            1_001,
        );
    }
    assert_eq!(c.state, RolloutState::Completed);
}

#[test]
fn devices_are_given_the_model_in_the_rollouts_own_order() {
    let mut c = Controller::new("r", "m", 2, plan("max_in_progress = 10"), &fleet(100)).unwrap();
    let first = desired_devices(&c.start(1_000));
    assert_eq!(first.len(), 10);
    let by_id: Vec<String> = c.devices.keys().take(10).cloned().collect();
    assert_ne!(first, by_id, "not the ten lowest ids");
    let mut again =
        Controller::new("r", "m", 2, plan("max_in_progress = 10"), &fleet(100)).unwrap();
    assert_eq!(desired_devices(&again.start(1_000)), first, "stable");
}

#[test]
fn a_dynamic_rollout_paces_devices_that_come_back_after_it_completed() {
    let mut p = plan("max_in_progress = 2");
    p.dynamic = true;
    let mut c = Controller::new("r", "m", 2, p, &fleet(8)).unwrap();
    for id in ["d001", "d002", "d003", "d004", "d005"] {
        c.on_online(id, false, 999);
    }
    run(&mut c, 1_000, 5, Some(1));
    assert_eq!(c.state, RolloutState::Completed);
    assert_eq!(c.counts(0), (3, 0, 0));
    // All five back at once: given the model two at a time, not five.
    for id in ["d001", "d002", "d003", "d004", "d005"] {
        c.on_online(id, true, 2_000);
    }
    assert_eq!(desired_devices(&c.on_tick(2_001)).len(), 2);
    assert!(desired_devices(&c.on_tick(2_002)).is_empty());
    for id in moved(&c) {
        c.on_status(&status(&id, &[], Some(2), None), 2_003);
    }
    assert_eq!(desired_devices(&c.on_tick(2_004)).len(), 2);
}
