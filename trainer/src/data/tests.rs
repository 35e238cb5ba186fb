use super::cache::features;
use super::source::columns::{self, HIVE_NULL};
use super::source::{delta, location};
use super::*;
use arrow::array::{
    ArrayRef, BinaryArray, Float64Array, Int32Array, Int64Array, RecordBatch, StringArray,
};
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;
use std::fs;
use std::sync::Arc;

fn png(seed: u8) -> Vec<u8> {
    let img = image::GrayImage::from_fn(4, 3, |x, y| {
        image::Luma([seed.wrapping_mul(7).wrapping_add((x * 3 + y) as u8)])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

fn write_parquet(path: &Path, columns: Vec<(&str, ArrayRef)>, rows_per_group: usize) {
    write_parquet_with(path, columns, rows_per_group, Compression::SNAPPY);
}

fn write_parquet_with(
    path: &Path,
    columns: Vec<(&str, ArrayRef)>,
    rows_per_group: usize,
    codec: Compression,
) {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).unwrap();
    }
    let batch = RecordBatch::try_from_iter(columns).unwrap();
    let props = WriterProperties::builder()
        .set_compression(codec)
        .set_max_row_group_row_count(Some(rows_per_group))
        .build();
    let mut w =
        ArrowWriter::try_new(fs::File::create(path).unwrap(), batch.schema(), Some(props)).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
}

/// Writes the same table as ImageFolder (`images/`), `manifest.csv`, `table.parquet` (2-row
/// groups) and a Spark-style `spark/` directory of part files. Returns the root.
fn fixture(labels: &[&str], int_labels: bool) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let mut csv = String::from("path,label\n");
    let (mut paths, mut contents) = (Vec::new(), Vec::new());
    for (i, label) in labels.iter().enumerate() {
        let rel = format!("images/{label}/{i:03}.png");
        fs::create_dir_all(root.join("images").join(label)).unwrap();
        let bytes = png(i as u8);
        fs::write(root.join(&rel), &bytes).unwrap();
        csv += &format!("{rel},{label}\n");
        paths.push(rel);
        contents.push(bytes);
    }
    fs::write(root.join("images/README.txt"), "not an image").unwrap();
    fs::write(root.join("manifest.csv"), csv).unwrap();
    let label_col: ArrayRef = if int_labels {
        Arc::new(Int64Array::from_iter_values(
            labels.iter().map(|l| l.parse::<i64>().unwrap()),
        ))
    } else {
        Arc::new(StringArray::from_iter_values(labels))
    };
    let content: ArrayRef = Arc::new(BinaryArray::from_iter_values(&contents));
    let path_col: ArrayRef = Arc::new(StringArray::from_iter_values(&paths));
    let cols = vec![
        ("path", path_col),
        ("content", content),
        ("label", label_col),
    ];
    write_parquet(&root.join("table.parquet"), cols.clone(), 2);
    fs::create_dir(root.join("spark")).unwrap();
    let half = labels.len() / 2;
    for (part, (start, len)) in [(0, half), (half, labels.len() - half)]
        .into_iter()
        .enumerate()
    {
        let sliced = cols
            .iter()
            .map(|(n, c)| (*n, c.slice(start, len)))
            .collect();
        write_parquet(
            &root.join(format!("spark/part-{part:05}-x.snappy.parquet")),
            sliced,
            3,
        );
    }
    fs::write(root.join("spark/_SUCCESS"), "").unwrap();
    dir
}

fn pairs(ds: &Dataset) -> Vec<(Vec<u8>, String)> {
    let mut v: Vec<_> = ds
        .samples
        .iter()
        .map(|s| (s.bytes().unwrap().into_owned(), ds.labels[s.label].clone()))
        .collect();
    v.sort();
    v
}

fn load_all(root: &Path) -> Vec<Dataset> {
    let opts = SourceOpts::default();
    ["images", "manifest.csv", "table.parquet", "spark"]
        .iter()
        .map(|p| load(&root.join(p), &opts).unwrap())
        .collect()
}

