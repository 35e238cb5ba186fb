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

/// The head's optimum on each run's split and features: scikit-learn's cross-validated L2
/// logistic regression on standardized features (`scripts/head-reference.py`), by run directory.
fn head_optimum(features_cache: &str, runs: &[PathBuf]) -> Vec<f64> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/head-reference.py");
    let o = Command::new(kestrel_tests::fetched("venv/bin/python"))
        .arg(script)
        .arg(features_cache)
        .args(runs)
        .output()
        .unwrap();
    assert!(o.status.success(), "head-reference.py: {}", stderr(&o));
    kestrel_tests::json_lines(&o)
        .iter()
        .map(|v| v["val_accuracy"].as_f64().unwrap())
        .collect()
}

/// Default flags reach the head's optimum: on LFW and digits, through ImageFolder, CSV and Parquet
/// (which must give the same weights), validation accuracy within 1 point of scikit-learn's on the
/// same split and features (LFW: within one of its 40 validation images).
///
/// One seed proves it (a head short of the optimum, or a source that reads other rows or labels,
/// fails on any seed); the five-seed figures (min and mean against scikit-learn's) come from
/// `scripts/bench.sh`'s "Accuracy over seeds" section.
#[test]
fn default_head_reaches_the_optimum_through_every_source() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, forms, tolerance) in [
        ("lfw", ["imagefolder", "manifest.csv", "lfw.parquet"], 0.026),
        (
            "digits",
            ["imagefolder", "manifest.csv", "digits.parquet"],
            0.01,
        ),
    ] {
        let prep = trainer_json(&["prepare", "--json", "--data", &dataset(name, forms[0])]);
        let cache = prep["features_cache"].as_str().unwrap().to_string();
        let (mut ours, mut runs) = (Vec::new(), Vec::new());
        for seed in ["1"] {
            let mut weights = Vec::new();
            for form in forms {
                let out = tmp.path().join(format!("{name}-{form}-{seed}"));
                let (s, _) = fit(&["--data", &dataset(name, form), "--seed", seed], &out);
                assert_eq!(s["head"]["l2_from"], "cross-validation (5 folds)", "{s}");
                if form == forms[0] {
                    ours.push(s["val_accuracy"].as_f64().unwrap());
                    runs.push(out.clone());
                }
                weights.push(sha(&out.join("best.safetensors")));
            }
            assert!(
                weights.iter().all(|w| *w == weights[0]),
                "{name} seed {seed}: sources gave different weights"
            );
            // Asking for more epochs leaves the head to its solver (it once switched to SGD:
            // 0.866 on digits against 0.95), and says the flag is unused.
            let out = tmp.path().join(format!("{name}-epochs-{seed}"));
            let data = dataset(name, forms[0]);
            let (s, log) = fit(&["--data", &data, "--seed", seed, "--epochs", "15"], &out);
            assert_eq!(s["val_accuracy"].as_f64(), ours.last().copied(), "{s}");
            assert_eq!(
                sha(&out.join("best.safetensors")),
                weights[0],
                "{name}: --epochs 15"
            );
            assert!(log.contains("--epochs train sgd or adamw"), "{log}");
        }
        let optimum = head_optimum(&cache, &runs);
        eprintln!("{name}: default head val accuracy {ours:?}; scikit-learn's optimum {optimum:?}");
        for (seed, (a, b)) in ours.iter().zip(&optimum).enumerate() {
            assert!(
                *a >= b - tolerance,
                "{name} seed {}: val accuracy {a} vs the optimum {b}",
                seed + 1
            );
        }
        if name == "lfw" {
            // The standardized head, folded into the saved layer, exports like any other.
            crate::export::three_forms_pass_the_gates(name, 2, &runs[0], tmp.path(), 1.0);
        }
    }
}

