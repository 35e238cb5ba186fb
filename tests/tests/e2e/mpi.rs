//! MPI: `mpirun -np N trainer fit` trains what one worker trains, and a killed, stalled or
//! mismatched rank ends the job with a non-zero exit naming it. Needs the trainer built with
//! `--features kestrel-trainer/mpi` and Open MPI's `mpirun` (scripts/test.sh does both).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use kestrel_tests::{
    bin, export_ok, lfw, max_abs_diff, read_json, read_jsonl, run_ok, stderr, stdout, table_subset,
};

/// Arguments as owned strings (an MPI app context's arguments).
fn owned(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// `mpirun -np N` over one program (each `&[args]` one MPMD app context of one rank when several).
fn mpirun(apps: &[(usize, PathBuf, Vec<String>)]) -> Command {
    let mut c = Command::new("mpirun");
    c.args(["--allow-run-as-root", "--oversubscribe"]);
    for (i, (n, exe, args)) in apps.iter().enumerate() {
        if i > 0 {
            c.arg(":");
        }
        c.args(["-np", &n.to_string()]).arg(exe).args(args);
    }
    c
}

fn fit_args(out: &Path, cache: &Path, extra: &[&str]) -> Vec<String> {
    let mut a = owned(&[
        "fit",
        "--threads",
        "1",
        "--data",
        &lfw(),
        "--engine",
        "ort",
        "--seed",
        "7",
        "--out",
        out.to_str().unwrap(),
        "--cache",
        cache.to_str().unwrap(),
    ]);
    a.extend(owned(extra));
    a
}

fn output(mut c: Command) -> Output {
    c.output()
        .expect("mpirun (install Open MPI: scripts/setup.sh)")
}

#[test]
fn mpi_ranks_train_what_one_worker_trains() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let one = tmp.path().join("one");
    run_ok(
        "trainer",
        &fit_args(&one, &cache, &["--optimizer", "sgd", "--epochs", "10"]),
    );
    for n in [2usize, 3] {
        let dir = tmp.path().join(format!("mpi{n}"));
        let o = output(mpirun(&[(
            n,
            bin("trainer"),
            fit_args(
                &dir,
                &cache,
                &["--optimizer", "sgd", "--epochs", "10", "--json"],
            ),
        )]));
        assert!(o.status.success(), "mpirun -np {n}: {}", stderr(&o));
        // Only rank 0 prints and writes.
        assert_eq!(stdout(&o).lines().count(), 1, "{}", stdout(&o));
        assert!(
            stderr(&o).contains(&format!("{n} ranks (MPI)")),
            "{}",
            stderr(&o)
        );
        for f in ["best.safetensors", "last.safetensors"] {
            let d = max_abs_diff(&one.join(f), &dir.join(f));
            eprintln!("mpirun -np {n} vs 1 worker, {f}: max abs diff {d:e}");
            assert!(d <= 1e-5, "-np {n}: {f} differs by {d}");
        }
        let params = read_json(&dir.join("params.json"));
        assert_eq!(params["workers"], n);
    }
}

/// Pid of MPI rank `rank` among processes whose command line mentions `marker`.
fn rank_pid(rank: usize, marker: &str) -> Option<u32> {
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        if !String::from_utf8_lossy(&cmd).contains(marker)
            || String::from_utf8_lossy(&cmd).starts_with("mpirun")
        {
            continue;
        }
        let env = std::fs::read(e.path().join("environ")).unwrap_or_default();
        let want = format!("OMPI_COMM_WORLD_RANK={rank}");
        if env.split(|b| *b == 0).any(|v| v == want.as_bytes()) {
            return Some(pid);
        }
    }
    None
}

