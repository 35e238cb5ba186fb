//! Bounds on what a checkpoint may make the reader do. A hostile file of a few hundred bytes
//! must fail fast, in bounded memory, with an error naming the file and the limit; each bound
//! sits far above what real checkpoints need (a state dict's pickle holds some tens of values
//! per tensor, nests a handful of levels, and names storages with short decimal keys).

/// Values the unpickler may create or copy for one pickle (each pushed value counts one, each
/// item copied when a shared list or dict is changed counts one, each 64 bytes of names a
/// persistent id or a call allocates count one). About 20,000 tensors' worth; a value with its
/// memo entry costs up to ~150 bytes, so at most ~160 MiB (2^23 let an 8 KB file of MEMOIZE
/// opcodes take 1.25 GiB: tests/tests/e2e/hostile_files.rs).
pub(super) const MAX_PICKLE_VALUES: u64 = 1 << 20;

/// Values one object may hold counted as a tree, a value shared through the memo or `DUP`
/// counted each time it appears: what a walk over it visits. Stops the doubling bombs (a tuple
/// of two references to the previous one, 40 times over) at the opcode that builds them.
pub(super) const MAX_EXPANDED_VALUES: u64 = 1 << 23;

/// Containers nested in one another (a state dict nests a handful of levels; CPython's own
/// pickler stops near 1000).
pub(super) const MAX_DEPTH: u32 = 256;

/// Bytes of a line of a text opcode (module and class names, protocol-0 numbers and strings).
pub(super) const MAX_LINE_BYTES: usize = 1 << 20;

/// Bytes of a string or long kept from the pickle.
pub(super) const MAX_STRING_BYTES: usize = 64 << 20;

/// Bytes of a global's module or name.
pub(super) const MAX_GLOBAL_NAME_BYTES: usize = 1024;

/// Bytes of a storage key (torch writes short decimal keys).
pub(super) const MAX_STORAGE_KEY_BYTES: usize = 256;

/// Dimensions of a tensor (torch's own tensors stop at 64).
pub(super) const MAX_RANK: usize = 64;

/// Steps of the walk that names the tensors of the unpickled object: one per value visited
/// plus one per byte of name built. About 64 MiB of names.
pub(super) const MAX_WALK_STEPS: u64 = 1 << 26;

/// Bytes of a zip entry that is not a storage (`data.pkl`, `byteorder`, ...), after
/// decompression.
pub(super) const MAX_PICKLE_ENTRY_BYTES: u64 = 256 << 20;

/// Bytes of one storage (a zip entry after decompression, or a legacy storage record): 1 Gi f32
/// elements, above the largest single tensors of public vision and language checkpoints.
pub(super) const MAX_STORAGE_BYTES: u64 = 4 << 30;

/// Elements a tensor may have beyond those of its storage (stride-0 broadcast views), and the
/// slack of the checkpoint-wide bound below.
pub(super) const MAX_BROADCAST_ELEMENTS: u64 = 1 << 24;

/// Elements all tensors together may gather, per element of storage read: views of one storage
/// (tied weights, q/k/v slices) rarely add up to more than twice it.
pub(super) const VIEWS_PER_STORAGE_ELEMENT: u64 = 4;
