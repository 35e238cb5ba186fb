//! Data-parallel training: N local workers (threads with allreduce) train exactly what one worker
//! trains with the same global batch and seed, and bad worker counts fail clearly.

use std::path::{Path, PathBuf};
use std::process::Command;

use kestrel_tests::{
    Scratch, bin, copy_dir, export_ok, fetched, kill_after_epochs, lfw, max_abs_diff, python,
    read_json, run, run_ok, stderr, table_subset, trainer_json,
};

/// `trainer fit --json --engine ort ARGS...` into `out` in the scratch directory, with its
/// cache; returns the run directory and the log.
fn fit(w: &Scratch, args: &[&str], out: &str) -> (PathBuf, String) {
    let dir = w.join(out);
    let mut a = vec![
        "fit",
        "--json",
        "--engine",
        "ort",
        "--out",
        dir.to_str().unwrap(),
        "--cache",
        w.cache.to_str().unwrap(),
    ];
    a.extend(args);
    let o = run_ok("trainer", &a);
    (dir, stderr(&o))
}

#[test]
fn workers_train_what_one_worker_trains() {
    let w = Scratch::new();
    let data = lfw();
    let base = [
        "--data",
        &data,
        "--optimizer",
        "sgd",
        "--epochs",
        "10",
        "--seed",
        "7",
        "--batch-size",
        "32",
    ];
    let (one, _) = fit(&w, &base, "w1");
    // 2 workers (parts of 16) and 3 workers (uneven parts 10/11/11 of the same global batch).
    for n in ["2", "3"] {
        let (dir, log) = fit(
            &w,
            &[&base[..], &["--workers", n]].concat(),
            &format!("w{n}"),
        );
        assert!(
            log.contains(&format!("{n} workers: global batch 32")),
            "{log}"
        );
        for f in ["best.safetensors", "last.safetensors"] {
            let d = max_abs_diff(&one.join(f), &dir.join(f));
            eprintln!("--workers {n} vs 1, {f}: max abs diff {d:e}");
            assert!(d <= 1e-5, "--workers {n}: {f} differs by {d}");
        }
        let s = read_json(&dir.join("summary.json"));
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
    let linear = ["--workers", "2", "--lr-scaling", "linear", "--lr", "0.005"];
    let (lin, _) = fit(&w, &[&base[..], &linear].concat(), "linear");
    let d = max_abs_diff(&one.join("last.safetensors"), &lin.join("last.safetensors"));
    eprintln!("--lr-scaling linear, 2 workers at lr 0.005 vs 1 worker at 0.01: {d:e}");
    assert!(d <= 1e-5, "linear scaling: differs by {d}");
}

#[test]
fn augmented_training_splits_the_same_views_over_workers() {
    let w = Scratch::new();
    let data = lfw();
    let base = [
        "--data",
        &data,
        "--optimizer",
        "sgd",
        "--epochs",
        "2",
        "--augment",
        "flip,crop",
        "--seed",
        "3",
    ];
    let (one, _) = fit(&w, &base, "w1");
    let (two, _) = fit(&w, &[&base[..], &["--workers", "2"]].concat(), "w2");
    let d = max_abs_diff(&one.join("last.safetensors"), &two.join("last.safetensors"));
    eprintln!("augmented, --workers 2 vs 1: max abs diff {d:e}");
    assert!(d <= 1e-5, "augmented run differs by {d}");
}

#[test]
fn too_few_samples_or_batch_for_the_workers_fail_clearly() {
    let w = Scratch::new();
    // A 4-image table: two of each class.
    let small = w.join("small");
    table_subset(&fetched("datasets/lfw/imagefolder"), &small, 2);
    let out = w.join("run");
    let fail = |args: &[&str]| {
        let mut a = vec![
            "fit",
            "--engine",
            "ort",
            "--cache",
            w.cache.to_str().unwrap(),
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

/// `trainer prepare --json` with its own cache; returns the JSON.
fn prepare(workers: &str, threads: &str, data: &str, cache: &Path) -> serde_json::Value {
    trainer_json(&[
        "prepare",
        "--threads",
        threads,
        "--json",
        "--engine",
        "ort",
        "--workers",
        workers,
        "--data",
        data,
        "--cache",
        cache.to_str().unwrap(),
    ])
}

fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

#[test]
fn features_extracted_by_two_workers_equal_one_workers() {
    let tmp = tempfile::tempdir().unwrap();
    let data = lfw();
    let one = prepare("1", "1", &data, &tmp.path().join("c1"));
    let two = prepare("2", "2", &data, &tmp.path().join("c2"));
    assert_eq!(one["backbone_runs"], 200);
    assert_eq!(two["backbone_runs"], 200);
    assert_eq!(two["feature_workers"], 2);
    assert_eq!(two["shards"], 2, "one shard per worker at least");
    eprintln!(
        "LFW features: 1 worker {:.2}s, 2 workers {:.2}s",
        one["feature_seconds"].as_f64().unwrap(),
        two["feature_seconds"].as_f64().unwrap()
    );
    let a = read_f32(&Path::new(one["features_cache"].as_str().unwrap()).join("features.f32"));
    let b = read_f32(&Path::new(two["features_cache"].as_str().unwrap()).join("features.f32"));
    assert_eq!(a.len(), 200 * 1280);
    let d = a
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(d <= 1e-5, "features differ by {d}");
}

/// Rows of a Parquet file as JSON objects, read by pyarrow (an independent reader).
fn read_parquet(path: &Path) -> Vec<serde_json::Value> {
    let o = python(
        "import sys, json, pyarrow.parquet as pq; print(json.dumps(pq.read_table(sys.argv[1]).to_pylist()))",
        &[path],
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn batch_prediction_over_workers_matches_evaluate_and_names_bad_rows() {
    let w = Scratch::new();
    let tmp = &w.tmp;
    let data = lfw();
    let (run_dir, _) = fit(
        &w,
        &["--data", &data, "--optimizer", "sgd", "--epochs", "5"],
        "run",
    );
    let art = tmp.path().join("art");
    export_ok(&run_dir, &art, &["--cache", w.cache.to_str().unwrap()]);
    // The table, with one image replaced by garbage.
    let table = tmp.path().join("table");
    copy_dir(Path::new(&data), &table);
    let class = std::fs::read_dir(&table)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let mut files: Vec<_> = std::fs::read_dir(&class)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    std::fs::write(&files[0], b"not an image").unwrap();
    let bad = files[0].display().to_string();

    let predict = |workers: &str, out: &Path| -> serde_json::Value {
        trainer_json(&[
            "predict",
            "--json",
            "--model",
            art.to_str().unwrap(),
            "--data",
            table.to_str().unwrap(),
            "--workers",
            workers,
            "--out",
            out.to_str().unwrap(),
        ])
    };
    let (p1, p2) = (tmp.path().join("p1.parquet"), tmp.path().join("p2.parquet"));
    let s1 = predict("1", &p1);
    let s2 = predict("2", &p2);
    eprintln!("predict: 1 worker {s1}\n         2 workers {s2}");
    assert_eq!(s2["workers"], 2);
    assert_eq!(s1["rows"], 200);
    assert_eq!(s1["errors"], 1);
    let (r1, r2) = (read_parquet(&p1), read_parquet(&p2));
    assert_eq!(
        r1, r2,
        "the same rows in the same order whatever the workers"
    );
    assert_eq!(r1.len(), 200);
    let broken: Vec<_> = r1.iter().filter(|r| !r["error"].is_null()).collect();
    assert_eq!(broken.len(), 1);
    assert_eq!(broken[0]["path"], bad.as_str());
    assert!(broken[0]["prediction"].is_null());
    // Predictions agree with `trainer evaluate --model` on the intact table.
    let e = trainer_json(&[
        "evaluate",
        "--json",
        "--model",
        art.to_str().unwrap(),
        "--data",
        &data,
        "--cache",
        w.cache.to_str().unwrap(),
    ]);
    let correct = r1.iter().filter(|r| r["prediction"] == r["label"]).count();
    let eval_correct = (e["accuracy"].as_f64().unwrap() * 200.0).round() as usize;
    // The garbage row cannot be right; every other row is classified as evaluate classifies it.
    assert!(
        correct == eval_correct || correct + 1 == eval_correct,
        "predict {correct} correct, evaluate {eval_correct}"
    );
    assert!(
        r1.iter()
            .all(|r| r["error"].is_null() != r["score"].is_null())
    );
}

/// A trainer built without MPI refuses to run as N uncoordinated copies under mpirun.
#[cfg(not(feature = "mpi"))]
#[test]
fn a_build_without_mpi_says_so_under_an_mpi_launcher() {
    let tmp = tempfile::tempdir().unwrap();
    let o = Command::new(bin("trainer"))
        .args([
            "fit",
            "--data",
            &lfw(),
            "--out",
            tmp.path().join("run").to_str().unwrap(),
        ])
        .env("OMPI_COMM_WORLD_SIZE", "2")
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("built without MPI: rebuild with"),
        "{}",
        stderr(&o)
    );
}

/// Resuming a killed 2-worker run: rank 0 reads the checkpoint (weights, AdamW state, history) and
/// broadcasts it; the result is byte-identical to an uninterrupted 2-worker run.
#[test]
fn a_killed_two_worker_run_resumes_to_identical_weights() {
    let w = Scratch::new();
    let data = lfw();
    let args = [
        "--data",
        &data,
        "--epochs",
        "40",
        "--batch-size",
        "4",
        "--workers",
        "2",
        "--lr",
        "0.001",
        "--optimizer",
        "adamw",
        "--weight-decay",
        "0.01",
    ];
    let (whole, _) = fit(&w, &args, "whole");

    let killed = w.join("killed");
    let mut cmd = Command::new(bin("trainer"));
    cmd.args([
        "fit",
        "--engine",
        "ort",
        "--cache",
        w.cache.to_str().unwrap(),
    ])
    .args(["--out", killed.to_str().unwrap()])
    .args(args);
    let done = kill_after_epochs(&mut cmd, &killed, 4);
    assert!(done < 40, "the run finished before the kill");
    eprintln!("2-worker run killed after {done} epochs");
    let o = run_ok(
        "trainer",
        &[
            "fit",
            "--resume",
            killed.to_str().unwrap(),
            "--cache",
            w.cache.to_str().unwrap(),
        ],
    );
    assert!(
        stderr(&o).contains("resuming after epoch"),
        "{}",
        stderr(&o)
    );
    assert!(stderr(&o).contains("2 workers"), "{}", stderr(&o));
    for f in ["last.safetensors", "best.safetensors"] {
        assert_eq!(
            std::fs::read(whole.join(f)).unwrap(),
            std::fs::read(killed.join(f)).unwrap(),
            "{f} differs after resume"
        );
    }
}

/// `--execution-provider cuda` asks ONNX Runtime for its CUDA execution provider (loaded at run time). The
/// CPU-only library set up here lacks it: the run must fail naming the missing provider library and
/// how to get it (with an onnxruntime-gpu library and a GPU it would run).
#[test]
fn execution_provider_cuda_uses_or_clearly_misses_the_cuda_provider() {
    let tmp = tempfile::tempdir().unwrap();
    let o = run(
        "trainer",
        &[
            "prepare",
            "--execution-provider",
            "cuda",
            "--engine",
            "ort",
            "--data",
            &lfw(),
            "--cache",
            tmp.path().to_str().unwrap(),
        ],
    );
    let e = stderr(&o);
    let lib = std::env::var("ORT_DYLIB_PATH").expect("the test command sets ORT_DYLIB_PATH");
    if !Path::new(&lib)
        .with_file_name("libonnxruntime_providers_cuda.so")
        .exists()
    {
        assert!(
            !o.status.success(),
            "prepared on CUDA without a CUDA provider"
        );
        assert!(
            e.contains("libonnxruntime_providers_cuda.so is missing")
                && e.contains(&lib)
                && e.contains("scripts/setup-cuda.sh --runtime"),
            "{e}"
        );
    } else if !o.status.success() {
        assert!(
            e.contains("--execution-provider cuda: the CUDA execution provider is unavailable"),
            "{e}"
        );
    }
}

/// `fit --compute-device` takes cpu, cuda or cuda:N; a trainer built without the `cuda` feature (the
/// default build, as here) refuses a GPU before any work, naming the flag and how to build one,
/// and a word that is no device is refused by the parser.
#[test]
fn compute_device_cuda_is_refused_clearly_without_cuda() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let fit = |device: &str| {
        run(
            "trainer",
            &[
                "fit",
                "--data",
                &lfw(),
                "--cache",
                cache.to_str().unwrap(),
                "--out",
                tmp.path().join("run").to_str().unwrap(),
                "--fine-tune",
                "1",
                "--epochs",
                "1",
                "--compute-device",
                device,
            ],
        )
    };
    let o = fit("cuda:0");
    assert!(!o.status.success(), "fine-tuned on cuda:0 without CUDA");
    let e = stderr(&o);
    assert!(
        e.contains("--compute-device cuda:0: this trainer was built without CUDA")
            && e.contains("--features kestrel-trainer/cuda")
            || e.contains("--compute-device cuda:0: GPU 0"),
        "{e}"
    );
    assert!(
        !cache.exists(),
        "the refusal came after work: {cache:?} exists"
    );
    let o = fit("tpu");
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("`tpu` is not a device: cpu, cuda or cuda:N"),
        "{}",
        stderr(&o)
    );
}
