//! Image-table sources: an ImageFolder tree, a `path,label` CSV manifest, or Parquet (one file or a
//! Spark output directory of part files, shaped like Spark's binaryFile reader: `path`, `content`,
//! `label`). Every source loads to the same [`Dataset`]: encoded image bytes and class indices.
//! Images are not decoded here; the caller validates them with the shared preprocessing.
//!
//! Class names are sorted: numerically when every label is a canonical decimal integer (so integer
//! Parquet labels, CSV labels and ImageFolder directory names agree, and 2 < 10), otherwise
//! lexicographically. Samples keep a deterministic order: ImageFolder by class then file name,
//! CSV and Parquet by row (part files sorted by name).

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use arrow::array::{Array, AsArray};
use arrow::compute::cast;
use arrow::datatypes::DataType;
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

const IMAGE_EXTENSIONS: [&str; 4] = ["png", "jpg", "jpeg", "bmp"];

/// One labelled image: its encoded bytes and the index of its class in [`Dataset::labels`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    /// The file path; for Parquet the row's path column value, or `<file>#row <n>`.
    pub id: String,
    pub bytes: Vec<u8>,
    pub label: usize,
}

#[derive(Clone, Debug)]
pub struct Dataset {
    pub samples: Vec<Sample>,
    /// `labels[i]` is the name of class `i`.
    pub labels: Vec<String>,
    /// What was loaded, e.g. `parquet /data/digits.parquet`.
    pub source: String,
}

/// Column names for CSV manifests and Parquet tables.
#[derive(Clone, Debug)]
pub struct SourceOpts {
    pub label_column: String,
    pub content_column: String,
    pub path_column: String,
}

impl Default for SourceOpts {
    fn default() -> Self {
        Self {
            label_column: "label".into(),
            content_column: "content".into(),
            path_column: "path".into(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: expected a .csv or .parquet file, or a directory (ImageFolder or Parquet part files)", path.display())]
    UnsupportedSource { path: PathBuf },
    #[error("{}: {message}", path.display())]
    Csv { path: PathBuf, message: String },
    #[error("cannot read Parquet {}: {message}", path.display())]
    Parquet { path: PathBuf, message: String },
    #[error("{}: no {role} column `{column}`; columns are: {}", file.display(), found.join(", "))]
    MissingColumn {
        file: PathBuf,
        role: &'static str,
        column: String,
        found: Vec<String>,
    },
    #[error("{}: no content column `{column}` (expected binary image bytes); columns are: {}", file.display(), found.join(", "))]
    MissingContentColumn {
        file: PathBuf,
        column: String,
        found: Vec<String>,
    },
    #[error("{}: column `{column}` has type {found}, expected {expected}", file.display())]
    WrongColumnType {
        file: PathBuf,
        column: String,
        expected: &'static str,
        found: String,
    },
    #[error("{}: label column `{column}` has unsupported type {found}, expected a string or integer type", file.display())]
    UnsupportedLabelType {
        file: PathBuf,
        column: String,
        found: String,
    },
    #[error("{}: null in column `{column}` at row {row}", file.display())]
    NullValue {
        file: PathBuf,
        column: String,
        row: usize,
    },
    #[error("empty class `{class}` in {}: no .png/.jpg/.jpeg/.bmp files", dir.display())]
    EmptyClass { class: String, dir: PathBuf },
    #[error("{}: line {line}: image file {} does not exist", csv.display(), path.display())]
    MissingFile {
        csv: PathBuf,
        line: u64,
        path: PathBuf,
    },
    #[error("{}: empty dataset (no samples found)", path.display())]
    EmptyDataset { path: PathBuf },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn pq_err(path: &Path, e: impl std::fmt::Display) -> DataError {
    DataError::Parquet {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// Loads a dataset, detecting the source from `path`: a `.csv` file, a `.parquet` file, a
/// directory holding `*.parquet` files, or else an ImageFolder directory (`root/<class>/<image>`).
pub fn load(path: &Path, opts: &SourceOpts) -> Result<Dataset, DataError> {
    let meta = fs::metadata(path).map_err(io_err(path))?;
    let ext = |p: &Path| {
        p.extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
    };
    let (rows, source) = if meta.is_dir() {
        let parts = parquet_parts(path)?;
        if parts.is_empty() {
            return image_folder(path);
        }
        (
            read_parquet(&parts, opts)?,
            format!("parquet {} ({} files)", path.display(), parts.len()),
        )
    } else if ext(path).as_deref() == Some("csv") {
        (read_csv(path, opts)?, format!("csv {}", path.display()))
    } else if ext(path).as_deref() == Some("parquet") {
        (
            read_parquet(&[path.to_path_buf()], opts)?,
            format!("parquet {}", path.display()),
        )
    } else {
        return Err(DataError::UnsupportedSource {
            path: path.to_path_buf(),
        });
    };
    if rows.is_empty() {
        return Err(DataError::EmptyDataset {
            path: path.to_path_buf(),
        });
    }
    let (labels, index) = sort_labels(rows.iter().map(|r| r.2.as_str()));
    let samples = rows
        .into_iter()
        .map(|(id, bytes, label)| Sample {
            id,
            bytes,
            label: index[&label],
        })
        .collect();
    Ok(Dataset {
        samples,
        labels,
        source,
    })
}

/// Sorted class names (numeric when all are canonical decimal integers) and name -> index.
fn sort_labels<'a>(names: impl Iterator<Item = &'a str>) -> (Vec<String>, HashMap<String, usize>) {
    let set: BTreeSet<&str> = names.collect();
    let mut labels: Vec<String> = set.into_iter().map(String::from).collect();
    let canonical = |s: &String| s.parse::<i64>().is_ok_and(|v| v.to_string() == *s);
    if labels.iter().all(canonical) {
        labels.sort_by_key(|s| s.parse::<i64>().unwrap());
    }
    let index = labels
        .iter()
        .enumerate()
        .map(|(i, s)| (s.clone(), i))
        .collect();
    (labels, index)
}

/// Sorted directory entries (by file name).
fn sorted_entries(dir: &Path) -> Result<Vec<PathBuf>, DataError> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_err(dir))? {
        out.push(entry.map_err(io_err(dir))?.path());
    }
    out.sort();
    Ok(out)
}

fn hidden(p: &Path) -> bool {
    p.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with('.') || n.starts_with('_'))
}

/// The `*.parquet` files directly in `dir` (Spark part files), skipping `_`/`.`-prefixed names.
fn parquet_parts(dir: &Path) -> Result<Vec<PathBuf>, DataError> {
    Ok(sorted_entries(dir)?
        .into_iter()
        .filter(|p| !hidden(p) && p.is_file())
        .filter(|p| {
            p.extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| e.eq_ignore_ascii_case("parquet"))
        })
        .collect())
}

fn image_folder(root: &Path) -> Result<Dataset, DataError> {
    let is_image = |p: &Path| {
        p.extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| IMAGE_EXTENSIONS.iter().any(|x| e.eq_ignore_ascii_case(x)))
    };
    let mut classes = Vec::new();
    for dir in sorted_entries(root)?
        .into_iter()
        .filter(|p| p.is_dir() && !hidden(p))
    {
        let class = dir.file_name().unwrap().to_string_lossy().into_owned();
        let files: Vec<PathBuf> = sorted_entries(&dir)?
            .into_iter()
            .filter(|p| p.is_file() && is_image(p))
            .collect();
        if files.is_empty() {
            return Err(DataError::EmptyClass {
                class,
                dir: root.to_path_buf(),
            });
        }
        classes.push((class, files));
    }
    if classes.is_empty() {
        return Err(DataError::EmptyDataset {
            path: root.to_path_buf(),
        });
    }
    let (labels, index) = sort_labels(classes.iter().map(|c| c.0.as_str()));
    classes.sort_by_key(|c| index[&c.0]);
    let mut samples = Vec::new();
    for (class, files) in classes {
        for file in files {
            let bytes = fs::read(&file).map_err(io_err(&file))?;
            samples.push(Sample {
                id: file.display().to_string(),
                bytes,
                label: index[&class],
            });
        }
    }
    Ok(Dataset {
        samples,
        labels,
        source: format!("imagefolder {}", root.display()),
    })
}