#[test]
fn second_fit_does_no_backbone_work_and_run_dir_is_complete() {
    let tmp = tempfile::tempdir().unwrap();
    let data = lfw();
    let cache = tmp.path().join("cache");
    let cache = cache.to_str().unwrap();
    let (first, _) = fit(
        &[
            "--data",
            &data,
            "--cache",
            cache,
            "--optimizer",
            "sgd",
            "--epochs",
            "3",
        ],
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
        "--optimizer",
        "sgd",
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
            "--optimizer",
            "sgd",
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
        &[
            "--data",
            &data,
            "--optimizer",
            "sgd",
            "--epochs",
            "2",
            "--augment",
            "flip,crop",
        ],
        &tmp.path().join("augment"),
    );
    assert!(s["val_accuracy"].as_f64().unwrap() >= 0.95);
    assert!(log.contains("dims [1280]"), "{log}");
}

/// VmHWM (peak RSS) of a running process, in MB; `None` once it has exited (a zombie's status
/// has no memory lines).
fn peak_rss_mb(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: f64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

/// `trainer fit --json --out RUN ARGS...` watched while it runs: the summary, the log, the peak
/// RSS in MB read from /proc at every epoch line while the process runs, and the whole run's
/// peak RSS (from `wait4`, so the last epochs count even when their lines are read after exit).
fn fit_watching_rss(args: &[&str], run: &Path) -> (Value, String, Vec<Option<f64>>, f64) {
    use std::io::{BufRead, BufReader, Read};
    let mut child = Command::new(bin("trainer"))
        .args(["fit", "--json", "--out", run.to_str().unwrap()])
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut out = Vec::new();
        stdout.read_to_end(&mut out).unwrap();
        out
    });
    let mut at_epoch = Vec::new();
    let mut log = String::new();
    for line in BufReader::new(child.stderr.take().unwrap()).lines() {
        let line = line.unwrap();
        if line.starts_with("epoch ") {
            at_epoch.push(peak_rss_mb(pid));
        }
        log.push_str(&line);
        log.push('\n');
    }
    let (mut status, mut usage) = (0, unsafe { std::mem::zeroed::<libc::rusage>() });
    // SAFETY: `pid` is this process's child, not yet reaped (`child` is never waited on).
    let reaped = unsafe { libc::wait4(pid as libc::pid_t, &mut status, 0, &mut usage) };
    assert_eq!(reaped, pid as libc::pid_t, "wait4");
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{log}"
    );
    let out = reader.join().unwrap();
    let summary = serde_json::from_slice(&out).unwrap();
    (summary, log, at_epoch, usage.ru_maxrss as f64 / 1024.0)
}

