//! Model quality on the fleet, with the real binaries: simulated devices fed real images
//! (`edge-agent run --simulate N --feed GROUP=DIR`) judge their live inputs against the
//! reference profile in the LFW artifact's manifest (`trainer status --quality`), and a rollout
//! whose first phase runs the candidate in shadow is gated on its agreement with the active model
//! (`trainer rollout`, `trainer rollout status --json`), on both brokers.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kestrel_fleet::statuses;
use kestrel_shared::protocol::sha256_hex;
use kestrel_shared::quality::DeviceQuality;
use kestrel_tests::fleet::{
    Broker, BrokerKind, Proc, agent_config, fixture, rollout_command, start_agent_with, wait_fleet,
};
use kestrel_tests::{export_ok, lfw, run, s, stderr, stdout, trainer_ok};
use serde_json::Value;

/// The LFW images the fixture's run held out for testing (its split.json), copied to `dir`.
pub(super) fn held_out(dir: &Path) -> Vec<PathBuf> {
    let split: Vec<Value> = serde_json::from_slice(
        &std::fs::read(fixture().dir.join("run").join("split.json")).unwrap(),
    )
    .unwrap();
    let test: Vec<&str> = split
        .iter()
        .filter(|r| r["split"] == "test")
        .map(|r| r["sha256"].as_str().unwrap())
        .collect();
    std::fs::create_dir_all(dir).unwrap();
    let mut out = Vec::new();
    for class in std::fs::read_dir(lfw()).unwrap() {
        for f in std::fs::read_dir(class.unwrap().path()).unwrap() {
            let p = f.unwrap().path();
            let bytes = std::fs::read(&p).unwrap();
            if test.contains(&sha256_hex(&bytes).as_str()) {
                let to = dir.join(p.file_name().unwrap());
                std::fs::write(&to, bytes).unwrap();
                out.push(to);
            }
        }
    }
    assert_eq!(out.len(), test.len(), "every held-out image found");
    out
}

/// The images with their grey levels inverted (a camera with the wrong pixel format), as PNG in
/// `dir`.
fn inverted(images: &[PathBuf], dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    for p in images {
        let mut img = image::open(p).unwrap();
        img.invert();
        img.save(dir.join(p.file_name().unwrap())).unwrap();
    }
}

/// agent.toml for `n` simulated devices with a short quality window and period.
fn fleet_config(dir: &Path, id: &str, b: &Broker, window: usize) -> PathBuf {
    let conf = agent_config(dir, id, &b.url(), &fixture().keys, "");
    let mut text = std::fs::read_to_string(&conf).unwrap();
    text.push_str(&format!("[quality]\nwindow = {window}\nperiod_s = 2\n"));
    std::fs::write(&conf, text).unwrap();
    conf
}

