//! The capture table writer against the kernel: appends, rewrites, conflicts, checkpoints.

use super::*;
use std::collections::BTreeMap;

fn row(path: &str, label: Option<&str>) -> CaptureRow {
    CaptureRow {
        content: path.as_bytes().to_vec(),
        path: path.into(),
        device: "cam-1".into(),
        model: "m".into(),
        version: 2,
        predicted: "3".into(),
        score: 0.4,
        reason: "low-confidence".into(),
        captured_at: 1_764_633_600_000_000,
        label: label.map(String::from),
    }
}

/// Labels go to the labels table: the capture table keeps its files and version (no image is
/// copied), and every reader (`read`, the general table reader) takes the labels from there.
#[test]
fn appends_and_labels_read_back_through_the_kernel() {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("captures");
    assert_eq!(read(&t).unwrap(), (vec![], None));
    // Version 0 creates the table; each append is one more.
    assert_eq!(
        append(&t, &[row("a", None), row("b", None)], None).unwrap(),
        1
    );
    assert_eq!(append(&t, &[row("c", None)], None).unwrap(), 2);
    let (rows, v) = read(&t).unwrap();
    assert_eq!((rows.len(), v), (3, Some(2)));
    // What collect de-duplicates by: the paths alone.
    let (paths, v) = read_paths(&t).unwrap();
    assert_eq!(v, Some(2));
    assert_eq!(paths, ["a", "b", "c"].map(String::from).into());
    let files = Table::open(&t, &CAPTURES).unwrap().live_files().unwrap();
    let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(p, l)| (p.to_string(), l.to_string()))
            .collect()
    };
    assert_eq!(
        write_labels(&t, &labels(&[("a", "La"), ("b", "Lb")])).unwrap(),
        1
    );
    assert_eq!(
        write_labels(&t, &labels(&[("a", "La"), ("b", "Lb"), ("c", "Lc")])).unwrap(),
        2
    );
    let captures = Table::open(&t, &CAPTURES).unwrap();
    assert_eq!(
        captures.live_files().unwrap(),
        files,
        "the images stay where they were"
    );
    assert_eq!(captures.snapshot().unwrap().unwrap().version(), 2);
    let labels_table = Table::open(&t.join(LABELS_TABLE), &LABELS).unwrap();
    assert_eq!(labels_table.live_files().unwrap().len(), 1, "a rewrite");
    let (mut back, _) = read(&t).unwrap();
    back.sort_by(|a, b| a.path.cmp(&b.path));
    let mut expected = rows.clone();
    expected.sort_by(|a, b| a.path.cmp(&b.path));
    for r in &mut expected {
        r.label = Some(format!("L{}", r.path));
    }
    assert_eq!(back, expected);
    // The general table reader sees the same rows and names both tables it read.
    let ds = crate::data::load(&t, &Default::default()).unwrap();
    assert_eq!(ds.labels, ["La", "Lb", "Lc"]);
    assert_eq!(ds.samples.len(), 3);
    assert_eq!(ds.tables.len(), 2, "{:?}", ds.tables);
    assert_eq!(ds.tables[1].version, Some(2));
    assert!(
        ds.tables[1].location.ends_with("_labels"),
        "{:?}",
        ds.tables
    );
    // Time travel: a version of the table gets the labels known now; a time before the labels
    // (the labels commits' times moved a minute on: the kernel takes a commit's time from its
    // file) gets none.
    let at_v2 = captures
        .snapshot()
        .unwrap()
        .unwrap()
        .get_timestamp(captures.engine.as_ref());
    let at_v2 = chrono::DateTime::from_timestamp_millis(at_v2.unwrap()).unwrap();
    let later = std::time::SystemTime::from(at_v2) + std::time::Duration::from_secs(60);
    for e in std::fs::read_dir(t.join("_labels/_delta_log")).unwrap() {
        let f = std::fs::File::options()
            .append(true)
            .open(e.unwrap().path())
            .unwrap();
        f.set_modified(later).unwrap();
    }
    let at = |data_version, data_timestamp: Option<String>| {
        let opts = crate::data::SourceOpts {
            data_version,
            data_timestamp,
            ..Default::default()
        };
        crate::data::load(&t, &opts)
    };
    assert_eq!(at(Some(1), None).unwrap().labels, ["La", "Lb"]);
    let before = at(None, Some(at_v2.to_rfc3339()));
    assert!(
        before.unwrap_err().to_string().contains("null"),
        "no labels before they were given"
    );
    let after = (at_v2 + chrono::Duration::seconds(61)).to_rfc3339();
    assert_eq!(at(None, Some(after)).unwrap().labels, ["La", "Lb", "Lc"]);
}

