//! Torch-specific parts of the unpickler: storages reached through persistent ids, and the
//! globals (`OrderedDict`, `_rebuild_tensor*`, `_rebuild_parameter*`, ...) we model.

use std::io::BufRead;
use std::rc::Rc;

use super::dtype::StorageType;
use super::limits::{MAX_RANK, MAX_STORAGE_KEY_BYTES};
use super::pickle::{PErr, Unpickler, Value, bad, limit};

#[derive(Debug, Clone)]
pub(super) struct StorageRef {
    pub(super) ty: StorageType,
    pub(super) key: String,
    /// Element offset of a legacy storage view into its root storage.
    pub(super) view_offset: usize,
}

#[derive(Debug, Clone)]
pub(super) struct TensorRef {
    pub(super) storage: StorageRef,
    pub(super) offset: usize,
    pub(super) size: Vec<usize>,
    pub(super) stride: Vec<usize>,
}

impl<R: BufRead> Unpickler<'_, R> {
    pub(super) fn persistent_load(&mut self, pid: Value) -> Result<Value, PErr> {
        let Value::Tuple(t) = pid else {
            return bad(format!(
                "persistent id is a {}, expected a tuple",
                pid.kind()
            ));
        };
        match t.first() {
            Some(Value::Str(s)) if &**s == "storage" => {}
            _ => return bad("persistent id is not a ('storage', ...) tuple"),
        }
        if t.len() < 5 {
            return bad("storage persistent id has fewer than 5 fields");
        }
        let key = match &t[2] {
            Value::Str(s) => s.to_string(),
            Value::Int(i) => i.to_string(),
            other => return bad(format!("storage key is a {}", other.kind())),
        };
        if key.len() > MAX_STORAGE_KEY_BYTES {
            return limit(format!(
                "a storage key of {} bytes (the limit is {MAX_STORAGE_KEY_BYTES})",
                key.len()
            ));
        }
        let ty = match &t[1] {
            Value::Global(m, n) => StorageType::from_class(m, n),
            other => return bad(format!("storage type is a {}", other.kind())),
        };
        // The key and type name are copied here and into `storages`.
        self.charge(1 + (2 * key.len() + type_name_len(&ty)) as u64 / 64)?;
        // Legacy format: a 6th field holds view metadata `(view_key, offset, view_size)` or
        // None; `key` is then the root storage and the view starts `offset` elements in.
        let mut view_offset = 0usize;
        if let Some(Value::Tuple(vm)) = t.get(5)
            && vm.len() >= 2
        {
            view_offset = as_usize(&vm[1])
                .ok_or_else(|| PErr::Bad("storage view offset is not a non-negative int".into()))?;
        }
        self.storages.insert(key.clone(), ty.clone());
        Ok(Value::Storage(Rc::new(StorageRef {
            ty,
            key,
            view_offset,
        })))
    }

    /// Calls `func(*args)` for the globals we model; anything else becomes an opaque object.
    pub(super) fn call(&mut self, func: Value, args: Value) -> Result<Value, PErr> {
        let Value::Global(module, name) = &func else {
            return Ok(Value::object(args));
        };
        let argv = match &args {
            Value::Tuple(a) => &a[..],
            _ => &[],
        };
        match (&**module, &**name) {
            ("collections", "OrderedDict") | ("builtins", "dict") | ("__builtin__", "dict") => {
                let mut d = Vec::new();
                if let Some(Value::List(items)) | Some(Value::Tuple(items)) = argv.first() {
                    for it in items.iter() {
                        if let Value::Tuple(kv) | Value::List(kv) = it
                            && kv.len() == 2
                        {
                            d.push((kv[0].clone(), kv[1].clone()));
                        }
                    }
                }
                self.charge(d.len() as u64)?;
                Ok(Value::dict(d))
            }
            ("torch._utils", "_rebuild_tensor")
            | ("torch._utils", "_rebuild_tensor_v2")
            | ("torch._utils", "_rebuild_tensor_v3") => self.rebuild_tensor(name, argv),
            ("torch._utils", "_rebuild_parameter")
            | ("torch._utils", "_rebuild_parameter_with_state") => match argv.first() {
                Some(v) => Ok(v.clone()),
                None => bad(format!("{name} called without arguments")),
            },
            ("torch._tensor", "_rebuild_from_type_v2")
            | ("torch._tensor", "_rebuild_from_type") => {
                if argv.len() < 3 {
                    return bad(format!("{name} called with {} arguments", argv.len()));
                }
                self.call(argv[0].clone(), argv[2].clone())
            }
            _ => Ok(Value::object(args)),
        }
    }

    /// `torch._utils._rebuild_tensor*(storage, offset, size, stride, ...)`.
    fn rebuild_tensor(&mut self, name: &str, argv: &[Value]) -> Result<Value, PErr> {
        if argv.len() < 4 {
            return bad(format!("{name} called with {} arguments", argv.len()));
        }
        let Value::Storage(storage) = &argv[0] else {
            return bad(format!("{name}: first argument is a {}", argv[0].kind()));
        };
        let mut storage = StorageRef::clone(storage);
        if name == "_rebuild_tensor_v3"
            && let Some(Value::Global(m, n)) = argv.get(6)
        {
            storage.ty = StorageType::from_dtype(m, n);
            self.charge(1 + (storage.key.len() + type_name_len(&storage.ty)) as u64 / 64)?;
            self.storages
                .insert(storage.key.clone(), storage.ty.clone());
        }
        let offset =
            as_usize(&argv[1]).ok_or_else(|| PErr::Bad(format!("{name}: bad storage offset")))?;
        let size = as_usize_vec(&argv[2]).ok_or_else(|| PErr::Bad(format!("{name}: bad size")))?;
        let stride =
            as_usize_vec(&argv[3]).ok_or_else(|| PErr::Bad(format!("{name}: bad stride")))?;
        if size.len() > MAX_RANK {
            return limit(format!(
                "{name}: a tensor of rank {} (the limit is {MAX_RANK})",
                size.len()
            ));
        }
        if size.len() != stride.len() {
            return bad(format!(
                "{name}: size {size:?} and stride {stride:?} differ in rank"
            ));
        }
        self.charge(1 + (size.len() + stride.len() + storage.key.len() / 8) as u64)?;
        Ok(Value::Tensor(Rc::new(TensorRef {
            storage,
            offset,
            size,
            stride,
        })))
    }
}

/// Bytes of the type name a storage type carries.
fn type_name_len(ty: &StorageType) -> usize {
    match ty {
        StorageType::Skip { name, .. } => name.len(),
        StorageType::Float(_) => 0,
    }
}

pub(super) fn as_usize(v: &Value) -> Option<usize> {
    match v {
        Value::Int(i) => usize::try_from(*i).ok(),
        Value::Bool(b) => Some(*b as usize),
        _ => None,
    }
}

pub(super) fn as_usize_vec(v: &Value) -> Option<Vec<usize>> {
    let mut v = v;
    loop {
        match v {
            Value::Tuple(items) | Value::List(items) => {
                return items.iter().map(as_usize).collect();
            }
            // torch.Size is pickled as a tuple, but accept the opaque `torch.Size((...))` form.
            Value::Object(args) => match &args[..] {
                [Value::Tuple(a)] if a.len() == 1 => v = &a[0],
                _ => return None,
            },
            _ => return None,
        }
    }
}
