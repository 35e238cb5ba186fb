//! Legacy `torch.save` format (torch < 1.6): five successive pickles (magic number, protocol
//! version, sys info, the object, the storage key list) followed by the raw storages.

use std::fs::File;
use std::io::{self, BufReader, Read};
use std::path::Path;

use super::pickle::{Value, load_one};
use super::state_dict::{float_tensors_by_storage, gather_all, key_name, named_tensors};
use super::{ImportError, io_err};
use crate::tensor::Weights;

/// `0x1950a86a20f9469cfc6c` as pickled by LONG1 (little-endian).
const LEGACY_MAGIC: [u8; 10] = [0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19];

pub(super) fn read_legacy(path: &Path) -> Result<Weights, ImportError> {
    let f = File::open(path).map_err(|e| io_err(path, "opening file", e))?;
    let mut r = BufReader::with_capacity(1 << 20, f);
    let mut pos = 0u64;

    let (magic, _) = load_one(path, &mut r, &mut pos, "magic number")?;
    match magic {
        Value::BigInt(b) if b == LEGACY_MAGIC => {}
        _ => {
            return Err(ImportError::Unsupported {
                path: path.to_path_buf(),
                message: "pickle file without the torch.save magic number \
                          (a plain pickle, not a checkpoint?)"
                    .into(),
            });
        }
    }
    let (proto, _) = load_one(path, &mut r, &mut pos, "protocol version")?;
    if !matches!(proto, Value::Int(1001)) {
        return Err(ImportError::Unsupported {
            path: path.to_path_buf(),
            message: format!("legacy protocol version {proto:?} (expected 1001)"),
        });
    }
    let (sys_info, _) = load_one(path, &mut r, &mut pos, "sys info")?;
    if let Value::Dict(d) = &sys_info {
        for (k, v) in d {
            if matches!(k, Value::Str(s) if s == "little_endian") && matches!(v, Value::Bool(false))
            {
                return Err(ImportError::Unsupported {
                    path: path.to_path_buf(),
                    message: "big-endian checkpoint".into(),
                });
            }
        }
    }
    let (root, storages) = load_one(path, &mut r, &mut pos, "state dict")?;
    let (keys, _) = load_one(path, &mut r, &mut pos, "storage key list")?;
    let keys: Vec<String> = match keys {
        Value::List(l) => l
            .iter()
            .map(key_name)
            .collect::<Option<_>>()
            .ok_or_else(|| ImportError::Pickle {
                path: path.to_path_buf(),
                offset: pos,
                message: "storage key list holds non-string keys".into(),
            })?,
        other => {
            return Err(ImportError::Pickle {
                path: path.to_path_buf(),
                offset: pos,
                message: format!("storage key list is a {}", other.kind()),
            });
        }
    };

    let mut by_key = float_tensors_by_storage(named_tensors(&root));
    let mut out = Weights::new();
    for key in &keys {
        let ty = storages.get(key).ok_or_else(|| ImportError::Pickle {
            path: path.to_path_buf(),
            offset: pos,
            message: format!("storage `{key}` listed but never referenced"),
        })?;
        let record_pos = pos;
        let context = |what: &str| format!("{what} of storage `{key}` at byte {record_pos}");
        let mut n8 = [0u8; 8];
        r.read_exact(&mut n8)
            .map_err(|e| io_err(path, &context("element count"), e))?;
        pos += 8;
        let numel = u64::from_le_bytes(n8);
        let elem = ty.elem_size().ok_or_else(|| ImportError::Unsupported {
            path: path.to_path_buf(),
            message: format!("storage `{key}` has unknown element type {ty:?}"),
        })?;
        let nbytes = numel
            .checked_mul(elem as u64)
            .ok_or_else(|| ImportError::Pickle {
                path: path.to_path_buf(),
                offset: pos,
                message: format!("storage `{key}` element count {numel} overflows"),
            })?;
        match by_key.remove(key) {
            Some(users) => {
                let mut bytes =
                    Vec::with_capacity(usize::try_from(nbytes).unwrap_or(0).min(1 << 26));
                let got = (&mut r)
                    .take(nbytes)
                    .read_to_end(&mut bytes)
                    .map_err(|e| io_err(path, &context("data"), e))?;
                if got as u64 != nbytes {
                    return Err(ImportError::Truncated {
                        path: path.to_path_buf(),
                        context: format!(
                            "storage `{key}` at byte {pos} needs {nbytes} bytes, only {got} present (tensor `{}`)",
                            users[0].0
                        ),
                    });
                }
                gather_all(path, &bytes, &users, &mut out)?;
            }
            None => {
                let got = io::copy(&mut (&mut r).take(nbytes), &mut io::sink())
                    .map_err(|e| io_err(path, &context("data"), e))?;
                if got != nbytes {
                    return Err(ImportError::Truncated {
                        path: path.to_path_buf(),
                        context: format!(
                            "storage `{key}` at byte {pos} needs {nbytes} bytes, only {got} present"
                        ),
                    });
                }
            }
        }
        pos += nbytes;
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
