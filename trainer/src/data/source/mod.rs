//! Where a dataset comes from: an ImageFolder tree, a `path,label` CSV listing ([`listing`]), Parquet
//! ([`table`]: one file, a Spark output directory of part files, or Hive-partitioned directories) or
//! a Delta table ([`delta`]; Kestrel's own capture tables are written by [`delta_write`] and labelled
//! by [`label`]), on local disk or an object store ([`store`]); encoded bytes wait in a [`spool`].

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use super::{DataError, Dataset, Sample, SourceOpts, TableRef, io_err, pq_err};

pub(super) mod columns;
pub mod delta;
pub mod delta_write;
pub mod label;
mod listing;
pub mod location;
pub mod spool;

use columns::{PartFile, hive_part, read_parquet, read_parquet_rows};
use location::Location;
use spool::Rows;

const IMAGE_EXTENSIONS: [&str; 4] = ["png", "jpg", "jpeg", "bmp"];

/// Loads a dataset, detecting the source from `path`: a `.csv` file, a `.parquet` file, a Delta
/// table (a directory with `_delta_log/`), a directory of Parquet part files (Hive-partitioned or
/// not), or else an ImageFolder directory (`root/<class>/<image>`).
pub fn load(path: &Path, opts: &SourceOpts) -> Result<Dataset, DataError> {
    let ds = load_source(path, opts)?;
    match ds.unlabelled_total() {
        n if ds.samples.is_empty() => Err(DataError::NoLabelled {
            path: path.to_path_buf(),
            unlabelled: n,
        }),
        _ => Ok(ds),
    }
}

/// Loads several sources ([`load`] each) into one dataset: one label set (the union of the class
/// names, sorted like one source's), every sample remapped to it, the samples in source order.
/// A source whose rows were all left out as unlabelled is allowed when another has samples.
pub fn load_all(paths: &[PathBuf], opts: &SourceOpts) -> Result<Dataset, DataError> {
    let [first, rest @ ..] = paths else {
        return Err(DataError::NoSource);
    };
    if rest.is_empty() {
        return load(first, opts);
    }
    let parts = paths
        .iter()
        .map(|p| load_source(p, opts))
        .collect::<Result<Vec<_>, _>>()?;
    let names = parts
        .iter()
        .flat_map(|d| d.labels.iter().map(String::as_str));
    let (labels, index) = sort_labels(names);
    let mut out = Dataset {
        samples: Vec::new(),
        labels,
        source: parts
            .iter()
            .map(|d| d.source.as_str())
            .collect::<Vec<_>>()
            .join(" + "),
        unlabelled: Vec::new(),
        tables: parts.iter().flat_map(|d| d.tables.clone()).collect(),
    };
    for d in parts {
        out.samples.extend(d.samples.into_iter().map(|s| Sample {
            label: index[&d.labels[s.label]],
            ..s
        }));
        out.unlabelled.extend(d.unlabelled);
    }
    if out.samples.is_empty() {
        return Err(DataError::NoLabelled {
            path: first.clone(),
            unlabelled: out.unlabelled_total(),
        });
    }
    Ok(out)
}

/// Rows read from one table, before their labels are indexed.
struct Read {
    rows: Rows,
    /// Rows left out for having no label.
    unlabelled: usize,
    /// What was read, for the log (`delta s3://b/t (version 3)`).
    source: String,
    format: &'static str,
    version: Option<u64>,
    /// The labels table the labels came from (a capture table's).
    labels: Option<TableRef>,
}

