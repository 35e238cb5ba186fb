//! Pretrained backbones see: real photos classified correctly on every engine, engines agree.

use kestrel_models::backbone::Backbone;
use kestrel_models::onnx::LowerOpts;
use kestrel_models::{Arch, EngineKind, Tensor};
use kestrel_shared::ImageLimits;
use kestrel_tests::{json_lines, photo, python, run_ok, stdout};

fn top1_per_image(out: &std::process::Output) -> Vec<(String, u64, f64)> {
    json_lines(out)
        .iter()
        .map(|v| {
            let top = &v["top"][0];
            (
                v["image"].as_str().unwrap().to_string(),
                top["class"].as_u64().unwrap(),
                top["score"].as_f64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn classify_photos_on_every_engine() {
    let chelsea = photo("chelsea.png");
    let coffee = photo("coffee.png");
    for engine in ["tract", "ort", "candle"] {
        let out = run_ok(
            "trainer",
            &[
                "classify",
                "--backbone",
                "efficientnet-lite0",
                "--engine",
                engine,
                "--json",
                "--top-k",
                "3",
                chelsea.to_str().unwrap(),
                coffee.to_str().unwrap(),
            ],
        );
        let tops = top1_per_image(&out);
        assert_eq!(tops.len(), 2, "{engine}: {}", stdout(&out));
        assert!(tops[0].0.ends_with("chelsea.png"));
        assert!(
            [281, 282, 285].contains(&tops[0].1),
            "{engine}: chelsea top-1 {}",
            tops[0].1
        );
        assert_eq!(tops[1].1, 967, "{engine}: coffee top-1");
        for (_, _, score) in &tops {
            assert!(*score > 0.0 && *score <= 1.0);
        }
    }
}

fn input_batch(backbone: &Backbone) -> Tensor {
    let spec = &backbone.net.preprocess;
    let mut data = Vec::new();
    for p in ["chelsea.png", "coffee.png"] {
        data.extend(
            spec.run_file(&photo(p), &ImageLimits::default())
                .unwrap()
                .data,
        );
    }
    Tensor::new(vec![2, 3, 224, 224], data)
}

fn engines_agree(backbone: Backbone) {
    let arch = backbone.net.arch;
    let x = input_batch(&backbone);
    let opts = LowerOpts::logits(&backbone.net, backbone.classifier().unwrap());
    let outs: Vec<(EngineKind, Tensor)> = EngineKind::ALL
        .into_iter()
        .map(|k| {
            (
                k,
                backbone
                    .engine(k, &opts, kestrel_models::engine::EngineOpts::cpu(2))
                    .unwrap_or_else(|e| panic!("{arch} {k}: {e}"))
                    .run(&x)
                    .unwrap(),
            )
        })
        .collect();
    let (_, reference) = &outs[0];
    assert_eq!(reference.shape, vec![2, 1000]);
    let spread = reference.data.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(
        spread > 1.0,
        "{arch}: logits are degenerate (max |logit| {spread})"
    );
    for (k, out) in &outs[1..] {
        let d = reference.max_abs_diff(out).expect("same shape");
        eprintln!("{arch}: tract vs {k}: max abs logit diff {d:e}");
        assert!(d <= 1e-3, "{arch}: tract vs {k} differ by {d}");
    }
}

#[test]
fn engines_agree_on_pretrained_lite0() {
    engines_agree(Backbone::resolve("efficientnet-lite0", None).expect("run scripts/setup.sh"));
}

#[test]
fn engines_agree_on_random_mobilenetv2() {
    engines_agree(Backbone::resolve("random:7", Some(Arch::Mobilenetv2)).unwrap());
}

#[test]
fn lowered_graphs_pass_the_onnx_checker() {
    let dir = tempfile::tempdir().unwrap();
    for (backbone, arch) in [
        ("efficientnet-lite0", None),
        ("random:3", Some("mobilenetv2")),
    ] {
        let path = dir.path().join(format!("{backbone}.onnx"));
        let mut args = vec![
            "lower",
            "--backbone",
            backbone,
            "--output",
            "logits",
            "--out",
            path.to_str().unwrap(),
        ];
        if let Some(a) = arch {
            args.extend(["--arch", a]);
        }
        run_ok("trainer", &args);
        let check = python(
            "import onnx, sys; m = onnx.load(sys.argv[1]); onnx.checker.check_model(m, full_check=True); \
             print(m.opset_import[0].version, m.graph.output[0].type.tensor_type.shape.dim[1].dim_value)",
            &[&path],
        );
        assert_eq!(stdout(&check).trim(), "13 1000", "{backbone}");
    }
}
