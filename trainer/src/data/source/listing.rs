//! CSV listings (`path,label`, what the docs call a manifest: not an artifact's `manifest.json`):
//! each path is an object URL (`s3://bucket/img/1.jpg`) or relative to the listing (a local
//! directory, or the listing's prefix on its object store).

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use url::Url;

use super::spool::Rows;
use super::store::{self, Location};
use super::table::UNLABELLED_HINT;
use super::{DataError, SourceOpts, io_err};

/// Where a manifest's relative paths point.
pub(super) enum Base<'a> {
    Local(&'a Path),
    Object(&'a Location),
}

/// Where one image is.
enum Image {
    Local(std::path::PathBuf),
    Object(Url),
}

/// The rows of the CSV manifest `text` (read from `origin`) and the count of unlabelled rows
/// left out (an empty label fails unless `opts.skip_unlabelled`). Object-store images are
/// fetched several at a time, per bucket.
pub(super) fn read_csv(
    text: &[u8],
    origin: &Path,
    base: &Base,
    opts: &SourceOpts,
) -> Result<(Rows, usize), DataError> {
    let csv_err = |e: csv::Error| DataError::Csv {
        path: origin.to_path_buf(),
        message: e.to_string(),
    };
    let mut reader = csv::ReaderBuilder::new()
        .trim(csv::Trim::All)
        .from_reader(text);
    let headers = reader.headers().map_err(csv_err)?.clone();
    let found: Vec<String> = headers.iter().map(String::from).collect();
    let column = |role: &'static str, name: &str| {
        headers
            .iter()
            .position(|h| h == name)
            .ok_or_else(|| DataError::MissingColumn {
                file: origin.to_path_buf(),
                role,
                column: name.to_string(),
                found: found.clone(),
            })
    };
    let path_i = column("path", &opts.path_column)?;
    let label_i = column("label", &opts.label_column)?;
    let (mut entries, mut unlabelled) = (Vec::new(), 0);
    for record in reader.records() {
        let record = record.map_err(csv_err)?;
        let line = record.position().map_or(0, |p| p.line());
        let rel = record.get(path_i).unwrap_or("");
        let label = record.get(label_i).unwrap_or("");
        if label.is_empty() {
            if !opts.skip_unlabelled {
                return Err(DataError::NullValue {
                    file: origin.to_path_buf(),
                    column: opts.label_column.clone(),
                    row: entries.len() + unlabelled,
                    hint: UNLABELLED_HINT,
                });
            }
            unlabelled += 1;
            continue;
        }
        entries.push((locate(rel, line, origin, base)?, label.to_string()));
    }
    Ok((fetch(entries, base)?, unlabelled))
}

/// Where the manifest's `rel` (on line `line`) is; a local file must exist.
fn locate(rel: &str, line: u64, origin: &Path, base: &Base) -> Result<Image, DataError> {
    if let Some(url) = store::object_url(Path::new(rel)) {
        return Ok(Image::Object(url));
    }
    match base {
        Base::Object(loc) if !rel.is_empty() => Ok(Image::Object(loc.join(rel)?)),
        Base::Local(dir) if !rel.is_empty() && dir.join(rel).exists() => {
            Ok(Image::Local(dir.join(rel)))
        }
        Base::Object(_) => Err(DataError::Csv {
            path: origin.to_path_buf(),
            message: format!("line {line}: empty path"),
        }),
        Base::Local(dir) => Err(DataError::MissingFile {
            csv: origin.to_path_buf(),
            line,
            path: dir.join(rel),
        }),
    }
}

/// The rows of `entries` with their images' bytes, in order.
fn fetch(entries: Vec<(Image, String)>, base: &Base) -> Result<Rows, DataError> {
    let mut rows = Rows::new()?;
    let mut blobs = Vec::with_capacity(entries.len());
    blobs.resize_with(entries.len(), || None);
    // Object-store images by bucket (scheme and host): one client and one batched fetch each.
    let mut buckets: BTreeMap<String, Vec<(usize, Url)>> = BTreeMap::new();
    for (i, (image, _)) in entries.iter().enumerate() {
        match image {
            Image::Local(p) => blobs[i] = Some(rows.spool(&fs::read(p).map_err(io_err(p))?)?),
            Image::Object(url) => {
                let bucket = format!("{}://{}/", url.scheme(), url.authority());
                buckets.entry(bucket).or_default().push((i, url.clone()));
            }
        }
    }
    for (bucket, wanted) in buckets {
        let own;
        let loc = match base {
            Base::Object(loc) if loc.url.as_str().starts_with(&bucket) => *loc,
            _ => {
                let url = Url::parse(&bucket).map_err(|e| DataError::ObjectStore {
                    url: bucket.clone(),
                    source: Box::new(e),
                })?;
                own = Location::object(&url)?;
                &own
            }
        };
        let urls: Vec<Url> = wanted.iter().map(|(_, u)| u.clone()).collect();
        let mut slots = wanted.iter().map(|(i, _)| *i);
        loc.fetch(&urls, |_, b| {
            blobs[slots.next().expect("one per url")] = Some(rows.spool(&b)?);
            Ok(())
        })?;
    }
    for ((image, label), blob) in entries.into_iter().zip(blobs) {
        let id = match image {
            Image::Local(p) => p.display().to_string(),
            Image::Object(u) => u.to_string(),
        };
        rows.push_blob(id, blob.expect("every image fetched"), label);
    }
    Ok(rows)
}