/// [`load`] without its check for labelled rows: a source of only unlabelled rows (left out with
/// `--skip-unlabelled`) loads with no samples.
fn load_source(path: &Path, opts: &SourceOpts) -> Result<Dataset, DataError> {
    let read = match location::object_url(path) {
        Some(url) => read_object(&Location::object(&url)?, opts)?,
        None => match read_local(path, opts)? {
            Some(read) => read,
            None => image_folder(path)?,
        },
    };
    let Read {
        rows,
        unlabelled,
        source,
        format,
        version,
        labels: labels_table,
    } = read;
    if rows.is_empty() && unlabelled == 0 {
        return Err(DataError::EmptyDataset {
            path: path.to_path_buf(),
        });
    }
    let (labels, index) = sort_labels(rows.labels());
    Ok(Dataset {
        samples: rows.into_samples(&index),
        labels,
        unlabelled: match unlabelled {
            0 => Vec::new(),
            n => vec![(source.clone(), n)],
        },
        source,
        tables: std::iter::once(TableRef {
            location: path.display().to_string(),
            format,
            version,
        })
        .chain(labels_table)
        .collect(),
    })
}

/// Time travel applies to Delta tables only.
fn check_time_travel(delta: bool, origin: &Path, opts: &SourceOpts) -> Result<(), DataError> {
    match !delta && (opts.data_version.is_some() || opts.data_timestamp.is_some()) {
        true => Err(DataError::NotDelta {
            path: origin.to_path_buf(),
        }),
        false => Ok(()),
    }
}

fn read_delta(loc: &Location, opts: &SourceOpts) -> Result<Read, DataError> {
    let t = delta::read(loc, opts)?;
    let labels = match &t.labels {
        Some(l) => format!(", labels version {}", l.version.unwrap_or(0)),
        None => String::new(),
    };
    Ok(Read {
        rows: t.rows,
        unlabelled: t.unlabelled,
        source: format!(
            "delta {} (version {}{labels})",
            loc.origin.display(),
            t.version
        ),
        format: "delta",
        version: Some(t.version),
        labels: t.labels,
    })
}

/// `, partitioned by a, b` for part files with partition columns, else empty.
fn partitioned_by<'a>(partitions: impl Iterator<Item = &'a [(String, String)]>) -> String {
    let mut columns: Vec<&str> = partitions
        .flat_map(|p| p.iter().map(|(c, _)| c.as_str()))
        .collect();
    columns.sort_unstable();
    columns.dedup();
    match columns.is_empty() {
        true => String::new(),
        false => format!(", partitioned by {}", columns.join(", ")),
    }
}

/// A local table; `None` for a directory that is no table (an ImageFolder, read by the caller).
fn read_local(path: &Path, opts: &SourceOpts) -> Result<Option<Read>, DataError> {
    let meta = fs::metadata(path).map_err(io_err(path))?;
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    let delta = meta.is_dir() && path.join("_delta_log").is_dir();
    check_time_travel(delta, path, opts)?;
    let read = |(rows, unlabelled), source, format| {
        Ok(Some(Read {
            rows,
            unlabelled,
            source,
            format,
            version: None,
            labels: None,
        }))
    };
    if delta {
        return read_delta(&Location::local(path)?, opts).map(Some);
    }
    if meta.is_dir() {
        let parts = parquet_parts(path)?;
        if parts.is_empty() {
            return Ok(None);
        }
        let by = partitioned_by(parts.iter().map(|p| p.partition.as_slice()));
        let source = format!("parquet {} ({} files{by})", path.display(), parts.len());
        return read(read_parquet(&parts, opts)?, source, "parquet");
    }
    match ext.as_deref() {
        Some("csv") => {
            let text = fs::read(path).map_err(io_err(path))?;
            let base = listing::Base::Local(path.parent().unwrap_or(Path::new("")));
            let rows = listing::read_csv(&text, path, &base, opts)?;
            read(rows, format!("csv {}", path.display()), "csv")
        }
        Some("parquet") => {
            let file = PartFile {
                path: path.to_path_buf(),
                partition: Vec::new(),
            };
            let source = format!("parquet {}", path.display());
            read(read_parquet(&[file], opts)?, source, "parquet")
        }
        _ => Err(DataError::UnsupportedSource {
            path: path.to_path_buf(),
        }),
    }
}

