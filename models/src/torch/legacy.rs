//! Legacy `torch.save` format (torch < 1.6): five successive pickles (magic number, protocol
//! version, sys info, the object, the storage key list) followed by the raw storages.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::Path;

use std::rc::Rc;

use super::dtype::{FloatType, StorageType};
use super::limits::MAX_STORAGE_BYTES;
use super::pickle::{Value, load_one};
use super::rebuild::TensorRef;
use super::state_dict::{
    ViewBudget, float_tensors_by_storage, gather_all, key_name, named_tensors,
};
use super::{ImportError, io_err};
use crate::tensor::Weights;

/// `0x1950a86a20f9469cfc6c` as pickled by LONG1 (little-endian).
const LEGACY_MAGIC: [u8; 10] = [0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19];

/// The float tensors that view each storage, by storage key.
type Users = BTreeMap<String, Vec<(String, Rc<TensorRef>, FloatType)>>;

/// A legacy checkpoint being read: the file, the reader and its byte offset (for messages).
struct Reader<'p, R> {
    path: &'p Path,
    r: R,
    pos: u64,
    views: ViewBudget,
}

pub(super) fn read_legacy(path: &Path) -> Result<Weights, ImportError> {
    let f = File::open(path).map_err(|e| io_err(path, "opening file", e))?;
    let mut rd = Reader {
        path,
        r: BufReader::with_capacity(1 << 20, f),
        pos: 0,
        views: ViewBudget::new(),
    };
    rd.header()?;
    let (root, storages) = load_one(path, &mut rd.r, &mut rd.pos, "state dict")?;
    let keys = rd.storage_keys()?;
    let tensors = named_tensors(&root).map_err(|message| ImportError::Limit {
        path: path.to_path_buf(),
        message,
    })?;
    drop(root);
    let mut by_key = float_tensors_by_storage(tensors);
    let mut out = Weights::new();
    for key in &keys {
        let ty = storages.get(key).ok_or_else(|| ImportError::Pickle {
            path: path.to_path_buf(),
            offset: rd.pos,
            message: format!("storage `{key}` listed but never referenced"),
        })?;
        rd.storage(key, ty, &mut by_key, &mut out)?;
    }
    if let Some((key, users)) = by_key.into_iter().next() {
        return Err(ImportError::MissingStorage {
            path: path.to_path_buf(),
            tensor: users[0].0.clone(),
            key,
        });
    }
    Ok(out)
}

impl<R: BufRead> Reader<'_, R> {
    fn unsupported(&self, message: String) -> ImportError {
        ImportError::Unsupported {
            path: self.path.to_path_buf(),
            message,
        }
    }

    fn pickle_error(&self, message: String) -> ImportError {
        ImportError::Pickle {
            path: self.path.to_path_buf(),
            offset: self.pos,
            message,
        }
    }

    /// The first three pickles: magic number, protocol version (1001) and sys info (little-endian).
    fn header(&mut self) -> Result<(), ImportError> {
        let (magic, _) = load_one(self.path, &mut self.r, &mut self.pos, "magic number")?;
        if !matches!(&magic, Value::BigInt(b) if **b == LEGACY_MAGIC) {
            return Err(self.unsupported(
                "pickle file without the torch.save magic number \
                 (a plain pickle, not a checkpoint?)"
                    .into(),
            ));
        }
        let (proto, _) = load_one(self.path, &mut self.r, &mut self.pos, "protocol version")?;
        if !matches!(proto, Value::Int(1001)) {
            let found = match proto {
                Value::Int(i) => i.to_string(),
                other => format!("a {}", other.kind()),
            };
            return Err(
                self.unsupported(format!("legacy protocol version {found} (expected 1001)"))
            );
        }
        let (sys_info, _) = load_one(self.path, &mut self.r, &mut self.pos, "sys info")?;
        if let Value::Dict(d) = &sys_info {
            for (k, v) in d.iter() {
                if matches!(k, Value::Str(s) if &**s == "little_endian")
                    && matches!(v, Value::Bool(false))
                {
                    return Err(self.unsupported("big-endian checkpoint".into()));
                }
            }
        }
        Ok(())
    }

    /// The fifth pickle: the storage keys, in the order their data follows.
    fn storage_keys(&mut self) -> Result<Vec<String>, ImportError> {
        let (keys, _) = load_one(self.path, &mut self.r, &mut self.pos, "storage key list")?;
        match keys {
            Value::List(l) => l
                .iter()
                .map(key_name)
                .collect::<Option<_>>()
                .ok_or_else(|| self.pickle_error("storage key list holds non-string keys".into())),
            other => Err(self.pickle_error(format!("storage key list is a {}", other.kind()))),
        }
    }

    /// One storage record (`u64` element count + raw data): gathered into `out` when float
    /// tensors view it, skipped otherwise.
    fn storage(
        &mut self,
        key: &str,
        ty: &StorageType,
        by_key: &mut Users,
        out: &mut Weights,
    ) -> Result<(), ImportError> {
        let path = self.path;
        let record_pos = self.pos;
        let context = |what: &str| format!("{what} of storage `{key}` at byte {record_pos}");
        let mut n8 = [0u8; 8];
        self.r
            .read_exact(&mut n8)
            .map_err(|e| io_err(path, &context("element count"), e))?;
        self.pos += 8;
        let numel = u64::from_le_bytes(n8);
        let elem = ty.elem_size().ok_or_else(|| {
            self.unsupported(format!("storage `{key}` has unknown element type {ty:?}"))
        })?;
        let nbytes = numel.checked_mul(elem as u64).ok_or_else(|| {
            self.pickle_error(format!("storage `{key}` element count {numel} overflows"))
        })?;
        if nbytes > MAX_STORAGE_BYTES {
            return Err(ImportError::Limit {
                path: path.to_path_buf(),
                message: format!(
                    "storage `{key}` at byte {record_pos} is {nbytes} bytes \
                     (the limit is {MAX_STORAGE_BYTES})"
                ),
            });
        }
        let pos = self.pos;
        let truncated = |got: u64, tensor: String| ImportError::Truncated {
            path: path.to_path_buf(),
            context: format!(
                "storage `{key}` at byte {pos} needs {nbytes} bytes, only {got} present{tensor}"
            ),
        };
        let mut data = (&mut self.r).take(nbytes);
        match by_key.remove(key) {
            Some(users) => {
                let mut bytes =
                    Vec::with_capacity(usize::try_from(nbytes).unwrap_or(0).min(1 << 26));
                let got = data
                    .read_to_end(&mut bytes)
                    .map_err(|e| io_err(path, &context("data"), e))?;
                if got as u64 != nbytes {
                    return Err(truncated(got as u64, format!(" (tensor `{}`)", users[0].0)));
                }
                gather_all(path, &bytes, &users, out, &mut self.views)?;
            }
            None => {
                let got = io::copy(&mut data, &mut io::sink())
                    .map_err(|e| io_err(path, &context("data"), e))?;
                if got != nbytes {
                    return Err(truncated(got, String::new()));
                }
            }
        }
        self.pos += nbytes;
        Ok(())
    }
}
