//! Tables written by other tools: Parquet with every codec pyarrow writes, Hive-partitioned
//! directories (pyarrow's `partition_cols`), and Delta tables written by delta-rs (with the Delta
//! kernel's diagnostics under `RUST_LOG`).

use std::path::Path;

use kestrel_tests::{fetched, python, run, s, stderr, trainer_json};
use serde_json::Value;

/// `trainer prepare --json` on `data` with the shared cache `cache`.
fn prepare(data: &Path, cache: &Path) -> Value {
    prepare_with(data, cache, &[])
}

/// `trainer prepare --json ... EXTRA...`.
fn prepare_with(data: &Path, cache: &Path, extra: &[&str]) -> Value {
    let (data, cache) = (s(data), s(cache));
    let mut args = vec![
        "prepare", "--json", "--engine", "ort", "--data", &data, "--cache", &cache,
    ];
    args.extend(extra);
    trainer_json(&args)
}

/// The LFW table rewritten by pyarrow with snappy, gzip, zstd, lz4, brotli and none, and as a
/// `label`-partitioned directory: every form loads to the same samples (the same sample-cache key,
/// so the later forms reuse the first's cache), and a fit on the partitioned form equals a fit
/// on the original file.
#[test]
fn pyarrow_codecs_and_hive_partitions_load_and_train_alike() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fetched("datasets/lfw/lfw.parquet");
    let codecs = ["snappy", "gzip", "zstd", "lz4", "brotli", "none"];
    python(
        "import sys, pyarrow.parquet as pq\n\
         src, out = sys.argv[1], sys.argv[2]\n\
         t = pq.read_table(src)\n\
         for c in sys.argv[3:]:\n\
         \x20   pq.write_table(t, f'{out}/lfw-{c}.parquet', compression=c, row_group_size=50)\n\
         pq.write_to_dataset(t, f'{out}/hive', partition_cols=['label'], compression='zstd')\n",
        &[&s(&src), &s(tmp.path())]
            .into_iter()
            .map(String::from)
            .chain(codecs.iter().map(|c| c.to_string()))
            .collect::<Vec<_>>(),
    );
    assert!(tmp.path().join("hive/label=face").is_dir());
    let cache = tmp.path().join("cache");
    let first = prepare(&src, &cache);
    assert_eq!(first["samples"], 200);
    let forms = codecs
        .iter()
        .map(|c| tmp.path().join(format!("lfw-{c}.parquet")))
        .chain([tmp.path().join("hive")]);
    for data in forms {
        let v = prepare(&data, &cache);
        assert_eq!(v["samples"], 200, "{}", data.display());
        assert_eq!(v["labels"], first["labels"], "{}", data.display());
        assert_eq!(
            v["samples_cache"],
            first["samples_cache"],
            "{}",
            data.display()
        );
        assert_eq!(v["samples_cache_reused"], true, "{}", data.display());
    }

    let fit = |data: &Path, out: &str| -> Value {
        let out = tmp.path().join(out);
        let args = [
            "fit",
            "--data",
            &s(data),
            "--cache",
            &s(&cache),
            "--out",
            &s(&out),
        ];
        kestrel_tests::run_ok("trainer", &args);
        kestrel_tests::read_json(&out.join("summary.json"))
    };
    let a = fit(&src, "run-file");
    let b = fit(&tmp.path().join("hive"), "run-hive");
    assert_eq!(a["val_accuracy"], b["val_accuracy"]);
    assert!(a["val_accuracy"].as_f64().unwrap() >= 0.9, "{a}");
}

