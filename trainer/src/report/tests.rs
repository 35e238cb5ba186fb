use super::*;

fn labels(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| s.to_string()).collect()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-12
}

/// truth: cat cat cat dog dog bird bird bird bird (indices 0,0,0,1,1,2,2,2,2)
/// pred:  cat cat dog dog cat bird bird cat  dog
/// confusion (rows true): cat [2,1,0]; dog [1,1,0]; bird [1,1,2]
/// cat:  tp 2, predicted 4, support 3 -> P 1/2, R 2/3, F1 4/7
/// dog:  tp 1, predicted 3, support 2 -> P 1/3, R 1/2, F1 2/5
/// bird: tp 2, predicted 2, support 4 -> P 1,   R 1/2, F1 2/3
/// accuracy 5/9
fn example() -> Evaluation {
    let truth = [0, 0, 0, 1, 1, 2, 2, 2, 2];
    let pred = [0, 0, 1, 1, 0, 2, 2, 0, 1];
    evaluate(
        &pred,
        &truth,
        &labels(&["cat", "dog", "bird"]),
        Some(0.8125),
    )
}

#[test]
fn report_evaluate_three_classes() {
    let e = example();
    assert_eq!(e.samples, 9);
    assert!(close(e.accuracy, 5.0 / 9.0));
    assert_eq!(
        e.confusion,
        vec![vec![2, 1, 0], vec![1, 1, 0], vec![1, 1, 2]]
    );
    let named = confused(&e);
    assert_eq!(
        named,
        [
            ("cat", "dog", 1),
            ("dog", "cat", 1),
            ("bird", "cat", 1),
            ("bird", "dog", 1)
        ]
    );
    assert!(
        e.to_table()
            .contains("most confused: cat as dog (1), dog as cat (1)")
    );
    let expect = [
        ("cat", 0.5, 2.0 / 3.0, 4.0 / 7.0, 3),
        ("dog", 1.0 / 3.0, 0.5, 0.4, 2),
        ("bird", 1.0, 0.5, 2.0 / 3.0, 4),
    ];
    for (m, (label, p, r, f1, support)) in e.per_class.iter().zip(expect) {
        assert_eq!(m.label, label);
        assert!(close(m.precision, p), "{label} precision {}", m.precision);
        assert!(close(m.recall, r), "{label} recall {}", m.recall);
        assert!(close(m.f1, f1), "{label} f1 {}", m.f1);
        assert_eq!(m.support, support);
    }
}

#[test]
fn report_evaluate_undefined_is_zero() {
    // Class 1 never predicted (precision undefined), class 2 has no support (recall undefined).
    let e = evaluate(&[0, 0, 2], &[0, 1, 1], &labels(&["a", "b", "c"]), None);
    assert!(close(e.accuracy, 1.0 / 3.0));
    let b = &e.per_class[1];
    assert_eq!((b.precision, b.recall, b.f1, b.support), (0.0, 0.0, 0.0, 2));
    let c = &e.per_class[2];
    assert_eq!((c.precision, c.recall, c.f1, c.support), (0.0, 0.0, 0.0, 0));
    // No samples at all.
    let empty = evaluate(&[], &[], &labels(&["a"]), None);
    assert_eq!(empty.accuracy, 0.0);
    assert_eq!(empty.confusion, vec![vec![0]]);
    // Out-of-range indices get their own class.
    let extra = evaluate(&[3], &[0], &labels(&["a"]), None);
    assert_eq!(
        extra.labels,
        labels(&["a", "class_1", "class_2", "class_3"])
    );
    assert_eq!(extra.confusion[0][3], 1);
}

#[test]
fn report_table_has_labels_and_numbers() {
    let mut e = example();
    e.labels[2] = "a-very-long-bird-label".into();
    e.per_class[2].label = e.labels[2].clone();
    let t = e.to_table();
    println!("{t}");
    assert!(t.contains("accuracy: 0.5556 (5/9 correct)"), "{t}");
    assert!(t.contains("loss: 0.8125"), "{t}");
    for label in ["cat", "dog", "a-very-lo…"] {
        assert!(t.contains(label), "{label} missing:\n{t}");
    }
    assert!(!t.contains("a-very-long"), "long label not truncated:\n{t}");
    for number in ["0.5000", "0.6667", "0.5714", "0.3333", "0.4000", "1.0000"] {
        assert!(t.contains(number), "{number} missing:\n{t}");
    }
    assert!(t.contains("precision") && t.contains("recall") && t.contains("support"));
    assert!(t.contains("true\\pred"));
    let bird_row = t
        .lines()
        .rev()
        .find(|l| l.starts_with("a-very-lo…"))
        .unwrap();
    let counts: Vec<&str> = bird_row.split_whitespace().skip(1).collect();
    assert_eq!(counts, ["1", "1", "2"]);
}

