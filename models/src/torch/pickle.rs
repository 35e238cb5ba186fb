//! A small protocol-2..5 pickle interpreter: the generic virtual machine. The torch-specific
//! parts (persistent storage ids, `_rebuild_*` globals) are in `rebuild.rs`.

use std::collections::HashMap;
use std::io::{self, BufRead, Read};
use std::path::Path;
use std::rc::Rc;

use super::ImportError;
use super::dtype::StorageType;
use super::limits::{
    MAX_DEPTH, MAX_EXPANDED_VALUES, MAX_GLOBAL_NAME_BYTES, MAX_LINE_BYTES, MAX_PICKLE_VALUES,
    MAX_STRING_BYTES,
};
use super::value::Measure;
pub(super) use super::value::Value;

/// Internal pickle error; mapped to [`ImportError`] with the path by the caller.
#[derive(Debug)]
pub(super) enum PErr {
    Eof,
    Io(io::Error),
    Bad(String),
    /// Over one of the bounds of [`super::limits`].
    Limit(String),
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

pub(super) fn limit<T>(msg: impl Into<String>) -> Result<T, PErr> {
    Err(PErr::Limit(msg.into()))
}

/// Refuses a value nested or (counting shared parts each time) expanding beyond the limits.
fn check_bounds(v: &Value) -> Result<(), PErr> {
    if v.depth() > MAX_DEPTH {
        return limit(format!("containers nested more than {MAX_DEPTH} deep"));
    }
    if v.weight() > MAX_EXPANDED_VALUES {
        return limit(format!(
            "a {} that expands to more than {MAX_EXPANDED_VALUES} values \
             (references repeated through the memo or DUP)",
            v.kind()
        ));
    }
    Ok(())
}

pub(super) struct Unpickler<'r, R: BufRead> {
    r: &'r mut R,
    /// Absolute byte position in the underlying stream (for error messages).
    pub(super) pos: u64,
    stack: Vec<Value>,
    memo: HashMap<u32, Value>,
    /// Every storage seen through a persistent id: key -> element type.
    pub(super) storages: HashMap<String, StorageType>,
    /// Values this pickle may still create or copy ([`MAX_PICKLE_VALUES`]).
    budget: u64,
}

impl<'r, R: BufRead> Unpickler<'r, R> {
    pub(super) fn new(r: &'r mut R, pos: u64) -> Self {
        Self {
            r,
            pos,
            stack: Vec::new(),
            memo: HashMap::new(),
            storages: HashMap::new(),
            budget: MAX_PICKLE_VALUES,
        }
    }

    /// Spends `n` of the value budget.
    pub(super) fn charge(&mut self, n: u64) -> Result<(), PErr> {
        match self.budget.checked_sub(n) {
            Some(left) => {
                self.budget = left;
                Ok(())
            }
            None => limit(format!(
                "creates more than {MAX_PICKLE_VALUES} values \
                 (repeated memo gets, DUP or copies of shared containers)"
            )),
        }
    }

    /// Pushes a new value, within the budget and the bounds.
    fn push(&mut self, v: Value) -> Result<(), PErr> {
        self.charge(1)?;
        check_bounds(&v)?;
        self.stack.push(v);
        Ok(())
    }

    fn u8(&mut self) -> Result<u8, PErr> {
        let mut b = [0u8; 1];
        self.r.read_exact(&mut b)?;
        self.pos += 1;
        Ok(b[0])
    }

    /// `n` bytes kept as a string or long (at most [`MAX_STRING_BYTES`]).
    fn bytes(&mut self, n: usize) -> Result<Vec<u8>, PErr> {
        if n > MAX_STRING_BYTES {
            return limit(format!(
                "a string of {n} bytes (the limit is {MAX_STRING_BYTES})"
            ));
        }
        // Guard against absurd lengths from corrupt input: read in bounded chunks.
        let mut v = Vec::with_capacity(n.min(1 << 20));
        let got = (&mut *self.r).take(n as u64).read_to_end(&mut v)?;
        self.pos += got as u64;
        if got != n {
            return Err(PErr::Eof);
        }
        Ok(v)
    }

    /// Skips `n` bytes whose contents are not kept.
    fn skip(&mut self, n: usize) -> Result<(), PErr> {
        let got = io::copy(&mut (&mut *self.r).take(n as u64), &mut io::sink())?;
        self.pos += got;
        if got != n as u64 {
            return Err(PErr::Eof);
        }
        Ok(())
    }

