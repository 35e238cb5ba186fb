//! A small protocol-2..5 pickle interpreter: the generic virtual machine. The torch-specific
//! parts (persistent storage ids, `_rebuild_*` globals) are in `rebuild.rs`.

use std::collections::HashMap;
use std::io::{self, BufRead, Read};
use std::path::Path;

use super::ImportError;
use super::dtype::StorageType;
use super::rebuild::{StorageRef, TensorRef};

#[derive(Debug, Clone)]
pub(super) enum Value {
    Mark,
    None,
    Bool(bool),
    Int(i64),
    /// Little-endian two's complement integer too large for i64.
    BigInt(Vec<u8>),
    /// A float; its value is never needed, so it is not kept.
    Float,
    Str(String),
    /// A bytes object; its contents are never needed, so they are not kept.
    Bytes,
    Tuple(Vec<Value>),
    List(Vec<Value>),
    Dict(Vec<(Value, Value)>),
    Set(Vec<Value>),
    Global(String, String),
    Storage(StorageRef),
    Tensor(TensorRef),
    /// Opaque result of calling a global we do not model; only the call arguments are kept
    /// (`torch.Size((...))` is read through them).
    Object(Box<Value>),
}

impl Value {
    pub(super) fn kind(&self) -> &'static str {
        match self {
            Value::Mark => "mark",
            Value::None => "None",
            Value::Bool(_) => "bool",
            Value::Int(_) | Value::BigInt(_) => "int",
            Value::Float => "float",
            Value::Str(_) => "str",
            Value::Bytes => "bytes",
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
pub(super) enum PErr {
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

pub(super) fn bad<T>(msg: impl Into<String>) -> Result<T, PErr> {
    Err(PErr::Bad(msg.into()))
}

pub(super) struct Unpickler<'r, R: BufRead> {
    r: &'r mut R,
    /// Absolute byte position in the underlying stream (for error messages).
    pub(super) pos: u64,
    stack: Vec<Value>,
    memo: HashMap<u32, Value>,
    /// Every storage seen through a persistent id: key -> element type.
    pub(super) storages: HashMap<String, StorageType>,
}

impl<'r, R: BufRead> Unpickler<'r, R> {
    pub(super) fn new(r: &'r mut R, pos: u64) -> Self {
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

    /// A memo index written in decimal on its own line (the text opcodes GET and PUT).
    fn line_index(&mut self, op: &str) -> Result<u32, PErr> {
        let l = self.line()?;
        l.trim()
            .parse()
            .map_err(|_| PErr::Bad(format!("bad {op} {l:?}")))
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

    // long-function: the pickle VM's opcode loop, one short match arm per opcode on shared VM state
    /// Runs until STOP; returns the unpickled object.
    pub(super) fn load(&mut self) -> Result<Value, PErr> {
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
                    // BINFLOAT: 8-byte big-endian double
                    self.arr::<8>()?;
                    self.stack.push(Value::Float);
                }
                b'F' => {
                    let l = self.line()?;
                    l.trim()
                        .parse::<f64>()
                        .map_err(|_| PErr::Bad(format!("bad FLOAT {l:?}")))?;
                    self.stack.push(Value::Float);
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
                    self.bytes(n)?;
                    self.stack.push(Value::Bytes);
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
                    let id = self.line_index("GET")?;
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
                    let id = self.line_index("PUT")?;
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

/// Unpickles one object from `r`, whose next byte is at absolute stream position `*pos`, and
/// advances `*pos` past it. Returns the object and the storages its persistent ids name;
/// `what` names the pickle in error messages.
pub(super) fn load_one<R: BufRead>(
    path: &Path,
    r: &mut R,
    pos: &mut u64,
    what: &str,
) -> Result<(Value, HashMap<String, StorageType>), ImportError> {
    let mut up = Unpickler::new(r, *pos);
    let v = up.load();
    *pos = up.pos;
    let v = v.map_err(|e| pickle_err(path, what, *pos, e))?;
    Ok((v, up.storages))
}