fn sample_metrics(n: usize) -> Vec<EpochMetrics> {
    (1..=n)
        .map(|e| {
            let x = e as f64;
            EpochMetrics {
                epoch: e,
                train_loss: 2.0 / x,
                train_accuracy: 1.0 - 0.5 / x,
                val_loss: 2.2 / x + 0.05,
                val_accuracy: 0.95 - 0.5 / x,
                samples_per_s: 100.0,
            }
        })
        .collect()
}

fn check_png(path: &Path) {
    assert!(
        fs::metadata(path).unwrap().len() > 0,
        "{} empty",
        path.display()
    );
    let img = image::open(path).unwrap().to_rgb8();
    assert_eq!(img.dimensions(), (800, 500), "{}", path.display());
    let first = *img.get_pixel(0, 0);
    assert!(
        img.pixels().any(|p| *p != first),
        "{} is blank",
        path.display()
    );
}

/// `KESTREL_KEEP_PLOTS=dir` copies the test plots to `dir/<case>/` for a look.
fn keep_plots(paths: &[PathBuf], case: &str) {
    if let Some(keep) = std::env::var_os("KESTREL_KEEP_PLOTS") {
        let keep = PathBuf::from(keep).join(case);
        fs::create_dir_all(&keep).unwrap();
        for p in paths {
            fs::copy(p, keep.join(p.file_name().unwrap())).unwrap();
        }
    }
}

#[test]
fn report_plot_curves_writes_pngs() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plots");
    let paths = plot_curves(&sample_metrics(12), &out).unwrap();
    assert_eq!(paths, vec![out.join("loss.png"), out.join("accuracy.png")]);
    for p in &paths {
        check_png(p);
    }
    keep_plots(&paths, "twelve");
    // Nothing but the two PNGs (no temp files).
    let mut names: Vec<_> = fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["accuracy.png", "loss.png"]);
}

#[test]
fn report_plot_curves_one_epoch_and_no_font() {
    let dir = tempfile::tempdir().unwrap();
    let one = plot_curves(&sample_metrics(1), dir.path()).unwrap();
    for p in &one {
        check_png(p);
    }
    keep_plots(&one, "one");
    // Without text (as when no font file exists) the curves are still drawn.
    let bare = dir.path().join("bare");
    let mut m = sample_metrics(5);
    m[2].val_loss = f64::NAN;
    let bare = plot_curves_with(&m, &bare, false).unwrap();
    for p in &bare {
        check_png(p);
    }
    keep_plots(&bare, "no-font");
    assert!(matches!(
        plot_curves(&[], dir.path()),
        Err(ReportError::NoMetrics)
    ));
}

#[test]
fn report_jsonl_roundtrip_and_truncated_tail() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("metrics.jsonl");
    let rows = sample_metrics(3);
    for r in &rows {
        append_jsonl(&path, r).unwrap();
    }
    assert_eq!(read_jsonl::<EpochMetrics>(&path).unwrap(), rows);

    // A crash mid-append leaves a partial last line: skipped on read.
    let mut f = OpenOptions::new().append(true).open(&path).unwrap();
    f.write_all(br#"{"epoch":4,"train_loss":0.3,"trai"#)
        .unwrap();
    drop(f);
    assert_eq!(read_jsonl::<EpochMetrics>(&path).unwrap(), rows);

    // The next append cuts the fragment off rather than gluing onto it.
    let next = sample_metrics(4).pop().unwrap();
    append_jsonl(&path, &next).unwrap();
    let mut all = rows.clone();
    all.push(next);
    assert_eq!(read_jsonl::<EpochMetrics>(&path).unwrap(), all);
    assert_eq!(fs::read_to_string(&path).unwrap().lines().count(), 4);
}

#[test]
fn report_jsonl_corrupt_middle_line_names_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("metrics.jsonl");
    let rows = sample_metrics(3);
    let mut text = String::new();
    text.push_str(&serde_json::to_string(&rows[0]).unwrap());
    text.push('\n');
    text.push_str("{\"epoch\": 2, garbage\n");
    text.push_str(&serde_json::to_string(&rows[2]).unwrap());
    text.push('\n');
    fs::write(&path, text).unwrap();
    let err = read_jsonl::<EpochMetrics>(&path).unwrap_err();
    assert!(
        matches!(err, ReportError::CorruptLine { line: 2, .. }),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(msg.contains("metrics.jsonl:2:"), "{msg}");

    // A complete (newline-terminated) corrupt last line is an error too, not a crash tail.
    let rows_text = format!("{}\nnot json\n", serde_json::to_string(&rows[0]).unwrap());
    fs::write(&path, rows_text).unwrap();
    let err = read_jsonl::<EpochMetrics>(&path).unwrap_err();
    assert!(
        matches!(err, ReportError::CorruptLine { line: 2, .. }),
        "{err:?}"
    );
}

