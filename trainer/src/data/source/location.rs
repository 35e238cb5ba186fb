//! Where a table's bytes are: a local directory or file, or an object store named by URL
//! (`s3://bucket/path`, `az://container/path`, `abfss://container@account.dfs.core.windows.net/path`,
//! `gs://bucket/path`), reached through the Delta kernel's default engine and its `object_store`
//! (one client for the log, the data files and the deletion vectors).
//!
//! Credentials and endpoints come from the standard environment, as the clouds' own tools read it:
//! `AWS_*` (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT_URL` for an
//! S3-compatible store such as MinIO; an `http://` endpoint allows plain HTTP), `AZURE_STORAGE_*`
//! (`AZURE_STORAGE_ACCOUNT_NAME`, `AZURE_STORAGE_ACCOUNT_KEY`, `AZURE_STORAGE_SAS_KEY`;
//! `AZURE_STORAGE_USE_EMULATOR=true` with `AZURITE_BLOB_STORAGE_URL` for Azurite) and `GOOGLE_*`
//! (`GOOGLE_APPLICATION_CREDENTIALS`, `GOOGLE_SERVICE_ACCOUNT`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use delta_kernel::Engine;
use delta_kernel::object_store::aws::AmazonS3Builder;
use delta_kernel::object_store::azure::MicrosoftAzureBuilder;
use delta_kernel::object_store::gcp::GoogleCloudStorageBuilder;
use delta_kernel::object_store::local::LocalFileSystem;
use delta_kernel::object_store::{DynObjectStore, ObjectStore};
use delta_kernel_default_engine::DefaultEngineBuilder;
use url::Url;

use super::{DataError, io_err};

/// The URL schemes of the object stores a table can be on.
pub const OBJECT_SCHEMES: [&str; 8] = ["s3", "s3a", "az", "azure", "abfs", "abfss", "adl", "gs"];

/// The object-store URL a `--data` argument names, if it names one (`s3://...` and the like);
/// `None` for a local path.
pub fn object_url(arg: &Path) -> Option<Url> {
    let s = arg.to_str()?;
    let url = Url::parse(s).ok()?;
    OBJECT_SCHEMES.contains(&url.scheme()).then_some(url)
}

/// A table's location with the engine that reads it: `url` is a directory URL (ending in `/`)
/// for a directory, else the file's URL.
pub(in crate::data) struct Location {
    pub url: Url,
    pub engine: Arc<dyn Engine>,
    /// How messages name it: the local path or the URL as given.
    pub origin: PathBuf,
}

fn store_err(url: &Url) -> impl FnOnce(delta_kernel::object_store::Error) -> DataError + '_ {
    move |source| DataError::ObjectStore {
        url: url.to_string(),
        source: Box::new(source),
    }
}

/// The kernel's default engine over `store`, its reads bounded for image rows: batches of
/// [`super::columns::BATCH_ROWS`] rows and a few files read ahead (its defaults, 1,000 of each, would
/// hold a whole table of images in memory).
fn engine(store: Arc<DynObjectStore>) -> Arc<dyn Engine> {
    let n = |v: usize| std::num::NonZero::new(v).expect("not zero");
    let builder = DefaultEngineBuilder::new(store)
        .with_batch_size(n(super::columns::BATCH_ROWS))
        .with_buffer_size(n(4));
    Arc::new(builder.build())
}