type Row = (String, Vec<u8>, String);

fn read_csv(csv_path: &Path, opts: &SourceOpts) -> Result<Vec<Row>, DataError> {
    let csv_err = |e: csv::Error| DataError::Csv {
        path: csv_path.to_path_buf(),
        message: e.to_string(),
    };
    let file = fs::File::open(csv_path).map_err(io_err(csv_path))?;
    let mut reader = csv::ReaderBuilder::new()
        .trim(csv::Trim::All)
        .from_reader(file);
    let headers = reader.headers().map_err(csv_err)?.clone();
    let found: Vec<String> = headers.iter().map(String::from).collect();
    let column = |role: &'static str, name: &str| {
        headers
            .iter()
            .position(|h| h == name)
            .ok_or_else(|| DataError::MissingColumn {
                file: csv_path.to_path_buf(),
                role,
                column: name.to_string(),
                found: found.clone(),
            })
    };
    let path_i = column("path", &opts.path_column)?;
    let label_i = column("label", &opts.label_column)?;
    let base = csv_path.parent().unwrap_or(Path::new(""));
    let mut rows = Vec::new();
    for record in reader.records() {
        let record = record.map_err(csv_err)?;
        let line = record.position().map_or(0, |p| p.line());
        let rel = record.get(path_i).unwrap_or("");
        let label = record.get(label_i).unwrap_or("");
        let full = base.join(rel);
        if rel.is_empty() || !full.exists() {
            return Err(DataError::MissingFile {
                csv: csv_path.to_path_buf(),
                line,
                path: full,
            });
        }
        let bytes = fs::read(&full).map_err(io_err(&full))?;
        rows.push((full.display().to_string(), bytes, label.to_string()));
    }
    Ok(rows)
}

