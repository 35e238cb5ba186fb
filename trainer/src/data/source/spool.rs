//! Where a table's encoded images wait between reading the table and decoding them: an anonymous
//! temporary file (in `TMPDIR`, gone when the last sample holding it is dropped), not memory, so
//! a load's memory does not grow with the table's bytes. Each image's SHA-256 is taken as it is
//! spooled (the sample cache's key and order need it before anything is decoded).

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use super::DataError;
use kestrel_shared::protocol::sha256_hex;

/// The temporary file images are appended to.
#[derive(Debug)]
pub struct Spool {
    file: File,
    len: u64,
}

/// Where one image's bytes are.
#[derive(Clone, Debug)]
pub enum Content {
    /// Held in memory (images made by the caller, tests).
    Memory(Arc<[u8]>),
    /// `len` bytes at `offset` of a spool file.
    Spooled {
        spool: Arc<Spool>,
        offset: u64,
        len: u64,
    },
}

impl Content {
    /// The image's bytes (read back from the spool file when spooled).
    pub fn bytes(&self) -> Result<Cow<'_, [u8]>, DataError> {
        match self {
            Content::Memory(b) => Ok(Cow::Borrowed(b)),
            Content::Spooled { spool, offset, len } => {
                let mut buf = vec![0u8; *len as usize];
                spool
                    .file
                    .read_exact_at(&mut buf, *offset)
                    .map_err(|source| DataError::Io {
                        path: std::env::temp_dir().join("(kestrel image spool)"),
                        source,
                    })?;
                Ok(Cow::Owned(buf))
            }
        }
    }
}

impl From<Vec<u8>> for Content {
    fn from(v: Vec<u8>) -> Self {
        Content::Memory(v.into())
    }
}

/// One spooled image: where it is and its SHA-256 (hex).
pub(super) struct Blob {
    offset: u64,
    len: u64,
    sha256: String,
}

struct Entry {
    id: String,
    blob: Blob,
    label: String,
}

/// The rows of one table as they are read: ids and labels in memory, images in a spool file.
pub(super) struct Rows {
    spool: Spool,
    entries: Vec<Entry>,
}

fn spool_err(source: std::io::Error) -> DataError {
    DataError::Io {
        path: std::env::temp_dir(),
        source,
    }
}

impl Rows {
    pub fn new() -> Result<Rows, DataError> {
        let file = tempfile::tempfile().map_err(spool_err)?;
        Ok(Rows {
            spool: Spool { file, len: 0 },
            entries: Vec::new(),
        })
    }

    /// Appends `bytes` to the spool file, not yet as a row (see [`Rows::push_blob`]).
    pub fn spool(&mut self, bytes: &[u8]) -> Result<Blob, DataError> {
        let s = &mut self.spool;
        s.file.write_all(bytes).map_err(spool_err)?;
        let blob = Blob {
            offset: s.len,
            len: bytes.len() as u64,
            sha256: sha256_hex(bytes),
        };
        s.len += bytes.len() as u64;
        Ok(blob)
    }

    /// Appends a row whose image was spooled with [`Rows::spool`].
    pub fn push_blob(&mut self, id: String, blob: Blob, label: String) {
        self.entries.push(Entry { id, blob, label });
    }

    /// Appends a row: its id, image bytes and class name.
    pub fn push(&mut self, id: String, bytes: &[u8], label: String) -> Result<(), DataError> {
        let blob = self.spool(bytes)?;
        self.push_blob(id, blob, label);
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The rows' class names, in row order.
    pub fn labels(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|e| e.label.as_str())
    }

    /// The rows as samples, their class names indexed by `index`.
    pub fn into_samples(self, index: &HashMap<String, usize>) -> Vec<super::Sample> {
        let spool = Arc::new(self.spool);
        self.entries
            .into_iter()
            .map(|e| super::Sample {
                id: e.id,
                label: index[&e.label],
                sha256: e.blob.sha256,
                content: Content::Spooled {
                    spool: spool.clone(),
                    offset: e.blob.offset,
                    len: e.blob.len,
                },
            })
            .collect()
    }
}
