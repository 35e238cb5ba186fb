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
use serde::{Deserialize, Serialize};

pub mod cache;
pub mod features;
pub mod samples;
pub mod split;

pub use features::Features;
pub use samples::Prepared;
pub use split::Split;

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

/// Column names for CSV manifests and Parquet tables (saved in a run's `params.json`).
#[derive(Clone, Debug, Serialize, Deserialize)]
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
    #[error(
        "{}: a Delta table (it has _delta_log/). Kestrel does not read Delta tables yet, and reading its \
         Parquet files directly would include rows that overwrites and deletes removed. Export the current \
         snapshot to Parquet (e.g. Spark `spark.table(...).write.parquet(DIR)` or delta-rs \
         `DeltaTable(PATH).to_pyarrow_table()` + `pyarrow.parquet.write_table`) and train on that",
        path.display()
    )]
    DeltaTable { path: PathBuf },
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
        if path.join("_delta_log").is_dir() {
            return Err(DataError::DeltaTable {
                path: path.to_path_buf(),
            });
        }
        let parts = parquet_parts(path)?;
        if parts.is_empty() {
            return image_folder(path);
        }
        let mut columns: Vec<&str> = parts
            .iter()
            .flat_map(|p| p.partition.iter().map(|(c, _)| c.as_str()))
            .collect();
        columns.sort_unstable();
        columns.dedup();
        let by = match columns.is_empty() {
            true => String::new(),
            false => format!(", partitioned by {}", columns.join(", ")),
        };
        (
            read_parquet(&parts, opts)?,
            format!("parquet {} ({} files{by})", path.display(), parts.len()),
        )
    } else if ext(path).as_deref() == Some("csv") {
        (read_csv(path, opts)?, format!("csv {}", path.display()))
    } else if ext(path).as_deref() == Some("parquet") {
        let file = PartFile {
            path: path.to_path_buf(),
            partition: Vec::new(),
        };
        (
            read_parquet(&[file], opts)?,
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

/// One Parquet file of a table and the Hive partition values of the directories above it
/// (`label=cat/part-0.parquet` gives `[("label", "cat")]`).
#[derive(Debug, Clone, PartialEq, Eq)]
struct PartFile {
    path: PathBuf,
    partition: Vec<(String, String)>,
}

/// The Parquet files of a table directory: `*.parquet` part files, directly in `dir` (Spark
/// `write.parquet`) or under Hive partition directories `column=value/` at any depth (Spark
/// `partitionBy`, pyarrow `partition_cols`), in path order. Entries starting with `_` or `.` are
/// skipped as Spark does (`_SUCCESS`, `_delta_log`, `.crc` files); a directory without `=` is not
/// part of a table (so an ImageFolder yields nothing). Partition values are unescaped (`%3A` is
/// `:`); Hive's `__HIVE_DEFAULT_PARTITION__` is a null value.
fn parquet_parts(dir: &Path) -> Result<Vec<PartFile>, DataError> {
    let mut out = Vec::new();
    collect_parts(dir, &mut Vec::new(), &mut out)?;
    Ok(out)
}

fn collect_parts(
    dir: &Path,
    partition: &mut Vec<(String, String)>,
    out: &mut Vec<PartFile>,
) -> Result<(), DataError> {
    for p in sorted_entries(dir)?.into_iter().filter(|p| !hidden(p)) {
        let name = p.file_name().unwrap_or_default().to_string_lossy();
        if p.is_dir() {
            let Some((column, value)) = name.split_once('=') else {
                continue;
            };
            let value = percent_encoding::percent_decode_str(value)
                .decode_utf8_lossy()
                .into_owned();
            partition.push((column.to_string(), value));
            collect_parts(&p, partition, out)?;
            partition.pop();
        } else if p
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| e.eq_ignore_ascii_case("parquet"))
        {
            out.push(PartFile {
                path: p.clone(),
                partition: partition.clone(),
            });
        }
    }
    Ok(())
}

/// Hive's name for a null partition value.
const HIVE_NULL: &str = "__HIVE_DEFAULT_PARTITION__";

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

fn read_parquet(files: &[PartFile], opts: &SourceOpts) -> Result<Vec<Row>, DataError> {
    let mut rows = Vec::new();
    for file in files {
        read_parquet_file(file, opts, &mut rows)?;
    }
    Ok(rows)
}

/// A column of the rows: read from the file, or one partition value for the whole file.
enum Column<'a> {
    File(usize),
    Partition(&'a str),
}

fn read_parquet_file(
    part: &PartFile,
    opts: &SourceOpts,
    rows: &mut Vec<Row>,
) -> Result<(), DataError> {
    let file = part.path.as_path();
    let handle = fs::File::open(file).map_err(io_err(file))?;
    let builder = ParquetRecordBatchReaderBuilder::try_new(handle).map_err(|e| pq_err(file, e))?;
    let schema = builder.schema().clone();
    let found: Vec<String> = schema
        .fields()
        .iter()
        .map(|f| f.name().clone())
        .chain(
            part.partition
                .iter()
                .map(|(c, _)| format!("{c} (partition)")),
        )
        .collect();
    let partition_value = |name: &str| {
        part.partition
            .iter()
            .rev()
            .find(|(c, _)| c == name)
            .map(|(_, v)| v.as_str())
    };
    let content_i =
        schema
            .index_of(&opts.content_column)
            .map_err(|_| DataError::MissingContentColumn {
                file: file.to_path_buf(),
                column: opts.content_column.clone(),
                found: found.clone(),
            })?;
    let label = match (
        schema.index_of(&opts.label_column),
        partition_value(&opts.label_column),
    ) {
        (Ok(i), _) => Column::File(i),
        (Err(_), Some(v)) => Column::Partition(v),
        (Err(_), None) => {
            return Err(DataError::MissingColumn {
                file: file.to_path_buf(),
                role: "label",
                column: opts.label_column.clone(),
                found: found.clone(),
            });
        }
    };
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
    if let Column::File(i) = label
        && !label_type_ok(&type_of(i))
    {
        return Err(DataError::UnsupportedLabelType {
            file: file.to_path_buf(),
            column: opts.label_column.clone(),
            found: type_of(i).to_string(),
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
    let label_i = match label {
        Column::File(i) => Some(i),
        Column::Partition(_) => None,
    };
    let roots = [content_i].into_iter().chain(label_i).chain(path_i);
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
        let labels = match label {
            Column::File(_) => {
                Some(cast(&col(&opts.label_column), &DataType::Utf8).map_err(|e| pq_err(file, e))?)
            }
            Column::Partition(_) => None,
        };
        let labels = labels.as_ref().map(|l| l.as_string::<i32>());
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
            let name = match (&labels, &label) {
                (Some(l), _) if l.is_null(i) => None,
                (Some(l), _) => Some(l.value(i)),
                (None, Column::Partition(v)) => Some(*v).filter(|v| *v != HIVE_NULL),
                (None, Column::File(_)) => unreachable!("a file column is read"),
            };
            let Some(name) = name else {
                return Err(null(&opts.label_column, row));
            };
            let bytes = match content.data_type() {
                DataType::Binary => content.as_binary::<i32>().value(i).to_vec(),
                DataType::LargeBinary => content.as_binary::<i64>().value(i).to_vec(),
                _ => content.as_binary_view().value(i).to_vec(),
            };
            let id = match &paths {
                Some(p) if !p.is_null(i) => p.as_string::<i32>().value(i).to_string(),
                _ => format!("{}#row {row}", file.display()),
            };
            rows.push((id, bytes, name.to_string()));
            row += 1;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