#[test]
fn report_write_json_atomic_leaves_no_temp_files() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("evaluation.json");
    let e = example();
    write_json_atomic(&path, &e).unwrap();
    write_json_atomic(&path, &e).unwrap(); // overwrite
    let text = fs::read_to_string(&path).unwrap();
    assert!(text.contains("\n  \"accuracy\""), "not pretty:\n{text}");
    let back: Evaluation = serde_json::from_str(&text).unwrap();
    assert_eq!(back.confusion, e.confusion);
    let names: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, ["evaluation.json"]);
    // A failing write (missing directory) leaves nothing behind either.
    assert!(write_json_atomic(&dir.path().join("missing/x.json"), &e).is_err());
}

#[test]
fn accuracy_counts_only_the_pairs_both_sides_have() {
    // Three pairs (the fourth truth has no prediction), two of them hits.
    assert!(close(accuracy([1, 2, 3], [1, 0, 3, 4]), 2.0 / 3.0));
    assert_eq!(accuracy(Vec::<usize>::new(), [1, 2]), 0.0);
}

#[test]
fn labels_over_ten_characters_are_cut_to_nine_and_an_ellipsis_counting_chars() {
    assert_eq!(short_label("abcdefghij"), "abcdefghij");
    assert_eq!(short_label("abcdefghijk"), "abcdefghi…");
    // Characters, not bytes: eleven two-byte characters are cut the same way.
    assert_eq!(short_label(&"é".repeat(11)), format!("{}…", "é".repeat(9)));
    assert_eq!(pad_left("…", 3), "  …");
    assert_eq!(pad_right("é", 3), "é  ");
}

#[test]
fn most_confused_keeps_the_five_commonest_mistakes_ties_in_matrix_order() {
    // (truth, pred, times): one correct sample and seven kinds of mistake.
    let pairs = [
        (0, 0, 1),
        (0, 1, 3),
        (0, 2, 1),
        (1, 0, 2),
        (1, 3, 1),
        (2, 3, 4),
        (3, 0, 1),
        (3, 2, 2),
    ];
    let (mut truth, mut pred) = (Vec::new(), Vec::new());
    for (t, p, n) in pairs {
        for _ in 0..n {
            truth.push(t);
            pred.push(p);
        }
    }
    let e = evaluate(&pred, &truth, &labels(&["a", "b", "c", "d"]), None);
    assert_eq!(e.samples, 15);
    assert!(close(e.accuracy, 1.0 / 15.0));
    let named = confused(&e);
    assert_eq!(
        named,
        [
            ("c", "d", 4),
            ("a", "b", 3),
            ("b", "a", 2),
            ("d", "c", 2),
            ("a", "c", 1)
        ]
    );
}

#[test]
fn a_complete_last_line_without_its_newline_is_kept_when_appending() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("metrics.jsonl");
    let rows = sample_metrics(2);
    let first = serde_json::to_string(&rows[0]).unwrap();
    fs::write(&path, &first).unwrap();
    assert_eq!(
        read_jsonl::<EpochMetrics>(&path).unwrap(),
        rows[..1].to_vec()
    );
    append_jsonl(&path, &rows[1]).unwrap();
    let second = serde_json::to_string(&rows[1]).unwrap();
    assert_eq!(
        fs::read_to_string(&path).unwrap(),
        format!("{first}\n{second}\n")
    );
    assert_eq!(read_jsonl::<EpochMetrics>(&path).unwrap(), rows);
}

#[test]
fn the_table_s_macro_average_is_the_plain_mean_over_classes() {
    let t = example().to_table();
    let row = t.lines().find(|l| l.starts_with("macro avg")).unwrap();
    let cells: Vec<&str> = row.split_whitespace().skip(2).collect();
    // Precision (1/2 + 1/3 + 1)/3, recall (2/3 + 1/2 + 1/2)/3, F1 (4/7 + 2/5 + 2/3)/3;
    // support: all samples.
    assert_eq!(cells, ["0.6111", "0.5556", "0.5460", "9"], "{t}");
}

/// An evaluation's most confused pairs as (truth, predicted, count).
fn confused(e: &Evaluation) -> Vec<(&str, &str, usize)> {
    e.most_confused
        .iter()
        .map(|c| (c.truth.as_str(), c.predicted.as_str(), c.count))
        .collect()
}