    fn arr<const N: usize>(&mut self) -> Result<[u8; N], PErr> {
        let mut b = [0u8; N];
        self.r.read_exact(&mut b)?;
        self.pos += N as u64;
        Ok(b)
    }

    /// A line of a text opcode (at most [`MAX_LINE_BYTES`]).
    fn line(&mut self) -> Result<String, PErr> {
        let mut v = Vec::new();
        let cap = MAX_LINE_BYTES as u64 + 1;
        let n = (&mut *self.r).take(cap).read_until(b'\n', &mut v)?;
        self.pos += n as u64;
        if v.last() != Some(&b'\n') {
            if n > MAX_LINE_BYTES {
                return limit(format!("a line longer than {MAX_LINE_BYTES} bytes"));
            }
            return Err(PErr::Eof);
        }
        v.pop();
        if v.last() == Some(&b'\r') {
            v.pop();
        }
        Ok(String::from_utf8_lossy(&v).into_owned())
    }

    /// Pushes the global `module.name`, whose parts are at most [`MAX_GLOBAL_NAME_BYTES`].
    fn global(&mut self, module: Rc<str>, name: Rc<str>) -> Result<(), PErr> {
        let longest = module.len().max(name.len());
        if longest > MAX_GLOBAL_NAME_BYTES {
            return limit(format!(
                "a global name of {longest} bytes (the limit is {MAX_GLOBAL_NAME_BYTES})"
            ));
        }
        self.push(Value::Global(module, name))
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

    /// The memoized value: a reference, not a copy.
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
        self.charge(1)?;
        self.memo.insert(id, v);
        Ok(())
    }

    /// Charges the copy that changing the container on top of the stack makes when it is shared
    /// (with the memo or another stack slot): one per item.
    fn charge_unshare(&mut self) -> Result<(), PErr> {
        let n = match self.stack.last() {
            Some(Value::List(n) | Value::Set(n)) if Rc::strong_count(n) > 1 => n.len(),
            Some(Value::Dict(n)) if Rc::strong_count(n) > 1 => n.len(),
            _ => 0,
        };
        self.charge(n as u64)
    }

