//! Zip checkpoint format (torch >= 1.6): `<prefix>/data.pkl` plus one entry per storage
//! under `<prefix>/data/`.

use std::fs::File;
use std::io::{self, BufReader, Read};
use std::path::Path;

use super::limits::{MAX_PICKLE_ENTRY_BYTES, MAX_STORAGE_BYTES};
use super::pickle::load_one;
use super::state_dict::{
    ViewBudget, float_tensors_by_storage, gather_all, named_tensors, storage_bytes_needed,
};
use super::{ImportError, io_err};
use crate::tensor::Weights;

type Zip = zip::ZipArchive<BufReader<File>>;

/// Bytes of the `byteorder` entry (`little` or `big`).
const MAX_BYTEORDER_BYTES: u64 = 64;

pub(super) fn read_zip(path: &Path) -> Result<Weights, ImportError> {
    let zerr = |message: String| ImportError::Zip {
        path: path.to_path_buf(),
        message,
    };
    let f = File::open(path).map_err(|e| io_err(path, "opening file", e))?;
    let mut zip = zip::ZipArchive::new(BufReader::new(f)).map_err(|e| zerr(e.to_string()))?;
    let pkl_name = zip
        .file_names()
        .filter(|n| *n == "data.pkl" || n.ends_with("/data.pkl"))
        .min_by_key(|n| n.len())
        .map(str::to_string)
        .ok_or_else(|| zerr("no data.pkl entry (not a torch checkpoint?)".into()))?;
    let prefix = &pkl_name[..pkl_name.len() - "data.pkl".len()];

    let order = read_entry(
        path,
        &mut zip,
        &format!("{prefix}byteorder"),
        MAX_BYTEORDER_BYTES,
    )?;
    if let Some(order) = order
        && order.trim_ascii() == b"big"
    {
        return Err(ImportError::Unsupported {
            path: path.to_path_buf(),
            message: "big-endian checkpoint".into(),
        });
    }

    let pkl = read_entry(path, &mut zip, &pkl_name, MAX_PICKLE_ENTRY_BYTES)?.unwrap_or_default();
    let mut cur = io::Cursor::new(pkl.as_slice());
    let (root, _) = load_one(path, &mut cur, &mut 0, &pkl_name)?;
    let tensors = named_tensors(&root).map_err(|message| ImportError::Limit {
        path: path.to_path_buf(),
        message: format!("{pkl_name}: {message}"),
    })?;
    drop(root);

    let by_key = float_tensors_by_storage(tensors);
    let mut out = Weights::new();
    let mut views = ViewBudget::new();
    for (key, users) in by_key {
        let name = format!("{prefix}data/{key}");
        // Only as much of the storage as its views reach is decompressed: an entry that
        // honestly declares a gigabyte of zeros behind a one-element view costs four bytes.
        let needed = storage_bytes_needed(&users).map_err(|message| ImportError::Limit {
            path: path.to_path_buf(),
            message: format!("storage `{key}`: {message}"),
        })?;
        let bytes = read_storage(path, &mut zip, &name, needed)?.ok_or_else(|| {
            ImportError::MissingStorage {
                path: path.to_path_buf(),
                tensor: users[0].0.clone(),
                key: key.clone(),
            }
        })?;
        gather_all(path, &bytes, &users, &mut out, &mut views)?;
    }
    Ok(out)
}

/// The first `needed` decompressed bytes of storage entry `name` (all of it when it is shorter:
/// then read as [`read_entry`] reads, bomb check included), `None` when there is none.
fn read_storage(
    path: &Path,
    zip: &mut Zip,
    name: &str,
    needed: u64,
) -> Result<Option<Vec<u8>>, ImportError> {
    let declared = zip.by_name(name).ok().map(|e| e.size());
    if declared.is_none_or(|d| d <= needed || needed > MAX_STORAGE_BYTES) {
        return read_entry(path, zip, name, MAX_STORAGE_BYTES);
    }
    let e = zip.by_name(name).map_err(|e| ImportError::Zip {
        path: path.to_path_buf(),
        message: format!("{name}: {e}"),
    })?;
    let mut v = Vec::with_capacity(usize::try_from(needed).unwrap_or(0).min(1 << 26));
    e.take(needed)
        .read_to_end(&mut v)
        .map_err(|e| io_err(path, &format!("reading zip entry {name}"), e))?;
    Ok(Some(v))
}

/// The decompressed bytes of entry `name` (`None` when there is none), refused when its header
/// declares more than `limit` bytes or when it decompresses to more than its header declares
/// (a decompression bomb): at most `min(declared, limit) + 1` bytes are ever decompressed.
pub(super) fn read_entry(
    path: &Path,
    zip: &mut Zip,
    name: &str,
    limit: u64,
) -> Result<Option<Vec<u8>>, ImportError> {
    let over = |message: String| ImportError::Limit {
        path: path.to_path_buf(),
        message: format!("zip entry `{name}` {message}"),
    };
    let e = match zip.by_name(name) {
        Ok(e) => e,
        Err(zip::result::ZipError::FileNotFound) => return Ok(None),
        Err(e) => {
            return Err(ImportError::Zip {
                path: path.to_path_buf(),
                message: format!("{name}: {e}"),
            });
        }
    };
    let declared = e.size();
    if declared > limit {
        return Err(over(format!(
            "declares {declared} bytes, over the limit of {limit}"
        )));
    }
    let mut v = Vec::with_capacity(usize::try_from(declared).unwrap_or(0).min(1 << 26));
    e.take(declared + 1)
        .read_to_end(&mut v)
        .map_err(|e| io_err(path, &format!("reading zip entry {name}"), e))?;
    if v.len() as u64 > declared {
        return Err(over(format!(
            "decompresses to more than the {declared} bytes its header declares \
             (a decompression bomb?)"
        )));
    }
    Ok(Some(v))
}
