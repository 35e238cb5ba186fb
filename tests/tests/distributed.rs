//! Data-parallel training: N local workers (threads with allreduce) train exactly what one worker
//! trains with the same global batch and seed, and bad worker counts fail clearly.

use std::path::Path;

use kestrel_models::torch::read_safetensors;
use kestrel_tests::{fetched, run, stderr};

fn lfw() -> String {
    fetched("datasets/lfw/imagefolder").display().to_string()
}

fn fit(args: &[&str], out: &Path, cache: &Path) -> String {
    let mut a = vec![
        "fit",
        "--json",
        "--engine",
        "ort",
        "--out",
        out.to_str().unwrap(),
        "--cache",
        cache.to_str().unwrap(),
    ];
    a.extend(args);
    let o = run("trainer", &a);
    assert!(o.status.success(), "fit {args:?} failed: {}", stderr(&o));
    stderr(&o)
}

/// Largest absolute difference between the same tensors of two safetensors files.
fn max_abs_diff(a: &Path, b: &Path) -> f32 {
    let (a, b) = (read_safetensors(a).unwrap(), read_safetensors(b).unwrap());
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "different tensors"
    );
    let mut worst = 0f32;
    for (name, ta) in &a {
        let tb = &b[name];
        assert_eq!(ta.shape, tb.shape, "{name}");
        for (x, y) in ta.data.iter().zip(&tb.data) {
            worst = worst.max((x - y).abs());
        }
    }
    worst
}

#[test]
fn workers_train_what_one_worker_trains() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let data = lfw();
    let base = [
        "--data",
        &data,
        "--epochs",
        "10",
        "--seed",
        "7",
        "--batch-size",
        "32",
    ];
    let one = tmp.path().join("w1");
    fit(&base, &one, &cache);
    // 2 workers (parts of 16) and 3 workers (uneven parts 10/11/11 of the same global batch).
    for w in ["2", "3"] {
        let dir = tmp.path().join(format!("w{w}"));
        let mut args = base.to_vec();
        args.extend(["--workers", w]);
        let log = fit(&args, &dir, &cache);
        assert!(
            log.contains(&format!("{w} workers: global batch 32")),
            "{log}"
        );
        for f in ["best.safetensors", "last.safetensors"] {
            let d = max_abs_diff(&one.join(f), &dir.join(f));
            eprintln!("--workers {w} vs 1, {f}: max abs diff {d:e}");
            assert!(d <= 1e-5, "--workers {w}: {f} differs by {d}");
        }
        let s: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap())
                .unwrap();
        assert!(s["val_accuracy"].as_f64().unwrap() >= 0.95, "{s}");
        assert_eq!(
            std::fs::read_to_string(dir.join("metrics.jsonl"))
                .unwrap()
                .lines()
                .count(),
            10
        );
    }
    // Linear lr scaling: 2 workers at lr 0.005 (x2) train what 1 worker trains at lr 0.01.
    let lin = tmp.path().join("linear");
    let mut args = base.to_vec();
    args.extend(["--workers", "2", "--lr-scaling", "linear", "--lr", "0.005"]);
    fit(&args, &lin, &cache);
    let d = max_abs_diff(&one.join("last.safetensors"), &lin.join("last.safetensors"));
    eprintln!("--lr-scaling linear, 2 workers at lr 0.005 vs 1 worker at 0.01: {d:e}");
    assert!(d <= 1e-5, "linear scaling: differs by {d}");
}

#[test]
fn augmented_training_splits_the_same_views_over_workers() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let data = lfw();
    let base = [
        "--data",
        &data,
        "--epochs",
        "2",
        "--augment",
        "flip,crop",
        "--seed",
        "3",
    ];
    let one = tmp.path().join("w1");
    fit(&base, &one, &cache);
    let two = tmp.path().join("w2");
    let mut args = base.to_vec();
    args.extend(["--workers", "2"]);
    fit(&args, &two, &cache);
    let d = max_abs_diff(&one.join("last.safetensors"), &two.join("last.safetensors"));
    eprintln!("augmented, --workers 2 vs 1: max abs diff {d:e}");
    assert!(d <= 1e-5, "augmented run differs by {d}");
}

#[test]
fn too_few_samples_or_batch_for_the_workers_fail_clearly() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    // A 4-image table: two of each class.
    let small = tmp.path().join("small");
    let src = fetched("datasets/lfw/imagefolder");
    for class in std::fs::read_dir(&src).unwrap() {
        let class = class.unwrap().path();
        let name = class.file_name().unwrap().to_owned();
        let mut files: Vec<_> = std::fs::read_dir(&class)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        let dst = small.join(&name);
        std::fs::create_dir_all(&dst).unwrap();
        for f in &files[..2] {
            std::fs::copy(f, dst.join(f.file_name().unwrap())).unwrap();
        }
    }
    let out = tmp.path().join("run");
    let fail = |args: &[&str]| {
        let mut a = vec![
            "fit",
            "--engine",
            "ort",
            "--cache",
            cache.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ];
        a.extend(args);
        let o = run("trainer", &a);
        assert!(!o.status.success(), "{args:?} should fail");
        stderr(&o)
    };
    let e = fail(&[
        "--data",
        small.to_str().unwrap(),
        "--workers",
        "5",
        "--batch-size",
        "5",
    ]);
    assert!(e.contains("only 4 usable samples for 5 workers"), "{e}");
    let e = fail(&["--data", &lfw(), "--workers", "4", "--batch-size", "2"]);
    assert!(
        e.contains("--batch-size 2 is smaller than --workers 4"),
        "{e}"
    );
    let e = fail(&[
        "--data",
        &lfw(),
        "--workers",
        "2",
        "--collective-timeout",
        "0",
    ]);
    assert!(e.contains("--collective-timeout must be a positive"), "{e}");
}