#[test]
fn data_three_sources_agree() {
    let labels = ["dog", "cat", "dog", "bird", "cat", "dog", "bird"];
    let dir = fixture(&labels, false);
    let all = load_all(dir.path());
    for ds in &all {
        assert_eq!(ds.labels, ["bird", "cat", "dog"], "{}", ds.source);
        assert_eq!(ds.samples.len(), 7, "{}", ds.source);
        assert_eq!(pairs(ds), pairs(&all[0]), "{}", ds.source);
    }
    // CSV and Parquet keep row order; Parquet ids come from the path column.
    assert_eq!(all[2].samples[3].id, "images/bird/003.png");
    assert_eq!(
        all[2].samples.iter().map(|s| s.label).collect::<Vec<_>>(),
        [2, 1, 2, 0, 1, 2, 0]
    );
    assert_eq!(
        all[1].samples.iter().map(|s| s.label).collect::<Vec<_>>(),
        [2, 1, 2, 0, 1, 2, 0]
    );
    assert_eq!(
        all[3].samples.iter().map(|s| &s.sha256).collect::<Vec<_>>(),
        all[2].samples.iter().map(|s| &s.sha256).collect::<Vec<_>>()
    );
    // ImageFolder: class then file name.
    assert_eq!(
        all[0].samples.iter().map(|s| s.label).collect::<Vec<_>>(),
        [0, 0, 1, 1, 2, 2, 2]
    );
    assert!(all[0].samples[0].id.ends_with("images/bird/003.png"));
}

#[test]
fn data_integer_labels_sort_numerically() {
    let dir = fixture(&["10", "2", "10", "2", "3"], true);
    for ds in load_all(dir.path()) {
        assert_eq!(ds.labels, ["2", "3", "10"], "{}", ds.source);
    }
    // Int32 labels, no path column: ids name the file and row.
    let file = dir.path().join("int32.parquet");
    let content: ArrayRef = Arc::new(BinaryArray::from_iter_values([png(1), png(2)]));
    write_parquet(
        &file,
        vec![
            ("content", content),
            ("label", Arc::new(Int32Array::from(vec![10, 2]))),
        ],
        1,
    );
    let ds = load(&file, &SourceOpts::default()).unwrap();
    assert_eq!(ds.labels, ["2", "10"]);
    assert_eq!(ds.samples[0].label, 1);
    assert_eq!(ds.samples[1].id, format!("{}#row 1", file.display()));
}

fn err(path: &Path, opts: &SourceOpts) -> (DataError, String) {
    let e = load(path, opts).unwrap_err();
    let msg = e.to_string();
    (e, msg)
}

