//! The device side of an artifact: verification, health check and inference, and the rejections.

use std::path::{Path, PathBuf};

use kestrel_tests::{
    copy_dir, export_ok, fetched, json_lines, run, run_ok, stderr, stdout, trainer_json,
};
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
    let art = fit_and_export(tmp.path(), &data);
    let images = edge_confusion_equals_the_trainers(&data, &art);
    a_bad_image_is_named_and_the_others_answered(tmp.path(), &art, &images[0]);
    bad_artifacts_are_rejected(tmp.path(), &art);
    signatures_are_checked(tmp.path(), &art);
}

/// A 5-epoch LFW run exported as int8-weights (`DIR/art`), which passes `edge-agent check`.
fn fit_and_export(dir: &Path, data: &Path) -> PathBuf {
    let run_dir = dir.join("run");
    let art = dir.join("art");
    run_ok(
        "trainer",
        &[
            "fit",
            "--data",
            data.to_str().unwrap(),
            "--optimizer",
            "sgd",
            "--epochs",
            "5",
            "--out",
            run_dir.to_str().unwrap(),
        ],
    );
    export_ok(&run_dir, &art, &["--quantize", "int8-weights"]);

    let o = run_ok("edge-agent", &["check", "--model", art.to_str().unwrap()]);
    assert!(stdout(&o).contains("golden samples pass"));
    art
}

/// Every LFW image on the edge, on each engine: the confusion matrix equals
/// `trainer evaluate --model --engine` on the same engine. Returns the images.
fn edge_confusion_equals_the_trainers(data: &Path, art: &Path) -> Vec<String> {
    let images = lfw_images(data);
    for engine in ["tract", "ort"] {
        let o = run_ok(
            "edge-agent",
            &[
                "--engine",
                engine,
                "check",
                "--model",
                art.to_str().unwrap(),
            ],
        );
        assert!(
            stdout(&o).contains(&format!("golden samples pass on {engine}")),
            "{}",
            stdout(&o)
        );
        edge_confusion_on(engine, data, art, &images);
    }
    images
}

fn lfw_images(data: &Path) -> Vec<String> {
    let mut images: Vec<String> = Vec::new();
    for class in ["face", "nonface"] {
        let mut v: Vec<String> = std::fs::read_dir(data.join(class))
            .unwrap()
            .map(|e| e.unwrap().path().display().to_string())
            .collect();
        v.sort();
        images.extend(v);
    }
    images
}

fn edge_confusion_on(engine: &str, data: &Path, art: &Path, images: &[String]) {
    let mut args = vec![
        "--engine",
        engine,
        "predict",
        "--json",
        "--model",
        art.to_str().unwrap(),
    ];
    args.extend(images.iter().map(String::as_str));
    let o = run_ok("edge-agent", &args);
    let mut confusion = [[0u64; 2]; 2];
    for p in json_lines(&o) {
        let truth = usize::from(p["image"].as_str().unwrap().contains("/nonface/"));
        confusion[truth][p["top"][0]["class"].as_u64().unwrap() as usize] += 1;
        assert_eq!(p["version"], 1);
    }
    let e = trainer_json(&[
        "evaluate",
        "--model",
        art.join("model.onnx").to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--engine",
        engine,
        "--json",
    ]);
    assert_eq!(
        serde_json::json!(confusion),
        e["confusion"],
        "edge and trainer disagree on {engine}"
    );
    assert!(confusion[0][0] + confusion[1][1] >= 190, "{confusion:?}");
}

/// A bad image among good ones: named, the others still answered, exit 1.
fn a_bad_image_is_named_and_the_others_answered(dir: &Path, art: &Path, image: &str) {
    let bad = dir.join("truncated.png");
    let good = std::fs::read(image).unwrap();
    std::fs::write(&bad, &good[..good.len() / 2]).unwrap();
    let o = run(
        "edge-agent",
        &[
            "predict",
            "--json",
            "--model",
            art.to_str().unwrap(),
            bad.to_str().unwrap(),
            image,
        ],
    );
    assert!(!o.status.success());
    assert!(stderr(&o).contains("truncated.png"), "{}", stderr(&o));
    assert_eq!(stdout(&o).lines().count(), 1);
}

/// Rejections, each with its reason.
fn bad_artifacts_are_rejected(dir: &Path, art: &Path) {
    let tampered = dir.join("tampered");
    copy_dir(art, &tampered);
    let mut onnx = std::fs::read(tampered.join("model.onnx")).unwrap();
    let n = onnx.len();
    onnx[n - 100] ^= 0xff;
    std::fs::write(tampered.join("model.onnx"), onnx).unwrap();
    check_fails(&tampered, &[], "model.onnx: sha256");

    let escape = dir.join("escape");
    copy_dir(art, &escape);
    edit_manifest(&escape, |m| {
        m["files"][0]["path"] = "../art/model.onnx".into()
    });
    check_fails(&escape, &[], "unsafe file name `../art/model.onnx`");

    let unhealthy = dir.join("unhealthy");
    copy_dir(art, &unhealthy);
    edit_manifest(&unhealthy, |m| {
        let l = m["golden"][0]["logits"][0].as_f64().unwrap();
        m["golden"][0]["logits"][0] = (l + 0.5).into();
    });
    check_fails(&unhealthy, &[], "health check failed");

    check_fails(art, &["--max-bytes", "1000"], "over the limit of 1000");
}

/// Signatures: a manifest signed by a trusted key passes; unknown key and altered manifest fail.
fn signatures_are_checked(dir: &Path, art: &Path) {
    let (ka, kb) = (dir.join("key-a"), dir.join("key-b"));
    for k in [&ka, &kb] {
        run_ok("trainer", &["keygen", "--out", k.to_str().unwrap()]);
    }
    let o = run("trainer", &["keygen", "--out", ka.to_str().unwrap()]);
    assert!(!o.status.success() && stderr(&o).contains("refusing to overwrite"));
    run_ok(
        "trainer",
        &[
            "sign",
            "--artifact",
            art.to_str().unwrap(),
            "--key",
            ka.join("kestrel.key").to_str().unwrap(),
        ],
    );
    let trusted_a = ka.join("kestrel.pub");
    run_ok(
        "edge-agent",
        &[
            "check",
            "--model",
            art.to_str().unwrap(),
            "--trusted-key",
            trusted_a.to_str().unwrap(),
        ],
    );
    check_fails(
        art,
        &["--trusted-key", kb.join("kestrel.pub").to_str().unwrap()],
        "signed by unknown key",
    );
    let altered = dir.join("altered");
    copy_dir(art, &altered);
    edit_manifest(&altered, |m| m["version"] = 99.into());
    check_fails(
        &altered,
        &["--trusted-key", trusted_a.to_str().unwrap()],
        "bad signature",
    );
}
