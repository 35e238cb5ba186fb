//! The device side of an artifact: verification, health check and inference, and the rejections.

use std::path::Path;

use kestrel_tests::{copy_dir, fetched, run, stderr, stdout};
use serde_json::Value;

fn edit_manifest(dir: &Path, f: impl FnOnce(&mut Value)) {
    let p = dir.join("manifest.json");
    let mut m: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut m);
    std::fs::write(&p, serde_json::to_string(&m).unwrap()).unwrap();
}

fn check_fails(art: &Path, extra: &[&str], reason: &str) {
    let mut args = vec!["check", "--model", art.to_str().unwrap()];
    args.extend(extra);
    let o = run("edge-agent", &args);
    assert!(!o.status.success(), "{} should be rejected", art.display());
    assert!(
        stderr(&o).contains(reason),
        "expected `{reason}`: {}",
        stderr(&o)
    );
}

#[test]
fn edge_predicts_like_the_trainer_and_rejects_bad_artifacts() {
    let tmp = tempfile::tempdir().unwrap();
    let data = fetched("datasets/lfw/imagefolder");
    let run_dir = tmp.path().join("run");
    let art = tmp.path().join("art");
    let o = run(
        "trainer",
        &[
            "fit",
            "--data",
            data.to_str().unwrap(),
            "--epochs",
            "5",
            "--out",
            run_dir.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let o = run(
        "trainer",
        &[
            "export",
            "--run",
            run_dir.to_str().unwrap(),
            "--out",
            art.to_str().unwrap(),
            "--quantize",
            "int8-weights",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));

    let o = run("edge-agent", &["check", "--model", art.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("golden samples pass"));

    // Every LFW image on the edge: the confusion matrix equals `trainer evaluate --model` (tract).
    let mut images: Vec<String> = Vec::new();
    for class in ["face", "nonface"] {
        let mut v: Vec<String> = std::fs::read_dir(data.join(class))
            .unwrap()
            .map(|e| e.unwrap().path().display().to_string())
            .collect();
        v.sort();
        images.extend(v);
    }
    let mut args = vec!["predict", "--json", "--model", art.to_str().unwrap()];
    args.extend(images.iter().map(String::as_str));
    let o = run("edge-agent", &args);
    assert!(o.status.success(), "{}", stderr(&o));
    let mut confusion = [[0u64; 2]; 2];
    for line in stdout(&o).lines() {
        let p: Value = serde_json::from_str(line).unwrap();
        let truth = usize::from(p["image"].as_str().unwrap().contains("/nonface/"));
        confusion[truth][p["top"][0]["class"].as_u64().unwrap() as usize] += 1;
        assert_eq!(p["version"], 1);
    }
    let o = run(
        "trainer",
        &[
            "evaluate",
            "--model",
            art.join("model.onnx").to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--json",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let e: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(
        serde_json::json!(confusion),
        e["confusion"],
        "edge and trainer disagree"
    );
    assert!(confusion[0][0] + confusion[1][1] >= 190, "{confusion:?}");

    // A bad image among good ones: named, the others still answered, exit 1.
    let bad = tmp.path().join("truncated.png");
    let good = std::fs::read(&images[0]).unwrap();
    std::fs::write(&bad, &good[..good.len() / 2]).unwrap();
    let o = run(
        "edge-agent",
        &[
            "predict",
            "--json",
            "--model",
            art.to_str().unwrap(),
            bad.to_str().unwrap(),
            &images[0],
        ],
    );
    assert!(!o.status.success());
    assert!(stderr(&o).contains("truncated.png"), "{}", stderr(&o));
    assert_eq!(stdout(&o).lines().count(), 1);

    // Rejections, each with its reason.
    let tampered = tmp.path().join("tampered");
    copy_dir(&art, &tampered);
    let mut onnx = std::fs::read(tampered.join("model.onnx")).unwrap();
    let n = onnx.len();
    onnx[n - 100] ^= 0xff;
    std::fs::write(tampered.join("model.onnx"), onnx).unwrap();
    check_fails(&tampered, &[], "model.onnx: sha256");

    let escape = tmp.path().join("escape");
    copy_dir(&art, &escape);
    edit_manifest(&escape, |m| {
        m["files"][0]["path"] = "../art/model.onnx".into()
    });
    check_fails(&escape, &[], "unsafe file name `../art/model.onnx`");

    let unhealthy = tmp.path().join("unhealthy");
    copy_dir(&art, &unhealthy);
    edit_manifest(&unhealthy, |m| {
        let l = m["golden"][0]["logits"][0].as_f64().unwrap();
        m["golden"][0]["logits"][0] = (l + 0.5).into();
    });
    check_fails(&unhealthy, &[], "health check failed");

    check_fails(&art, &["--max-bytes", "1000"], "over the limit of 1000");

    // Signatures: a manifest signed by a trusted key passes; unknown key and altered manifest fail.
    let (ka, kb) = (tmp.path().join("key-a"), tmp.path().join("key-b"));
    for k in [&ka, &kb] {
        let o = run("trainer", &["keygen", "--out", k.to_str().unwrap()]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let o = run("trainer", &["keygen", "--out", ka.to_str().unwrap()]);
    assert!(!o.status.success() && stderr(&o).contains("refusing to overwrite"));
    let o = run(
        "trainer",
        &[
            "sign",
            "--artifact",
            art.to_str().unwrap(),
            "--key",
            ka.join("kestrel.key").to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let trusted_a = ka.join("kestrel.pub");
    let o = run(
        "edge-agent",
        &[
            "check",
            "--model",
            art.to_str().unwrap(),
            "--trusted-key",
            trusted_a.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    check_fails(
        &art,
        &["--trusted-key", kb.join("kestrel.pub").to_str().unwrap()],
        "signed by unknown key",
    );
    let altered = tmp.path().join("altered");
    copy_dir(&art, &altered);
    edit_manifest(&altered, |m| m["version"] = 99.into());
    check_fails(
        &altered,
        &["--trusted-key", trusted_a.to_str().unwrap()],
        "bad signature",
    );
}