#[test]
fn data_errors() {
    let dir = fixture(&["a", "b", "a"], false);
    let root = dir.path();
    let opts = SourceOpts::default();
    let bad_label = SourceOpts {
        label_column: "class".into(),
        ..SourceOpts::default()
    };

    let (e, m) = err(&root.join("table.parquet"), &bad_label);
    assert!(
        matches!(e, DataError::MissingColumn { .. })
            && m.contains("`class`")
            && m.contains("path, content, label"),
        "{m}"
    );
    let (e, m) = err(&root.join("manifest.csv"), &bad_label);
    assert!(
        matches!(e, DataError::MissingColumn { .. })
            && m.contains("manifest.csv")
            && m.contains("path, label"),
        "{m}"
    );

    let f = root.join("nocontent.parquet");
    write_parquet(
        &f,
        vec![("label", Arc::new(StringArray::from(vec!["a"])) as ArrayRef)],
        8,
    );
    let (e, m) = err(&f, &opts);
    assert!(
        matches!(e, DataError::MissingContentColumn { .. }) && m.contains("`content`"),
        "{m}"
    );

    let f = root.join("strcontent.parquet");
    let s: ArrayRef = Arc::new(StringArray::from(vec!["a"]));
    write_parquet(&f, vec![("content", s.clone()), ("label", s.clone())], 8);
    let (e, m) = err(&f, &opts);
    assert!(
        matches!(e, DataError::WrongColumnType { .. })
            && m.contains("`content`")
            && m.contains("binary"),
        "{m}"
    );

    let f = root.join("floatlabel.parquet");
    let b: ArrayRef = Arc::new(BinaryArray::from_iter_values([png(0)]));
    write_parquet(
        &f,
        vec![
            ("content", b),
            ("label", Arc::new(Float64Array::from(vec![1.0]))),
        ],
        8,
    );
    let (e, m) = err(&f, &opts);
    assert!(
        matches!(e, DataError::UnsupportedLabelType { .. }) && m.contains("Float64"),
        "{m}"
    );

    fs::create_dir(root.join("images/empty")).unwrap();
    fs::write(root.join("images/empty/notes.txt"), "x").unwrap();
    let (e, m) = err(&root.join("images"), &opts);
    assert!(
        matches!(e, DataError::EmptyClass { .. }) && m.contains("empty class `empty` in"),
        "{m}"
    );

    fs::create_dir(root.join("nothing")).unwrap();
    assert!(matches!(
        err(&root.join("nothing"), &opts).0,
        DataError::EmptyDataset { .. }
    ));
    fs::write(root.join("header.csv"), "path,label\n").unwrap();
    assert!(matches!(
        err(&root.join("header.csv"), &opts).0,
        DataError::EmptyDataset { .. }
    ));

    fs::write(
        root.join("missing.csv"),
        "path,label\nimages/a/000.png,a\ngone.png,b\n",
    )
    .unwrap();
    let (e, m) = err(&root.join("missing.csv"), &opts);
    assert!(
        matches!(e, DataError::MissingFile { line: 3, .. })
            && m.contains("line 3")
            && m.contains("gone.png"),
        "{m}"
    );

    // A directory where an image file should be: unreadable.
    fs::write(root.join("unreadable.csv"), "path,label\nimages/a,a\n").unwrap();
    let (e, m) = err(&root.join("unreadable.csv"), &opts);
    assert!(
        matches!(e, DataError::Io { .. }) && m.contains("images/a"),
        "{m}"
    );

    fs::write(root.join("corrupt.parquet"), b"not parquet at all").unwrap();
    let (e, m) = err(&root.join("corrupt.parquet"), &opts);
    assert!(
        matches!(e, DataError::Parquet { .. }) && m.contains("corrupt.parquet"),
        "{m}"
    );

    assert!(matches!(
        err(&root.join("images/README.txt"), &opts).0,
        DataError::UnsupportedSource { .. }
    ));
    assert!(matches!(
        err(&root.join("absent"), &opts).0,
        DataError::Io { .. }
    ));
}

/// The real datasets built by scripts/fetch-datasets.sh, when present.
#[test]
fn data_real_datasets_agree() {
    let home = std::env::var_os("KESTREL_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/kestrel")
        });
    for (name, n, labels) in [
        ("lfw", 200, vec!["face".to_string(), "nonface".to_string()]),
        ("digits", 1797, (0..10).map(|d| d.to_string()).collect()),
    ] {
        let root = home.join("datasets").join(name);
        if !root.join(".done").exists() {
            eprintln!(
                "skipping: {} not built (scripts/fetch-datasets.sh)",
                root.display()
            );
            continue;
        }
        let opts = SourceOpts::default();
        let forms = [
            "imagefolder".to_string(),
            "manifest.csv".into(),
            format!("{name}.parquet"),
        ];
        let all: Vec<Dataset> = forms
            .iter()
            .map(|f| load(&root.join(f), &opts).unwrap())
            .collect();
        for ds in &all {
            assert_eq!(ds.samples.len(), n, "{}", ds.source);
            assert_eq!(ds.labels, labels, "{}", ds.source);
            assert_eq!(pairs(ds), pairs(&all[0]), "{}", ds.source);
        }
        // Parquet ids are the manifest's relative paths, in the same row order as the CSV.
        let csv_ids: Vec<_> = all[1].samples.iter().map(|s| s.id.clone()).collect();
        let pq_ids: Vec<_> = all[2]
            .samples
            .iter()
            .map(|s| root.join(&s.id).display().to_string())
            .collect();
        assert_eq!(csv_ids, pq_ids);
    }
}

