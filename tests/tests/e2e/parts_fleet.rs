//! Updates in parts through the binaries, on both brokers (issue #57): `trainer publish` of v1
//! (every part), `trainer rollout` of a new head (v2), a fine-tuned model (v3: its frozen range
//! and trained block are new; v4: only the block and the head change), to simulated devices
//! connected through a relay that counts what the broker sends them. Each device fetches only what it lacks (its
//! own counters and the broker's bytes say so), keeps one copy of the backbone, and answers as
//! the artifact does; a device joining later fetches every part; a tampered part, a head cut for
//! another backbone and a genuine part from another model's manifest are refused.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use kestrel_fleet::{Bundle, Conn};
use kestrel_shared::manifest::Manifest;
use kestrel_shared::protocol::{ArtifactOffer, Status, pieces};
use kestrel_shared::signing::{PayloadType, sign};
use kestrel_tests::fleet::{
    Broker, BrokerKind, agent_config, desired, fixture, publish_ok, publish_raw, rollout_command,
    start_agent_with, wait_fleet, wait_status,
};
use kestrel_tests::proxy::Relay;
use kestrel_tests::{Scratch, fetched, json_lines, read_json, run, s, stderr, stdout};
use serde_json::Value;

use super::parts::{export, runs, sha};
use kestrel_shared::wire::DeviceState;

/// LFW v1..v4 of `lfw`, int8 weights on the shared backbone: v1, v2 new heads (runs h1, h2);
/// v3, v4 the last block fine-tuned too (ft1, ft2).
fn artifacts() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        kestrel_tests::once::fixture("parts-artifacts", |dir| {
            let form = ["--quantize", "int8-weights", "--shared-backbone"];
            let args = [&form[..], &["--model-name", "lfw"]].concat();
            for (v, run) in [(1, "h1"), (2, "h2"), (3, "ft1"), (4, "ft2")] {
                export(&runs().join(run), &dir.join(format!("v{v}")), v, &args);
            }
        })
    })
}

fn art(v: u64) -> PathBuf {
    artifacts().join(format!("v{v}"))
}

fn manifest(v: u64) -> Manifest {
    serde_json::from_value(read_json(&art(v).join("manifest.json"))).unwrap()
}

/// Bytes of `v`'s distinct pieces that none of `held` has: what a device holding those fetches.
fn new_bytes(v: u64, held: &[u64]) -> u64 {
    let has: Vec<String> = (held.iter())
        .flat_map(|h| pieces(&manifest(*h)))
        .map(|(sha, _)| sha)
        .collect();
    let mut new: Vec<(String, u64)> = pieces(&manifest(v))
        .into_iter()
        .filter(|(sha, _)| !has.contains(sha))
        .collect();
    new.sort();
    new.dedup();
    new.iter().map(|(_, size)| size).sum()
}

/// Every piece's bytes by sha256, from the artifacts' model.onnx (cut as their manifests say)
/// and golden files.
fn piece_bytes() -> HashMap<String, Vec<u8>> {
    let mut out = HashMap::new();
    for v in 1..=4 {
        let m = manifest(v);
        let model = std::fs::read(art(v).join("model.onnx")).unwrap();
        let mut at = 0;
        for p in &m.composition.as_ref().unwrap().parts {
            out.insert(p.sha256.clone(), model[at..at + p.size as usize].to_vec());
            at += p.size as usize;
        }
        for f in &m.files {
            out.entry(f.sha256.clone())
                .or_insert_with(|| std::fs::read(art(v).join(&f.path)).unwrap());
        }
    }
    out
}

