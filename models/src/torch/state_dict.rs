//! State-dict extraction from the unpickled object, and gathering of strided tensors.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;
use std::rc::Rc;

use super::ImportError;
use super::dtype::{FloatType, StorageType};
use super::limits::{MAX_BROADCAST_ELEMENTS, MAX_WALK_STEPS, VIEWS_PER_STORAGE_ELEMENT};
use super::pickle::Value;
use super::rebuild::TensorRef;
use super::value::Measure;
use crate::tensor::{Tensor, Weights};

pub(super) fn key_name(k: &Value) -> Option<String> {
    key_str(k).map(Cow::into_owned)
}

/// The walk that names the tensors of an unpickled object, iterative and bounded: its steps
/// (one per value visited, one per byte of name built) are counted against [`MAX_WALK_STEPS`],
/// so values shared many times over (the memo, `DUP`) cannot make it run long. It goes only
/// where a tensor is ([`Measure::has_tensor`]).
struct Walk {
    steps: u64,
}

impl Walk {
    fn step(&mut self, n: u64) -> Result<(), String> {
        match self.steps.checked_sub(n) {
            Some(left) => {
                self.steps = left;
                Ok(())
            }
            None => Err(format!(
                "naming the tensors takes more than {MAX_WALK_STEPS} steps \
                 (values referenced many times over, or very long keys)"
            )),
        }
    }

    /// `prefix.key` (or `key` at the top), charged before it is built.
    fn join(&mut self, prefix: &str, key: &str) -> Result<String, String> {
        self.step(2 + prefix.len() as u64 + key.len() as u64)?;
        Ok(if prefix.is_empty() {
            key.to_string()
        } else {
            format!("{prefix}.{key}")
        })
    }

