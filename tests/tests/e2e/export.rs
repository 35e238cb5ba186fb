//! Exported artifacts: three forms, loadable and correct in tract, ONNX Runtime (Rust and Python)
//! and the ONNX checker; the manifest alone drives evaluation; failures stop the export.

use std::path::{Path, PathBuf};
use std::process::Output;

use kestrel_tests::{dataset, export_ok, python, run, run_ok, stderr, stdout};
use serde_json::Value;

/// A trainer call that must succeed and print JSON last (`--json`); returns that JSON.
fn ok_json(args: &[&str]) -> Value {
    last_json(&run_ok("trainer", args))
}

/// The last line of standard output as JSON.
fn last_json(o: &Output) -> Value {
    serde_json::from_str(stdout(o).lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("{e}: {}", stdout(o)))
}

/// `onnx.checker.check_model(full_check=True)` and one Python ONNX Runtime run of each model (one
/// Python process: importing onnx and onnxruntime takes seconds); returns the output shapes.
fn python_check(models: &[PathBuf]) -> Vec<String> {
    let o = python(
        "import onnx, onnxruntime as ort, numpy as np, sys\n\
def check(path):\n\
\x20   onnx.checker.check_model(onnx.load(path), full_check=True)\n\
\x20   s = ort.InferenceSession(path, providers=['CPUExecutionProvider'])\n\
\x20   return s.run(None, {'input': np.zeros((3, 3, 224, 224), np.float32)})[0].shape\n\
for path in sys.argv[1:]: print(check(path))",
        models,
    );
    stdout(&o).lines().map(str::to_string).collect()
}

/// The first `per_class` images of each class of table `name` (ImageFolder), copied once per test
/// run: what `trainer evaluate` reads to show that an artifact's manifest alone drives evaluation
/// (a wrong preprocessing or label order fails the 0.85 bound on these as on the whole table).
fn eval_table(name: &str, per_class: usize) -> String {
    let dir = kestrel_tests::once::fixture(&format!("{name}-first-{per_class}"), |d| {
        kestrel_tests::table_subset(Path::new(&dataset(name, "imagefolder")), d, per_class)
    });
    dir.to_string_lossy().into_owned()
}

fn file_size(m: &Value, path: &str) -> u64 {
    m["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["path"] == path)
        .unwrap()["size"]
        .as_u64()
        .unwrap()
}

/// The default runs (plain `trainer fit`) of both tables export in every form within the default
/// gate (int8 weights once cost the default digits head 3 points: the stem's and first block's
/// weights, now kept in f32).
#[test]
fn three_forms_for_lfw_and_digits() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, classes) in [("lfw", 2), ("digits", 10)] {
        let data = dataset(name, "imagefolder");
        let run_dir = tmp.path().join(format!("{name}-run"));
        ok_json(&[
            "fit",
            "--data",
            &data,
            "--engine",
            "ort",
            "--json",
            "--out",
            run_dir.to_str().unwrap(),
        ]);
        three_forms_pass_the_gates(name, classes, &run_dir, tmp.path(), 1.0);
    }
}

/// The device's health check of artifact `art` passes on either engine (static int8 in ONNX
/// Runtime's integer kernels against the outputs the manifest records for it).
fn device_check_passes(art: &Path) {
    for engine in ["tract", "ort"] {
        let model = art.to_str().unwrap();
        let o = run(
            "edge-agent",
            &["--engine", engine, "check", "--model", model],
        );
        assert!(
            o.status.success() && stdout(&o).contains(&format!("golden samples pass on {engine}")),
            "{model}: edge-agent check on {engine}: {}{}",
            stdout(&o),
            stderr(&o)
        );
    }
}