/// `--fine-tune 2 --epochs 5` on digits with default flags otherwise: the head first (its
/// accuracy recorded), then the last two blocks move; validation accuracy above scikit-learn's
/// head optimum on the same split and (head-only) features, and 0.95 or more; memory stays flat
/// from epoch 2 to the end (a leak, as the old ~450 MB per epoch, raises the peak epoch after
/// epoch) and under 2 GB; the fine-tuned run exports in all three forms.
///
/// One seed (a fine-tune that does not beat the head, or leaks, fails on it) and five epochs
/// instead of the default ten (about 14 s each on 2 cores): three after epoch 2 show a leak, and
/// digits passes the head's optimum within three. The five-seed, default-epoch figures and the
/// memory by epoch come from `scripts/bench.sh` ("Accuracy over seeds").
#[test]
fn fine_tune_beats_the_head_optimum_with_flat_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset("digits", "imagefolder");
    let prep = trainer_json(&["prepare", "--json", "--data", &data]);
    let cache = prep["features_cache"].as_str().unwrap().to_string();
    let run = tmp.path().join("ft-1");
    let (s, log, at_epoch, peak) = fit_watching_rss(
        &[
            "--data",
            &data,
            "--seed",
            "1",
            "--fine-tune",
            "2",
            "--epochs",
            "5",
        ],
        &run,
    );
    assert!(log.contains("fine-tune stage 1: head alone"), "{log}");
    assert_eq!(read_json(&run.join("params.json"))["head_first"], true);
    assert!(s["head_val_accuracy"].as_f64().unwrap() >= 0.9, "{s}");
    eprintln!("fine-tune peak RSS by epoch (MB): {at_epoch:?}, whole run {peak:.0}");
    assert!(at_epoch.len() >= 4, "{log}");
    let peak2 = at_epoch[1].expect("the run ended at its second epoch");
    assert!(
        peak <= peak2 * 1.05 + 30.0,
        "peak RSS grew from {peak2} MB at epoch 2 to {peak} MB"
    );
    assert!(peak < 2048.0, "peak RSS {peak} MB");
    let w = kestrel_models::torch::read_safetensors(&run.join("best.safetensors")).unwrap();
    let pretrained =
        kestrel_models::backbone::Backbone::resolve("efficientnet-lite0", None).unwrap();
    let folded = pretrained.folded().unwrap();
    let moved = folded[folded.len() - 1]
        .weight
        .max_abs_diff(&w["head.conv.weight"])
        .unwrap();
    assert!(moved > 1e-6, "the head conv did not train");
    let ours = s["val_accuracy"].as_f64().unwrap();
    let optimum = head_optimum(&cache, std::slice::from_ref(&run))[0];
    eprintln!("digits --fine-tune 2: val accuracy {ours}; head optimum {optimum}");
    assert!(
        ours > optimum,
        "fine-tuned {ours} vs the head's optimum {optimum}"
    );
    assert!(ours >= 0.95, "val accuracy {ours}");
    // A fine-tuned run (blocks and a standardized head) exports like any other, within 2 points:
    // its static int8 form lost 1.11 points in ONNX Runtime (4 of 359 images; tract 0.56) on
    // 2026-12-02, over the default gate of 1 (the README's quantization notes say so).
    crate::export::three_forms_pass_the_gates("digits", 10, &run, tmp.path(), 2.0);
}

/// `--class-weights balanced` and `--label-smoothing` reach the solved head (recorded, and a
/// different solution from the plain one, still accurate); the table names the confused pairs.
#[test]
fn class_weights_and_label_smoothing_change_the_head() {
    let tmp = tempfile::tempdir().unwrap();
    let data = lfw();
    let (plain, _) = fit(&["--data", &data, "--l2", "0.1"], &tmp.path().join("plain"));
    let run = tmp.path().join("weighted");
    let (s, _) = fit(
        &[
            "--data",
            &data,
            "--l2",
            "0.1",
            "--class-weights",
            "balanced",
            "--label-smoothing",
            "0.1",
        ],
        &run,
    );
    let p = read_json(&run.join("params.json"));
    assert_eq!(p["class_weights"], "balanced");
    assert_eq!(p["label_smoothing"], 0.1);
    assert_eq!(s["head"]["l2_from"], "--l2");
    assert!(s["val_accuracy"].as_f64().unwrap() >= 0.95, "{s}");
    assert_ne!(
        sha(&run.join("best.safetensors")),
        sha(&tmp.path().join("plain").join("best.safetensors"))
    );
    assert!(plain["validation"]["most_confused"].is_array(), "{plain}");
    let bad = run_fails_text(&[
        "fit",
        "--data",
        &data,
        "--label-smoothing",
        "1.5",
        "--out",
        tmp.path().join("x").to_str().unwrap(),
    ]);
    assert!(bad.contains("--label-smoothing"), "{bad}");
}

fn run_fails_text(args: &[&str]) -> String {
    stderr(&kestrel_tests::run_fails("trainer", args))
}