/// Starts a long MPI run, waits until it trains, applies `signal` to rank 1 and returns the
/// job's output (it must end by itself within `limit`).
fn disturb_rank_1(signal: &str, extra: &[&str], limit: Duration) -> (Output, Duration) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let mut args = vec!["--optimizer", "sgd", "--epochs", "1000000"];
    args.extend(extra);
    let mut c = mpirun(&[(
        2,
        bin("trainer"),
        fit_args(&dir, &tmp.path().join("cache"), &args),
    )]);
    let child: Child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun");
    // Training has started when rank 0 wrote its first epoch.
    let t = Instant::now();
    while !dir.join("metrics.jsonl").exists() {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "training never started"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let marker = dir.to_str().unwrap().to_string();
    let pid = rank_pid(1, &marker).expect("rank 1's process");
    let status = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let t = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait_with_output()));
    let out = rx.recv_timeout(limit);
    let waited = t.elapsed();
    // Never leave a stopped rank behind.
    let _ = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .stderr(Stdio::null())
        .status();
    let out = out
        .unwrap_or_else(|_| {
            panic!("the job hung: still running {limit:?} after {signal} on rank 1")
        })
        .unwrap();
    (out, waited)
}

#[test]
fn a_killed_rank_ends_the_job_non_zero_naming_it() {
    let (o, waited) = disturb_rank_1("-KILL", &[], Duration::from_secs(60));
    let all = format!("{}{}", stdout(&o), stderr(&o));
    eprintln!(
        "job ended {waited:?} after SIGKILL on rank 1: {:?}",
        o.status
    );
    assert!(!o.status.success());
    assert!(all.contains("rank 1"), "{all}");
}

#[test]
fn a_stalled_rank_times_out_naming_it() {
    let (o, waited) = disturb_rank_1(
        "-STOP",
        &["--collective-timeout", "3"],
        Duration::from_secs(60),
    );
    let err = stderr(&o);
    eprintln!(
        "job ended {waited:?} after SIGSTOP on rank 1: {:?}",
        o.status
    );
    assert!(!o.status.success());
    assert!(
        err.contains("rank 1 did not receive") || err.contains("rank(s) 1 did not arrive"),
        "{err}"
    );
    assert!(err.contains("--collective-timeout"), "{err}");
}

