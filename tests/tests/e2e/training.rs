//! Transfer learning on the real LFW-subset and digits tables, through every source, with caches,
//! resume and bad inputs.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use kestrel_tests::{
    bin, copy_dir, dataset, kill_after_epochs, lfw, python, read_json, read_jsonl, run, run_ok,
    stderr, trainer_json,
};

use serde_json::Value;

/// Runs `trainer fit ... --json --out DIR` and returns summary.json as printed.
fn fit(args: &[&str], out: &Path) -> (Value, String) {
    let mut a = vec!["fit", "--json", "--out", out.to_str().unwrap()];
    a.extend(args);
    let o = run_ok("trainer", &a);
    (kestrel_tests::json(&o), stderr(&o))
}

fn sha(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn lfw_and_digits_through_every_source() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, forms, epochs, min_acc) in [
        (
            "lfw",
            ["imagefolder", "manifest.csv", "lfw.parquet"],
            "10",
            0.95,
        ),
        (
            "digits",
            ["imagefolder", "manifest.csv", "digits.parquet"],
            "15",
            0.90,
        ),
    ] {
        let mut weights = Vec::new();
        for form in forms {
            let out = tmp.path().join(format!("{name}-{form}"));
            let (s, _) = fit(
                &[
                    "--data",
                    &dataset(name, form),
                    "--engine",
                    "ort",
                    "--epochs",
                    epochs,
                    "--seed",
                    "42",
                ],
                &out,
            );
            let acc = s["val_accuracy"].as_f64().unwrap();
            eprintln!("{name} via {form}: val accuracy {acc}");
            assert!(
                acc >= min_acc,
                "{name} via {form}: val accuracy {acc} < {min_acc}"
            );
            weights.push(sha(&out.join("best.safetensors")));
        }
        assert!(
            weights.iter().all(|w| *w == weights[0]),
            "{name}: sources gave different weights for the same seed"
        );
    }
}

#[test]
fn second_fit_does_no_backbone_work_and_run_dir_is_complete() {
    let tmp = tempfile::tempdir().unwrap();
    let data = lfw();
    let cache = tmp.path().join("cache");
    let cache = cache.to_str().unwrap();
    let (first, _) = fit(
        &["--data", &data, "--cache", cache, "--epochs", "3"],
        &tmp.path().join("a"),
    );
    assert_eq!(first["backbone_runs"], 200);
    let t = Instant::now();
    let (second, log) = fit(
        &[
            "--data",
            &data,
            "--cache",
            cache,
            "--epochs",
            "4",
            "--lr",
            "0.003",
            "--optimizer",
            "adamw",
            "--schedule",
            "cosine",
            "--test-fraction",
            "0.2",
        ],
        &tmp.path().join("b"),
    );
    eprintln!("second fit took {:?}", t.elapsed());
    assert_eq!(second["backbone_runs"], 0, "{log}");
    assert!(log.contains("backbone runs: 0 (cache hit)"), "{log}");
    assert!(second["test_accuracy"].as_f64().unwrap() >= 0.9);

    let run = tmp.path().join("b");
    let metrics = read_jsonl(&run.join("metrics.jsonl"));
    assert_eq!(metrics.len(), 4);
    for key in [
        "epoch",
        "train_loss",
        "train_accuracy",
        "val_loss",
        "val_accuracy",
        "samples_per_s",
    ] {
        assert!(metrics[3][key].is_number(), "metrics.jsonl lacks {key}");
    }
    let summary = read_json(&run.join("summary.json"));
    assert_eq!(summary["labels"], serde_json::json!(["face", "nonface"]));
    assert!(summary["best_epoch"].as_u64().unwrap() >= 1);
    let confusion = summary["validation"]["confusion"].as_array().unwrap();
    let total: u64 = confusion
        .iter()
        .flat_map(|r| r.as_array().unwrap())
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(total, 40);
    assert!(summary["validation"]["per_class"][0]["precision"].is_number());
    let params = read_json(&run.join("params.json"));
    assert_eq!(params["optimizer"], "adamw");
    for png in ["loss.png", "accuracy.png"] {
        let img = image::open(run.join(png)).unwrap();
        assert_eq!((img.width(), img.height()), (800, 500));
    }

    // evaluate the run on the whole table.
    let e = trainer_json(&[
        "evaluate",
        "--run",
        run.to_str().unwrap(),
        "--data",
        &data,
        "--cache",
        cache,
        "--json",
    ]);
    assert_eq!(e["samples"], 200);
    assert!(e["accuracy"].as_f64().unwrap() >= 0.95, "{e}");
}