/// `trainer status --quality --json`, as a user types it: one report per device.
fn qualities(b: &Broker) -> Vec<DeviceQuality> {
    let o = run(
        "trainer",
        &["status", "--broker", &b.url(), "--quality", "--json"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Polls the quality reports until `done` holds for all `n` devices.
fn wait_quality(
    b: &Broker,
    n: usize,
    secs: u64,
    done: impl Fn(&DeviceQuality) -> bool,
) -> Vec<DeviceQuality> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let q = qualities(b);
        if q.len() == n && q.iter().all(&done) {
            return q;
        }
        assert!(
            Instant::now() < deadline,
            "quality reports not there: {q:?}"
        );
        std::thread::sleep(Duration::from_secs(1));
    }
}

fn rollout(b: &Broker, art: &Path, plan_dir: &Path, name: &str, phases: &str) -> (bool, Value) {
    std::fs::create_dir_all(plan_dir).unwrap();
    let plan = plan_dir.join(format!("{name}.toml"));
    std::fs::write(&plan, format!("name = \"{name}\"\n{phases}")).unwrap();
    let o = rollout_command(b, art, &s(&plan))
        .arg("--json")
        .output()
        .unwrap();
    let c =
        serde_json::from_str(stdout(&o).trim()).unwrap_or_else(|e| panic!("{e}: {}", stderr(&o)));
    (o.status.success(), c)
}

/// Devices fed the held-out LFW images are not flagged as drifted; devices fed the same images
/// inverted are, in (almost) every judged window, although their confidence stays as high as on
/// the reference: the confidence histogram alone would not tell them apart.
#[test]
fn inverted_inputs_drift_and_held_out_ones_do_not() {
    let f = fixture();
    let dir = f.dir.join("drift");
    let b = Broker::start(BrokerKind::Rumqttd, &dir.join("broker"));
    let held = held_out(&dir.join("held"));
    inverted(&held, &dir.join("inverted"));
    let conf = fleet_config(&dir.join("sim"), "q", &b, 40);
    let feeds = [
        format!("held={}", s(&dir.join("held"))),
        format!("inverted={}", s(&dir.join("inverted"))),
    ];
    let mut agents: Proc = start_agent_with(
        &conf,
        &[],
        &[
            "--simulate",
            "8",
            "--feed",
            &feeds[0],
            "--feed",
            &feeds[1],
            "--feed-rate",
            "5",
        ],
    );
    wait_fleet(&b.config(), 8);
    kestrel_tests::fleet::publish_ok(&b, &f.v1, &f.key(), "group/all");
    let reports = wait_quality(&b, 8, 400, |q| {
        q.version == 1 && q.window.as_ref().is_some_and(|w| w.windows >= 5)
    });
    assert!(agents.is_running());
    let groups: Vec<(String, Vec<String>)> = statuses(&b.config(), None)
        .unwrap()
        .into_iter()
        .map(|s| (s.device, s.groups))
        .collect();
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(f.v1.join("manifest.json")).unwrap()).unwrap();
    let reference: Vec<f64> =
        serde_json::from_value(manifest["reference"]["confidence_histogram"].clone()).unwrap();
    let mut tally = std::collections::BTreeMap::<&str, (u64, u64, f64, f64)>::new();
    for q in &reports {
        let g = &groups.iter().find(|(d, _)| *d == q.device).unwrap().1;
        let group = if g.contains(&"held".to_string()) {
            "held"
        } else {
            "inverted"
        };
        let w = q.window.as_ref().unwrap();
        // Total variation distance of the window's confidence histogram to the reference's.
        let tv = 0.5
            * w.confidence_histogram
                .iter()
                .zip(&reference)
                .map(|(a, b)| (a - b).abs())
                .sum::<f64>();
        let t = tally.entry(group).or_default();
        t.0 += w.windows;
        t.1 += w.flagged_windows;
        t.2 = t.2.max(tv);
        t.3 += w.mean_confidence / 4.0;
        eprintln!(
            "{} ({group}): windows {}/{} flagged, max z {:.1}, mean confidence {:.3} (reference {:.3}), \
             confidence histogram TV {:.3}, class distance {:.3}",
            q.device,
            w.flagged_windows,
            w.windows,
            w.drift.max_z,
            w.mean_confidence,
            w.reference_confidence,
            tv,
            w.class_distance
        );
    }
    let (hw, hf, htv, hconf) = tally["held"];
    let (iw, if_, itv, iconf) = tally["inverted"];
    eprintln!(
        "held out: {hf}/{hw} windows flagged, mean confidence {hconf:.3}, histogram TV up to {htv:.3}; \
         inverted: {if_}/{iw} flagged, mean confidence {iconf:.3}, histogram TV up to {itv:.3}"
    );
    assert!(hw >= 20 && iw >= 20);
    assert!(
        hf as f64 <= 0.05 * hw as f64,
        "held-out windows flagged: {hf}/{hw}"
    );
    assert!(
        if_ as f64 >= 0.95 * iw as f64,
        "inverted windows flagged: {if_}/{iw}"
    );
    // The model stays as confident on the inverted images as on the held-out ones: a gate on
    // the confidence alone would pass them.
    let ref_conf = reports[0].window.as_ref().unwrap().reference_confidence;
    assert!(
        iconf >= ref_conf - 0.05 && iconf >= hconf - 0.05,
        "inverted mean confidence {iconf:.3}, held out {hconf:.3}, reference {ref_conf:.3}"
    );
    // The table a user reads.
    let o = run("trainer", &["status", "--broker", &b.url(), "--quality"]);
    let table = stdout(&o);
    assert!(
        table.contains("flagged") && table.contains("q-000") && table.contains("lfw v1"),
        "{table}"
    );
}

/// The candidates of the shadow test: v3 trained on shuffled labels, v4 on the true labels with
/// another seed (the fixture's run is the default seed, 42).
pub(super) fn candidates() -> (PathBuf, PathBuf) {
    let dir = kestrel_tests::once::fixture("quality-candidates", |dir| {
        // The LFW manifest with its labels permuted (a fixed shuffle), images by absolute path.
        let base = PathBuf::from(kestrel_tests::dataset("lfw", "manifest.csv"));
        let text = std::fs::read_to_string(&base).unwrap();
        let rows: Vec<(&str, &str)> = text
            .lines()
            .skip(1)
            .map(|l| l.split_once(',').unwrap())
            .collect();
        let mut labels: Vec<&str> = rows.iter().map(|r| r.1).collect();
        let mut state = 7u64;
        for i in (1..labels.len()).rev() {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            labels.swap(i, (state >> 33) as usize % (i + 1));
        }
        let root = base.parent().unwrap();
        let mut csv = String::from("path,label\n");
        for ((path, _), label) in rows.iter().zip(&labels) {
            csv.push_str(&format!("{},{label}\n", s(&root.join(path))));
        }
        let shuffled = dir.join("shuffled.csv");
        std::fs::write(&shuffled, csv).unwrap();
        let fit_export = |data: &str, seed: &str, version: &str| {
            let run_dir = dir.join(format!("run-{version}"));
            trainer_ok(&[
                "fit",
                "--data",
                data,
                "--engine",
                "ort",
                "--optimizer",
                "sgd",
                "--epochs",
                "10",
                "--test-fraction",
                "0.2",
                "--seed",
                seed,
                "--out",
                &s(&run_dir),
            ]);
            let art = dir.join(format!("v{version}"));
            // Export checks that need no labels (int8 against f32, goldens) pass on both.
            export_ok(
                &run_dir,
                &art,
                &[
                    "--quantize",
                    "int8-weights",
                    "--model-version",
                    version,
                    "--model-name",
                    "lfw",
                ],
            );
            art
        };
        fit_export(&s(&shuffled), "42", "3");
        fit_export(&lfw(), "2", "4");
    });
    (dir.join("v3"), dir.join("v4"))
}