/// The fixture's table with each codec Spark, pyarrow and delta-rs write, and as Hive partitions
/// (`label=<value>/`, nested under another partition column, a value that needs escaping): the
/// same samples as the ImageFolder.
#[test]
fn data_codecs_and_hive_partitions_read_alike() {
    use parquet::basic::{BrotliLevel, GzipLevel, ZstdLevel};
    let labels = ["dog", "cat", "dog", "bird", "cat", "dog", "b:rd"];
    let dir = fixture(&labels, false);
    let root = dir.path();
    let opts = SourceOpts::default();
    let want = pairs(&load(&root.join("images"), &opts).unwrap());
    let table = load(&root.join("table.parquet"), &opts).unwrap();
    let column = |name: &str, rows: &[usize]| -> ArrayRef {
        let src: Vec<&Sample> = rows.iter().map(|&i| &table.samples[i]).collect();
        match name {
            "content" => Arc::new(BinaryArray::from_iter_values(
                src.iter().map(|s| s.bytes().unwrap().into_owned()),
            )),
            "path" => Arc::new(StringArray::from_iter_values(src.iter().map(|s| &s.id))),
            _ => Arc::new(StringArray::from_iter_values(
                src.iter().map(|s| &table.labels[s.label]),
            )),
        }
    };
    let all: Vec<usize> = (0..labels.len()).collect();
    for codec in [
        Compression::UNCOMPRESSED,
        Compression::SNAPPY,
        Compression::GZIP(GzipLevel::default()),
        Compression::ZSTD(ZstdLevel::default()),
        Compression::LZ4,
        Compression::LZ4_RAW,
        Compression::BROTLI(BrotliLevel::default()),
    ] {
        let f = root.join(format!("codec/{codec:?}.parquet"));
        let cols = ["path", "content", "label"].map(|n| (n, column(n, &all)));
        write_parquet_with(&f, cols.to_vec(), 3, codec);
        let ds = load(&f, &opts).unwrap_or_else(|e| panic!("{codec:?}: {e}"));
        assert_eq!(pairs(&ds), want, "{codec:?}");
    }

    // Hive partitions: the label only in the path, nested under `split=`, Spark's escaping.
    for (i, s) in table.samples.iter().enumerate() {
        let label = &table.labels[s.label];
        let escaped = label.replace(':', "%3A");
        let f = root.join(format!(
            "hive/split={}/label={escaped}/part-{i}.parquet",
            i % 2
        ));
        let cols = ["path", "content"].map(|n| (n, column(n, &[i])));
        write_parquet_with(
            &f,
            cols.to_vec(),
            3,
            Compression::ZSTD(ZstdLevel::default()),
        );
    }
    fs::create_dir_all(root.join("hive/_temporary/label=x")).unwrap();
    fs::write(root.join("hive/_SUCCESS"), "").unwrap();
    let ds = load(&root.join("hive"), &opts).unwrap();
    assert_eq!(pairs(&ds), want, "{}", ds.source);
    assert!(
        ds.source.contains("partitioned by label, split"),
        "{}",
        ds.source
    );

    // A null partition value is named like a null label.
    let f = root.join(format!("nullpart/label={HIVE_NULL}/part-0.parquet"));
    write_parquet_with(
        &f,
        vec![("content", column("content", &[0]))],
        3,
        Compression::SNAPPY,
    );
    let (e, m) = err(&root.join("nullpart"), &opts);
    assert!(
        matches!(e, DataError::NullValue { .. }) && m.contains("`label`"),
        "{m}"
    );
    // No label column anywhere: the partition columns are listed with the file's.
    let (e, m) = err(
        &root.join("hive"),
        &SourceOpts {
            label_column: "class".into(),
            ..SourceOpts::default()
        },
    );
    assert!(
        matches!(e, DataError::MissingColumn { .. }) && m.contains("label (partition)"),
        "{m}"
    );
}

/// A directory with `_delta_log/` is read as a Delta table, never as Parquet files: a broken log
/// is an error naming the table; time travel on a non-Delta source is refused.
#[test]
fn data_delta_logs_are_never_bypassed() {
    let dir = fixture(&["a", "b"], false);
    let t = dir.path().join("spark");
    fs::create_dir(t.join("_delta_log")).unwrap();
    let (e, m) = err(&t, &SourceOpts::default());
    assert!(matches!(e, DataError::Delta { .. }), "{m}");
    assert!(m.contains("Delta table") && m.contains("spark"), "{m}");
    let at = SourceOpts {
        data_version: Some(0),
        ..SourceOpts::default()
    };
    let (e, m) = err(&dir.path().join("table.parquet"), &at);
    assert!(matches!(e, DataError::NotDelta { .. }), "{m}");
    assert!(delta::parse_timestamp("2026-12-01").is_ok());
    assert!(delta::parse_timestamp("2026-12-01 06:00:00").is_ok());
    assert_eq!(
        delta::parse_timestamp("2026-12-01T06:00:00Z"),
        delta::parse_timestamp("2026-12-01 06:00:00")
    );
    assert!(
        delta::parse_timestamp("yesterday")
            .unwrap_err()
            .contains("yesterday")
    );
}