/// The client for `url`'s bucket or container, configured from the environment.
pub(super) fn object_store(url: &Url) -> Result<Arc<DynObjectStore>, DataError> {
    let store: Arc<dyn ObjectStore> = match url.scheme() {
        "s3" | "s3a" => {
            let mut b = AmazonS3Builder::from_env().with_url(url.as_str());
            let endpoint = std::env::var("AWS_ENDPOINT_URL")
                .or_else(|_| std::env::var("AWS_ENDPOINT"))
                .unwrap_or_default();
            if endpoint.starts_with("http://") {
                b = b.with_allow_http(true);
            }
            Arc::new(b.build().map_err(store_err(url))?)
        }
        "gs" => Arc::new(
            GoogleCloudStorageBuilder::from_env()
                .with_url(url.as_str())
                .build()
                .map_err(store_err(url))?,
        ),
        _ => {
            let mut b = MicrosoftAzureBuilder::from_env().with_url(url.as_str());
            let emulator = std::env::var("AZURITE_BLOB_STORAGE_URL").unwrap_or_default();
            if emulator.starts_with("http://") {
                b = b.with_allow_http(true);
            }
            Arc::new(b.build().map_err(store_err(url))?)
        }
    };
    Ok(store)
}

/// Writes `bytes` as the object at `url` (one PUT: readers see the whole object or none).
pub fn put(url: &Url, bytes: Vec<u8>) -> Result<(), DataError> {
    use delta_kernel::object_store::ObjectStoreExt;
    use delta_kernel_default_engine::executor::TaskExecutor;
    use delta_kernel_default_engine::executor::tokio::TokioBackgroundExecutor;
    let store = object_store(url)?;
    let path = delta_kernel::object_store::path::Path::from_url_path(url.path()).map_err(|e| {
        DataError::ObjectStore {
            url: url.to_string(),
            source: Box::new(e),
        }
    })?;
    TokioBackgroundExecutor::new()
        .block_on(async move { store.put(&path, bytes.into()).await })
        .map(drop)
        .map_err(store_err(url))
}

/// The extension of the URL's last path segment, lower-cased.
fn extension(url: &Url) -> Option<String> {
    let last = url.path().rsplit('/').next()?;
    let (_, ext) = last.rsplit_once('.')?;
    Some(ext.to_ascii_lowercase())
}

impl Location {
    /// A local directory or file.
    pub fn local(path: &Path) -> Result<Self, DataError> {
        let abs = path.canonicalize().map_err(io_err(path))?;
        let url = match abs.is_dir() {
            true => Url::from_directory_path(&abs),
            false => Url::from_file_path(&abs),
        };
        let url = url.map_err(|()| DataError::UnsupportedSource {
            path: path.to_path_buf(),
        })?;
        Ok(Self {
            url,
            engine: engine(Arc::new(LocalFileSystem::new())),
            origin: path.to_path_buf(),
        })
    }

    /// An object-store URL: a file when it ends in `.parquet` or `.csv`, else a directory (a
    /// Delta table, Parquet part files).
    pub fn object(url: &Url) -> Result<Self, DataError> {
        let store = object_store(url)?;
        let mut url = url.clone();
        let file = matches!(extension(&url).as_deref(), Some("parquet" | "csv"));
        if !file && !url.path().ends_with('/') {
            url.set_path(&format!("{}/", url.path()));
        }
        Ok(Self {
            origin: PathBuf::from(url.as_str()),
            url,
            engine: engine(store),
        })
    }

    pub fn is_dir(&self) -> bool {
        self.url.path().ends_with('/')
    }

    /// The file name's extension, lower-cased.
    pub fn extension(&self) -> Option<String> {
        extension(&self.url)
    }

    fn kernel_err(&self, e: delta_kernel::KernelError) -> DataError {
        DataError::ObjectStore {
            url: self.url.to_string(),
            source: Box::new(e),
        }
    }

    /// Every file under this directory, as paths relative to it (`label=cat/part-0.parquet`), in
    /// path order.
    pub fn list(&self) -> Result<Vec<String>, DataError> {
        let files = self
            .engine
            .storage_handler()
            .list_from(&self.url)
            .map_err(|e| self.kernel_err(e))?;
        let mut out = Vec::new();
        for f in files {
            let f = f.map_err(|e| self.kernel_err(e))?;
            if let Some(rel) = f.location.path().strip_prefix(self.url.path()) {
                let rel = percent_encoding::percent_decode_str(rel).decode_utf8_lossy();
                out.push(rel.into_owned());
            }
        }
        out.sort();
        Ok(out)
    }

