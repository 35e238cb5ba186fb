//! Bring your own backbone: ONNX graphs as other tools export them (built by
//! `tests/py/foreign_backbones.py` with the `onnx` package) used whole as the frozen backbone
//! (`--backbone model.onnx`), and their weights imported onto Kestrel's architectures
//! (`import-weights --from model.onnx`). One set of graphs is generated for every test here.

use std::path::{Path, PathBuf};

use kestrel_tests::{Scratch, export_ok, lfw, python, run, run_ok, s, stderr, stdout};
use serde_json::Value;

const GENERATOR: &str = include_str!("../../py/foreign_backbones.py");

/// The generated graphs (lite0_foreign.onnx, mobilenetv2_torchvision.onnx, not_image.onnx,
/// rank2.onnx), made once per test run.
fn graphs() -> PathBuf {
    kestrel_tests::once::fixture("foreign-graphs", |dir| {
        let lite0 = dir.join("kestrel_lite0.onnx");
        run_ok(
            "trainer",
            &["lower", "--output", "logits", "--out", &s(&lite0)],
        );
        python(GENERATOR, &[s(&lite0), s(dir)]);
    })
}

fn graph(name: &str) -> String {
    s(&graphs().join(name))
}

/// The last line of standard output as JSON.
fn last_json(o: &std::process::Output) -> Value {
    serde_json::from_str(stdout(o).lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("{e}: {}", stdout(o)))
}

/// The numbers a Python check printed after a numpy shape: `(3, 1000) 1e-5 2.0` gives `[1e-5, 2.0]`.
fn numbers_after_shape(line: &str) -> Vec<f64> {
    line.split(") ")
        .nth(1)
        .unwrap_or_else(|| panic!("no shape in {line:?}"))
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect()
}

fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// `trainer prepare` on LFW with `backbone` flags; returns the feature cache's values.
fn prepared_features(cache: &Path, backbone: &[&str], engine: &str) -> Vec<f32> {
    let (lfw, cache) = (lfw(), s(cache));
    let mut args = vec![
        "prepare", "--data", &lfw, "--cache", &cache, "--engine", engine, "--json",
    ];
    args.extend(backbone);
    let v = last_json(&run_ok("trainer", &args));
    assert_eq!(v["feature_dims"], serde_json::json!([1280]), "{v}");
    read_f32(&Path::new(v["features_cache"].as_str().unwrap()).join("features.f32"))
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The foreign Lite0 (NHWC input `image`, renamed initializers, BN unfolded, opset 17, symbolic
/// batch) as the frozen backbone: the same features as the built-in Lite0 on tract and ONNX
/// Runtime, the same head accuracy on LFW, and an export that passes the gates and the device's
/// health check on both engines.
#[test]
fn foreign_lite0_is_the_builtin_backbone() {
    let sc = Scratch::new();
    let foreign = graph("lite0_foreign.onnx");
    let own: &[&str] = &["--backbone", &foreign, "--preprocess", "efficientnet-lite0"];
    let builtin = prepared_features(&sc.cache, &[], "tract");
    for engine in ["tract", "ort"] {
        // tract's features stay in the shared cache for the fit below (the cache is keyed by
        // backbone, not engine).
        let cache = match engine {
            "tract" => sc.cache.clone(),
            _ => sc.join("cache-ort"),
        };
        let diff = max_diff(&builtin, &prepared_features(&cache, own, engine));
        eprintln!("foreign Lite0 features on {engine}: max |diff| {diff:.2e}");
        assert!(diff <= 1e-4, "{engine}: features differ by {diff}");
    }
    let fit = |name: &str, extra: &[&str]| -> (PathBuf, f64) {
        let dir = sc.join(name);
        let (lfw, cache, out) = (lfw(), sc.cache_arg(), s(&dir));
        let mut a = vec![
            "fit", "--data", &lfw, "--cache", &cache, "--out", &out, "--json",
        ];
        a.extend(extra);
        let v = last_json(&run_ok("trainer", &a));
        (dir, v["val_accuracy"].as_f64().unwrap())
    };
    let (_, acc_builtin) = fit("run-builtin", &[]);
    let (run_dir, acc) = fit("run-foreign", own);
    eprintln!("LFW validation accuracy: built-in {acc_builtin}, foreign {acc}");
    assert_eq!(acc, acc_builtin);
    assert!(acc >= 0.9, "{acc}");
    let params: Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("params.json")).unwrap())
            .unwrap();
    assert!(
        params["backbone"]
            .as_str()
            .unwrap()
            .ends_with("/lite0_foreign.onnx")
    );
    assert_eq!(params["backbone_sha256"].as_str().unwrap().len(), 64);
    assert_eq!(
        params["preprocess"]["mean"],
        serde_json::json!([0.5, 0.5, 0.5])
    );
    let mut sizes = Vec::new();
    for form in ["none", "int8-weights"] {
        let art = sc.join(form);
        let m = last_json(&export_ok(&run_dir, &art, &["--quantize", form, "--json"]));
        assert_eq!(m["arch"], "onnx");
        assert_eq!(m["input"]["shape"], serde_json::json!(["N", 3, 224, 224]));
        let q = &m["quantization"];
        eprintln!(
            "export {form}: accuracy {} (f32 {})",
            q["accuracy"], q["f32_accuracy"]
        );
        assert!(q["accuracy_delta_pt"].as_f64().unwrap().abs() <= 1.0, "{q}");
        for c in m["verification"].as_array().unwrap() {
            let d = c["max_abs_logit_diff"].as_f64().unwrap();
            eprintln!("export {form} {}: max |logit diff| {d:.2e}", c["runtime"]);
            if form == "none" {
                assert!(d <= 1e-3, "{c}");
            }
        }
        for engine in ["tract", "ort"] {
            let o = run_ok(
                "edge-agent",
                &["--engine", engine, "check", "--model", &s(&art)],
            );
            let out = stdout(&o);
            assert!(
                out.contains(&format!("golden samples pass on {engine}")),
                "{out}"
            );
        }
        sizes.push(std::fs::metadata(art.join("model.onnx")).unwrap().len());
    }
    eprintln!(
        "model.onnx sizes: f32 {} B, int8-weights {} B",
        sizes[0], sizes[1]
    );
    assert!(sizes[1] * 3 < sizes[0], "{sizes:?}");
    // Static int8 needs Kestrel's own layers: refused with the reason, not written wrong.
    let (run_arg, out) = (s(&run_dir), s(&sc.join("int8")));
    let o = run(
        "trainer",
        &[
            "export",
            "--run",
            &run_arg,
            "--out",
            &out,
            "--quantize",
            "int8",
        ],
    );
    assert!(
        !o.status.success() && stderr(&o).contains("ONNX backbone"),
        "{}",
        stderr(&o)
    );
}