/// A validly signed manifest, `version`, that is `base`'s with the head part of `head_from`:
/// its messages, pieces and offer as a publisher would make them.
fn forged(version: u64, base: u64, head_from: u64) -> Vec<(String, Vec<u8>, bool)> {
    let mut m = manifest(base);
    m.version = version;
    let head = manifest(head_from)
        .composition
        .unwrap()
        .parts
        .pop()
        .unwrap();
    let c = m.composition.as_mut().unwrap();
    assert_eq!(
        (c.parts.last().unwrap().role.as_str(), head.role.as_str()),
        ("head", "head")
    );
    *c.parts.last_mut().unwrap() = head;
    let size = c.parts.iter().map(|p| p.size).sum();
    m.files
        .iter_mut()
        .find(|f| f.path == "model.onnx")
        .unwrap()
        .size = size;
    let text = serde_json::to_string(&m).unwrap();
    let signature = sign(&fixture().signing(), PayloadType::Manifest, text.as_bytes());
    let all = piece_bytes();
    let cut: Vec<Vec<u8>> = pieces(&m).iter().map(|(sha, _)| all[sha].clone()).collect();
    let bundle = cut.concat();
    let offer = ArtifactOffer::new(&m, text, signature, &bundle, 128 << 10);
    assert_eq!(offer.pieces.len(), cut.len());
    let b = Bundle {
        manifest: m,
        offer,
        chunks: vec![],
        pieces: cut,
    };
    b.messages(&kestrel_shared::topics::Topics::default())
}

/// `trainer publish` of `version` to each device; the last one's JSON.
fn publish_each(b: &Broker, devices: &[&str], version: u64) -> Value {
    let key = fixture().key();
    let mut out = Value::Null;
    for d in devices {
        out = publish_ok(b, &art(version), &key, &format!("device/{d}"));
    }
    out
}

const DEVICES: [&str; 2] = ["hd-000", "hd-001"];

fn status(b: &Broker, device: &str) -> Status {
    wait_status(&b.config(), device, 30, "a status", |_| true)
}

/// Waits until every device in `devices` runs `version`; their statuses.
fn active(b: &Broker, devices: &[&str], version: u64) -> Vec<Status> {
    let what = format!("v{version} active");
    (devices.iter())
        .map(|d| {
            wait_status(&b.config(), d, 240, &what, |s| {
                s.active == Some(version) && s.state == DeviceState::Idle
            })
        })
        .collect()
}

/// An update to `version` (`publish` does it): per device, the bytes it counted fetched and
/// reused, and the bytes the broker sent it (the relay's count over the devices).
fn update(
    b: &Broker,
    relay: &Relay,
    version: u64,
    publish: impl FnOnce(),
) -> (Vec<(u64, u64)>, u64) {
    let before: Vec<Status> = DEVICES.iter().map(|d| status(b, d)).collect();
    let sent = relay.delivered();
    publish();
    let after = active(b, &DEVICES, version);
    let per_device = (after.iter().zip(&before))
        .map(|(a, b)| {
            let (a, b) = (&a.counters, &b.counters);
            (
                a.bytes_fetched - b.bytes_fetched,
                a.bytes_reused - b.bytes_reused,
            )
        })
        .collect();
    (
        per_device,
        (relay.delivered() - sent) / DEVICES.len() as u64,
    )
}

/// `fetched` is `need` (a chunk delivered twice, a retained one with a live one, counts twice).
fn assert_fetched(what: &str, fetched: u64, need: u64) {
    assert!(
        (need..=need + need / 2).contains(&fetched),
        "{what}: fetched {fetched} bytes, needs {need}"
    );
}

/// Distinct files' bytes under `dir` (hard links once) of at least `min` bytes.
fn big_files(dir: &Path, min: u64) -> Vec<u64> {
    use std::os::unix::fs::MetadataExt;
    let mut seen = std::collections::BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let m = std::fs::symlink_metadata(e.path()).unwrap();
            if m.is_dir() {
                stack.push(e.path());
            } else if m.is_file() && m.len() >= min {
                seen.insert(m.ino(), m.len());
            }
        }
    }
    seen.into_values().collect()
}