    /// Whether this directory is a Delta table (has a `_delta_log/` with something in it).
    pub fn is_delta(&self) -> Result<bool, DataError> {
        if !self.is_dir() {
            return Ok(false);
        }
        let log = self.join("_delta_log/")?;
        let mut files = self
            .engine
            .storage_handler()
            .list_from(&log)
            .map_err(|e| self.kernel_err(e))?;
        match files.next() {
            Some(Ok(_)) => Ok(true),
            Some(Err(e)) => Err(self.kernel_err(e)),
            None => Ok(false),
        }
    }

    /// The URL of `rel` (a path relative to this directory, or to this file's directory).
    pub fn join(&self, rel: &str) -> Result<Url, DataError> {
        self.url.join(rel).map_err(|e| DataError::ObjectStore {
            url: format!("{} + {rel}", self.url),
            source: Box::new(e),
        })
    }

    /// Calls `f` with each file at `urls` (on this location's store) and its bytes, in order;
    /// the store fetches a few ahead, so only those are held besides what `f` keeps.
    pub fn fetch(
        &self,
        urls: &[Url],
        mut f: impl FnMut(&Url, Bytes) -> Result<(), DataError>,
    ) -> Result<(), DataError> {
        let files = self
            .engine
            .storage_handler()
            .read_files(urls.iter().map(|u| (u.clone(), None)).collect())
            .map_err(|e| self.kernel_err(e))?;
        for (bytes, url) in files.zip(urls) {
            let bytes = bytes.map_err(|e| DataError::ObjectStore {
                url: url.to_string(),
                source: Box::new(e),
            })?;
            f(url, bytes)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn every_object_scheme_is_recognised_and_extensions_come_from_the_last_segment() {
        for (url, scheme) in [
            ("s3a://b/t", "s3a"),
            ("azure://c/t", "azure"),
            ("abfs://c@a.dfs.core.windows.net/t", "abfs"),
            ("adl://a/t", "adl"),
            ("S3://b/t", "s3"),
        ] {
            let got = object_url(Path::new(url)).map(|u| u.scheme().to_string());
            assert_eq!(got.as_deref(), Some(scheme), "{url}");
        }
        for not_object in ["ftp://h/t", "hdfs://nn/t", "s3"] {
            assert!(object_url(Path::new(not_object)).is_none(), "{not_object}");
        }
        let ext = |s: &str| extension(&Url::parse(s).unwrap());
        assert_eq!(ext("s3://b/t/Part-0.PARQUET").as_deref(), Some("parquet"));
        assert_eq!(ext("gs://b/x.tar.gz").as_deref(), Some("gz"));
        assert_eq!(
            ext("s3://b/dir.v2/table"),
            None,
            "only the last segment counts"
        );
        assert_eq!(ext("s3://b/t/"), None);
    }

    #[test]
    fn a_local_directory_is_a_directory_url_and_paths_join_beside_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let file = dir.path().join("List.CSV");
        fs::write(&file, "path,label\n").unwrap();
        let d = Location::local(dir.path()).unwrap();
        assert!(d.is_dir());
        assert_eq!(d.url, Url::from_directory_path(&root).unwrap());
        assert_eq!((d.origin.as_path(), d.extension()), (dir.path(), None));
        let f = Location::local(&file).unwrap();
        assert!(!f.is_dir());
        assert_eq!(f.extension().as_deref(), Some("csv"));
        // Relative to a directory: inside it; relative to a file: beside it.
        let inside = Url::from_file_path(root.join("img/1.png")).unwrap();
        assert_eq!(d.join("img/1.png").unwrap(), inside);
        assert_eq!(f.join("img/1.png").unwrap(), inside);
        let missing = dir.path().join("absent");
        assert!(matches!(
            Location::local(&missing).err(),
            Some(DataError::Io { path, .. }) if path == missing
        ));
    }
}