/// Retraining on old + new data (`--data OLD --data NEW`): one label set, the feature rows of the
/// old table copied from its cache by content, so the backbone runs on the new images only
/// (counted in the log and summary.json); unlabelled rows are left out with `--skip-unlabelled`;
/// `--init-from` starts the head from the first run's; the combined set is then a cache hit.
#[test]
fn retraining_on_old_and_new_tables_runs_the_backbone_on_new_rows_only() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let cache = cache.to_str().unwrap();
    let lfw = PathBuf::from(lfw());
    let old = tmp.path().join("old");
    kestrel_tests::table_subset(&lfw, &old, 30);
    // The new table: a CSV of 3 unseen images per class, one image of the old table again (same
    // bytes: no backbone run) and one unseen image not labelled yet.
    let new = tmp.path().join("new");
    let mut csv = String::from("path,label\n");
    for class in ["face", "nonface"] {
        let mut files: Vec<PathBuf> = std::fs::read_dir(lfw.join(class))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        std::fs::create_dir_all(new.join(class)).unwrap();
        for f in &files[30..33] {
            let name = f.file_name().unwrap().to_str().unwrap();
            std::fs::copy(f, new.join(class).join(name)).unwrap();
            csv += &format!("{class}/{name},{class}\n");
        }
        if class == "face" {
            std::fs::copy(&files[0], new.join("again.png")).unwrap();
            csv += "again.png,face\n";
            std::fs::copy(&files[40], new.join("todo.png")).unwrap();
            csv += "todo.png,\n";
        }
    }
    std::fs::write(new.join("manifest.csv"), csv).unwrap();
    let (old_s, new_s) = (old.to_str().unwrap(), new.join("manifest.csv"));
    let new_s = new_s.to_str().unwrap();

    let (first, _) = fit(&["--data", old_s, "--cache", cache], &tmp.path().join("v1"));
    assert_eq!(
        (
            first["backbone_runs"].as_u64(),
            first["features_reused"].as_u64()
        ),
        (Some(60), Some(0))
    );

    // Without --skip-unlabelled the unlabelled row fails the run, naming the flag.
    let e = fit_err(&["--data", old_s, "--data", new_s], cache);
    assert!(e.contains("todo") || e.contains("label"), "{e}");
    assert!(e.contains("--skip-unlabelled"), "{e}");

    let v1 = tmp.path().join("v1");
    let both = [
        "--data",
        old_s,
        "--data",
        new_s,
        "--cache",
        cache,
        "--skip-unlabelled",
    ];
    let mut args = both.to_vec();
    args.extend(["--init-from", v1.to_str().unwrap()]);
    let (second, log) = fit(&args, &tmp.path().join("v2"));
    eprintln!("{log}");
    assert_eq!(second["backbone_runs"], 6, "only the new images: {log}");
    assert_eq!(second["features_reused"], 61, "{log}");
    assert_eq!(second["unlabelled_skipped"], 1, "{log}");
    assert!(
        log.contains("backbone runs: 6 (61 rows reused from other feature caches"),
        "{log}"
    );
    assert!(log.contains("1 unlabelled rows skipped from csv"), "{log}");
    assert!(
        log.contains("init: head from") && log.contains("2 of 2 classes"),
        "{log}"
    );
    assert_eq!(second["init"]["matched"], 2, "{second}");
    assert_eq!(second["labels"], serde_json::json!(["face", "nonface"]));
    assert!(second["val_accuracy"].as_f64().unwrap() >= 0.9, "{second}");
    let params = read_json(&tmp.path().join("v2/params.json"));
    assert_eq!(params["data"], old_s);
    assert_eq!(params["more_data"], serde_json::json!([new_s]));
    assert_eq!(params["source"]["skip_unlabelled"], true);
    assert_eq!(params["init_from"], v1.to_str().unwrap());

    // The same two tables again: the combined feature cache is hit.
    let (third, log) = fit(&both, &tmp.path().join("v3"));
    assert_eq!(third["backbone_runs"], 0, "{log}");
    assert_eq!(third["features_reused"], 67, "{log}");
    assert!(log.contains("backbone runs: 0 (cache hit)"), "{log}");

    // A command that reads one table says so.
    let e = run_fails_text(&[
        "evaluate",
        "--run",
        v1.to_str().unwrap(),
        "--data",
        old_s,
        "--data",
        new_s,
    ]);
    assert!(e.contains("reads one table"), "{e}");
    // --init-from a directory that is no run.
    let e = fit_err(&["--data", old_s, "--init-from", cache], cache);
    assert!(
        e.contains("--init-from") && e.contains("best.safetensors"),
        "{e}"
    );
}