/// Exports `run_dir` (trained on the `name` table's ImageFolder form) in the three forms and
/// checks each: both runtimes verify (f32 logits within 1e-3 of the trainer's), the golden
/// samples match, every file is listed with its hash and size, Python's ONNX Runtime runs it,
/// the manifest alone drives evaluation, and the quantized forms stay within 1.0 point of f32
/// (the export's default gate, checked here on the reported numbers too; int8-weights also in 30%
/// of the size). A tighter bound is noise on these splits: one digits validation image is 0.28
/// points, and a fine-tuned digits run lost 2 images (0.56 points) to int8 weights on a CI machine.
/// `max_drop` is the bound (and the export's `--max-accuracy-drop`) in points.
pub(crate) fn three_forms_pass_the_gates(
    name: &str,
    classes: usize,
    run_dir: &Path,
    tmp: &Path,
    max_drop: f64,
) {
    let data = eval_table(name, if classes > 2 { 10 } else { 20 });
    let gate = max_drop.to_string();
    let mut f32_acc = 0.0;
    let mut f32_size = 0;
    let mut models = Vec::new();
    for form in ["none", "int8-weights", "int8"] {
        let art = tmp.join(format!(
            "{}-{name}-{form}",
            run_dir.file_name().unwrap().to_string_lossy()
        ));
        let m = last_json(&export_ok(
            run_dir,
            &art,
            &["--quantize", form, "--max-accuracy-drop", &gate, "--json"],
        ));
        let q = &m["quantization"];
        let acc = q["accuracy"].as_f64().unwrap();
        eprintln!(
            "{name} {form}: val accuracy {acc} (f32 {}), files {:?}",
            q["f32_accuracy"], m["files"]
        );
        assert_eq!(m["labels"].as_array().unwrap().len(), classes);
        check_reference(&m, classes);
        assert_eq!(m["input"]["shape"], serde_json::json!(["N", 3, 224, 224]));
        let checks = m["verification"].as_array().unwrap();
        assert_eq!(
            checks.len(),
            2,
            "{name} {form}: tract and ort must both verify"
        );
        for c in checks {
            let d = c["max_abs_logit_diff"].as_f64().unwrap();
            if form == "none" {
                assert!(
                    d <= 1e-3,
                    "{name} {form} {}: logits differ by {d}",
                    c["runtime"]
                );
            }
            assert_eq!(c["golden_top1_match"], true);
        }
        // Every file is listed with its real hash and size.
        for f in m["files"].as_array().unwrap() {
            let bytes = std::fs::read(art.join(f["path"].as_str().unwrap())).unwrap();
            assert_eq!(bytes.len() as u64, f["size"].as_u64().unwrap());
        }
        models.push(art.join("model.onnx"));
        device_check_passes(&art);
        // The manifest alone drives evaluation, in both runtimes.
        for engine in ["tract", "ort"] {
            let e = ok_json(&[
                "evaluate",
                "--model",
                art.join("model.onnx").to_str().unwrap(),
                "--data",
                &data,
                "--engine",
                engine,
                "--json",
            ]);
            assert!(
                e["accuracy"].as_f64().unwrap() >= 0.85,
                "{name} {form} {engine}: {e}"
            );
        }
        let size = file_size(&m, "model.onnx");
        match form {
            "none" => {
                f32_acc = acc;
                f32_size = size;
            }
            "int8-weights" => {
                assert!(
                    (f32_acc - acc) * 100.0 <= max_drop,
                    "{name}: int8-weights {acc} vs f32 {f32_acc}"
                );
                assert!(
                    size as f64 <= 0.3 * f32_size as f64,
                    "{name}: int8-weights {size} vs f32 {f32_size} bytes"
                );
            }
            _ => assert!(
                (f32_acc - acc) * 100.0 <= max_drop,
                "{name}: int8 {acc} vs f32 {f32_acc}"
            ),
        }
    }
    assert_eq!(python_check(&models), vec![format!("(3, {classes})"); 3]);
}

/// The manifest's quality reference: the graph's `features` output (1280 pooled features) profiled
/// on the whole validation split, distributions that sum to 1, and a spread for every projection.
fn check_reference(m: &Value, classes: usize) {
    let r = &m["reference"];
    let val = m["verification"][0]["samples"].as_u64().unwrap();
    assert_eq!(r["samples"].as_u64(), Some(val), "{r}");
    for (key, len) in [
        ("class_distribution", classes),
        ("confidence_histogram", 10),
    ] {
        let v: Vec<f64> = r[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(v.len(), len, "{key}: {v:?}");
        assert!((v.iter().sum::<f64>() - 1.0).abs() < 1e-9, "{key}: {v:?}");
    }
    let f = &r["features"];
    assert_eq!(
        (f["output"].as_str(), f["dim"].as_u64()),
        (Some("features"), Some(1280))
    );
    let std = f["std"].as_array().unwrap();
    assert_eq!(std.len(), 16);
    assert!(std.iter().all(|s| s.as_f64().unwrap() > 0.0), "{f}");
}

#[test]
fn export_fails_when_a_check_fails() {
    let tmp = tempfile::tempdir().unwrap();
    let run_dir = tmp.path().join("run");
    ok_json(&[
        "fit",
        "--data",
        &dataset("lfw", "imagefolder"),
        "--optimizer",
        "sgd",
        "--epochs",
        "3",
        "--json",
        "--out",
        run_dir.to_str().unwrap(),
    ]);
    let art = tmp.path().join("art");
    for (extra, msg) in [
        (
            ["--quantize=none", "--tolerance=0"],
            "disagrees with the trainer",
        ),
        (
            ["--quantize=int8", "--max-accuracy-drop=-1"],
            "more than --max-accuracy-drop",
        ),
    ] {
        let mut args = vec![
            "export",
            "--run",
            run_dir.to_str().unwrap(),
            "--out",
            art.to_str().unwrap(),
        ];
        args.extend(extra);
        let o = run("trainer", &args);
        assert!(!o.status.success(), "{extra:?} should fail");
        assert!(stderr(&o).contains(msg), "{extra:?}: {}", stderr(&o));
        assert!(!art.exists(), "a failed export must not leave an artifact");
    }
    // `trainer latency` on the artifact once it passes: a median in milliseconds from each
    // engine, and a missing image named.
    export_ok(&run_dir, &art, &["--quantize", "none"]);
    let photo = kestrel_tests::photo("coffee.png");
    for engine in ["tract", "ort"] {
        let args = [
            "latency",
            "--model",
            art.to_str().unwrap(),
            "--engine",
            engine,
        ];
        let o = run_ok(
            "trainer",
            &[
                &args[..],
                &["--rounds", "5", "--json", photo.to_str().unwrap()],
            ]
            .concat(),
        );
        let v: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
        assert_eq!(v["engine"], engine);
        let ms = v["ms"].as_f64().unwrap();
        assert!(ms > 0.1 && ms < 10_000.0, "{engine}: {ms} ms");
        let o = run("trainer", &[&args[..], &["no-such-image.png"]].concat());
        assert!(!o.status.success());
        assert!(stderr(&o).contains("no-such-image.png"), "{}", stderr(&o));
    }
}