/// A table whose labels table property is not a plain directory name inside it is refused
/// (a table from elsewhere must not make the reader look outside it).
#[test]
fn a_labels_table_outside_the_table_is_refused() {
    assert!(super::super::delta::labels_dir("_labels").is_ok());
    for bad in ["../other", "/etc", "", ".hidden", "a/b", "s3://b/t"] {
        let e = super::super::delta::labels_dir(bad).unwrap_err();
        assert!(e.contains("not a directory name"), "{bad}: {e}");
    }
}

/// Commits are put-if-absent: a writer that read version 1 and commits after another writer
/// took version 2 is refused, and version 2 stands.
#[test]
fn a_second_writer_of_one_version_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("captures");
    assert_eq!(append(&t, &[row("a", None)], None).unwrap(), 1);
    let table = Table::open(&t, &CAPTURES).unwrap();
    let stale = table.snapshot().unwrap().unwrap();
    assert_eq!(append(&t, &[row("b", None)], None).unwrap(), 2);
    let engine = table.engine.as_ref();
    let txn = stale
        .update_table(UpdateTableOperation::Write, ENGINE_INFO, true)
        .build(engine, Box::new(FileSystemCommitter::new()))
        .unwrap();
    match txn.commit(engine).unwrap() {
        CommitResult::Conflicted(c) => assert_eq!(c.conflict_version(), 2),
        _ => panic!("a second commit of version 2 went through"),
    }
    let (rows, v) = read(&t).unwrap();
    assert_eq!((rows.len(), v), (2, Some(2)));
}

/// 200 appends (a long `collect`): a checkpoint every 10 versions (the kernel's), every row
/// read back from the last one and the commits after it, and files carry min/max/null
/// statistics. The read after 200 commits replays what the read after 10 does (a checkpoint
/// and at most 9 JSON commits): the older commits can go and it still reads every row.
#[test]
fn long_collects_are_checkpointed_and_files_carry_statistics() {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("captures");
    let log = t.join("_delta_log");
    // Log replay (snapshot and live files) timed apart from reading the rows, whose cost
    // grows with the rows, not the log (shown with --no-capture; not asserted).
    let timed_read = |commits: usize| {
        let start = std::time::Instant::now();
        assert_eq!(
            Table::open(&t, &CAPTURES)
                .unwrap()
                .live_files()
                .unwrap()
                .len(),
            commits
        );
        let replay = start.elapsed();
        let (rows, v) = read(&t).unwrap();
        assert_eq!((rows.len(), v), (2 * commits, Some(commits as u64)));
        eprintln!(
            "after {commits} commits: log replay {replay:?}, read with rows {:?}",
            start.elapsed() - replay
        );
    };
    for i in 0..200 {
        let mut r = row(&format!("cam-1/{i:03}"), (i % 2 == 0).then_some("cat"));
        r.captured_at += i * 1_500;
        append(
            &t,
            &[r, row(&format!("cam-2/{i:03}"), None)],
            Some("collect-a"),
        )
        .unwrap();
        if i == 10 {
            timed_read(11);
        }
    }
    for v in (10..=200).step_by(10) {
        let checkpoint = log.join(format!("{v:020}.checkpoint.parquet"));
        assert!(checkpoint.is_file(), "{v}");
    }
    let last = std::fs::read_to_string(log.join("_last_checkpoint")).unwrap();
    assert!(last.contains("\"version\":200"), "{last}");
    // Every append carried the collector's transaction id, numbered from 0.
    let table = Table::open(&t, &CAPTURES).unwrap();
    let snapshot = table.snapshot().unwrap().unwrap();
    let app = snapshot.get_app_id_version("collect-a", table.engine.as_ref());
    assert_eq!(app.unwrap(), Some(199));
    timed_read(200);
    // The kernel wrote each file's statistics (the 199th append, version 199).
    let commit = std::fs::read_to_string(log.join(format!("{:020}.json", 199))).unwrap();
    let add: serde_json::Value = commit
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|a| a.get("add").is_some())
        .unwrap();
    let st: serde_json::Value =
        serde_json::from_str(add["add"]["stats"].as_str().unwrap()).unwrap();
    assert_eq!(st["numRecords"], 2);
    assert_eq!(st["minValues"]["path"], "cam-1/198");
    assert_eq!(st["maxValues"]["path"], "cam-2/198");
    assert_eq!(st["nullCount"]["label"], 1);
    assert_eq!(st["minValues"]["captured_at"], "2025-12-02T00:00:00.000Z");
    assert_eq!(st["maxValues"]["captured_at"], "2025-12-02T00:00:00.297Z");
    // The commits before the last checkpoint are no longer needed to read the table.
    for v in 0..200 {
        std::fs::remove_file(log.join(format!("{v:020}.json"))).unwrap();
    }
    let (rows, _) = read(&t).unwrap();
    assert_eq!(rows.len(), 400);
    assert_eq!(
        rows.iter().filter(|r| r.label.is_some()).count(),
        100,
        "labels kept through the checkpoints"
    );
}