#[test]
fn killed_and_resumed_run_ends_with_identical_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let data = lfw();
    let args = [
        "--data",
        data.as_str(),
        "--epochs",
        "60",
        "--batch-size",
        "2",
        "--lr",
        "0.001",
        "--optimizer",
        "adamw",
        "--weight-decay",
        "0.01",
        "--schedule",
        "step",
    ];
    let whole = tmp.path().join("whole");
    fit(&args, &whole);

    let killed = tmp.path().join("killed");
    let mut cmd = Command::new(bin("trainer"));
    cmd.args(["fit", "--out", killed.to_str().unwrap()])
        .args(args);
    let done = kill_after_epochs(&mut cmd, &killed, 5);
    assert!(done < 60, "the run finished before the kill");
    eprintln!("killed after {done} epochs");

    let o = run_ok(
        "trainer",
        &["fit", "--resume", killed.to_str().unwrap(), "--json"],
    );
    assert!(
        stderr(&o).contains("resuming after epoch"),
        "{}",
        stderr(&o)
    );
    assert_eq!(
        sha(&whole.join("last.safetensors")),
        sha(&killed.join("last.safetensors")),
        "final weights differ"
    );
    assert_eq!(
        sha(&whole.join("best.safetensors")),
        sha(&killed.join("best.safetensors"))
    );
    let lines = std::fs::read_to_string(killed.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .count();
    assert_eq!(lines, 60);
}

fn fit_err(args: &[&str], cache: &str) -> String {
    let out = tempfile::tempdir().unwrap();
    let mut a = vec![
        "fit",
        "--epochs",
        "1",
        "--cache",
        cache,
        "--out",
        out.path().to_str().unwrap(),
    ];
    a.extend(args);
    let o = run("trainer", &a);
    assert!(!o.status.success(), "expected failure for {args:?}");
    let e = stderr(&o);
    assert!(!e.contains("panicked"), "{e}");
    e
}

#[test]
fn bad_tables_fail_clearly() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let cache = cache.to_str().unwrap();
    let lfw = PathBuf::from(lfw());

    // A corrupt image: fails naming it; --skip-invalid skips it and says so.
    let table = tmp.path().join("corrupt");
    copy_dir(&lfw, &table);
    std::fs::write(table.join("face/007.png"), b"\x89PNG\r\n\x1a\n garbage").unwrap();
    let e = fit_err(&["--data", table.to_str().unwrap()], cache);
    assert!(
        e.contains("face/007.png") && e.contains("--skip-invalid"),
        "{e}"
    );
    let (s, log) = fit(
        &[
            "--data",
            table.to_str().unwrap(),
            "--cache",
            cache,
            "--epochs",
            "2",
            "--skip-invalid",
        ],
        &tmp.path().join("skip"),
    );
    assert!(
        log.contains("1 invalid skipped") && log.contains("face/007.png"),
        "{log}"
    );
    assert!(s["val_accuracy"].as_f64().unwrap() > 0.9);

    // An empty class directory.
    let empty = tmp.path().join("empty-class");
    copy_dir(&lfw, &empty);
    std::fs::create_dir_all(empty.join("zebra")).unwrap();
    let e = fit_err(&["--data", empty.to_str().unwrap()], cache);
    assert!(e.contains("zebra"), "{e}");

    // An unknown label column.
    let e = fit_err(
        &[
            "--data",
            &dataset("lfw", "manifest.csv"),
            "--label-column",
            "species",
        ],
        cache,
    );
    assert!(e.contains("species") && e.contains("label"), "{e}");
    let e = fit_err(
        &[
            "--data",
            &dataset("lfw", "lfw.parquet"),
            "--label-column",
            "species",
        ],
        cache,
    );
    assert!(e.contains("species"), "{e}");

    // A Parquet file without the content column.
    let no_content = tmp.path().join("no-content.parquet");
    python(
        "import pyarrow as pa, pyarrow.parquet as pq, sys; \
         pq.write_table(pa.table({'path': ['a.png'], 'label': ['x']}), sys.argv[1])",
        &[&no_content],
    );
    let e = fit_err(&["--data", no_content.to_str().unwrap()], cache);
    assert!(
        e.contains("content") && e.contains("no-content.parquet"),
        "{e}"
    );
}

#[test]
fn unfrozen_blocks_and_augmentation_train() {
    let tmp = tempfile::tempdir().unwrap();
    let data = lfw();
    let run = tmp.path().join("unfreeze");
    let (s, log) = fit(
        &["--data", &data, "--epochs", "3", "--unfreeze-last", "1"],
        &run,
    );
    assert!(log.contains("boundary 17/18 dims [320, 7, 7]"), "{log}");
    assert!(s["val_accuracy"].as_f64().unwrap() >= 0.95);
    let w = kestrel_models::torch::read_safetensors(&run.join("best.safetensors")).unwrap();
    let head = &w["head.conv.weight"];
    assert_eq!(head.shape, vec![1280, 320, 1, 1]);
    // The unfrozen block moved away from its pretrained (BN-folded) value.
    let pretrained =
        kestrel_models::backbone::Backbone::resolve("efficientnet-lite0", None).unwrap();
    let folded = pretrained.folded().unwrap();
    let before = &folded[folded.len() - 1].weight;
    assert!(before.max_abs_diff(head).unwrap() > 1e-6);

    let (s, log) = fit(
        &["--data", &data, "--epochs", "2", "--augment", "flip,crop"],
        &tmp.path().join("augment"),
    );
    assert!(s["val_accuracy"].as_f64().unwrap() >= 0.95);
    assert!(log.contains("dims [1280]"), "{log}");
}