/// Delta tables written by delta-rs (the `deltalake` Python package): created from the LFW
/// table, overwritten with a subset, then some rows deleted. Kestrel trains on exactly the rows
/// `deltalake` reads now, `--data-version 0` on the original rows, a `label`-partitioned table
/// like the plain file, and a table needing a reader feature the kernel lacks fails naming it.
#[test]
fn delta_tables_read_the_current_snapshot_and_travel_in_time() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fetched("datasets/lfw/lfw.parquet");
    let out = python(
        "import sys, json, pyarrow.parquet as pq\n\
         from deltalake import DeltaTable, write_deltalake\n\
         src, out = sys.argv[1], sys.argv[2]\n\
         t = pq.read_table(src)\n\
         write_deltalake(f'{out}/delta', t)\n\
         write_deltalake(f'{out}/delta', t.slice(0, 150), mode='overwrite')\n\
         gone = sorted(t.slice(0, 150).column('path').to_pylist())[:12]\n\
         DeltaTable(f'{out}/delta').delete('path IN (' + ','.join(repr(p) for p in gone) + ')')\n\
         write_deltalake(f'{out}/delta_part', t, partition_by=['label'])\n\
         write_deltalake(f'{out}/delta_future', t.slice(0, 4))\n\
         dt = DeltaTable(f'{out}/delta')\n\
         print(json.dumps({'version': dt.version(), 'paths': sorted(dt.to_pyarrow_table(columns=['path']).column('path').to_pylist())}))\n",
        &[s(&src), s(tmp.path())],
    );
    let want: Value = serde_json::from_str(kestrel_tests::stdout(&out).trim()).unwrap();
    let want_paths = want["paths"].as_array().unwrap().clone();
    assert_eq!(want_paths.len(), 138);
    let cache = tmp.path().join("cache");
    let ids = |v: &Value| -> Vec<Value> {
        let meta = kestrel_tests::read_json(
            &Path::new(v["samples_cache"].as_str().unwrap()).join("meta.json"),
        );
        let mut ids = meta["ids"].as_array().unwrap().clone();
        ids.sort_by(|a, b| a.as_str().cmp(&b.as_str()));
        ids
    };
    let delta = tmp.path().join("delta");
    let now = prepare(&delta, &cache);
    assert_eq!(now["samples"], 138);
    assert_eq!(ids(&now), want_paths);
    // RUST_LOG surfaces the Delta kernel's own diagnostics, named by their target; by default
    // a library speaks only from warnings up.
    for (rust_log, shown) in [("debug", true), ("", false)] {
        let o = std::process::Command::new(kestrel_tests::bin("trainer"))
            .args([
                "prepare",
                "--engine",
                "ort",
                "--data",
                &s(&delta),
                "--cache",
                &s(&cache),
            ])
            .env("RUST_LOG", rust_log)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        let kernel = stderr(&o)
            .lines()
            .any(|l| l.contains("delta_kernel::snapshot: Created snapshot"));
        assert_eq!(kernel, shown, "RUST_LOG={rust_log:?}: {}", stderr(&o));
    }

    let at = |flag: &str, value: &str| prepare_with(&delta, &cache, &[flag, value]);
    let v0 = at("--data-version", "0");
    assert_eq!(v0["samples"], 200);
    let plain = prepare(&src, &cache);
    assert_eq!(
        v0["samples_cache"], plain["samples_cache"],
        "version 0 is the LFW table"
    );
    let future = at("--data-timestamp", "2999-01-01");
    assert_eq!(future["samples_cache"], now["samples_cache"]);
    let o = run(
        "trainer",
        &[
            "prepare",
            "--data",
            &s(&delta),
            "--data-timestamp",
            "2000-01-01",
        ],
    );
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("--data-timestamp 2000-01-01"),
        "{}",
        stderr(&o)
    );
    let o = run(
        "trainer",
        &["prepare", "--data", &s(&delta), "--data-version", "9"],
    );
    assert!(!o.status.success());
    assert!(stderr(&o).contains("version 9"), "{}", stderr(&o));

    // Partitioned by label: the label comes from the log, the samples equal the plain table's.
    let part = prepare(&tmp.path().join("delta_part"), &cache);
    assert_eq!(part["samples_cache"], plain["samples_cache"]);
    assert_eq!(part["labels"], plain["labels"]);

    unknown_reader_features_are_named(&tmp.path().join("delta_future"));
}

/// A reader feature the kernel does not know, patched into the table's first commit: refused by
/// name, not read around.
fn unknown_reader_features_are_named(table: &Path) {
    let log = table.join("_delta_log/00000000000000000000.json");
    let text = std::fs::read_to_string(&log).unwrap();
    let patched: Vec<String> = text
        .lines()
        .map(|l| {
            let mut v: Value = serde_json::from_str(l).unwrap();
            if v.get("protocol").is_some() {
                v["protocol"] = serde_json::json!({
                    "minReaderVersion": 3, "minWriterVersion": 7,
                    "readerFeatures": ["kestrelImaginaryFeature"],
                    "writerFeatures": ["kestrelImaginaryFeature"],
                });
            }
            v.to_string()
        })
        .collect();
    std::fs::write(&log, patched.join("\n") + "\n").unwrap();
    let o = run("trainer", &["prepare", "--data", &s(table)]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains(&s(table)) && e.contains("kestrelImaginaryFeature"),
        "{e}"
    );
}

/// Image tables in the form Delta on Databricks writes by default (tests/py/databricks_delta.py,
/// modelled on the kernel's fixtures in tests/fixtures/delta/): deletion vectors on disk and
/// inline leave exactly the rows they keep; column mapping in `name` and `id` mode reads the
/// physical `col-<uuid>` columns by their logical names, a renamed label column included.
#[test]
fn databricks_deletion_vectors_and_column_mapping_read_the_kept_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fetched("datasets/lfw/lfw.parquet");
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("py/databricks_delta.py");
    let o = python(
        "import runpy, sys\nsys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')",
        &[s(&script), s(&src), s(tmp.path())],
    );
    let want: Value = serde_json::from_str(kestrel_tests::stdout(&o).trim()).unwrap();
    let kept = want["dv"].as_array().unwrap().clone();
    assert_eq!((kept.len(), want["rows"].as_u64()), (165, Some(200)));
    let cache = tmp.path().join("cache");

    let dv = prepare(&tmp.path().join("dv"), &cache);
    assert_eq!(dv["samples"], 165);
    let meta = kestrel_tests::read_json(
        &Path::new(dv["samples_cache"].as_str().unwrap()).join("meta.json"),
    );
    let mut ids = meta["ids"].as_array().unwrap().clone();
    ids.sort_by(|a, b| a.as_str().cmp(&b.as_str()));
    assert_eq!(ids, kept, "the rows the deletion vectors keep, no others");
    // Version 0, before the DELETE: every row.
    let v0 = prepare_with(&tmp.path().join("dv"), &cache, &["--data-version", "0"]);
    assert_eq!(v0["samples"], 200);

    let plain = prepare(&src, &cache);
    for mode in ["name", "id"] {
        let table = tmp.path().join(format!("cm-{mode}"));
        let v = prepare_with(&table, &cache, &["--label-column", "class"]);
        assert_eq!(v["samples_cache"], plain["samples_cache"], "{mode}");
        assert_eq!(v["labels"], plain["labels"], "{mode}");
        // The label column's old name is gone; the message lists the logical names.
        let o = run("trainer", &["prepare", "--data", &s(&table)]);
        assert!(!o.status.success(), "{mode}");
        let e = stderr(&o);
        assert!(e.contains("`label`") && e.contains("class"), "{mode}: {e}");
        assert!(!e.contains("col-"), "{mode}: physical names leak: {e}");
    }
}
