//! Arrow tables of images (Parquet files, Hive-partitioned directories, Delta tables): which
//! column plays which role, checked once per schema, and the rows of each record batch.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use arrow::array::{Array, ArrayRef, AsArray, RecordBatch};
use arrow::compute::cast;
use arrow::datatypes::{DataType, Schema};
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::file::reader::ChunkReader;

use super::spool::Rows;
use super::{DataError, SourceOpts, io_err, pq_err};

/// One Parquet file of a table and the Hive partition values of the directories above it
/// (`label=cat/part-0.parquet` gives `[("label", "cat")]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct PartFile {
    pub path: PathBuf,
    pub partition: Vec<(String, String)>,
}

/// What a null label's error suggests.
pub(super) const UNLABELLED_HINT: &str =
    "\n(pass --skip-unlabelled to leave out rows without a label, e.g. captures not labelled yet)";

/// Rows per record batch read from a table: image rows are large (a camera frame is ~100 kB),
/// so Arrow's default of 1,024 would hold ~100 MB at once.
pub(super) const BATCH_ROWS: usize = 64;

/// Hive's name for a null partition value.
pub(crate) const HIVE_NULL: &str = "__HIVE_DEFAULT_PARTITION__";

/// Where the label comes from: a column of the data, or one partition value for a whole file.
#[derive(Clone, Copy)]
enum Label<'a> {
    Column,
    Partition(&'a str),
}

/// The columns of a schema that hold each role, checked for presence and type.
pub(super) struct Roles<'a> {
    label: Label<'a>,
    has_path: bool,
    /// Labels by path that take precedence over the label column (a capture table's labels
    /// table).
    labels: Option<&'a HashMap<String, String>>,
    /// The columns to read, in schema order.
    pub read: Vec<usize>,
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

