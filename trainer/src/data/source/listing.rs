//! CSV listings (`path,label`, what the docs call a manifest: not an artifact's `manifest.json`):
//! each path is an object URL (`s3://bucket/img/1.jpg`) or relative to the listing (a local
//! directory, or the listing's prefix on its object store).

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use url::Url;

use super::columns::UNLABELLED_HINT;
use super::location::{self, Location};
use super::spool::Rows;
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
    if let Some(url) = location::object_url(Path::new(rel)) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use kestrel_shared::protocol::sha256_hex;
    use std::collections::HashMap;

    #[test]
    fn relative_paths_resolve_against_the_listing_directory_in_row_order() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("sub")).unwrap();
        fs::write(dir.path().join("a.png"), b"aaa").unwrap();
        fs::write(dir.path().join("sub/b.png"), b"bb").unwrap();
        // Other column names, in another order, with spaces around the cells.
        let opts = SourceOpts {
            path_column: "file".into(),
            label_column: "class".into(),
            ..SourceOpts::default()
        };
        let text = b" class , file \n dog , sub/b.png \ncat,a.png\n";
        let origin = dir.path().join("list.csv");
        let (rows, unlabelled) = read_csv(text, &origin, &Base::Local(dir.path()), &opts).unwrap();
        assert_eq!(unlabelled, 0);
        let labels: Vec<String> = rows.labels().map(String::from).collect();
        assert_eq!(labels, ["dog", "cat"]);
        let index = HashMap::from([("cat".to_string(), 0), ("dog".to_string(), 1)]);
        let samples = rows.into_samples(&index);
        let ids: Vec<&str> = samples.iter().map(|s| s.id.as_str()).collect();
        let want = [dir.path().join("sub/b.png"), dir.path().join("a.png")];
        assert_eq!(ids, want.map(|p| p.display().to_string()));
        assert_eq!((samples[0].label, samples[1].label), (1, 0));
        assert_eq!(samples[0].bytes().unwrap().into_owned(), b"bb".to_vec());
        assert_eq!(samples[0].sha256, sha256_hex(b"bb"));
    }

    #[test]
    fn object_urls_are_kept_and_relative_paths_join_an_object_listings_directory() {
        let dir = tempfile::tempdir().unwrap();
        let origin = dir.path().join("list.csv");
        let Ok(Image::Object(u)) = locate(
            "s3://bucket/img/1.jpg",
            2,
            &origin,
            &Base::Local(dir.path()),
        ) else {
            panic!("an object URL in a local listing is an object");
        };
        assert_eq!(u.as_str(), "s3://bucket/img/1.jpg");
        let loc = Location::local(dir.path()).unwrap();
        let Ok(Image::Object(u)) = locate("img/1.png", 3, &origin, &Base::Object(&loc)) else {
            panic!("a relative path of an object listing is an object");
        };
        assert_eq!(u, loc.url.join("img/1.png").unwrap());
        // An empty path in a local listing is a missing file (never the listing's directory).
        let Err(DataError::MissingFile { line, .. }) =
            locate("", 4, &origin, &Base::Local(dir.path()))
        else {
            panic!("an empty local path is no image");
        };
        assert_eq!(line, 4);
    }

    #[test]
    fn bad_rows_are_csv_errors_and_skipped_rows_are_never_looked_for() {
        let dir = tempfile::tempdir().unwrap();
        let origin = dir.path().join("list.csv");
        let loc = Location::local(dir.path()).unwrap();
        let opts = SourceOpts::default();
        let e = read_csv(b"path,label\n,cat\n", &origin, &Base::Object(&loc), &opts)
            .err()
            .expect("an empty path");
        assert!(
            matches!(&e, DataError::Csv { message, .. } if message == "line 2: empty path"),
            "{e}"
        );
        assert_eq!(
            e.to_string(),
            format!("{}: line 2: empty path", origin.display())
        );
        let local = Base::Local(dir.path());
        let e = read_csv(b"path,label\na.png,cat,extra\n", &origin, &local, &opts)
            .err()
            .expect("a ragged row");
        assert!(
            matches!(&e, DataError::Csv { message, .. }
                if message.contains("found record with 3 fields, but the previous record has 2 fields")),
            "{e}"
        );
        // --skip-unlabelled: a row without a label is counted, and its (missing) file not checked.
        fs::write(dir.path().join("a.png"), b"a").unwrap();
        let skip = SourceOpts {
            skip_unlabelled: true,
            ..SourceOpts::default()
        };
        let (rows, unlabelled) = read_csv(
            b"path,label\ngone.png,\na.png,cat\n",
            &origin,
            &local,
            &skip,
        )
        .unwrap();
        assert_eq!(rows.labels().collect::<Vec<_>>(), ["cat"]);
        assert_eq!(unlabelled, 1);
    }
}