/// A broker, a relay that counts what it sends, and two simulated devices behind the relay.
struct Rig {
    w: Scratch,
    b: Broker,
    relay: Relay,
    /// The simulated devices' agent.toml.
    conf: PathBuf,
}

fn updates_move_only_the_parts_a_device_lacks(kind: BrokerKind) {
    let f = fixture();
    let w = Scratch::new();
    let b = Broker::start(kind, &w.join("broker"));
    let relay = Relay::start(b.port);
    let conf = agent_config(&w.join("sim"), "hd", &relay.url(), &f.keys, "");
    let agent = start_agent_with(&conf, &[], &["--simulate", "2"]);
    wait_fleet(&b.config(), 2);
    let r = Rig { w, b, relay, conf };
    a_new_head(&r, kind);
    fine_tuned_blocks(&r, kind);
    late_device_and_strangers(&r);
    damaged_part(&r, agent);
}

/// v1 (every part), then v2, a new head on the same backbone, rolled out.
fn a_new_head(r: &Rig, kind: BrokerKind) {
    let (w, b, relay) = (&r.w, &r.b, &r.relay);
    // v1: every part.
    let (d, _) = update(b, relay, 1, || {
        publish_each(b, &DEVICES, 1);
    });
    for (fetched, reused) in d {
        assert_fetched("v1", fetched, new_bytes(1, &[]));
        assert_eq!(reused, 0);
    }

    // v2: a new head on the same backbone, rolled out.
    let backbone = manifest(1).composition.unwrap().parts[1].size;
    assert_eq!(sha(&manifest(1), "backbone"), sha(&manifest(2), "backbone"));
    let plan = w.join("plan.toml");
    std::fs::write(&plan, "[[phases]]\nname = \"all\"\npercent = 100\n").unwrap();
    let mut rollout = Value::Null;
    let (d, broker_bytes) = update(&b, &relay, 2, || {
        let o = rollout_command(&b, &art(2), &s(&plan))
            .arg("--json")
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        rollout = serde_json::from_str(stdout(&o).trim()).unwrap();
    });
    let need = new_bytes(2, &[1]);
    let whole = rollout["artifact_bytes"].as_u64().unwrap();
    eprintln!(
        "{kind:?}: v2 (new head): {need} bytes of pieces to fetch of {whole}; the broker sent \
         {broker_bytes} bytes per device; devices counted {d:?}"
    );
    for ((fetched, reused), dev) in d.iter().zip(DEVICES) {
        assert_fetched("v2", *fetched, need);
        assert_eq!(*reused, new_bytes(2, &[]) - need, "v2 reused");
        let in_rollout = rollout["devices"][dev]["bytes_fetched"].as_u64();
        assert_eq!(in_rollout, Some(*fetched), "{dev} in the rollout's state");
    }
    assert!(need < 50_000 && whole > 70 * need, "{need} of {whole}");
    assert!(
        broker_bytes < 2 * need + 40_000,
        "the broker sent {broker_bytes} per device"
    );
    for dev in DEVICES {
        let store = w.join("sim").join("store").join(dev);
        let big = big_files(&store, backbone / 2);
        assert_eq!(
            big,
            [backbone],
            "{dev}: one copy of the backbone in its store"
        );
    }
    answers_as(&b, "hd-001", &art(2));
    composed_like_the_export(&w.join("sim/store/hd-000"), &art(2));
}

