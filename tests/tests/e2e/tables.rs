//! Tables written by other tools: Parquet with every codec pyarrow writes, Hive-partitioned
//! directories (pyarrow's `partition_cols`), and Delta tables (refused until they can be read right).

use std::path::Path;

use kestrel_tests::{fetched, python, run, s, stderr, trainer_json};
use serde_json::Value;

/// `trainer prepare --json` on `data` with the shared cache `cache`.
fn prepare(data: &Path, cache: &Path) -> Value {
    trainer_json(&[
        "prepare",
        "--json",
        "--engine",
        "ort",
        "--data",
        &s(data),
        "--cache",
        &s(cache),
    ])
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

/// A Delta table directory (`_delta_log/` beside Parquet files) is refused with the reason,
/// never read as a plain Parquet directory (its files include rows the log removed).
#[test]
fn delta_table_directories_are_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path().join("images_delta");
    std::fs::create_dir_all(t.join("_delta_log")).unwrap();
    std::fs::copy(
        fetched("datasets/lfw/lfw.parquet"),
        t.join("part-00000.parquet"),
    )
    .unwrap();
    std::fs::write(t.join("_delta_log/00000000000000000000.json"), "{}\n").unwrap();
    let o = run("trainer", &["prepare", "--data", &s(&t)]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("images_delta") && e.contains("Delta table") && e.contains("_delta_log"),
        "{e}"
    );
}
