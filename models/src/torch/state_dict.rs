//! State-dict extraction from the unpickled object, and gathering of strided tensors.

use std::collections::BTreeMap;
use std::path::Path;

use super::ImportError;
use super::dtype::{FloatType, StorageType};
use super::pickle::Value;
use super::rebuild::TensorRef;
use crate::tensor::{Tensor, Weights};

pub(super) fn key_name(k: &Value) -> Option<String> {
    match k {
        Value::Str(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

fn contains_tensor(v: &Value) -> bool {
    match v {
        Value::Tensor(_) => true,
        Value::Dict(d) => d.iter().any(|(_, v)| contains_tensor(v)),
        Value::List(l) | Value::Tuple(l) => l.iter().any(contains_tensor),
        _ => false,
    }
}

fn flatten(v: &Value, prefix: &str, out: &mut Vec<(String, TensorRef)>) {
    let join = |k: &str| {
        if prefix.is_empty() {
            k.to_string()
        } else {
            format!("{prefix}.{k}")
        }
    };
    match v {
        Value::Tensor(t) => out.push((prefix.to_string(), t.clone())),
        Value::Dict(d) => {
            for (k, v) in d {
                if let Some(k) = key_name(k) {
                    flatten(v, &join(&k), out);
                }
            }
        }
        Value::List(l) | Value::Tuple(l) => {
            for (i, v) in l.iter().enumerate() {
                flatten(v, &join(&i.to_string()), out);
            }
        }
        _ => {}
    }
}

/// Named tensors of the unpickled top-level object. A plain state dict is used as is; a
/// training checkpoint (`{"epoch": .., "state_dict": {...}}`) with no top-level tensors is
/// unwrapped through its `state_dict` / `model_state_dict` / `model` entry when present;
/// anything else is flattened with dotted names.
pub(super) fn named_tensors(root: &Value) -> Vec<(String, TensorRef)> {
    let mut out = Vec::new();
    if let Value::Dict(d) = root
        && !d.iter().any(|(_, v)| matches!(v, Value::Tensor(_)))
    {
        for wanted in ["state_dict", "model_state_dict", "model"] {
            if let Some((_, v)) = d
                .iter()
                .find(|(k, v)| matches!(k, Value::Str(s) if s == wanted) && contains_tensor(v))
            {
                flatten(v, "", &mut out);
                return out;
            }
        }
    }
    flatten(root, "", &mut out);
    out
}

/// Gathers `t` from the raw little-endian storage bytes into contiguous row-major f32.
fn gather(bytes: &[u8], ft: FloatType, t: &TensorRef) -> Result<Vec<f32>, String> {
    let storage_numel = bytes.len() / ft.size();
    let numel = t
        .size
        .iter()
        .try_fold(1usize, |a, &s| a.checked_mul(s))
        .ok_or("element count overflows")?;
    if numel == 0 {
        return Ok(Vec::new());
    }
    let start = t
        .storage
        .view_offset
        .checked_add(t.offset)
        .ok_or("storage offset overflows")?;
    let mut last = start;
    for (&s, &st) in t.size.iter().zip(&t.stride) {
        last = (s - 1)
            .checked_mul(st)
            .and_then(|x| last.checked_add(x))
            .ok_or("extent overflows")?;
    }
    if last >= storage_numel {
        return Err(format!(
            "size {:?} stride {:?} offset {start} reaches element {last}, \
             but storage `{}` holds only {storage_numel} elements",
            t.size, t.stride, t.storage.key
        ));
    }
    let mut out = Vec::with_capacity(numel);
    // Contiguous fast path.
    let mut expect = 1usize;
    let contiguous = t.size.iter().zip(&t.stride).rev().all(|(&s, &st)| {
        let ok = s == 1 || st == expect;
        expect *= s;
        ok
    });
    if contiguous {
        out.extend((start..start + numel).map(|i| ft.load(bytes, i)));
        return Ok(out);
    }
    let nd = t.size.len();
    let mut idx = vec![0usize; nd];
    let mut pos = start;
    for _ in 0..numel {
        out.push(ft.load(bytes, pos));
        for d in (0..nd).rev() {
            idx[d] += 1;
            pos += t.stride[d];
            if idx[d] < t.size[d] {
                break;
            }
            pos -= t.stride[d] * t.size[d];
            idx[d] = 0;
        }
    }
    Ok(out)
}

/// Groups the float tensors by storage key; integer tensors are dropped here.
pub(super) fn float_tensors_by_storage(
    tensors: Vec<(String, TensorRef)>,
) -> BTreeMap<String, Vec<(String, TensorRef, FloatType)>> {
    let mut by_key: BTreeMap<String, Vec<_>> = BTreeMap::new();
    for (name, t) in tensors {
        if let StorageType::Float(ft) = t.storage.ty {
            by_key
                .entry(t.storage.key.clone())
                .or_default()
                .push((name, t, ft));
        }
    }
    by_key
}

pub(super) fn gather_all(
    path: &Path,
    bytes: &[u8],
    users: &[(String, TensorRef, FloatType)],
    out: &mut Weights,
) -> Result<(), ImportError> {
    for (name, t, ft) in users {
        let data = gather(bytes, *ft, t).map_err(|message| ImportError::Tensor {
            path: path.to_path_buf(),
            tensor: name.clone(),
            message,
        })?;
        out.insert(
            name.clone(),
            Tensor {
                shape: t.size.clone(),
                data,
            },
        );
    }
    Ok(())
}
