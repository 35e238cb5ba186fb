//! Torch-specific parts of the unpickler: storages reached through persistent ids, and the
//! globals (`OrderedDict`, `_rebuild_tensor*`, `_rebuild_parameter*`, ...) we model.

use std::io::BufRead;

use super::dtype::StorageType;
use super::pickle::{PErr, Unpickler, Value, bad};

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
            Some(Value::Str(s)) if s == "storage" => {}
            _ => return bad("persistent id is not a ('storage', ...) tuple"),
        }
        if t.len() < 5 {
            return bad("storage persistent id has fewer than 5 fields");
        }
        let ty = match &t[1] {
            Value::Global(m, n) => StorageType::from_class(m, n),
            other => return bad(format!("storage type is a {}", other.kind())),
        };
        let key = match &t[2] {
            Value::Str(s) => s.clone(),
            Value::Int(i) => i.to_string(),
            other => return bad(format!("storage key is a {}", other.kind())),
        };
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
        Ok(Value::Storage(StorageRef {
            ty,
            key,
            view_offset,
        }))
    }

    /// Calls `func(*args)` for the globals we model; anything else becomes an opaque object.
    pub(super) fn call(&mut self, func: Value, args: Value) -> Result<Value, PErr> {
        let Value::Global(module, name) = &func else {
            return Ok(Value::Object(Box::new(args)));
        };
        let argv = match &args {
            Value::Tuple(a) => a.as_slice(),
            _ => &[],
        };
        match (module.as_str(), name.as_str()) {
            ("collections", "OrderedDict") | ("builtins", "dict") | ("__builtin__", "dict") => {
                let mut d = Vec::new();
                if let Some(Value::List(items)) | Some(Value::Tuple(items)) = argv.first() {
                    for it in items {
                        if let Value::Tuple(kv) | Value::List(kv) = it
                            && kv.len() == 2
                        {
                            d.push((kv[0].clone(), kv[1].clone()));
                        }
                    }
                }
                Ok(Value::Dict(d))
            }
            ("torch._utils", "_rebuild_tensor")
            | ("torch._utils", "_rebuild_tensor_v2")
            | ("torch._utils", "_rebuild_tensor_v3") => {
                if argv.len() < 4 {
                    return bad(format!("{name} called with {} arguments", argv.len()));
                }
                let Value::Storage(mut storage) = argv[0].clone() else {
                    return bad(format!("{name}: first argument is a {}", argv[0].kind()));
                };
                if name == "_rebuild_tensor_v3"
                    && let Some(Value::Global(m, n)) = argv.get(6)
                {
                    storage.ty = StorageType::from_dtype(m, n);
                    self.storages
                        .insert(storage.key.clone(), storage.ty.clone());
                }
                let offset = as_usize(&argv[1])
                    .ok_or_else(|| PErr::Bad(format!("{name}: bad storage offset")))?;
                let size =
                    as_usize_vec(&argv[2]).ok_or_else(|| PErr::Bad(format!("{name}: bad size")))?;
                let stride = as_usize_vec(&argv[3])
                    .ok_or_else(|| PErr::Bad(format!("{name}: bad stride")))?;
                if size.len() != stride.len() {
                    return bad(format!(
                        "{name}: size {size:?} and stride {stride:?} differ in rank"
                    ));
                }
                Ok(Value::Tensor(TensorRef {
                    storage,
                    offset,
                    size,
                    stride,
                }))
            }
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
            _ => Ok(Value::Object(Box::new(args))),
        }
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
    match v {
        Value::Tuple(items) | Value::List(items) => items.iter().map(as_usize).collect(),
        // torch.Size is pickled as a tuple, but accept the opaque `torch.Size((...))` form.
        Value::Object(args) => match args.as_ref() {
            Value::Tuple(a) if a.len() == 1 => as_usize_vec(&a[0]),
            _ => None,
        },
        _ => None,
    }
}