/// v3, the first fine-tuned model (a tampered chunk of its block dropped), then v4 with the
/// same fine-tuned range: only the block and the head move.
fn fine_tuned_blocks(r: &Rig, kind: BrokerKind) {
    let (f, b, relay) = (fixture(), &r.b, &r.relay);
    // v3: the first fine-tuned model, its block's first chunk tampered with in the broker:
    // dropped, counted, never a failure; the genuine chunk completes it.
    let m3 = manifest(3);
    let block = m3.composition.as_ref().unwrap().parts[2].clone();
    assert!(block.role.starts_with("block:"), "{:?}", block.role);
    let topics = kestrel_shared::topics::Topics::default();
    let genuine_topic = topics.part_chunk(&block.sha256, 128 << 10, 0);
    let v3 = Bundle::from_dir(&art(3), &f.signing(), 128 << 10).unwrap();
    let mut msgs = v3.messages(&topics);
    let genuine = msgs
        .iter()
        .find(|(t, ..)| *t == genuine_topic)
        .cloned()
        .unwrap();
    for (t, payload, _) in msgs.iter_mut() {
        if *t == genuine_topic {
            *payload = b"tampered".to_vec();
        }
    }
    let (d, _) = update(&b, &relay, 3, || {
        publish_raw(&b, msgs, desired(DEVICES[0], 3, false));
        publish_raw(&b, vec![], desired(DEVICES[1], 3, false));
        for dev in DEVICES {
            let st = wait_status(&b.config(), dev, 120, "tampered part dropped", |s| {
                s.target == Some(3) && s.counters.chunks_corrupt >= 1
            });
            assert_eq!((st.active, st.state.as_str()), (Some(2), "downloading"));
            assert_ne!(st.failed_version, Some(3));
        }
        let mut c = Conn::connect(&b.config(), "publisher").unwrap();
        c.publish_all(vec![genuine], None).unwrap();
        c.disconnect();
    });
    for (fetched, _) in d {
        assert_fetched("v3", fetched, new_bytes(3, &[1, 2]));
    }

    // v4: the same fine-tuned range; only the block, the head (and frame, golden samples) move.
    assert_eq!(sha(&m3, "backbone"), sha(&manifest(4), "backbone"));
    let mut published = Value::Null;
    let (d, broker_bytes) = update(&b, &relay, 4, || {
        published = publish_each(&b, &DEVICES, 4);
    });
    // What a device at v3 fetches, by the publisher's count; a device keeps the active and
    // previous versions' parts (v3's and v2's), so it may fetch less.
    assert_eq!(
        published["bytes_update"].as_u64(),
        Some(new_bytes(4, &[3])),
        "{published}"
    );
    let need = new_bytes(4, &[2, 3]);
    eprintln!("{kind:?}: v4 (fine-tuned block): {need} bytes to fetch, broker sent {broker_bytes}");
    for (fetched, _) in d {
        assert_fetched("v4", fetched, need);
    }
    assert!(need < new_bytes(4, &[]) / 2, "{need}");
}

/// A device joining later fetches every part; validly signed manifests that are no model are
/// refused.
fn late_device_and_strangers(r: &Rig) {
    let (f, b, relay, w) = (fixture(), &r.b, &r.relay, &r.w);
    // A device joining later fetches every part of v4.
    let late = agent_config(&w.join("late"), "late", &relay.url(), &f.keys, "");
    let _late = start_agent_with(&late, &[], &[]);
    wait_fleet(&b.config(), 3);
    publish_each(&b, &["late"], 4);
    let st = active(&b, &["late"], 4).pop().unwrap();
    assert_fetched("late", st.counters.bytes_fetched, new_bytes(4, &[]));
    assert_eq!(st.counters.bytes_reused, 0);

    // Signed by a trusted key, yet not a model: a head cut to follow another part (v5: v4's
    // parts with v2's head), and v1's genuine head in v2's manifest (v6).
    let target = |v| desired("late", v, false);
    publish_raw(&b, forged(5, 4, 2), target(5));
    refused(&b, 5, "part 3 (head");
    refused(&b, 5, "cut to follow part");
    publish_raw(&b, forged(6, 2, 1), target(6));
    refused(&b, 6, "the parts make");
}