/// Several sources load into one dataset: the union of their classes, sorted by the one rule
/// (numerically when every name is an integer), every sample remapped, sources in order.
#[test]
fn data_several_sources_share_one_label_set() {
    let a = fixture(&["10", "2", "10"], true);
    let b = fixture(&["3", "10"], true);
    let paths = [a.path().join("table.parquet"), b.path().join("images")];
    let ds = crate::data::load_all(&paths, &SourceOpts::default()).unwrap();
    assert_eq!(ds.labels, ["2", "3", "10"]);
    assert_eq!(ds.samples.len(), 5);
    let names: Vec<&str> = ds
        .samples
        .iter()
        .map(|s| ds.labels[s.label].as_str())
        .collect();
    // The Parquet table by row, then the ImageFolder by class (numeric: 3 before 10).
    assert_eq!(names, ["10", "2", "10", "3", "10"]);
    assert!(
        ds.source.starts_with("parquet ") && ds.source.contains(" + imagefolder "),
        "{}",
        ds.source
    );
    // Names: lexicographic once one is not an integer; one source loads as `load` does.
    let c = fixture(&["dog", "cat"], false);
    let d = fixture(&["bird", "10"], false);
    let paths = [c.path().join("manifest.csv"), d.path().join("spark")];
    let ds = crate::data::load_all(&paths, &SourceOpts::default()).unwrap();
    assert_eq!(ds.labels, ["10", "bird", "cat", "dog"]);
    assert_eq!(
        pairs(&ds),
        [
            pairs(&load(&paths[0], &SourceOpts::default()).unwrap()),
            pairs(&load(&paths[1], &SourceOpts::default()).unwrap())
        ]
        .concat()
        .into_iter()
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect::<Vec<_>>()
    );
    let one = crate::data::load_all(&paths[..1], &SourceOpts::default()).unwrap();
    assert_eq!(
        pairs(&one),
        pairs(&load(&paths[0], &SourceOpts::default()).unwrap())
    );
    assert!(matches!(
        crate::data::load_all(&[], &SourceOpts::default()),
        Err(DataError::NoSource)
    ));
}

/// Rows without a label (null, or empty) fail naming `--skip-unlabelled`; with it they are left
/// out and counted per source, and a source of only unlabelled rows is allowed beside others.
#[test]
fn data_unlabelled_rows_fail_or_are_skipped() {
    let dir = fixture(&["a", "b"], false);
    let root = dir.path();
    let f = root.join("captures.parquet");
    let content: ArrayRef = Arc::new(BinaryArray::from_iter_values([
        png(1),
        png(2),
        png(3),
        png(4),
    ]));
    let label: ArrayRef = Arc::new(StringArray::from(vec![
        Some("a"),
        None,
        Some(""),
        Some("c"),
    ]));
    write_parquet(&f, vec![("content", content), ("label", label)], 2);
    fs::write(
        root.join("partly.csv"),
        "path,label\nimages/a/000.png,a\nimages/b/001.png,\n",
    )
    .unwrap();
    let skip = SourceOpts {
        skip_unlabelled: true,
        ..SourceOpts::default()
    };
    for (file, row) in [("captures.parquet", 1), ("partly.csv", 1)] {
        let (e, m) = err(&root.join(file), &SourceOpts::default());
        assert!(
            matches!(e, DataError::NullValue { row: r, .. } if r == row)
                && m.contains("`label`")
                && m.contains("--skip-unlabelled"),
            "{m}"
        );
    }
    let ds = load(&f, &skip).unwrap();
    assert_eq!(ds.labels, ["a", "c"]);
    assert_eq!(ds.samples.len(), 2);
    assert_eq!(ds.unlabelled, [(ds.source.clone(), 2)]);
    assert_eq!(
        ds.samples[1].id,
        format!("{}#row 3", f.display()),
        "rows keep their numbers"
    );
    let ds = load(&root.join("partly.csv"), &skip).unwrap();
    assert_eq!((ds.samples.len(), ds.unlabelled_total()), (1, 1));
    // Content nulls are no label matter: no hint.
    let nul = root.join("nullcontent.parquet");
    let content: ArrayRef = Arc::new(BinaryArray::from(vec![None::<&[u8]>]));
    let label: ArrayRef = Arc::new(StringArray::from(vec!["a"]));
    write_parquet(&nul, vec![("content", content), ("label", label)], 2);
    let (_, m) = err(&nul, &skip);
    assert!(
        m.contains("`content`") && !m.contains("--skip-unlabelled"),
        "{m}"
    );

    // Only unlabelled rows: alone an error, beside a labelled table a source like any other.
    let none = root.join("none.parquet");
    let content: ArrayRef = Arc::new(BinaryArray::from_iter_values([png(5)]));
    let label: ArrayRef = Arc::new(StringArray::from(vec![None::<&str>]));
    write_parquet(&none, vec![("content", content), ("label", label)], 2);
    let (e, m) = err(&none, &skip);
    assert!(
        matches!(e, DataError::NoLabelled { unlabelled: 1, .. }),
        "{m}"
    );
    let paths = [root.join("table.parquet"), none.clone(), f.clone()];
    let ds = crate::data::load_all(&paths, &skip).unwrap();
    assert_eq!(ds.labels, ["a", "b", "c"]);
    assert_eq!(ds.samples.len(), 4);
    assert_eq!(ds.unlabelled_total(), 3);
    assert_eq!(ds.unlabelled.len(), 2, "{:?}", ds.unlabelled);
    let e = crate::data::load_all(&paths, &SourceOpts::default()).unwrap_err();
    assert!(e.to_string().contains("none.parquet"), "{e}");
}