/// The value of a rollout's gate `name` (of its first phase).
pub(super) fn gate(c: &Value, name: &str) -> f64 {
    c["gates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["name"] == name && g["phase"] == 0)
        .and_then(|g| g["value"].as_f64())
        .unwrap_or_else(|| panic!("no value of gate {name}: {c}"))
}

const SHADOW_PLAN: &str = r#"
[[phases]]
name = "shadow"
percent = 50
mode = "shadow"
min_requests = 60
min_shadow_agreement = 0.9
timeout_s = 240
[[phases]]
name = "all"
percent = 100
timeout_s = 120
"#;

#[test]
fn a_shadow_phase_stops_a_bad_candidate_and_passes_a_good_one_on_rumqttd() {
    shadow_phase_gates_the_rollout(BrokerKind::Rumqttd);
}

#[test]
fn a_shadow_phase_stops_a_bad_candidate_and_passes_a_good_one_on_mosquitto() {
    shadow_phase_gates_the_rollout(BrokerKind::Mosquitto);
}

fn shadow_phase_gates_the_rollout(kind: BrokerKind) {
    let f = fixture();
    let (bad, good) = candidates();
    let dir = f.dir.join(format!("shadow-{kind:?}"));
    let b = Broker::start(kind, &dir.join("broker"));
    held_out(&dir.join("held"));
    let conf = fleet_config(&dir.join("sim"), "sh", &b, 50);
    let feed = format!("held={}", s(&dir.join("held")));
    let _agents = start_agent_with(
        &conf,
        &[],
        &["--simulate", "4", "--feed", &feed, "--feed-rate", "4"],
    );
    wait_fleet(&b.config(), 4);
    let (ok, c) = rollout(
        &b,
        &f.v1,
        &dir,
        "v1",
        "[[phases]]\nname = \"all\"\npercent = 100\n",
    );
    assert!(ok, "{c}");

    // The shuffled-label candidate: verified and health-checked in shadow, never activated.
    let (ok, c) = rollout(&b, &bad, &dir, "bad", SHADOW_PLAN);
    assert!(!ok, "the rollout must abort: {c}");
    assert_eq!(c["state"]["state"], "aborted", "{c}");
    let reason = c["state"]["reason"].as_str().unwrap();
    assert!(
        reason.contains("phase 0 `shadow`: quality gate min_shadow_agreement"),
        "{reason}"
    );
    let agreement = gate(&c, "min_shadow_agreement");
    assert!(agreement < 0.9, "{c}");
    assert!(gate(&c, "min_requests") >= 60.0, "{c}");
    for s in statuses(&b.config(), None).unwrap() {
        assert_eq!(s.active, Some(1), "{} must be on v1", s.device);
        assert_eq!(
            s.previous, None,
            "{} never activated anything else",
            s.device
        );
        let store = dir.join("sim/store").join(&s.device);
        assert!(!store.join("versions/3").exists(), "{}", s.device);
    }
    let shown = run(
        "trainer",
        &[
            "rollout",
            "status",
            "--broker",
            &b.url(),
            "--name",
            "bad",
            "--json",
        ],
    );
    let shown: Value = serde_json::from_str(stdout(&shown).trim()).unwrap();
    assert_eq!(shown["gates"], c["gates"]);
    let table = stdout(&run(
        "trainer",
        &["rollout", "status", "--broker", &b.url(), "--name", "bad"],
    ));
    assert!(
        table.contains("min_shadow_agreement") && table.contains("BREACHED"),
        "{table}"
    );

    // Another seed on the true labels agrees with v1: shadow phase passed, then everyone on v4.
    let (ok, c) = rollout(&b, &good, &dir, "good", SHADOW_PLAN);
    assert!(ok, "{c}");
    assert_eq!(c["state"]["state"], "completed", "{c}");
    let agreement_good = gate(&c, "min_shadow_agreement");
    assert!(agreement_good >= 0.9, "{c}");
    for s in statuses(&b.config(), None).unwrap() {
        assert_eq!(s.active, Some(4), "{}", s.device);
    }
    eprintln!(
        "{kind:?}: shuffled-label v3 agreement {agreement:.3} (aborted), seed-2 v4 at least {agreement_good:.3} (completed)"
    );
}