#[test]
fn mismatched_configs_and_binaries_fail_clearly() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let dir = tmp.path().join("run");
    let o = output(mpirun(&[
        (
            1,
            bin("trainer"),
            fit_args(&dir, &cache, &["--optimizer", "sgd", "--lr", "0.01"]),
        ),
        (
            1,
            bin("trainer"),
            fit_args(&dir, &cache, &["--optimizer", "sgd", "--lr", "0.02"]),
        ),
    ]));
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("training parameters of rank(s) 1 differ from rank 0's"),
        "{}",
        stderr(&o)
    );
    // The same program with one byte more: another build.
    let other = tmp.path().join("trainer-other");
    let mut bytes = std::fs::read(bin("trainer")).unwrap();
    bytes.push(0);
    std::fs::write(&other, bytes).unwrap();
    std::fs::set_permissions(&other, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let o = output(mpirun(&[
        (1, bin("trainer"), fit_args(&dir, &cache, &[])),
        (1, other, fit_args(&dir, &cache, &[])),
    ]));
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("trainer executables (version and sha256) of rank(s) 1 differ"),
        "{}",
        stderr(&o)
    );
    // Fewer samples than ranks: a 2-image table on 3 ranks.
    let small = tmp.path().join("small");
    table_subset(Path::new(&lfw()), &small, 1);
    let mut args = fit_args(&dir, &cache, &["--batch-size", "3"]);
    let at = args.iter().position(|a| a == "--data").unwrap();
    args[at + 1] = small.display().to_string();
    let o = output(mpirun(&[(3, bin("trainer"), args)]));
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("only 2 usable samples for 3 workers"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn tune_and_predict_spread_over_mpi_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let c = cache.to_str().unwrap().to_string();
    let data = lfw();
    let tune_args = |out: &Path, extra: &[&str]| -> Vec<String> {
        let mut a = owned(&[
            "tune",
            "--threads",
            "1",
            "--data",
            &data,
            "--engine",
            "ort",
            "--cache",
            &c,
            "--trials",
            "12",
            "--startup",
            "4",
            "--seed",
            "5",
            "--out",
            out.to_str().unwrap(),
        ]);
        a.extend(owned(extra));
        a
    };
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let final_run = tmp.path().join("final");
    let o = output(mpirun(&[(
        2,
        bin("trainer"),
        tune_args(&a, &["--then-fit", final_run.to_str().unwrap()]),
    )]));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("on each of 2 ranks"), "{}", stderr(&o));
    // Rank 0 alone prints the table (header + 12 trials) and the final model line.
    let table = stdout(&o);
    assert_eq!(table.matches("rank trial source").count(), 1, "{table}");
    assert!(table.contains("final model: val accuracy"), "{table}");
    let o = output(mpirun(&[(2, bin("trainer"), tune_args(&b, &[]))]));
    assert!(o.status.success(), "{}", stderr(&o));
    let params = |d: &Path| -> Vec<serde_json::Value> {
        read_jsonl(&d.join("trials.jsonl"))
            .iter()
            .map(|t| t["params"].clone())
            .collect()
    };
    assert_eq!(params(&a).len(), 12);
    assert_eq!(params(&a), params(&b), "same seed and ranks, same trials");
    let best = read_json(&a.join("best.json"));
    assert!(best["val_accuracy"].as_f64().unwrap() >= 0.95, "{best}");
    let fp = read_json(&final_run.join("params.json"));
    assert_eq!(
        fp["workers"], 2,
        "the final fit ran data-parallel on the ranks"
    );
    assert_eq!(fp["lr"], best["params"]["lr"]);

    // Batch prediction: 2 ranks write what 1 worker writes.
    let art = tmp.path().join("art");
    export_ok(&final_run, &art, &["--cache", &c]);
    let predict = |out: &Path| -> Vec<String> {
        owned(&[
            "predict",
            "--threads",
            "1",
            "--model",
            art.to_str().unwrap(),
            "--data",
            &data,
            "--out",
            out.to_str().unwrap(),
            "--json",
        ])
    };
    let (p1, p2) = (tmp.path().join("p1.parquet"), tmp.path().join("p2.parquet"));
    run_ok("trainer", &predict(&p1));
    let o = output(mpirun(&[(2, bin("trainer"), predict(&p2))]));
    assert!(o.status.success(), "{}", stderr(&o));
    let s: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(s["workers"], 2);
    assert_eq!(s["rows"], 200);
    assert_eq!(
        std::fs::read(&p1).unwrap(),
        std::fs::read(&p2).unwrap(),
        "2 MPI ranks wrote other predictions than 1 worker"
    );
}

#[test]
fn mpi_ranks_extract_the_features_one_worker_extracts() {
    let tmp = tempfile::tempdir().unwrap();
    let prepare = |cache: &Path| -> Vec<String> {
        owned(&[
            "prepare",
            "--threads",
            "1",
            "--json",
            "--engine",
            "ort",
            "--data",
            &lfw(),
            "--cache",
            cache.to_str().unwrap(),
        ])
    };
    let (c1, c2) = (tmp.path().join("c1"), tmp.path().join("c2"));
    let one = kestrel_tests::trainer_json(&prepare(&c1));
    let o = output(mpirun(&[(2, bin("trainer"), prepare(&c2))]));
    assert!(o.status.success(), "{}", stderr(&o));
    let two: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(two["feature_workers"], 2);
    assert_eq!(two["backbone_runs"], 200);
    let f = |v: &serde_json::Value| {
        std::fs::read(Path::new(v["features_cache"].as_str().unwrap()).join("features.f32"))
            .unwrap()
    };
    assert_eq!(
        f(&one),
        f(&two),
        "2 ranks extracted other features than 1 worker"
    );
    // Commands that are not distributed refuse to run as N copies.
    let o = output(mpirun(&[(
        1,
        bin("trainer"),
        vec![
            "keygen".into(),
            "--out".into(),
            tmp.path().join("k").display().to_string(),
        ],
    )]));
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("only prepare, fit, tune and predict run as MPI jobs"),
        "{}",
        stderr(&o)
    );
}