/// A MobileNetV2 in torchvision's exported layout (BN folded, generated initializer names):
/// `import-weights` maps it by structure, and Kestrel's MobileNetV2 with those weights gives the
/// ONNX file's logits in ONNX Runtime; the same file used whole gives Kestrel's features; and the
/// imported weights fine-tune.
#[test]
fn torchvision_mobilenetv2_onnx_imports() {
    let sc = Scratch::new();
    let mbv2 = graph("mobilenetv2_torchvision.onnx");
    let weights = sc.join("mbv2.safetensors");
    let out = stdout(&run_ok(
        "trainer",
        &[
            "import-weights",
            "--arch",
            "mobilenetv2",
            "--from",
            &mbv2,
            "--out",
            &s(&weights),
        ],
    ));
    assert!(out.contains("imported 262 tensors"), "{out}");
    let (logits, features, own) = (sc.join("k.onnx"), sc.join("kf.onnx"), sc.join("own.onnx"));
    for (output, file) in [("logits", &logits), ("features", &features)] {
        run_ok(
            "trainer",
            &[
                "lower",
                "--backbone",
                &s(&weights),
                "--arch",
                "mobilenetv2",
                "--output",
                output,
                "--out",
                &s(file),
            ],
        );
    }
    run_ok(
        "trainer",
        &[
            "lower",
            "--backbone",
            &mbv2,
            "--preprocess",
            "mobilenetv2",
            "--feature-output",
            "/Flatten_output_0",
            "--out",
            &s(&own),
        ],
    );
    let o = python(
        "import onnxruntime as ort, numpy as np, sys\n\
run = lambda p, name, x: ort.InferenceSession(p, providers=['CPUExecutionProvider']).run(None, {name: x})[0]\n\
x = np.random.default_rng(1).normal(size=(3, 3, 224, 224)).astype(np.float32)\n\
a, b = run(sys.argv[1], 'input', x), run(sys.argv[2], 'input', x)\n\
f, g = run(sys.argv[3], 'input', x), run(sys.argv[4], 'input', x)\n\
print(a.shape, float(np.abs(a - b).max()), float(np.abs(a).max()), float(np.abs(f - g).max()))",
        &[mbv2, s(&logits), s(&features), s(&own)],
    );
    let line = stdout(&o);
    eprintln!(
        "torchvision MobileNetV2: shape, max |logit diff|, max |logit|, max |feature diff|: {line}"
    );
    let v = numbers_after_shape(&line);
    assert!(line.starts_with("(3, 1000)"), "{line}");
    assert!(v[0] <= 1e-4 && v[1] > 0.1 && v[2] <= 1e-4, "{line}");
    // The imported weights fine-tune (the last block and the head).
    let run_dir = sc.join("ft");
    let (lfw, cache) = (lfw(), sc.cache_arg());
    let v = last_json(&run_ok(
        "trainer",
        &[
            "fit",
            "--data",
            &lfw,
            "--cache",
            &cache,
            "--backbone",
            &s(&weights),
            "--arch",
            "mobilenetv2",
            "--fine-tune",
            "1",
            "--epochs",
            "2",
            "--out",
            &s(&run_dir),
            "--json",
        ],
    ));
    eprintln!("fine-tuned on imported MobileNetV2 weights: {v}");
    assert!(v["val_accuracy"].as_f64().unwrap() > 0.5, "{v}");
}

/// What is not an image model, a feature tensor that does not exist, and a missing
/// preprocessing are refused naming what was found.
#[test]
fn onnx_backbone_errors_name_what_was_found() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.onnx");
    let lower = |extra: &[&str]| {
        let mut a = vec!["lower", "--out", out.to_str().unwrap()];
        a.extend(extra);
        let o = run("trainer", &a);
        assert!(!o.status.success(), "{extra:?} succeeded");
        stderr(&o)
    };
    let (tokens, rank2, mbv2) = (
        graph("not_image.onnx"),
        graph("rank2.onnx"),
        graph("mobilenetv2_torchvision.onnx"),
    );
    let e = lower(&["--backbone", &tokens, "--preprocess", "mobilenetv2"]);
    assert!(
        e.contains("not an image model") && e.contains("input `input_ids`: int64 [?, 128]"),
        "{e}"
    );
    let e = lower(&["--backbone", &rank2, "--preprocess", "mobilenetv2"]);
    assert!(
        e.contains("not an image model") && e.contains("input `x`: float [?, 10]"),
        "{e}"
    );
    let e = lower(&[
        "--backbone",
        &mbv2,
        "--preprocess",
        "mobilenetv2",
        "--feature-output",
        "pooled",
    ]);
    assert!(
        e.contains("`pooled` is not a tensor") && e.contains("`/Flatten_output_0`"),
        "{e}"
    );
    let e = lower(&["--backbone", &mbv2]);
    assert!(e.contains("needs its preprocessing"), "{e}");
    let e = lower(&["--backbone", &tokens, "--arch", "mobilenetv2"]);
    assert!(e.contains("0 Conv nodes, mobilenetv2 has 52"), "{e}");
}