/// A part damaged in a device's store while its agent was down.
fn damaged_part(r: &Rig, agent: kestrel_tests::fleet::Proc) {
    let (b, w) = (&r.b, &r.w);
    // A part damaged in a device's store while its agent was down: the active model does not
    // load at start, so v4 is installed again, fetching that part only; the other device
    // fetches nothing.
    // (A new agent process: its statuses have a new `started`, its counters start from 0.)
    let before: Vec<u64> = DEVICES.iter().map(|d| status(&b, d).started).collect();
    agent.kill();
    let head = manifest(4).composition.unwrap().parts.pop().unwrap();
    let part = w.join("sim/store/hd-000/parts").join(&head.sha256);
    let mut bytes = std::fs::read(&part).unwrap();
    bytes[10] ^= 0xff;
    std::fs::write(&part, bytes).unwrap();
    let agent = start_agent_with(&r.conf, &[], &["--simulate", "2"]);
    let st = wait_status(&b.config(), "hd-000", 120, "v4 installed again", |s| {
        s.started != before[0] && s.active == Some(4) && s.state == DeviceState::Idle
    });
    assert_fetched("the damaged part", st.counters.bytes_fetched, head.size);
    let other = wait_status(&b.config(), "hd-001", 60, "v4", |s| {
        s.started != before[1] && s.active == Some(4)
    });
    assert_eq!(other.counters.bytes_fetched, 0);
    answers_as(&b, "hd-000", &art(4));
    drop(agent);
}

/// `late` rejected `version` with `text` in its error; v4 serves on.
fn refused(b: &Broker, version: u64, text: &str) {
    let st = wait_status(&b.config(), "late", 120, text, |s| {
        s.failed_version == Some(version)
    });
    let e = st.last_error.clone().unwrap_or_default();
    assert!(e.contains("verification failed") && e.contains(text), "{e}");
    assert_eq!(st.active, Some(4));
}