fn label_type_ok(t: &DataType) -> bool {
    use DataType::*;
    match t {
        Utf8 | LargeUtf8 | Utf8View | Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32
        | UInt64 => true,
        Dictionary(_, values) => label_type_ok(values),
        _ => false,
    }
}

fn read_parquet(files: &[PathBuf], opts: &SourceOpts) -> Result<Vec<Row>, DataError> {
    let mut rows = Vec::new();
    for file in files {
        read_parquet_file(file, opts, &mut rows)?;
    }
    Ok(rows)
}

fn read_parquet_file(file: &Path, opts: &SourceOpts, rows: &mut Vec<Row>) -> Result<(), DataError> {
    let handle = fs::File::open(file).map_err(io_err(file))?;
    let builder = ParquetRecordBatchReaderBuilder::try_new(handle).map_err(|e| pq_err(file, e))?;
    let schema = builder.schema().clone();
    let found: Vec<String> = schema.fields().iter().map(|f| f.name().clone()).collect();
    let content_i =
        schema
            .index_of(&opts.content_column)
            .map_err(|_| DataError::MissingContentColumn {
                file: file.to_path_buf(),
                column: opts.content_column.clone(),
                found: found.clone(),
            })?;
    let label_i = schema
        .index_of(&opts.label_column)
        .map_err(|_| DataError::MissingColumn {
            file: file.to_path_buf(),
            role: "label",
            column: opts.label_column.clone(),
            found: found.clone(),
        })?;
    let path_i = schema.index_of(&opts.path_column).ok();
    let type_of = |i: usize| schema.field(i).data_type().clone();
    if !matches!(
        type_of(content_i),
        DataType::Binary | DataType::LargeBinary | DataType::BinaryView
    ) {
        return Err(DataError::WrongColumnType {
            file: file.to_path_buf(),
            column: opts.content_column.clone(),
            expected: "binary or large binary (image bytes)",
            found: type_of(content_i).to_string(),
        });
    }
    if !label_type_ok(&type_of(label_i)) {
        return Err(DataError::UnsupportedLabelType {
            file: file.to_path_buf(),
            column: opts.label_column.clone(),
            found: type_of(label_i).to_string(),
        });
    }
    if let Some(i) = path_i.filter(|&i| {
        !matches!(
            type_of(i),
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
        )
    }) {
        return Err(DataError::WrongColumnType {
            file: file.to_path_buf(),
            column: opts.path_column.clone(),
            expected: "string",
            found: type_of(i).to_string(),
        });
    }
    let roots = [content_i, label_i].into_iter().chain(path_i);
    let mask = ProjectionMask::roots(builder.parquet_schema(), roots);
    let reader = builder
        .with_projection(mask)
        .build()
        .map_err(|e| pq_err(file, e))?;
    let null = |column: &str, row: usize| DataError::NullValue {
        file: file.to_path_buf(),
        column: column.into(),
        row,
    };
    let mut row = 0;
    for batch in reader {
        let batch = batch.map_err(|e| pq_err(file, e))?;
        let col = |name: &str| {
            batch
                .column_by_name(name)
                .expect("projected column")
                .clone()
        };
        let content = col(&opts.content_column);
        let labels =
            cast(&col(&opts.label_column), &DataType::Utf8).map_err(|e| pq_err(file, e))?;
        let labels = labels.as_string::<i32>();
        let paths = match path_i {
            Some(_) => {
                Some(cast(&col(&opts.path_column), &DataType::Utf8).map_err(|e| pq_err(file, e))?)
            }
            None => None,
        };
        for i in 0..batch.num_rows() {
            if content.is_null(i) {
                return Err(null(&opts.content_column, row));
            }
            if labels.is_null(i) {
                return Err(null(&opts.label_column, row));
            }
            let bytes = match content.data_type() {
                DataType::Binary => content.as_binary::<i32>().value(i).to_vec(),
                DataType::LargeBinary => content.as_binary::<i64>().value(i).to_vec(),
                _ => content.as_binary_view().value(i).to_vec(),
            };
            let id = match &paths {
                Some(p) if !p.is_null(i) => p.as_string::<i32>().value(i).to_string(),
                _ => format!("{}#row {row}", file.display()),
            };
            rows.push((id, bytes, labels.value(i).to_string()));
            row += 1;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{
        ArrayRef, BinaryArray, Float64Array, Int32Array, Int64Array, RecordBatch, StringArray,
    };
    use parquet::arrow::ArrowWriter;
    use parquet::basic::Compression;
    use parquet::file::properties::WriterProperties;
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
        let batch = RecordBatch::try_from_iter(columns).unwrap();
        let props = WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .set_max_row_group_row_count(Some(rows_per_group))
            .build();
        let mut w =
            ArrowWriter::try_new(fs::File::create(path).unwrap(), batch.schema(), Some(props))
                .unwrap();
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
            .map(|s| (s.bytes.clone(), ds.labels[s.label].clone()))
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
            all[3].samples.iter().map(|s| &s.bytes).collect::<Vec<_>>(),
            all[2].samples.iter().map(|s| &s.bytes).collect::<Vec<_>>()
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
}