    fn set_items(&mut self, pairs: Vec<Value>) -> Result<(), PErr> {
        if !pairs.len().is_multiple_of(2) {
            return bad("odd number of items for SETITEMS");
        }
        self.charge_unshare()?;
        let target = self.top()?;
        let Value::Dict(d) = target else {
            // Setting items on an opaque object: ignore (we only care about dicts).
            return Ok(());
        };
        let mut it = pairs.into_iter();
        let mut kv = Vec::with_capacity(it.len() / 2);
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            kv.push((k, v));
        }
        Rc::make_mut(d).extend(kv);
        check_bounds(target)
    }

    fn append(&mut self, items: Vec<Value>) -> Result<(), PErr> {
        self.charge_unshare()?;
        let target = self.top()?;
        match target {
            Value::List(l) | Value::Set(l) => Rc::make_mut(l).extend(items),
            _ => {} // e.g. appending to an opaque object: ignore
        }
        check_bounds(target)
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
                b'(' => self.push(Value::Mark)?,
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
                    self.push(v)?;
                }
                b'N' => self.push(Value::None)?,
                0x88 => self.push(Value::Bool(true))?,
                0x89 => self.push(Value::Bool(false))?,
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
                    self.push(v)?;
                }
                b'L' => {
                    let l = self.line()?;
                    let s = l.trim().trim_end_matches('L');
                    let v = s
                        .parse()
                        .map_err(|_| PErr::Bad(format!("unsupported LONG {s:?}")))?;
                    self.push(Value::Int(v))?;
                }
                b'J' => {
                    let v = i32::from_le_bytes(self.arr::<4>()?);
                    self.push(Value::Int(v as i64))?;
                }
                b'K' => {
                    let v = self.u8()?;
                    self.push(Value::Int(v as i64))?;
                }
                b'M' => {
                    let v = u16::from_le_bytes(self.arr::<2>()?);
                    self.push(Value::Int(v as i64))?;
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
                    self.push(long_from_bytes(b))?;
                }
                b'G' => {
                    // BINFLOAT: 8-byte big-endian double
                    self.arr::<8>()?;
                    self.push(Value::Float)?;
                }
                b'F' => {
                    let l = self.line()?;
                    l.trim()
                        .parse::<f64>()
                        .map_err(|_| PErr::Bad(format!("bad FLOAT {l:?}")))?;
                    self.push(Value::Float)?;
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
                    self.push(Value::str(s))?;
                }
                b'V' => {
                    let l = self.line()?;
                    self.push(Value::str(l))?;
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
                    self.push(Value::str(String::from_utf8_lossy(&b)))?;
                }
                b'S' => {
                    let l = self.line()?;
                    let s = l.trim();
                    let s = s
                        .strip_prefix('\'')
                        .and_then(|s| s.strip_suffix('\''))
                        .or_else(|| s.strip_prefix('"').and_then(|s| s.strip_suffix('"')))
                        .unwrap_or(s);
                    self.push(Value::str(s))?;
                }
                b'B' | b'C' | 0x8e | 0x96 => {
                    // BINBYTES / SHORT_BINBYTES / BINBYTES8 / BYTEARRAY8
                    let n = match op {
                        b'B' => u32::from_le_bytes(self.arr::<4>()?) as usize,
                        b'C' => self.u8()? as usize,
                        _ => usize::try_from(u64::from_le_bytes(self.arr::<8>()?))
                            .map_err(|_| PErr::Bad("bytes too long".into()))?,
                    };
                    self.skip(n)?;
                    self.push(Value::Bytes)?;
                }
                b')' => self.push(Value::tuple(vec![]))?,
                b't' => {
                    let items = self.pop_mark()?;
                    self.push(Value::tuple(items))?;
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
                    self.push(Value::tuple(items))?;
                }
                b']' => self.push(Value::list(vec![]))?,
                b'l' => {
                    let items = self.pop_mark()?;
                    self.push(Value::list(items))?;
                }
                b'a' => {
                    let v = self.pop()?;
                    self.append(vec![v])?;
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    self.append(items)?;
                }
                b'}' => self.push(Value::dict(vec![]))?,
                b'd' => {
                    let items = self.pop_mark()?;
                    self.push(Value::dict(vec![]))?;
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
                0x8f => self.push(Value::set(vec![]))?,
                0x90 => {
                    let items = self.pop_mark()?;
                    self.append(items)?;
                }
                0x91 => {
                    let items = self.pop_mark()?;
                    self.push(Value::set(items))?;
                }
                b'c' => {
                    let module = self.line()?;
                    let name = self.line()?;
                    self.global(module.into(), name.into())?;
                }
                0x93 => {
                    // STACK_GLOBAL
                    let name = self.pop()?;
                    let module = self.pop()?;
                    match (module, name) {
                        (Value::Str(m), Value::Str(n)) => self.global(m, n)?,
                        _ => return bad("STACK_GLOBAL operands are not strings"),
                    }
                }
                b'R' => {
                    let args = self.pop()?;
                    let func = self.pop()?;
                    let v = self.call(func, args)?;
                    self.push(v)?;
                }
                0x81 => {
                    // NEWOBJ: cls.__new__(cls, *args)
                    let args = self.pop()?;
                    let cls = self.pop()?;
                    let v = self.call(cls, args)?;
                    self.push(v)?;
                }
                0x92 => {
                    // NEWOBJ_EX
                    let _kwargs = self.pop()?;
                    let args = self.pop()?;
                    let cls = self.pop()?;
                    let v = self.call(cls, args)?;
                    self.push(v)?;
                }
                b'b' => {
                    // BUILD: set state on the object; we keep the object as is, except that
                    // a dict-state on a dict (OrderedDict _metadata) is ignored too.
                    let _state = self.pop()?;
                    self.top()?;
                }
                b'P' => {
                    let l = self.line()?;
                    let v = self.persistent_load(Value::str(l))?;
                    self.push(v)?;
                }
                b'Q' => {
                    let pid = self.pop()?;
                    let v = self.persistent_load(pid)?;
                    self.push(v)?;
                }
                b'g' => {
                    let id = self.line_index("GET")?;
                    let v = self.memo_get(id)?;
                    self.push(v)?;
                }
                b'h' => {
                    let id = self.u8()? as u32;
                    let v = self.memo_get(id)?;
                    self.push(v)?;
                }
                b'j' => {
                    let id = u32::from_le_bytes(self.arr::<4>()?);
                    let v = self.memo_get(id)?;
                    self.push(v)?;
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
        Value::BigInt(b.into())
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
        PErr::Limit(message) => ImportError::Limit {
            path: path.to_path_buf(),
            message: format!("pickle `{what}` at byte {pos}: {message}"),
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