impl<'a> Roles<'a> {
    /// Resolves `opts`' columns in `schema` (from `origin`), a missing label column falling back
    /// to a partition value.
    pub fn resolve(
        schema: &Schema,
        partition: &'a [(String, String)],
        opts: &SourceOpts,
        origin: &Path,
    ) -> Result<Self, DataError> {
        let found: Vec<String> = schema
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .chain(partition.iter().map(|(c, _)| format!("{c} (partition)")))
            .collect();
        let type_of = |i: usize| schema.field(i).data_type().clone();
        let wrong = |column: &str, expected: &'static str, i: usize| DataError::WrongColumnType {
            file: origin.to_path_buf(),
            column: column.to_string(),
            expected,
            found: type_of(i).to_string(),
        };
        let content =
            schema
                .index_of(&opts.content_column)
                .map_err(|_| DataError::MissingContentColumn {
                    file: origin.to_path_buf(),
                    column: opts.content_column.clone(),
                    found: found.clone(),
                })?;
        if !matches!(
            type_of(content),
            DataType::Binary | DataType::LargeBinary | DataType::BinaryView
        ) {
            let expected = "binary or large binary (image bytes)";
            return Err(wrong(&opts.content_column, expected, content));
        }
        let partition_value = partition
            .iter()
            .rev()
            .find(|(c, _)| *c == opts.label_column)
            .map(|(_, v)| v.as_str());
        let (label, label_i) = match (schema.index_of(&opts.label_column), partition_value) {
            (Ok(i), _) if !label_type_ok(&type_of(i)) => {
                return Err(DataError::UnsupportedLabelType {
                    file: origin.to_path_buf(),
                    column: opts.label_column.clone(),
                    found: type_of(i).to_string(),
                });
            }
            (Ok(i), _) => (Label::Column, Some(i)),
            (Err(_), Some(v)) => (Label::Partition(v), None),
            (Err(_), None) => {
                return Err(DataError::MissingColumn {
                    file: origin.to_path_buf(),
                    role: "label",
                    column: opts.label_column.clone(),
                    found,
                });
            }
        };
        let path = schema.index_of(&opts.path_column).ok();
        if let Some(i) = path.filter(|&i| {
            !matches!(
                type_of(i),
                DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
            )
        }) {
            return Err(wrong(&opts.path_column, "string", i));
        }
        let mut read: Vec<usize> = [Some(content), label_i, path]
            .into_iter()
            .flatten()
            .collect();
        read.sort_unstable();
        Ok(Self {
            label,
            has_path: path.is_some(),
            labels: None,
            read,
        })
    }

    /// Takes each row's label from `labels` by its path where it has one there (the label column
    /// otherwise); the table must have the path column.
    pub fn with_labels(
        self,
        labels: &'a HashMap<String, String>,
        opts: &SourceOpts,
        origin: &Path,
    ) -> Result<Self, DataError> {
        if !self.has_path {
            return Err(DataError::MissingColumn {
                file: origin.to_path_buf(),
                role: "path (the labels table's key)",
                column: opts.path_column.clone(),
                found: Vec::new(),
            });
        }
        Ok(Self {
            labels: Some(labels),
            ..self
        })
    }

    /// Appends the rows of `batch` (holding at least the resolved columns) to `rows`; `row` counts
    /// the rows of `origin` read so far (for ids and error messages). A row without a label (null
    /// or empty) fails, or with `opts.skip_unlabelled` is counted in `unlabelled` and left out.
    pub fn batch_rows(
        &self,
        batch: &RecordBatch,
        opts: &SourceOpts,
        origin: &Path,
        row: &mut usize,
        rows: &mut Rows,
        unlabelled: &mut usize,
    ) -> Result<(), DataError> {
        let col = |name: &str| -> ArrayRef {
            batch.column_by_name(name).expect("resolved column").clone()
        };
        let utf8 = |name: &str| cast(&col(name), &DataType::Utf8).map_err(|e| pq_err(origin, e));
        let null = |column: &str, row: usize, hint: &'static str| DataError::NullValue {
            file: origin.to_path_buf(),
            column: column.into(),
            row,
            hint,
        };
        let content = col(&opts.content_column);
        let labels = match self.label {
            Label::Column => Some(utf8(&opts.label_column)?),
            Label::Partition(_) => None,
        };
        let labels = labels.as_ref().map(|l| l.as_string::<i32>());
        let paths = self.has_path.then(|| utf8(&opts.path_column)).transpose()?;
        for i in 0..batch.num_rows() {
            if content.is_null(i) {
                return Err(null(&opts.content_column, *row, ""));
            }
            let name = match (&labels, self.label) {
                (Some(l), _) => (!l.is_null(i)).then(|| l.value(i)),
                (None, Label::Partition(v)) => Some(v).filter(|v| *v != HIVE_NULL),
                (None, Label::Column) => unreachable!("a label column is read"),
            };
            let given = match (self.labels, &paths) {
                (Some(by_path), Some(p)) if !p.is_null(i) => {
                    by_path.get(p.as_string::<i32>().value(i))
                }
                _ => None,
            };
            let name = given.map(String::as_str).or(name).filter(|n| !n.is_empty());
            let Some(name) = name else {
                if opts.skip_unlabelled {
                    *unlabelled += 1;
                    *row += 1;
                    continue;
                }
                return Err(null(&opts.label_column, *row, UNLABELLED_HINT));
            };
            let bytes = match content.data_type() {
                DataType::Binary => content.as_binary::<i32>().value(i),
                DataType::LargeBinary => content.as_binary::<i64>().value(i),
                _ => content.as_binary_view().value(i),
            };
            let id = match &paths {
                Some(p) if !p.is_null(i) => p.as_string::<i32>().value(i).to_string(),
                _ => format!("{}#row {row}", origin.display()),
            };
            rows.push(id, bytes, name.to_string())?;
            *row += 1;
        }
        Ok(())
    }
}

/// The rows of local Parquet files and the count of unlabelled rows left out.
pub(super) fn read_parquet(
    files: &[PartFile],
    opts: &SourceOpts,
) -> Result<(Rows, usize), DataError> {
    let mut rows = Rows::new()?;
    let mut unlabelled = 0;
    for part in files {
        let file = part.path.as_path();
        let handle = fs::File::open(file).map_err(io_err(file))?;
        let p = &part.partition;
        read_parquet_rows(handle, file, p, opts, &mut rows, &mut unlabelled)?;
    }
    Ok((rows, unlabelled))
}