/// An in-memory dataset of classes `a` and `b`.
fn classes_a_b(samples: Vec<Sample>) -> Dataset {
    Dataset {
        samples,
        labels: vec!["a".into(), "b".into()],
        source: "test".into(),
        unlabelled: Vec::new(),
        tables: Vec::new(),
    }
}

/// A quiet one-worker job over the caches under `root`.
fn local_job(root: &Path, threads: usize) -> crate::distributed::Job {
    use crate::distributed::{Job, JobOpts};
    Job::local(JobOpts {
        threads,
        cache_root: root.to_path_buf(),
        ..JobOpts::default()
    })
    .quiet()
}

/// Building the sample and feature caches in one pass (decode overlapped with the backbone) gives
/// the same shards, metadata and features as building them one after the other, skips the same
/// invalid rows, and applies only where no cache holds the samples yet.
#[test]
fn caches_built_in_one_pass_equal_two_passes() {
    use kestrel_models::backbone::Backbone;
    let mut samples: Vec<Sample> = (0..70u8)
        .map(|i| Sample::in_memory(format!("img-{i}.png"), png(i), usize::from(i % 3 == 0)))
        .collect();
    samples.push(Sample::in_memory(
        "torn.png".into(),
        png(200)[..20].to_vec(),
        1,
    ));
    let ds = classes_a_b(samples);
    let backbone = Backbone::resolve("random:3", Some(kestrel_models::Arch::EfficientnetLite0))
        .expect("random weights");
    let boundary = backbone.net.blocks.len();
    let spec = &backbone.net.preprocess;
    let tract = kestrel_models::EngineKind::Tract;
    let job = |root: &Path| local_job(root, 2);
    let (one, two) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let job1 = job(one.path());
    let plan1 = SamplePlan::new(one.path(), &ds, spec);
    let (p1, f1) =
        features::extract_while_decoding(&job1, &plan1, &ds, &backbone, boundary, tract, true)
            .unwrap()
            .expect("no cache yet: one pass");
    assert_eq!((f1.computed, f1.reused, f1.hit), (70, 0, false));
    // Every row kept once, with its own label and pixels (chunks of 32 end mid-table).
    for (k, id) in p1.meta.ids.iter().enumerate() {
        let s = ds.samples.iter().find(|s| s.id == *id).unwrap();
        assert_eq!(p1.meta.sample_labels[k], s.label, "{id}");
        assert_eq!(
            p1.meta.content_sha256[k],
            kestrel_shared::protocol::sha256_hex(&s.bytes().unwrap()),
            "{id}"
        );
        let img = kestrel_shared::preprocess::decode(&s.bytes().unwrap(), id, &Default::default())
            .unwrap();
        let want = spec.to_pixels(&img).unwrap().into_raw();
        assert_eq!(p1.load_samples(&[k]).unwrap()[0], want, "{id}");
    }
    // Built now: the one-pass path steps aside, and the usual path finds both caches.
    assert!(
        features::extract_while_decoding(&job1, &plan1, &ds, &backbone, boundary, tract, true)
            .unwrap()
            .is_none()
    );
    let job2 = job(two.path());
    let plan2 = SamplePlan::new(two.path(), &ds, spec);
    let p2 = Prepared::open_or_build(&plan2, &ds, 1, 2, true, &mut |_| Ok(())).unwrap();
    let f2 = features::features(&job2, &p2, &backbone, boundary, tract).unwrap();
    assert_eq!(f2.computed, 70);
    assert_eq!(p1.meta.key, p2.meta.key);
    assert_eq!(p1.meta.ids, p2.meta.ids);
    assert_eq!(p1.meta.content_sha256, p2.meta.content_sha256);
    assert_eq!(p1.meta.skipped.len(), 1);
    assert_eq!(p1.meta.skipped[0].0, "torn.png");
    assert_eq!(p1.meta.skipped, p2.meta.skipped);
    assert_eq!(p1.load_pixels().unwrap(), p2.load_pixels().unwrap());
    assert_eq!(f1.meta.dims, f2.meta.dims);
    assert_eq!(
        f1.data, f2.data,
        "features differ between one and two passes"
    );
    let reread = features::features(&job1, &p1, &backbone, boundary, tract).unwrap();
    assert!(reread.hit);
    assert_eq!(reread.data, f1.data);
    // Without --skip-invalid the torn image stops the build, naming it, and leaves no cache.
    let three = tempfile::tempdir().unwrap();
    let plan3 = SamplePlan::new(three.path(), &ds, spec);
    let err = features::extract_while_decoding(
        &job(three.path()),
        &plan3,
        &ds,
        &backbone,
        boundary,
        tract,
        false,
    )
    .err()
    .expect("a torn image fails the build");
    assert!(err.to_string().contains("torn.png"), "{err}");
    assert!(!plan3.is_built());
}