/// A classifier-less export (timm's `num_classes=0`, a torchvision model without its
/// classifier): its pooled output is the feature tensor with no `--feature-output`, equal to the
/// full model's pooled tensor; `--preprocess` takes timm's `pretrained_cfg` (here inside a Hugging
/// Face `config.json`) and gives the same spec as the architecture's; candidates are named once.
#[test]
fn headless_exports_and_timm_configs_need_no_flags() {
    let sc = Scratch::new();
    let (full, headless) = (
        graph("mobilenetv2_torchvision.onnx"),
        graph("mobilenetv2_headless.onnx"),
    );
    let cfg = sc.join("config.json");
    std::fs::write(
        &cfg,
        r#"{"architecture": "mobilenetv2_100", "num_classes": 0, "pretrained_cfg": {
            "input_size": [3, 224, 224], "interpolation": "bilinear", "crop_pct": 0.875,
            "crop_mode": "center", "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}}"#,
    )
    .unwrap();
    let (a, b) = (sc.join("full.onnx"), sc.join("headless.onnx"));
    run_ok(
        "trainer",
        &[
            "lower",
            "--backbone",
            &full,
            "--preprocess",
            "mobilenetv2",
            "--feature-output",
            "/Flatten_output_0",
            "--out",
            &s(&a),
        ],
    );
    run_ok(
        "trainer",
        &[
            "lower",
            "--backbone",
            &headless,
            "--preprocess",
            &s(&cfg),
            "--out",
            &s(&b),
        ],
    );
    let o = python(
        "import onnxruntime as ort, numpy as np, sys\n\
run = lambda p, x: ort.InferenceSession(p, providers=['CPUExecutionProvider']).run(None, {'input': x})[0]\n\
x = np.random.default_rng(2).normal(size=(2, 3, 224, 224)).astype(np.float32)\n\
a, b = run(sys.argv[1], x), run(sys.argv[2], x)\n\
print(a.shape, float(np.abs(a - b).max()), float(np.abs(a).max()))",
        &[s(&a), s(&b)],
    );
    let line = stdout(&o);
    let v = numbers_after_shape(&line);
    assert!(line.starts_with("(2, 1280)"), "{line}");
    assert!(v[0] <= 1e-5 && v[1] > 0.0, "{line}");
    // The config's spec is the architecture's: the same sample cache.
    let (data, cache) = (lfw(), sc.cache_arg());
    let prepare = |backbone: &str, extra: &[&str]| -> Value {
        let mut args = vec![
            "prepare",
            "--json",
            "--engine",
            "ort",
            "--data",
            &data,
            "--cache",
            &cache,
            "--backbone",
            backbone,
        ];
        args.extend(extra);
        last_json(&run_ok("trainer", &args))
    };
    let x = prepare(
        &full,
        &[
            "--preprocess",
            "mobilenetv2",
            "--feature-output",
            "/Flatten_output_0",
        ],
    );
    let y = prepare(&headless, &["--preprocess", &s(&cfg)]);
    assert_eq!(x["samples_cache"], y["samples_cache"]);
    assert_eq!(y["feature_dims"], serde_json::json!([1280]), "{y}");
    // A tensor that is not there: the candidates list the graph's output once.
    let o = run(
        "trainer",
        &[
            "lower",
            "--backbone",
            &headless,
            "--preprocess",
            &s(&cfg),
            "--feature-output",
            "pooled",
            "--out",
            &s(&sc.join("x.onnx")),
        ],
    );
    assert!(!o.status.success());
    assert_eq!(stderr(&o).matches("`feat`").count(), 1, "{}", stderr(&o));
}