/// A table on an object store: a Delta table, a Parquet file or directory (Hive-partitioned or
/// not), or a CSV manifest.
fn read_object(loc: &Location, opts: &SourceOpts) -> Result<Read, DataError> {
    let delta = loc.is_delta()?;
    check_time_travel(delta, &loc.origin, opts)?;
    if delta {
        return read_delta(loc, opts);
    }
    let (mut rows, mut unlabelled) = (Rows::new()?, 0);
    let shown = loc.url.as_str();
    if loc.extension().as_deref() == Some("csv") {
        let mut text = Vec::new();
        loc.fetch(std::slice::from_ref(&loc.url), |_, b| {
            text = b.into();
            Ok(())
        })?;
        let (rows, unlabelled) =
            listing::read_csv(&text, &loc.origin, &listing::Base::Object(loc), opts)?;
        let source = format!("csv {shown}");
        return Ok(Read {
            rows,
            unlabelled,
            source,
            format: "csv",
            version: None,
            labels: None,
        });
    }
    let parts: Vec<(String, Vec<(String, String)>)> = match loc.is_dir() {
        true => loc
            .list()?
            .into_iter()
            .filter_map(|rel| hive_part(&rel).map(|p| (rel, p)))
            .collect(),
        false => vec![(String::new(), Vec::new())],
    };
    if parts.is_empty() {
        return Err(DataError::NoTableAt {
            url: loc.url.to_string(),
        });
    }
    let urls = parts
        .iter()
        .map(|(rel, _)| loc.join(rel))
        .collect::<Result<Vec<_>, _>>()?;
    let mut partitions = parts.iter().map(|p| p.1.as_slice());
    loc.fetch(&urls, |url, bytes| {
        let partition = partitions.next().expect("one per url");
        let origin = Path::new(url.as_str());
        read_parquet_rows(bytes, origin, partition, opts, &mut rows, &mut unlabelled)
    })?;
    let source = match loc.is_dir() {
        true => {
            let by = partitioned_by(parts.iter().map(|p| p.1.as_slice()));
            format!("parquet {shown} ({} files{by})", parts.len())
        }
        false => format!("parquet {shown}"),
    };
    Ok(Read {
        rows,
        unlabelled,
        source,
        format: "parquet",
        version: None,
        labels: None,
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

/// The Parquet part files of a local table directory ([`columns::hive_part`]), in path order; only
/// `column=value/` directories are descended into.
fn parquet_parts(dir: &Path) -> Result<Vec<PartFile>, DataError> {
    let mut rels = Vec::new();
    collect_files(dir, "", &mut rels)?;
    Ok(rels
        .into_iter()
        .filter_map(|rel| {
            let partition = hive_part(&rel)?;
            Some(PartFile {
                path: dir.join(&rel),
                partition,
            })
        })
        .collect())
}

fn collect_files(dir: &Path, rel: &str, out: &mut Vec<String>) -> Result<(), DataError> {
    for p in sorted_entries(dir)?.into_iter().filter(|p| !hidden(p)) {
        let name = p.file_name().unwrap_or_default().to_string_lossy();
        let rel = format!("{rel}{name}");
        if p.is_dir() {
            if name.contains('=') {
                collect_files(&p, &format!("{rel}/"), out)?;
            }
        } else {
            out.push(rel);
        }
    }
    Ok(())
}

/// An ImageFolder: one directory per class, its images the class's samples (sorted by file
/// name within a class, the classes in label order).
fn image_folder(root: &Path) -> Result<Read, DataError> {
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
    let (_, index) = sort_labels(classes.iter().map(|c| c.0.as_str()));
    classes.sort_by_key(|c| index[&c.0]);
    let mut rows = Rows::new()?;
    for (class, files) in classes {
        for file in files {
            let bytes = fs::read(&file).map_err(io_err(&file))?;
            rows.push(file.display().to_string(), &bytes, class.clone())?;
        }
    }
    Ok(Read {
        rows,
        unlabelled: 0,
        source: format!("imagefolder {}", root.display()),
        format: "imagefolder",
        version: None,
        labels: None,
    })
}