/// Appends the rows of one Parquet file (`reader`: a local file or fetched bytes; `origin`
/// names it in messages and ids) with its partition values.
pub(super) fn read_parquet_rows<R: ChunkReader + 'static>(
    reader: R,
    origin: &Path,
    partition: &[(String, String)],
    opts: &SourceOpts,
    rows: &mut Rows,
    unlabelled: &mut usize,
) -> Result<(), DataError> {
    let builder =
        ParquetRecordBatchReaderBuilder::try_new(reader).map_err(|e| pq_err(origin, e))?;
    let roles = Roles::resolve(builder.schema(), partition, opts, origin)?;
    let mask = ProjectionMask::roots(builder.parquet_schema(), roles.read.iter().copied());
    let reader = builder
        .with_projection(mask)
        .with_batch_size(BATCH_ROWS)
        .build()
        .map_err(|e| pq_err(origin, e))?;
    let mut row = 0;
    for batch in reader {
        let batch = batch.map_err(|e| pq_err(origin, e))?;
        roles.batch_rows(&batch, opts, origin, &mut row, rows, unlabelled)?;
    }
    Ok(())
}

/// Whether a file of a table directory, by its path relative to the directory, is a Parquet
/// part file, and if so its Hive partition values: `*.parquet` directly in the directory (Spark
/// `write.parquet`) or under `column=value/` directories at any depth (Spark `partitionBy`,
/// pyarrow `partition_cols`). A path with a segment starting with `_` or `.` is skipped as Spark
/// does (`_SUCCESS`, `_delta_log`, `.crc` files); a directory without `=` is not part of a table
/// (so an ImageFolder yields nothing). Values are unescaped (`%3A` is `:`); Hive's
/// `__HIVE_DEFAULT_PARTITION__` stays as a null marker.
pub(crate) fn hive_part(rel: &str) -> Option<Vec<(String, String)>> {
    let mut segments: Vec<&str> = rel.split('/').collect();
    let file = segments.pop()?;
    let hidden = |s: &str| s.starts_with('.') || s.starts_with('_');
    let parquet = file
        .rsplit_once('.')
        .is_some_and(|(_, e)| e.eq_ignore_ascii_case("parquet"));
    if !parquet || hidden(file) {
        return None;
    }
    segments
        .into_iter()
        .map(|dir| {
            let (column, value) = dir.split_once('=').filter(|_| !hidden(dir))?;
            let value = percent_encoding::percent_decode_str(value).decode_utf8_lossy();
            Some((column.to_string(), value.into_owned()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{BinaryArray, StringArray};
    use arrow::datatypes::Field;
    use std::sync::Arc;

    fn schema(fields: &[(&str, DataType)]) -> Schema {
        Schema::new(
            fields
                .iter()
                .map(|(n, t)| Field::new(*n, t.clone(), true))
                .collect::<Vec<_>>(),
        )
    }

    #[test]
    fn hive_values_split_at_the_first_equals_and_keep_the_null_marker() {
        assert_eq!(
            hive_part("expr=a=b/p.parquet"),
            Some(vec![("expr".into(), "a=b".into())])
        );
        assert_eq!(
            hive_part(&format!("label={HIVE_NULL}/p.parquet")),
            Some(vec![("label".into(), HIVE_NULL.into())])
        );
        // Percent escapes are decoded; `+` is no space.
        assert_eq!(
            hive_part("label=a+b%20c/p.parquet"),
            Some(vec![("label".into(), "a+b c".into())])
        );
        assert_eq!(
            hive_part("label=/p.parquet"),
            Some(vec![("label".into(), String::new())])
        );
        for skipped in [
            "_label=x/p.parquet",
            ".label=x/p.parquet",
            "a=1/b/p.parquet",
            "a=1/.parquet",
            "p",
        ] {
            assert_eq!(hive_part(skipped), None, "{skipped}");
        }
    }

    #[test]
    fn roles_take_the_label_column_else_the_deepest_partition_value() {
        let opts = SourceOpts::default();
        let origin = Path::new("t/part-0.parquet");
        let parts: Vec<(String, String)> = [("label", "outer"), ("split", "0"), ("label", "inner")]
            .map(|(c, v)| (c.to_string(), v.to_string()))
            .into();
        let r = Roles::resolve(
            &schema(&[("content", DataType::Binary)]),
            &parts,
            &opts,
            origin,
        )
        .unwrap();
        assert!(matches!(r.label, Label::Partition("inner")));
        assert_eq!(r.read, [0]);
        assert!(!r.has_path);
        let by_path: HashMap<String, String> = HashMap::new();
        let e = r
            .with_labels(&by_path, &opts, origin)
            .err()
            .expect("no path column");
        assert!(
            matches!(&e, DataError::MissingColumn { role: "path (the labels table's key)", column, .. } if column == "path"),
            "{e}"
        );
        // A dictionary label column wins over the partition; the columns read are in schema order.
        let dict = DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8));
        let full = schema(&[
            ("label", dict),
            ("score", DataType::Float64),
            ("path", DataType::Utf8View),
            ("content", DataType::LargeBinary),
        ]);
        let r = Roles::resolve(&full, &parts, &opts, origin).unwrap();
        assert!(matches!(r.label, Label::Column));
        assert_eq!((r.read, r.has_path), (vec![0, 2, 3], true));
        let bad_path = schema(&[
            ("content", DataType::Binary),
            ("label", DataType::Utf8),
            ("path", DataType::Int64),
        ]);
        let e = Roles::resolve(&bad_path, &[], &opts, origin)
            .err()
            .expect("an integer path");
        assert_eq!(
            e.to_string(),
            "t/part-0.parquet: column `path` has type Int64, expected string"
        );
    }

    #[test]
    fn labels_by_path_override_the_label_column_and_an_empty_one_unlabels_the_row() {
        let opts = SourceOpts {
            skip_unlabelled: true,
            ..SourceOpts::default()
        };
        let origin = Path::new("captures");
        let paths = StringArray::from(vec![Some("p1"), Some("p2"), None, Some("p4"), Some("p5")]);
        let labels = StringArray::from(vec![Some("a"), Some("b"), Some("c"), None, Some("e")]);
        let batch = RecordBatch::try_from_iter([
            ("path", Arc::new(paths) as ArrayRef),
            (
                "content",
                Arc::new(BinaryArray::from_iter_values([
                    b"1", b"2", b"3", b"4", b"5",
                ])) as ArrayRef,
            ),
            ("label", Arc::new(labels) as ArrayRef),
        ])
        .unwrap();
        let by_path: HashMap<String, String> = [("p1", "zebra"), ("p4", "yak"), ("p5", "")]
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .into();
        let roles = Roles::resolve(&batch.schema(), &[], &opts, origin)
            .unwrap()
            .with_labels(&by_path, &opts, origin)
            .unwrap();
        let (mut row, mut rows, mut unlabelled) = (0, Rows::new().unwrap(), 0);
        roles
            .batch_rows(&batch, &opts, origin, &mut row, &mut rows, &mut unlabelled)
            .unwrap();
        assert_eq!((row, unlabelled), (5, 1), "p5's empty label leaves it out");
        let names: Vec<String> = rows.labels().map(String::from).collect();
        assert_eq!(names, ["zebra", "b", "c", "yak"]);
        let index: HashMap<String, usize> = names
            .iter()
            .enumerate()
            .map(|(i, l)| (l.clone(), i))
            .collect();
        let ids: Vec<String> = rows
            .into_samples(&index)
            .into_iter()
            .map(|s| s.id)
            .collect();
        assert_eq!(ids, ["p1", "p2", "captures#row 2", "p4"]);
    }

    #[test]
    fn a_partition_value_labels_every_row_and_the_hive_null_marker_is_no_label() {
        let skip = SourceOpts {
            skip_unlabelled: true,
            ..SourceOpts::default()
        };
        let origin = Path::new("t/label=x/part-0.parquet");
        let content = BinaryArray::from_iter_values([b"1", b"2"]);
        let batch =
            RecordBatch::try_from_iter([("content", Arc::new(content) as ArrayRef)]).unwrap();
        let read = |value: &str| {
            let partition = vec![("label".to_string(), value.to_string())];
            let roles = Roles::resolve(&batch.schema(), &partition, &skip, origin).unwrap();
            let (mut row, mut rows, mut unlabelled) = (0, Rows::new().unwrap(), 0);
            roles
                .batch_rows(&batch, &skip, origin, &mut row, &mut rows, &mut unlabelled)
                .unwrap();
            (
                rows.labels().map(String::from).collect::<Vec<_>>(),
                row,
                unlabelled,
            )
        };
        assert_eq!(
            read("cat"),
            (vec!["cat".to_string(), "cat".to_string()], 2, 0)
        );
        assert_eq!(read(HIVE_NULL), (Vec::<String>::new(), 2, 2));
    }
}