    /// Every tensor under `root`, named by its dotted path, in document order.
    fn flatten(
        &mut self,
        root: &Value,
        out: &mut Vec<(String, Rc<TensorRef>)>,
    ) -> Result<(), String> {
        // Only where a tensor is: a subtree without one is skipped whatever its size.
        let mut todo: Vec<(&Value, String)> = vec![(root, String::new())];
        while let Some((v, name)) = todo.pop() {
            self.step(1)?;
            match v {
                Value::Tensor(t) => out.push((name, t.clone())),
                Value::Dict(d) => {
                    for (k, v) in d.iter().rev().filter(|(_, v)| v.has_tensor()) {
                        if let Some(k) = key_str(k) {
                            todo.push((v, self.join(&name, &k)?));
                        }
                    }
                }
                Value::List(l) | Value::Tuple(l) => {
                    for (i, v) in l.iter().enumerate().rev().filter(|(_, v)| v.has_tensor()) {
                        todo.push((v, self.join(&name, &i.to_string())?));
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }
}

fn key_str(k: &Value) -> Option<Cow<'_, str>> {
    match k {
        Value::Str(s) => Some(Cow::Borrowed(&**s)),
        Value::Int(i) => Some(Cow::Owned(i.to_string())),
        _ => None,
    }
}

/// Named tensors of the unpickled top-level object. A plain state dict is used as is; a
/// training checkpoint (`{"epoch": .., "state_dict": {...}}`) with no top-level tensors is
/// unwrapped through its `state_dict` / `model_state_dict` / `model` entry when present;
/// anything else is flattened with dotted names. Errs when the walk is over its bound.
pub(super) fn named_tensors(root: &Value) -> Result<Vec<(String, Rc<TensorRef>)>, String> {
    let mut walk = Walk {
        steps: MAX_WALK_STEPS,
    };
    let mut out = Vec::new();
    if let Value::Dict(d) = root
        && !d.iter().any(|(_, v)| matches!(v, Value::Tensor(_)))
    {
        for wanted in ["state_dict", "model_state_dict", "model"] {
            for (k, v) in d.iter() {
                if matches!(k, Value::Str(s) if &**s == wanted) && v.has_tensor() {
                    walk.flatten(v, &mut out)?;
                    return Ok(out);
                }
            }
        }
    }
    walk.flatten(root, &mut out)?;
    Ok(out)
}

/// Where a view lies in its storage: its first element and its element count, checked with
/// checked arithmetic against the storage's `storage_numel` elements; its strides, with those of
/// dimensions of size 1 zeroed (they are never stepped over).
fn view_extent(t: &TensorRef, storage_numel: usize) -> Result<(usize, usize, Vec<usize>), String> {
    let numel = t
        .size
        .iter()
        .try_fold(1usize, |a, &s| a.checked_mul(s))
        .ok_or("element count overflows")?;
    let stride: Vec<usize> = t
        .size
        .iter()
        .zip(&t.stride)
        .map(|(&s, &st)| if s == 1 { 0 } else { st })
        .collect();
    if numel == 0 {
        return Ok((0, 0, stride));
    }
    let start = t
        .storage
        .view_offset
        .checked_add(t.offset)
        .ok_or("storage offset overflows")?;
    let mut last = start;
    for (&s, &st) in t.size.iter().zip(&stride) {
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
    if numel > storage_numel && numel as u64 > MAX_BROADCAST_ELEMENTS {
        return Err(format!(
            "size {:?} stride {:?} makes {numel} elements out of the {storage_numel} of \
             storage `{}` (a view larger than its storage may have at most \
             {MAX_BROADCAST_ELEMENTS} elements)",
            t.size, t.stride, t.storage.key
        ));
    }
    Ok((start, numel, stride))
}

/// Gathers `t` from the raw little-endian storage bytes into contiguous row-major f32; `start`,
/// `numel` and `stride` are from [`view_extent`].
fn gather(
    bytes: &[u8],
    ft: FloatType,
    t: &TensorRef,
    (start, numel, stride): (usize, usize, Vec<usize>),
) -> Vec<f32> {
    let mut out = Vec::with_capacity(numel);
    if numel == 0 {
        return out;
    }
    // Contiguous fast path.
    let mut expect = 1usize;
    let contiguous = t.size.iter().zip(&stride).rev().all(|(&s, &st)| {
        let ok = s == 1 || st == expect;
        expect *= s;
        ok
    });
    if contiguous {
        out.extend((start..start + numel).map(|i| ft.load(bytes, i)));
        return out;
    }
    let nd = t.size.len();
    let mut idx = vec![0usize; nd];
    let mut pos = start;
    for _ in 0..numel {
        out.push(ft.load(bytes, pos));
        for d in (0..nd).rev() {
            idx[d] += 1;
            pos += stride[d];
            if idx[d] < t.size[d] {
                break;
            }
            pos -= stride[d] * t.size[d];
            idx[d] = 0;
        }
    }
    out
}

/// Elements the tensors of one checkpoint may still gather: [`MAX_BROADCAST_ELEMENTS`] plus
/// [`VIEWS_PER_STORAGE_ELEMENT`] per element of the storages read, so that many views of the
/// same data (or many stride-0 views) cannot multiply a small file into a huge output.
pub(super) struct ViewBudget {
    left: u64,
}

impl ViewBudget {
    pub(super) fn new() -> Self {
        ViewBudget {
            left: MAX_BROADCAST_ELEMENTS,
        }
    }
}

/// Groups the float tensors by storage key; integer tensors are dropped here.
pub(super) fn float_tensors_by_storage(
    tensors: Vec<(String, Rc<TensorRef>)>,
) -> BTreeMap<String, Vec<(String, Rc<TensorRef>, FloatType)>> {
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

/// Bytes of one storage that its views `users` reach: past the furthest element any of them
/// addresses, nothing is needed (checked arithmetic; an overflow is an error).
pub(super) fn storage_bytes_needed(
    users: &[(String, Rc<TensorRef>, FloatType)],
) -> Result<u64, String> {
    let mut elements = 0u64;
    for (name, t, _) in users {
        if t.size.contains(&0) {
            continue;
        }
        let mut last = t.storage.view_offset.checked_add(t.offset);
        for (&s, &st) in t.size.iter().zip(&t.stride) {
            let st = if s == 1 { 0 } else { st };
            last = last.and_then(|l| (s - 1).checked_mul(st)?.checked_add(l));
        }
        let last = last.ok_or_else(|| format!("tensor `{name}`: its extent overflows"))?;
        elements = elements.max(last as u64 + 1);
    }
    let size = users.first().map_or(0, |(_, _, ft)| ft.size() as u64);
    elements
        .checked_mul(size)
        .ok_or_else(|| "its extent in bytes overflows".to_string())
}

/// Gathers the views `users` of one storage (`bytes`) into `out`, within `budget`.
pub(super) fn gather_all(
    path: &Path,
    bytes: &[u8],
    users: &[(String, Rc<TensorRef>, FloatType)],
    out: &mut Weights,
    budget: &mut ViewBudget,
) -> Result<(), ImportError> {
    if let Some((_, _, ft)) = users.first() {
        let elements = (bytes.len() / ft.size()) as u64;
        budget.left = budget
            .left
            .saturating_add(elements.saturating_mul(VIEWS_PER_STORAGE_ELEMENT));
    }
    for (name, t, ft) in users {
        let extent =
            view_extent(t, bytes.len() / ft.size()).map_err(|message| ImportError::Tensor {
                path: path.to_path_buf(),
                tensor: name.clone(),
                message,
            })?;
        let numel = extent.1 as u64;
        budget.left = budget
            .left
            .checked_sub(numel)
            .ok_or_else(|| ImportError::Limit {
                path: path.to_path_buf(),
                message: format!(
                    "tensor `{name}`: its {numel} elements and those gathered before it exceed \
                 {VIEWS_PER_STORAGE_ELEMENT} per element of the storages read plus \
                 {MAX_BROADCAST_ELEMENTS} (the same data viewed over and over)"
                ),
            })?;
        let data = gather(bytes, *ft, t, extent);
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
