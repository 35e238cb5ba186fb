//! Shared preprocessing across binaries, and bad inputs (images, checkpoints) failing clearly.

use std::io::Cursor;
use std::process::Output;

use image::{DynamicImage, ImageFormat, RgbImage};
use kestrel_models::tensor::{Tensor, Weights};
use kestrel_models::{Arch, Network, torch};
use kestrel_shared::ImageLimits;
use kestrel_tests::{photo, run, run_ok, stderr};

#[test]
fn trainer_and_edge_preprocess_identically() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Network::new(Arch::EfficientnetLite0).preprocess;
    let spec_path = dir.path().join("spec.json");
    std::fs::write(&spec_path, serde_json::to_string(&spec).unwrap()).unwrap();
    // A colour PNG, a grayscale image and an RGBA PNG.
    let rgba = dir.path().join("rgba.png");
    DynamicImage::ImageRgba8(image::RgbaImage::from_fn(40, 30, |x, y| {
        image::Rgba([x as u8 * 6, y as u8 * 8, 90, 128])
    }))
    .save(&rgba)
    .unwrap();
    let images = [photo("chelsea.png"), photo("camera.png"), rgba];
    let args = |out: &str| -> Vec<String> {
        let mut v = vec![
            "preprocess".into(),
            "--spec".into(),
            spec_path.display().to_string(),
            "--out".into(),
            out.into(),
        ];
        v.extend(images.iter().map(|p| p.display().to_string()));
        v
    };
    let t_out = dir.path().join("t").display().to_string();
    let e_out = dir.path().join("e").display().to_string();
    run_ok("trainer", &args(&t_out));
    run_ok("edge-agent", &args(&e_out));
    for img in &images {
        let name = format!("{}.f32", img.file_name().unwrap().to_string_lossy());
        let a = std::fs::read(dir.path().join("t").join(&name)).unwrap();
        let b = std::fs::read(dir.path().join("e").join(&name)).unwrap();
        assert_eq!(a.len(), 3 * 224 * 224 * 4, "{name}");
        assert!(a == b, "{name}: trainer and edge-agent tensors differ");
        let in_process = spec
            .run_file(img, &ImageLimits::default())
            .unwrap()
            .to_le_bytes();
        assert!(a == in_process, "{name}: binary and library tensors differ");
    }
}

fn png_bytes(w: u32, h: u32) -> Vec<u8> {
    let mut c = Cursor::new(Vec::new());
    DynamicImage::ImageRgb8(RgbImage::new(w, h))
        .write_to(&mut c, ImageFormat::Png)
        .unwrap();
    c.into_inner()
}

/// `trainer classify` with a random MobileNetV2: `ARGS...` are images (and flags).
fn classify_random(args: &[&str]) -> Output {
    let mut a = vec![
        "classify",
        "--backbone",
        "random:1",
        "--arch",
        "mobilenetv2",
    ];
    a.extend(args);
    run("trainer", &a)
}

#[test]
fn bad_images_are_named_and_fail() {
    let dir = tempfile::tempdir().unwrap();
    let good = std::fs::read(photo("coffee.png")).unwrap();
    let cases: [(&str, Vec<u8>, &str); 4] = [
        (
            "corrupt.png",
            {
                let mut b = good.clone();
                b[100..4000].fill(0x5a);
                b
            },
            "cannot decode",
        ),
        (
            "truncated.png",
            good[..good.len() / 3].to_vec(),
            "cannot decode",
        ),
        ("empty.jpg", Vec::new(), "empty input"),
        ("huge.png", png_bytes(9000, 4), "exceeds the limit"),
    ];
    for (name, bytes, reason) in cases {
        let path = dir.path().join(name);
        std::fs::write(&path, &bytes).unwrap();
        let out = classify_random(&[path.to_str().unwrap()]);
        let err = stderr(&out);
        assert!(!out.status.success(), "{name}: expected failure");
        assert!(
            err.contains(name) && err.contains(reason),
            "{name}: stderr lacks file/reason: {err}"
        );
        assert!(!err.contains("panicked"), "{name}: {err}");
    }
    // A good image next to a bad one is still classified, and the run still fails.
    let bad = dir.path().join("empty.jpg");
    let out = classify_random(&[
        "--json",
        photo("coffee.png").to_str().unwrap(),
        bad.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1);
}

#[test]
fn checkpoint_with_wrong_shape_or_missing_tensor_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let net = Network::new(Arch::Mobilenetv2);
    let good = kestrel_models::weights::random(
        &net,
        kestrel_models::weights::Part::BackboneAndClassifier,
        3,
    );
    // Upstream (torchvision) names, as a real checkpoint would have.
    let upstream: Weights = good
        .iter()
        .map(|(k, v)| (net.source_name(k), v.clone()))
        .collect();

    let mut wrong = upstream.clone();
    wrong.insert(
        "features.4.conv.1.0.weight".into(),
        Tensor::zeros(vec![144, 1, 5, 5]),
    );
    let path = dir.path().join("wrong.safetensors");
    torch::write_safetensors(&path, &wrong, None).unwrap();
    let out = run(
        "trainer",
        &[
            "classify",
            "--backbone",
            path.to_str().unwrap(),
            "--arch",
            "mobilenetv2",
            path.to_str().unwrap(),
        ],
    );
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(
        err.contains("features.4.conv.1.0.weight")
            && err.contains("[144, 1, 3, 3]")
            && err.contains("[144, 1, 5, 5]"),
        "{err}"
    );

    let mut missing = upstream;
    missing.remove("classifier.1.bias");
    missing.remove("features.18.1.running_var");
    let path = dir.path().join("missing.safetensors");
    torch::write_safetensors(&path, &missing, None).unwrap();
    let out = run(
        "trainer",
        &[
            "lower",
            "--backbone",
            path.to_str().unwrap(),
            "--arch",
            "mobilenetv2",
            "--out",
            "/dev/null",
        ],
    );
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(
        err.contains("features.18.1.running_var") && err.contains("head.bn.running_var"),
        "{err}"
    );
}
