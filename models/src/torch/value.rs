//! The values the unpickler builds. Everything that owns heap data is behind an `Rc`, so a memo
//! get or a `DUP` copies a pointer, never a tree; containers ([`Node`]) carry their nesting depth
//! and expanded size (shared children counted each time they appear), so the unpickler can refuse
//! a value that nests too deep or would expand too far before anything walks it
//! ([`super::limits`]). Dropping a deep value is iterative (see `Drop for Node`).

use std::ops::Deref;
use std::rc::Rc;

use super::rebuild::{StorageRef, TensorRef};

#[derive(Debug, Clone)]
pub(super) enum Value {
    Mark,
    None,
    Bool(bool),
    Int(i64),
    /// Little-endian two's complement integer too large for i64.
    BigInt(Rc<[u8]>),
    /// A float; its value is never needed, so it is not kept.
    Float,
    Str(Rc<str>),
    /// A bytes object; its contents are never needed, so they are not kept.
    Bytes,
    Tuple(Rc<Node<Value>>),
    List(Rc<Node<Value>>),
    Dict(Rc<Node<(Value, Value)>>),
    Set(Rc<Node<Value>>),
    Global(Rc<str>, Rc<str>),
    Storage(Rc<StorageRef>),
    Tensor(Rc<TensorRef>),
    /// Opaque result of calling a global we do not model; only the call arguments are kept (one
    /// item; `torch.Size((...))` is read through them).
    Object(Rc<Node<Value>>),
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

    pub(super) fn str(s: impl Into<Rc<str>>) -> Value {
        Value::Str(s.into())
    }

    pub(super) fn tuple(items: Vec<Value>) -> Value {
        Value::Tuple(Rc::new(Node::new(items)))
    }

    pub(super) fn list(items: Vec<Value>) -> Value {
        Value::List(Rc::new(Node::new(items)))
    }

    pub(super) fn set(items: Vec<Value>) -> Value {
        Value::Set(Rc::new(Node::new(items)))
    }

    pub(super) fn dict(items: Vec<(Value, Value)>) -> Value {
        Value::Dict(Rc::new(Node::new(items)))
    }

    pub(super) fn object(args: Value) -> Value {
        Value::Object(Rc::new(Node::new(vec![args])))
    }

    /// Moves the children of a container held only here into `out`, leaving it empty (so that
    /// dropping it recurses no further).
    fn detach_children(&mut self, out: &mut Vec<Value>) {
        match self {
            Value::Tuple(n) | Value::List(n) | Value::Set(n) | Value::Object(n) => {
                if let Some(n) = Rc::get_mut(n) {
                    n.depth = 0;
                    out.append(&mut n.items);
                }
            }
            Value::Dict(n) => {
                if let Some(n) = Rc::get_mut(n) {
                    n.depth = 0;
                    for (k, v) in n.items.drain(..) {
                        out.push(k);
                        out.push(v);
                    }
                }
            }
            _ => {}
        }
    }
}

/// What a container needs of its items: their nesting depth and expanded size.
pub(super) trait Measure {
    /// Containers nested inside (0 for a leaf).
    fn depth(&self) -> u32;
    /// Values in the expanded tree (1 for a leaf; saturating).
    fn weight(&self) -> u64;
    /// Whether a tensor is in it (or is it).
    fn has_tensor(&self) -> bool;
    /// Moves the values of this item into `out`.
    fn into_values(self, out: &mut Vec<Value>);
}

impl Measure for Value {
    fn depth(&self) -> u32 {
        match self {
            Value::Tuple(n) | Value::List(n) | Value::Set(n) | Value::Object(n) => n.depth,
            Value::Dict(n) => n.depth,
            _ => 0,
        }
    }

    fn weight(&self) -> u64 {
        match self {
            Value::Tuple(n) | Value::List(n) | Value::Set(n) | Value::Object(n) => n.weight,
            Value::Dict(n) => n.weight,
            _ => 1,
        }
    }

    /// Through tuples, lists and dicts only: the containers a state dict is named through
    /// (sets and opaque objects are not walked).
    fn has_tensor(&self) -> bool {
        match self {
            Value::Tuple(n) | Value::List(n) => n.tensors,
            Value::Dict(n) => n.tensors,
            Value::Tensor(_) => true,
            _ => false,
        }
    }

    fn into_values(self, out: &mut Vec<Value>) {
        out.push(self);
    }
}

impl Measure for (Value, Value) {
    fn depth(&self) -> u32 {
        self.0.depth().max(self.1.depth())
    }

    fn weight(&self) -> u64 {
        self.0.weight().saturating_add(self.1.weight())
    }

    fn has_tensor(&self) -> bool {
        self.0.has_tensor() || self.1.has_tensor()
    }

    fn into_values(self, out: &mut Vec<Value>) {
        out.push(self.0);
        out.push(self.1);
    }
}

/// A container's items with their depth, expanded size and whether a tensor is among them,
/// kept up to date on every change.
#[derive(Debug, Clone)]
pub(super) struct Node<T: Measure> {
    items: Vec<T>,
    depth: u32,
    weight: u64,
    tensors: bool,
}

impl<T: Measure> Node<T> {
    pub(super) fn new(items: Vec<T>) -> Self {
        let mut n = Node {
            items: Vec::new(),
            depth: 1,
            weight: 1,
            tensors: false,
        };
        n.extend(items);
        n
    }

    pub(super) fn extend(&mut self, items: Vec<T>) {
        for it in &items {
            self.depth = self.depth.max(it.depth().saturating_add(1));
            self.weight = self.weight.saturating_add(it.weight());
            self.tensors |= it.has_tensor();
        }
        self.items.extend(items);
    }
}

impl<T: Measure> Deref for Node<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.items
    }
}

/// Below this depth a node is dropped the ordinary (recursive) way.
const SHALLOW: u32 = 32;

/// Drops a deep tree with a work list instead of recursion, whatever its depth: every container
/// held only by the tree has its children moved onto the list before it is dropped.
impl<T: Measure> Drop for Node<T> {
    fn drop(&mut self) {
        if self.depth <= SHALLOW {
            return;
        }
        let mut work = Vec::new();
        for it in self.items.drain(..) {
            it.into_values(&mut work);
        }
        while let Some(mut v) = work.pop() {
            v.detach_children(&mut work);
        }
    }
}
