//! The capture table writer against the kernel: appends, rewrites, conflicts, checkpoints.

use super::*;

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

#[test]
fn appends_and_a_rewrite_read_back_through_the_kernel() {
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
    let labelled: Vec<_> = rows
        .iter()
        .map(|r| CaptureRow {
            label: Some(format!("L{}", r.path)),
            ..r.clone()
        })
        .collect();
    assert_eq!(replace(&t, &labelled).unwrap(), 3);
    let (mut back, _) = read(&t).unwrap();
    let mut labelled = labelled;
    back.sort_by(|a, b| a.path.cmp(&b.path));
    labelled.sort_by(|a, b| a.path.cmp(&b.path));
    assert_eq!(back, labelled, "one live file: the rewrite");
    // The general table reader sees the same rows (labels and content).
    let ds = crate::data::load(&t, &Default::default()).unwrap();
    assert_eq!(ds.labels, ["La", "Lb", "Lc"]);
    assert_eq!(ds.samples.len(), 3);
    // Time travel still shows the unlabelled version.
    let (old, _) = (
        crate::data::load(
            &t,
            &crate::data::SourceOpts {
                data_version: Some(1),
                ..Default::default()
            },
        ),
        (),
    );
    assert!(
        old.unwrap_err().to_string().contains("null"),
        "version 1 has no labels"
    );
}

/// Commits are put-if-absent: a writer that read version 1 and commits after another writer
/// took version 2 is refused, and version 2 stands.
#[test]
fn a_second_writer_of_one_version_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("captures");
    assert_eq!(append(&t, &[row("a", None)], None).unwrap(), 1);
    let table = Table::open(&t).unwrap();
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
            Table::open(&t).unwrap().live_files().unwrap().len(),
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
    let table = Table::open(&t).unwrap();
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
