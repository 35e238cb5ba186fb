//! Signed model delivery over MQTT with the real binaries: `trainer publish` / `trainer infer` /
//! `trainer status`, `edge-agent run`, against the embedded rumqttd and against Mosquitto.

use std::path::Path;
use std::process::Output;

use kestrel_fleet::{Bundle, Conn};
use kestrel_shared::protocol::{ArtifactOffer, sha256_hex};
use kestrel_shared::topics::Topics;
use kestrel_shared::wire::DeviceState;
use kestrel_tests::fleet::{
    Broker, BrokerKind, Proc, agent_config, desired, fixture, killed_mid_download, publish,
    publish_ok, publish_raw, start_agent, start_agent_with, trainer_ok, wait_status,
};
use kestrel_tests::{fetched, json_lines, run, s, stderr, stdout};
use serde_json::Value;

/// `trainer infer --json`: the per-image lines and the summary line.
fn infer(b: &Broker, device: &str, args: &[&str]) -> (Vec<Value>, Value, Output) {
    let url = b.url();
    let mut all = vec!["infer", "--broker", &url, "--device", device, "--json"];
    all.extend_from_slice(args);
    let o = run("trainer", &all);
    let mut lines: Vec<Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let summary = lines
        .pop()
        .unwrap_or_else(|| panic!("no output: {}", stderr(&o)));
    (lines, summary, o)
}

#[test]
fn rumqttd_delivery_inference_updates_and_every_rejection() {
    let f = fixture();
    let dir = f.dir.join("rumqttd");
    let b = Broker::start(BrokerKind::Rumqttd, &dir.join("broker"));
    let mut agent = v1_published_before_the_device_infers_like_evaluate(&b, &dir);
    v2_replaces_v1_kept_as_previous(&b, &dir);
    // Every bad update is rejected with a reason in the status, and v2 keeps serving.
    let topics = Conn::connect(&b.config(), "t").unwrap().topics.clone();
    downgrades_and_unknown_keys_are_rejected(&b, &topics);
    bad_files_are_rejected(&b, &topics, &dir);
    bad_images_get_error_replies(&b, &dir, &mut agent);

    // SIGTERM: a clean exit.
    assert!(agent.terminate().success());
}

