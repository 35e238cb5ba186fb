//! `trainer tune`: TPE over parallel trials on the real LFW subset, reading one feature cache.

use std::path::{Path, PathBuf};
use std::time::Instant;

use kestrel_tests::{Scratch, lfw, read_json, read_jsonl, run, run_ok, stderr, stdout};
use serde_json::Value;

/// The hyperparameters of a trial.
const PARAMS: [&str; 6] = [
    "lr",
    "momentum",
    "weight_decay",
    "batch_size",
    "optimizer",
    "epochs",
];

/// `trainer tune --data LFW --engine ort EXTRA...` into `out` in the scratch directory, with its
/// cache; returns the output directory, stdout and the log.
fn tune(w: &Scratch, extra: &[&str], out: &str) -> (PathBuf, String, String) {
    let (data, dir) = (lfw(), w.join(out));
    let mut a = vec![
        "tune",
        "--data",
        &data,
        "--engine",
        "ort",
        "--cache",
        w.cache.to_str().unwrap(),
        "--out",
        dir.to_str().unwrap(),
    ];
    a.extend(extra);
    let o = run_ok("trainer", &a);
    (dir, stdout(&o), stderr(&o))
}

fn trials(dir: &Path) -> Vec<Value> {
    read_jsonl(&dir.join("trials.jsonl"))
}

#[test]
fn fifty_parallel_trials_find_an_accurate_head_and_fit_it() {
    let w = Scratch::new();
    let run_dir = w.join("final");
    let t = Instant::now();
    let (out, json, log) = tune(
        &w,
        &[
            "--trials",
            "50",
            "--parallel",
            "2",
            "--seed",
            "11",
            "--json",
            "--then-fit",
            run_dir.to_str().unwrap(),
        ],
        "tune",
    );
    eprintln!(
        "tune --trials 50 --parallel 2 (with feature extraction and --then-fit): {:?}",
        t.elapsed()
    );
    assert_eq!(
        log.matches("backbone runs: 200").count(),
        1,
        "features once: {log}"
    );
    let v: Value = serde_json::from_str(&json).unwrap();
    let best = &v["best"];
    let acc = best["val_accuracy"].as_f64().unwrap();
    assert!(acc >= 0.95, "best val accuracy {acc}");
    let all = trials(&out);
    assert_eq!(all.len(), 50);
    assert_eq!(
        all.iter().filter(|t| t["source"] == "random").count(),
        10,
        "10 random warm-up trials, then TPE"
    );
    for (i, t) in all.iter().enumerate() {
        assert_eq!(t["trial"], i);
        for k in PARAMS {
            assert!(!t["params"][k].is_null(), "{t}");
        }
        assert!(t["seconds"].as_f64().unwrap() > 0.0);
    }
    // Sorted output, best first, and best.json is the first.
    let sorted = v["trials"].as_array().unwrap();
    assert_eq!(sorted.len(), 50);
    assert_eq!(&sorted[0], best);
    let best_file = read_json(&out.join("best.json"));
    assert_eq!(&best_file, best);
    let losses: Vec<f64> = sorted
        .iter()
        .map(|t| t["val_loss"].as_f64().unwrap_or(f64::INFINITY))
        .collect();
    assert!(losses.windows(2).all(|w| w[0] <= w[1]), "{losses:?}");
    // --then-fit trained the best parameters into a run directory.
    let params = read_json(&run_dir.join("params.json"));
    for k in PARAMS {
        assert_eq!(params[k], best["params"][k], "{k}");
    }
    assert!(v["then_fit"]["val_accuracy"].as_f64().unwrap() >= 0.95);
    assert!(run_dir.join("best.safetensors").exists());
}

#[test]
fn the_same_seed_gives_the_same_trials() {
    let w = Scratch::new();
    let args = [
        "--trials",
        "16",
        "--parallel",
        "2",
        "--startup",
        "6",
        "--seed",
        "5",
    ];
    let (a_dir, table, _) = tune(&w, &args, "a");
    assert!(table.starts_with("rank trial source"), "{table}");
    assert_eq!(table.lines().count(), 17, "{table}");
    let (b_dir, _, log) = tune(&w, &args, "b");
    assert!(log.contains("backbone runs: 0 (cache hit)"), "{log}");
    let params =
        |d: &Path| -> Vec<Value> { trials(d).iter().map(|t| t["params"].clone()).collect() };
    assert_eq!(params(&a_dir), params(&b_dir));
    let mut other = args.to_vec();
    other[7] = "6";
    let (c_dir, _, _) = tune(&w, &other, "c");
    assert_ne!(
        params(&a_dir),
        params(&c_dir),
        "another seed, another search"
    );
}

#[test]
fn a_space_file_bounds_the_search_and_bad_spaces_fail() {
    let w = Scratch::new();
    let space = w.join("space.toml");
    std::fs::write(
        &space,
        "lr = [0.001, 0.01]\nbatch_size = [8]\noptimizer = [\"adamw\"]\nepochs = [2, 3]\n",
    )
    .unwrap();
    let (out, _, _) = tune(
        &w,
        &[
            "--trials",
            "12",
            "--parallel",
            "2",
            "--space",
            space.to_str().unwrap(),
        ],
        "t",
    );
    for t in trials(&out) {
        let p = &t["params"];
        let lr = p["lr"].as_f64().unwrap();
        assert!((0.001..=0.01).contains(&lr), "{p}");
        assert_eq!(p["batch_size"], 8);
        assert_eq!(p["optimizer"], "adamw");
        assert!([2, 3].contains(&p["epochs"].as_u64().unwrap()), "{p}");
    }
    std::fs::write(&space, "lr = [0.1, 0.01]\n").unwrap();
    let data = lfw();
    let o = run(
        "trainer",
        &[
            "tune",
            "--data",
            &data,
            "--out",
            out.to_str().unwrap(),
            "--space",
            space.to_str().unwrap(),
        ],
    );
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("lr range [0.1, 0.01]"),
        "{}",
        stderr(&o)
    );
}
