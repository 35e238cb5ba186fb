//! Zip checkpoint format (torch >= 1.6): `<prefix>/data.pkl` plus one entry per storage
//! under `<prefix>/data/`.

use std::fs::File;
use std::io::{self, BufReader, Read};
use std::path::Path;

use super::pickle::load_one;
use super::state_dict::{float_tensors_by_storage, gather_all, named_tensors};
use super::{ImportError, io_err};
use crate::tensor::Weights;

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

    let read_entry = |zip: &mut zip::ZipArchive<BufReader<File>>,
                      name: &str|
     -> Result<Option<Vec<u8>>, ImportError> {
        let mut e = match zip.by_name(name) {
            Ok(e) => e,
            Err(zip::result::ZipError::FileNotFound) => return Ok(None),
            Err(e) => return Err(zerr(format!("{name}: {e}"))),
        };
        let mut v = Vec::with_capacity(usize::try_from(e.size()).unwrap_or(0).min(1 << 26));
        e.read_to_end(&mut v)
            .map_err(|e| io_err(path, &format!("reading zip entry {name}"), e))?;
        Ok(Some(v))
    };

    if let Some(order) = read_entry(&mut zip, &format!("{prefix}byteorder"))?
        && order.trim_ascii() == b"big"
    {
        return Err(ImportError::Unsupported {
            path: path.to_path_buf(),
            message: "big-endian checkpoint".into(),
        });
    }

    let pkl = read_entry(&mut zip, &pkl_name)?.unwrap_or_default();
    let mut cur = io::Cursor::new(pkl.as_slice());
    let (root, _) = load_one(path, &mut cur, &mut 0, &pkl_name)?;

    let by_key = float_tensors_by_storage(named_tensors(&root));
    let mut out = Weights::new();
    for (key, users) in by_key {
        let name = format!("{prefix}data/{key}");
        let bytes = read_entry(&mut zip, &name)?.ok_or_else(|| ImportError::MissingStorage {
            path: path.to_path_buf(),
            tensor: users[0].0.clone(),
            key: key.clone(),
        })?;
        gather_all(path, &bytes, &users, &mut out)?;
    }
    Ok(out)
}