/// v1 is published before the device exists; the publisher has exited when it connects. Then
/// inference over MQTT gives what `trainer evaluate` gives on the same 200 images.
fn v1_published_before_the_device_infers_like_evaluate(b: &Broker, dir: &Path) -> Proc {
    let f = fixture();
    let cfg = b.config();
    let p = publish_ok(b, &f.v1, &f.key(), "device/pi-1");
    assert_eq!(
        (p["version"].as_u64(), p["replaced"].as_u64()),
        (Some(1), None)
    );
    let conf = agent_config(
        &dir.join("pi-1"),
        "pi-1",
        &b.url(),
        &f.keys,
        "max_artifact_bytes = 8000000\nmax_image_bytes = 1000000",
    );
    let agent = start_agent(&conf, &[]);
    let st = wait_status(&cfg, "pi-1", 120, "v1 active", |s| {
        s.active == Some(1) && s.state == DeviceState::Idle
    });
    assert_eq!(st.model.as_deref(), Some("lfw"));
    assert_eq!(st.last_error, None);

    let table = s(&fetched("datasets/lfw/manifest.csv"));
    let (lines, summary, o) = infer(b, "pi-1", &["--data", &table]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!((lines.len(), summary["errors"].as_u64()), (200, Some(0)));
    assert!(lines.iter().all(|l| l["prediction"]["version"] == 1));
    let eval: Value = serde_json::from_str(&trainer_ok(&[
        "evaluate",
        "--model",
        &s(&f.v1.join("model.onnx")),
        "--data",
        &table,
        "--engine",
        "tract",
        "--json",
    ]))
    .unwrap();
    assert_eq!(summary["evaluation"]["confusion"], eval["confusion"]);
    assert_eq!(summary["evaluation"]["accuracy"], eval["accuracy"]);
    assert!(eval["accuracy"].as_f64().unwrap() > 0.95);
    agent
}

/// v2 replaces v1, which is kept as previous.
fn v2_replaces_v1_kept_as_previous(b: &Broker, dir: &Path) {
    let f = fixture();
    let p = publish_ok(b, &f.v2, &f.key(), "device/pi-1");
    assert_eq!(p["replaced"].as_u64(), Some(1));
    wait_status(&b.config(), "pi-1", 120, "v2 active, v1 previous", |s| {
        s.active == Some(2) && s.previous == Some(1) && s.state == DeviceState::Idle
    });
    let store = dir.join("pi-1/store");
    assert_eq!(
        std::fs::read_link(store.join("active")).unwrap(),
        Path::new("versions/2")
    );
    assert_eq!(
        std::fs::read_link(store.join("previous")).unwrap(),
        Path::new("versions/1")
    );
}

/// pi-1 rejected an update (`text` in its status' last error) and v2 keeps serving.
fn rejected(b: &Broker, what: &str, text: &str) {
    let st = wait_status(&b.config(), "pi-1", 120, what, |s| {
        s.last_error.as_deref().is_some_and(|e| e.contains(text)) && s.state == DeviceState::Idle
    });
    assert_eq!((st.active, st.previous), (Some(2), Some(1)), "{what}");
    let (lines, _, o) = infer(
        b,
        "pi-1",
        &[&s(&fetched("datasets/lfw/imagefolder/face/000.png"))],
    );
    assert!(o.status.success(), "{what}: {}", stderr(&o));
    assert_eq!(lines[0]["prediction"]["version"], 2, "{what}");
}

/// A downgrade, and manifests or desired states signed by a key the device does not trust.
fn downgrades_and_unknown_keys_are_rejected(b: &Broker, topics: &Topics) {
    let f = fixture();
    // A downgrade: the publisher refuses without --rollback, and so does the device.
    let o = publish(b, &f.v1, &f.key(), "device/pi-1", &[]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("needs --rollback"), "{}", stderr(&o));
    publish_raw(b, vec![], desired("pi-1", 1, false));
    rejected(
        b,
        "downgrade",
        "older than the active v2: a downgrade needs --rollback",
    );

    // A manifest signed by a key the device does not trust.
    let v3 = f.variant(&f.v2, 3, |_| {});
    let rogue = Bundle::from_dir(
        &v3,
        &kestrel_tests::fleet::signing_key(&f.rogue_keys),
        128 * 1024,
    )
    .unwrap();
    publish_raw(b, rogue.messages(topics), desired("pi-1", 3, false));
    refused_unverified(b, "unknown key", "offer refused: signed by unknown key");
    // A desired state (and manifest) signed by that key, through the CLI.
    let v10 = f.variant(&f.v2, 10, |_| {});
    let rogue_key = f.rogue_keys.join("kestrel.key");
    let o = publish(b, &v10, &rogue_key, "device/pi-1", &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    refused_unverified(
        b,
        "unsigned desired state",
        "desired state refused: signed by unknown key",
    );
    // The operator's key (the console's) signs commands only: no device trusts it for a desired
    // state (or a manifest).
    let operator = kestrel_shared::signing::public_key(
        &std::fs::read_to_string(f.keys.join("operator.pub")).unwrap(),
        "operator.pub",
    )
    .unwrap();
    let v11 = f.variant(&f.v2, 11, |_| {});
    let o = publish(b, &v11, &f.operator_key(), "device/pi-1", &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    refused_unverified(
        b,
        "desired state signed with the operator key",
        &format!(
            "desired state refused: signed by unknown key {}",
            kestrel_shared::signing::key_id(&operator)
        ),
    );
}

/// pi-1 refused a message that does not verify (`text` in its status' `refused`): reported, and
/// nothing of it acted on (no failed install, no error of an update), and v2 keeps serving.
fn refused_unverified(b: &Broker, what: &str, text: &str) {
    let st = wait_status(&b.config(), "pi-1", 120, what, |s| {
        s.refused.as_deref().is_some_and(|e| e.contains(text)) && s.state == DeviceState::Idle
    });
    assert_eq!((st.active, st.previous), (Some(2), Some(1)), "{what}");
    assert_eq!(
        st.failed_version,
        Some(1),
        "{what}: the downgrade's, from before"
    );
    assert!(
        st.last_error
            .as_deref()
            .is_some_and(|e| e.contains("downgrade")),
        "{what}: {:?}",
        st.last_error
    );
    let (lines, _, o) = infer(
        b,
        "pi-1",
        &[&s(&fetched("datasets/lfw/imagefolder/face/000.png"))],
    );
    assert!(o.status.success(), "{what}: {}", stderr(&o));
    assert_eq!(lines[0]["prediction"]["version"], 2, "{what}");
}

/// Altered chunks, files that do not match the signed manifest, a too large artifact, an unsafe
/// file name and a model that fails its health check.
fn bad_files_are_rejected(b: &Broker, topics: &Topics, dir: &Path) {
    let f = fixture();
    // A chunk altered in the broker after publishing.
    let v4 = Bundle::from_dir(&f.variant(&f.v2, 4, |_| {}), &f.signing(), 128 * 1024)
        .unwrap()
        .without_pieces(); // whole-bundle chunks: v4 shares every piece with v2
    let mut msgs = v4.messages(topics);
    msgs.push((topics.chunk("lfw", 4, 3), b"tampered".to_vec(), true));
    publish_raw(b, msgs, desired("pi-1", 4, false));
    // Unverified bytes change nothing: the chunk is dropped and asked for again, v4 is not
    // failed, v2 keeps serving (the next desired state supersedes the download).
    let st = wait_status(&b.config(), "pi-1", 120, "altered chunk dropped", |s| {
        s.target == Some(4)
            && s.last_error
                .as_deref()
                .is_some_and(|e| e.contains("chunk 3 of v4 failed its sha256 check"))
    });
    assert_eq!(st.state, DeviceState::Downloading, "{st:?}");
    assert_ne!(st.failed_version, Some(4), "{st:?}");
    assert_eq!(st.active, Some(2), "{st:?}");

    // Files that do not match the signed manifest (chunk hashes forged to match).
    let mut v5 = Bundle::from_dir(&f.variant(&f.v2, 5, |_| {}), &f.signing(), 128 * 1024)
        .unwrap()
        .without_pieces();
    v5.chunks[1][100] ^= 0xff;
    v5.offer.chunks[1] = sha256_hex(&v5.chunks[1]);
    publish_raw(b, v5.messages(topics), desired("pi-1", 5, false));
    rejected(
        b,
        "hash mismatch",
        "verification failed: model.onnx: sha256",
    );

    // An artifact over the device's size limit (the f32 model, 13 MB > 8 MB).
    publish_ok(b, &f.f32_v6, &f.key(), "device/pi-1");
    rejected(b, "too large", "over the limit of 8000000");

    // A path-like file name in a (validly signed) manifest.
    publish_raw(b, unsafe_name_v7(topics), desired("pi-1", 7, false));
    rejected(b, "unsafe name", "unsafe file name `../evil.png`");
    assert!(!dir.join("pi-1/evil.png").exists() && !dir.join("pi-1/store/evil.png").exists());

    // A model whose golden outputs do not match fails its health check and is rolled back.
    let v8 = f.variant(&f.v2, 8, |m| {
        for g in m["golden"].as_array_mut().unwrap() {
            let top = g["expected_top1"].as_u64().unwrap();
            g["expected_top1"] = (1 - top).into();
        }
    });
    publish_ok(b, &v8, &f.key(), "device/pi-1");
    rejected(b, "health check", "health check failed");
    assert!(
        !dir.join("pi-1/store").join("versions/8").exists(),
        "the failed model is discarded"
    );
}

/// The messages of v7: v2's files under a validly signed manifest that names a golden image
/// `../evil.png`.
fn unsafe_name_v7(topics: &Topics) -> Vec<(String, Vec<u8>, bool)> {
    let f = fixture();
    let v7 = f.variant(&f.v2, 7, |m| {
        let g = m["golden"][0]["file"].as_str().unwrap().to_string();
        m["golden"][0]["file"] = "../evil.png".into();
        for e in m["files"].as_array_mut().unwrap() {
            if e["path"] == g.as_str() {
                e["path"] = "../evil.png".into();
            }
        }
    });
    let text = std::fs::read_to_string(v7.join("manifest.json")).unwrap();
    let manifest = serde_json::from_str(&text).unwrap();
    let sig = kestrel_shared::signing::sign(
        &f.signing(),
        kestrel_shared::signing::PayloadType::Manifest,
        text.as_bytes(),
    );
    let bundle: Vec<u8> = Bundle::from_dir(&f.v2, &f.signing(), 1 << 30)
        .unwrap()
        .chunks
        .concat();
    let offer = ArtifactOffer::new(&manifest, text, sig, &bundle, 128 * 1024);
    let mut msgs: Vec<_> = bundle
        .chunks(128 * 1024)
        .enumerate()
        .map(|(i, c)| (topics.chunk("lfw", 7, i as u32), c.to_vec(), true))
        .collect();
    msgs.push((
        topics.artifact_manifest("lfw", 7),
        serde_json::to_vec(&offer).unwrap(),
        true,
    ));
    msgs
}

/// Bad images over MQTT get error replies; the agent stays up and keeps serving.
fn bad_images_get_error_replies(b: &Broker, dir: &Path, agent: &mut Proc) {
    let bad = dir.join("bad");
    std::fs::create_dir_all(&bad).unwrap();
    let png = std::fs::read(fetched("datasets/lfw/imagefolder/face/000.png")).unwrap();
    std::fs::write(bad.join("corrupt.png"), b"this is not an image").unwrap();
    std::fs::write(bad.join("truncated.png"), &png[..png.len() / 2]).unwrap();
    // Over the device's 1 MB image limit, under the 1 MiB packet limit.
    std::fs::write(bad.join("oversize.png"), vec![7u8; 1_040_000]).unwrap();
    let (lines, summary, o) = infer(
        b,
        "pi-1",
        &[
            &s(&bad.join("corrupt.png")),
            &s(&bad.join("truncated.png")),
            &s(&bad.join("oversize.png")),
        ],
    );
    assert!(!o.status.success());
    assert_eq!(summary["errors"].as_u64(), Some(3), "{lines:?}");
    let err = |i: usize| lines[i]["error"].as_str().unwrap_or_default().to_string();
    assert!(
        err(0).contains("request") && !err(0).is_empty(),
        "{}",
        err(0)
    );
    assert!(!err(1).is_empty(), "{lines:?}");
    assert!(err(2).contains("over the limit of 1000000"), "{}", err(2));
    assert!(agent.is_running(), "{}", agent.output());
    rejected(b, "still serving after bad images", "health check failed");
}

#[test]
fn sigkill_during_download_and_during_activation_then_resume() {
    let f = fixture();
    let dir = f.dir.join("sigkill");
    let b = Broker::start(BrokerKind::Rumqttd, &dir.join("broker"));
    let cfg = b.config();
    let conf = agent_config(&dir.join("pi-k"), "pi-k", &b.url(), &f.keys, "");

    // Killed mid-download (the test hook stops taking chunks after two).
    killed_mid_download(&b, &f.v1, &dir.join("pi-k"), 120, "downloading", |env| {
        start_agent(&conf, env)
    });
    let agent = start_agent(&conf, &[]);
    wait_status(&cfg, "pi-k", 120, "v1 active after resume", |s| {
        s.active == Some(1) && s.state == DeviceState::Idle
    });
    assert!(agent.output().contains("loading") || agent.output().contains("v1 active"));
    agent.kill();

    // Killed between the health check and the atomic switch.
    let agent = start_agent(&conf, &[("KESTREL_AGENT_PAUSE", "activate")]);
    wait_status(&cfg, "pi-k", 60, "v1 active on restart", |s| {
        s.active == Some(1)
    });
    publish_ok(&b, &f.v2, &f.key(), "device/pi-k");
    wait_status(&cfg, "pi-k", 120, "activating", |s| {
        s.state == DeviceState::Activating
    });
    agent.kill();
    let store = dir.join("pi-k/store");
    assert_eq!(
        std::fs::read_link(store.join("active")).unwrap(),
        Path::new("versions/1")
    );
    let agent = start_agent(&conf, &[]);
    wait_status(&cfg, "pi-k", 120, "v2 active after resume", |s| {
        s.active == Some(2) && s.previous == Some(1) && s.state == DeviceState::Idle
    });
    let (lines, _, o) = infer(
        &b,
        "pi-k",
        &[&s(&fetched("datasets/lfw/imagefolder/nonface/199.png"))],
    );
    assert!(o.status.success(), "{}: {}", stderr(&o), agent.output());
    assert_eq!(lines[0]["prediction"]["version"], 2);
    assert!(!store.join("downloads/2").exists() && !store.join("staging/2").exists());
}

#[test]
fn mosquitto_late_device_update_and_broker_restart() {
    let f = fixture();
    let dir = f.dir.join("mosquitto");
    let mut b = Broker::start(BrokerKind::Mosquitto, &dir.join("broker"));
    let cfg = b.config();

    // Published to a group before any device exists.
    publish_ok(&b, &f.v1, &f.key(), "group/all");
    let conf = agent_config(&dir.join("pi-m"), "pi-m", &b.url(), &f.keys, "");
    let agent = start_agent(&conf, &[]);
    wait_status(&cfg, "pi-m", 120, "v1 active", |s| {
        s.active == Some(1) && s.state == DeviceState::Idle
    });
    answers_like_edge_agent_predict(&b, "pi-m", &f.v1);

    // v2 to the group; v1 kept as previous.
    publish_ok(&b, &f.v2, &f.key(), "group/all");
    wait_status(&cfg, "pi-m", 120, "v2 active", |s| {
        s.active == Some(2) && s.previous == Some(1) && s.state == DeviceState::Idle
    });
    agent.kill();

    // Mosquitto restarts with its persisted retained messages: a new device still installs v2.
    b.restart();
    let conf2 = agent_config(&dir.join("pi-n"), "pi-n", &b.url(), &f.keys, "");
    let watch = dir.join("watch");
    let _agent2 = start_agent_with(&conf2, &[], &["--watch", &s(&watch)]);
    let st = wait_status(
        &cfg,
        "pi-n",
        120,
        "v2 active on a device that came after a broker restart",
        |s| s.active == Some(2) && s.state == DeviceState::Idle,
    );
    // The first device's status survived the restart too (retained, persisted).
    let all = kestrel_fleet::statuses(&cfg, Some("pi-m")).unwrap();
    assert_eq!(all.first().and_then(|s| s.active), Some(2));

    // A broker outage: the agent reconnects by itself and publishes its status again.
    b.restart();
    wait_status(
        &cfg,
        "pi-n",
        60,
        "status re-published after the outage",
        |s| s.active == Some(2) && (s.started, s.seq) > (st.started, st.seq),
    );

    watched_directory_images_are_classified(&watch);
}

/// Two images over MQTT: no errors, face then nonface, and the same answers as the artifact
/// `art` run locally by `edge-agent predict`.
fn answers_like_edge_agent_predict(b: &Broker, device: &str, art: &Path) {
    let images = [
        s(&fetched("datasets/lfw/imagefolder/face/000.png")),
        s(&fetched("datasets/lfw/imagefolder/nonface/199.png")),
    ];
    let (lines, summary, o) = infer(b, device, &[&images[0], &images[1]]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(summary["errors"].as_u64(), Some(0));
    let o = run(
        "edge-agent",
        &[
            "predict",
            "--model",
            &s(art),
            "--json",
            &images[0],
            &images[1],
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let local = json_lines(&o);
    for (remote, local) in lines.iter().zip(&local) {
        let (r, l) = (&remote["prediction"]["top"], &local["top"]);
        for k in 0..2 {
            assert_eq!(r[k]["class"], l[k]["class"]);
            let (a, b) = (
                r[k]["score"].as_f64().unwrap(),
                l[k]["score"].as_f64().unwrap(),
            );
            assert!((a - b).abs() < 1e-6, "{r} vs {l}");
        }
    }
    let labels: Vec<&str> = lines
        .iter()
        .map(|l| l["prediction"]["top"][0]["label"].as_str().unwrap())
        .collect();
    assert_eq!(labels, ["face", "nonface"]);
}

/// Images dropped into the watched directory are classified (by v2) into results.jsonl.
fn watched_directory_images_are_classified(watch: &Path) {
    for (i, img) in ["face/000.png", "nonface/199.png"].iter().enumerate() {
        let src = fetched(&format!("datasets/lfw/imagefolder/{img}"));
        std::fs::copy(src, watch.join(format!(".{i}.tmp"))).unwrap();
        std::fs::rename(
            watch.join(format!(".{i}.tmp")),
            watch.join(format!("{i}.png")),
        )
        .unwrap();
    }
    let results = watch.join("results.jsonl");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let lines: Vec<Value> = loop {
        let text = std::fs::read_to_string(&results).unwrap_or_default();
        if text.lines().count() >= 2 || std::time::Instant::now() > deadline {
            break text
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let labels: Vec<(&str, u64)> = lines
        .iter()
        .map(|l| {
            (
                l["top"][0]["label"].as_str().unwrap(),
                l["version"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(labels, [("face", 2), ("nonface", 2)]);
    assert!(watch.join("done/0.png").exists() && !watch.join("0.png").exists());
}