/// Rows an [`Extractor`](super::extract::Extractor) computed outside any cache (what a Spark task
/// of `kestrel.spark.features(..., cache=)` does) and stored are found by content: the backbone
/// runs only on the other samples, and the features equal a cache built from scratch.
#[test]
fn stored_feature_rows_spare_the_backbone() {
    use kestrel_models::backbone::Backbone;
    let samples: Vec<Sample> = (0..12u8)
        .map(|i| Sample::in_memory(format!("img-{i}.png"), png(i), usize::from(i % 2 == 0)))
        .collect();
    let ds = classes_a_b(samples);
    let backbone = || Backbone::resolve("random:3", Some(kestrel_models::Arch::EfficientnetLite0));
    let tract = kestrel_models::EngineKind::Tract;
    let built = |root: &Path| {
        let b = backbone().unwrap();
        let job = local_job(root, 1);
        let plan = SamplePlan::new(root, &ds, &b.net.preprocess);
        let p = Prepared::open_or_build(&plan, &ds, 1, 1, false, &mut |_| Ok(())).unwrap();
        let f = features::features(&job, &p, &b, b.net.blocks.len(), tract).unwrap();
        (p, f)
    };
    let (fresh, stored) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (_, want) = built(fresh.path());
    // Eight of the twelve images, in another order, from an extractor.
    let ex = super::extract::Extractor::new(
        backbone().unwrap(),
        tract,
        kestrel_models::engine::EngineOpts::cpu(1),
    )
    .unwrap();
    let some: Vec<&Sample> = ds.samples.iter().rev().take(8).collect();
    let bytes: Vec<Vec<u8>> = some
        .iter()
        .map(|s| s.bytes().unwrap().into_owned())
        .collect();
    let items: Vec<(&str, &[u8])> = some
        .iter()
        .zip(&bytes)
        .map(|(s, b)| (s.id.as_str(), &b[..]))
        .collect();
    let rows = ex.extract(&items).unwrap();
    let data: Vec<f32> = rows.into_iter().flat_map(|r| r.unwrap()).collect();
    let content = bytes
        .iter()
        .map(|b| kestrel_shared::protocol::sha256_hex(b))
        .collect();
    let dir = ex.store(stored.path(), content, &data, 0.1).unwrap();
    assert!(
        dir.starts_with(stored.path().join("features")),
        "{}",
        dir.display()
    );
    let (p, got) = built(stored.path());
    assert_eq!((got.computed, got.reused), (4, 8));
    assert_eq!(got.meta.dims, want.meta.dims);
    for k in 0..p.len() {
        let diff = got
            .row(k)
            .iter()
            .zip(want.row(k))
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(diff <= 1e-5, "{}: {diff}", p.meta.ids[k]);
    }
    // A row count that does not match the values is refused, naming the numbers.
    let e = ex
        .store(stored.path(), vec!["x".into()], &data, 0.1)
        .unwrap_err();
    assert!(format!("{:#}", anyhow::Error::new(e)).contains("for 1 images"));
}