/// The model a device composes from its part store is the exported model.onnx byte for byte, and
/// gives its logits on the golden samples: ONNX Runtime (Python's) on both files, the manifest's
/// golden logits within the health check's tolerance; tract (`edge-agent predict`) on the
/// store's active version and on the artifact.
fn composed_like_the_export(store: &Path, art: &Path) {
    let active = store.join("active");
    let m: Manifest = serde_json::from_value(read_json(&active.join("manifest.json"))).unwrap();
    assert!(
        !active.join("model.onnx").exists(),
        "composed at load, not stored whole"
    );
    let parts = m.composition.as_ref().unwrap().parts.iter();
    let composed: Vec<u8> = parts
        .flat_map(|p| std::fs::read(store.join("parts").join(&p.sha256)).unwrap())
        .collect();
    assert!(
        composed == std::fs::read(art.join("model.onnx")).unwrap(),
        "composed == model.onnx"
    );
    let tmp = tempfile::tempdir().unwrap();
    let (onnx, spec, tensors) = (
        tmp.path().join("c.onnx"),
        tmp.path().join("spec.json"),
        tmp.path(),
    );
    std::fs::write(&onnx, &composed).unwrap();
    std::fs::write(&spec, serde_json::to_vec(&m.preprocess).unwrap()).unwrap();
    let golden: Vec<String> = m.golden.iter().map(|g| s(&active.join(&g.file))).collect();
    let mut args = vec!["preprocess", "--spec", spec.to_str().unwrap(), "--out"];
    args.push(tensors.to_str().unwrap());
    args.extend(golden.iter().map(String::as_str));
    let o = run("edge-agent", &args);
    assert!(o.status.success(), "{}", stderr(&o));
    let expect: Vec<Vec<f32>> = (m.golden.iter())
        .map(|g| g.runtime_logits.get("ort").unwrap_or(&g.logits).clone())
        .collect();
    let names: Vec<String> = (m.golden.iter())
        .map(|g| {
            format!(
                "{}.f32",
                Path::new(&g.file).file_name().unwrap().to_str().unwrap()
            )
        })
        .collect();
    let o = kestrel_tests::python(
        r#"
import json, sys, numpy as np, onnxruntime as ort
composed, exported, tensors, names, expect, size = sys.argv[1:7]
names, expect, size = json.loads(names), json.loads(expect), json.loads(size)
a = ort.InferenceSession(composed, providers=["CPUExecutionProvider"])
b = ort.InferenceSession(exported, providers=["CPUExecutionProvider"])
worst = 0.0
for name, want in zip(names, expect):
    x = np.fromfile(f"{tensors}/{name}", dtype="<f4").reshape(1, 3, *size)
    feed = {a.get_inputs()[0].name: x}
    la, lb = a.run(None, feed)[0][0], b.run(None, feed)[0][0]
    assert (la == lb).all(), (name, la, lb)
    worst = max(worst, float(np.abs(la - np.array(want)).max()))
print(json.dumps({"samples": len(names), "max_diff": worst}))
"#,
        &[
            s(&onnx),
            s(&art.join("model.onnx")),
            s(tensors),
            serde_json::to_string(&names).unwrap(),
            serde_json::to_string(&expect).unwrap(),
            serde_json::to_string(&m.preprocess.input_size).unwrap(),
        ],
    );
    let r: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(r["samples"].as_u64(), Some(m.golden.len() as u64), "{r}");
    assert!(
        r["max_diff"].as_f64().unwrap() <= 1e-3,
        "ORT vs the golden logits: {r}"
    );
    let predict = |model: &Path| {
        let mut args = vec!["predict", "--model", model.to_str().unwrap(), "--json"];
        args.extend(golden.iter().map(String::as_str));
        let o = run("edge-agent", &args);
        assert!(o.status.success(), "{}", stderr(&o));
        json_lines(&o)
            .into_iter()
            .map(|p| p["top"].clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        predict(&active),
        predict(art),
        "tract: the store's model and the artifact"
    );
}

/// `device` answers over MQTT as the artifact `art` does on the same images.
fn answers_as(b: &Broker, device: &str, art: &Path) {
    let root = fetched("datasets/lfw/imagefolder");
    let images: Vec<String> = ["face", "nonface"]
        .iter()
        .flat_map(|c| {
            let mut files: Vec<PathBuf> = (std::fs::read_dir(root.join(c)).unwrap())
                .map(|e| e.unwrap().path())
                .collect();
            files.sort();
            files.into_iter().take(3).map(|p| s(&p))
        })
        .collect();
    let refs: Vec<&str> = images.iter().map(String::as_str).collect();
    let url = b.url();
    let mut args = vec!["infer", "--broker", &url, "--device", device, "--json"];
    args.extend(&refs);
    let o = run("trainer", &args);
    assert!(o.status.success(), "{}", stderr(&o));
    let remote: Vec<Value> = json_lines(&o)
        .into_iter()
        .filter(|v| v.get("image").is_some())
        .collect();
    let mut args = vec!["predict", "--model", art.to_str().unwrap(), "--json"];
    args.extend(&refs);
    let o = run("edge-agent", &args);
    assert!(o.status.success(), "{}", stderr(&o));
    let local = json_lines(&o);
    assert_eq!((remote.len(), local.len()), (images.len(), images.len()));
    for l in &local {
        let r = (remote.iter())
            .find(|r| r["image"] == l["image"])
            .unwrap_or_else(|| panic!("no reply for {}", l["image"]));
        let (rt, lt) = (&r["prediction"]["top"][0], &l["top"][0]);
        assert_eq!(rt["class"], lt["class"], "{}", l["image"]);
        let d = rt["score"].as_f64().unwrap() - lt["score"].as_f64().unwrap();
        assert!(d.abs() < 1e-4, "{}: {rt} vs {lt}", l["image"]);
    }
}

#[test]
fn updates_move_only_the_parts_a_device_lacks_on_mosquitto() {
    updates_move_only_the_parts_a_device_lacks(BrokerKind::Mosquitto);
}

#[test]
fn updates_move_only_the_parts_a_device_lacks_on_rumqttd() {
    updates_move_only_the_parts_a_device_lacks(BrokerKind::Rumqttd);
}