/// The Delta kernel's own test tables as Delta on Spark wrote them (`tests/fixtures/delta/`): an
/// on-disk deletion vector over one file, one over one of two files, none, and column mapping
/// (`id`, `name`) over a partitioned table's log. Each reads its documented rows.
#[test]
fn data_delta_fixtures_written_by_spark_read_their_rows() {
    use arrow::array::AsArray;
    use arrow::datatypes::{Int32Type, Int64Type};
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/delta");
    let values = |table: &str, column: &str| -> Vec<i64> {
        let loc = location::Location::local(&root.join(table)).unwrap();
        let mut out = Vec::new();
        delta::scan(
            &loc,
            &SourceOpts::default(),
            &[column],
            &mut Vec::new(),
            |b| {
                let c = b.column_by_name(column).expect("the column");
                match c.data_type() {
                    arrow::datatypes::DataType::Int32 => out.extend(
                        c.as_primitive::<Int32Type>()
                            .iter()
                            .map(|v| v.unwrap() as i64),
                    ),
                    _ => out.extend(c.as_primitive::<Int64Type>().iter().map(|v| v.unwrap())),
                }
                Ok(())
            },
        )
        .unwrap();
        out.sort_unstable();
        out
    };
    // Version 1 deleted `value IN (0, 9)` through a deletion vector; the file still holds 10 rows.
    assert_eq!(
        values("table-with-dv-small", "value"),
        (1..=8).collect::<Vec<_>>()
    );
    assert_eq!(
        values("table-without-dv-small", "value"),
        (0..=9).collect::<Vec<_>>()
    );
    // Two files of five rows; the first one's vector deletes three.
    let ids = values("with-short-dv", "id");
    assert_eq!(ids.len(), 7, "{ids:?}");
    assert_eq!(ids[2..], [5, 6, 7, 8, 9]);
    for mode in ["none", "id", "name"] {
        let loc = location::Location::local(&root.join("partition_cm").join(mode)).unwrap();
        let (mut rows, mut columns) = (0, Vec::new());
        delta::scan(
            &loc,
            &SourceOpts::default(),
            &["value"],
            &mut columns,
            |b| {
                rows += b.num_rows();
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(rows, 0, "{mode}: a log with a schema and no files");
        assert_eq!(columns, ["value", "category"], "{mode}: logical names");
    }
}

#[test]
fn data_hive_part_paths() {
    let part = |rel: &str| columns::hive_part(rel);
    assert_eq!(part("part-0.parquet"), Some(vec![]));
    assert_eq!(
        part("label=a%3Ab/day=1/p.PARQUET"),
        Some(vec![
            ("label".into(), "a:b".into()),
            ("day".into(), "1".into())
        ])
    );
    for skipped in [
        "_delta_log/0.parquet",
        "cat/x.parquet",
        ".p.parquet",
        "a=1/_SUCCESS",
        "x.csv",
    ] {
        assert_eq!(part(skipped), None, "{skipped}");
    }
}

#[test]
fn data_object_urls_are_recognised() {
    for url in [
        "s3://b/t",
        "az://c/t/",
        "abfss://c@a.dfs.core.windows.net/t",
        "gs://b/x.parquet",
    ] {
        assert!(location::object_url(Path::new(url)).is_some(), "{url}");
    }
    for local in ["data/t", "/abs/t", "C:/t", "file:///t", "http://h/t"] {
        assert!(location::object_url(Path::new(local)).is_none(), "{local}");
    }
}
