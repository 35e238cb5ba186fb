//! Hostile checkpoints, each a few hundred bytes (or a few MB of repeated opcodes): every one
//! must fail fast, in bounded memory, with an error naming the file and the limit.

use std::fs::File;
use std::io::{BufReader, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use zip::CompressionMethod;
use zip::write::SimpleFileOptions;

use super::archive::read_entry;
use super::limits::{MAX_DEPTH, MAX_PICKLE_ENTRY_BYTES};
use super::value::Value;
use super::{ImportError, read_checkpoint};

// ----------------------------------------------------------------------------------------
// Pickle and file builders
// ----------------------------------------------------------------------------------------

/// BINUNICODE.
fn ustr(s: &str) -> Vec<u8> {
    let mut b = vec![b'X'];
    b.extend((s.len() as u32).to_le_bytes());
    b.extend(s.as_bytes());
    b
}

/// LONG1 of 8 bytes.
fn int(v: u64) -> Vec<u8> {
    let mut b = vec![0x8a, 8];
    b.extend(v.to_le_bytes());
    b
}

/// MARK items TUPLE.
fn tuple(items: &[Vec<u8>]) -> Vec<u8> {
    let mut b = vec![b'('];
    for it in items {
        b.extend(it);
    }
    b.push(b't');
    b
}

fn global(module: &str, name: &str) -> Vec<u8> {
    format!("c{module}\n{name}\n").into_bytes()
}

/// `_rebuild_tensor_v2(storage(key, FloatStorage, numel), offset, size, stride, False, {})`.
fn tensor(key: &str, numel: u64, offset: u64, size: &[u64], stride: &[u64]) -> Vec<u8> {
    let pid = tuple(&[
        ustr("storage"),
        global("torch", "FloatStorage"),
        ustr(key),
        ustr("cpu"),
        int(numel),
    ]);
    let ints = |v: &[u64]| tuple(&v.iter().map(|&x| int(x)).collect::<Vec<_>>());
    let mut b = global("torch._utils", "_rebuild_tensor_v2");
    b.extend(tuple(&[
        [pid, b"Q".to_vec()].concat(),
        int(offset),
        ints(size),
        ints(stride),
        b"\x89".to_vec(),
        [global("collections", "OrderedDict"), b")R".to_vec()].concat(),
    ]));
    b.push(b'R');
    b
}

/// A protocol-2 pickle of the dict `{name: value, ...}` (values are pickle fragments).
fn state_dict(entries: &[(&str, Vec<u8>)]) -> Vec<u8> {
    let mut b = b"\x80\x02}(".to_vec();
    for (k, v) in entries {
        b.extend(ustr(k));
        b.extend(v);
    }
    b.extend(b"u.");
    b
}

/// A zip checkpoint with these entries under `archive/`.
fn zip_file(dir: &Path, file: &str, entries: &[(&str, &[u8], CompressionMethod)]) -> PathBuf {
    let path = dir.join(file);
    let mut z = zip::ZipWriter::new(File::create(&path).unwrap());
    for (name, bytes, method) in entries {
        let opts = SimpleFileOptions::default().compression_method(*method);
        z.start_file(format!("archive/{name}"), opts).unwrap();
        z.write_all(bytes).unwrap();
    }
    z.finish().unwrap();
    path
}

/// A zip checkpoint whose `data.pkl` is `pkl`.
fn zip_pickle(dir: &Path, file: &str, pkl: &[u8]) -> PathBuf {
    zip_file(dir, file, &[("data.pkl", pkl, CompressionMethod::Stored)])
}

/// Rewrites the uncompressed size of entry `name` in its local and central headers.
fn patch_declared_size(bytes: &mut [u8], name: &str, size: u32) {
    let u16_at = |b: &[u8], i: usize| u16::from_le_bytes([b[i], b[i + 1]]) as usize;
    let mut patched = 0;
    for i in 0..bytes.len() - 46 {
        let (size_at, name_len_at, name_at) = match &bytes[i..i + 4] {
            b"PK\x03\x04" => (22, 26, 30),
            b"PK\x01\x02" => (24, 28, 46),
            _ => continue,
        };
        let n = u16_at(bytes, i + name_len_at);
        if bytes.get(i + name_at..i + name_at + n) == Some(name.as_bytes()) {
            bytes[i + size_at..i + size_at + 4].copy_from_slice(&size.to_le_bytes());
            patched += 1;
        }
    }
    assert_eq!(patched, 2, "local and central header of {name}");
}

/// A legacy (torch < 1.6) checkpoint: magic, protocol, sys info, `state`, the storage keys,
/// then `records` (raw storage records).
fn legacy_file(dir: &Path, file: &str, state: &[u8], keys: &[&str], records: &[u8]) -> PathBuf {
    let mut b = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.".to_vec();
    b.extend(b"\x80\x02M\xe9\x03.\x80\x02}.");
    b.extend(state);
    b.extend(b"\x80\x02(");
    for k in keys {
        b.extend(ustr(k));
    }
    b.extend(b"l.");
    b.extend(records);
    let path = dir.join(file);
    std::fs::write(&path, b).unwrap();
    path
}

/// Reads `path`, which must fail within a second; returns the error and its message, checked
/// to name the file.
fn refused(path: &Path) -> (ImportError, String) {
    let t = Instant::now();
    let err = read_checkpoint(path).expect_err("a hostile file was accepted");
    let took = t.elapsed();
    let msg = err.to_string();
    assert!(took < Duration::from_secs(1), "took {took:?}: {msg}");
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    (err, msg)
}

/// Checks that `path` is refused over a limit whose message contains `what`.
fn refused_over_limit(path: &Path, what: &str) {
    let (err, msg) = refused(path);
    assert!(matches!(err, ImportError::Limit { .. }), "{msg}");
    assert!(msg.contains(what), "expected `{what}` in: {msg}");
}

// ----------------------------------------------------------------------------------------
// The builders make good checkpoints (so the refusals below are for the right reason)
// ----------------------------------------------------------------------------------------

#[test]
fn builders_make_readable_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let pkl = state_dict(&[("w", tensor("0", 6, 0, &[2, 3], &[1, 2]))]);
    let data: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let z = zip_file(
        dir.path(),
        "good.pt",
        &[
            ("data.pkl", &pkl, CompressionMethod::Deflated),
            ("data/0", &data, CompressionMethod::Deflated),
        ],
    );
    let w = read_checkpoint(&z).unwrap();
    assert_eq!(w["w"].shape, vec![2, 3]);
    assert_eq!(w["w"].data, vec![0.0, 2.0, 4.0, 1.0, 3.0, 5.0]);

    let mut records = 6u64.to_le_bytes().to_vec();
    records.extend(&data);
    let l = legacy_file(dir.path(), "good.pth", &pkl, &["0"], &records);
    assert_eq!(read_checkpoint(&l).unwrap(), w);

    // A small broadcast view (stride 0) is still accepted.
    let pkl = state_dict(&[("b", tensor("0", 1, 0, &[3, 2], &[0, 0]))]);
    let z = zip_file(
        dir.path(),
        "broadcast.pt",
        &[
            ("data.pkl", &pkl, CompressionMethod::Stored),
            ("data/0", &7f32.to_le_bytes(), CompressionMethod::Stored),
        ],
    );
    assert_eq!(read_checkpoint(&z).unwrap()["b"].data, vec![7.0; 6]);
}

// ----------------------------------------------------------------------------------------
// Memo / DUP bombs
// ----------------------------------------------------------------------------------------

#[test]
fn doubling_bombs_are_refused_at_the_opcode() {
    let dir = tempfile::tempdir().unwrap();
    let bomb = |start: &[u8], step: &[u8]| {
        let mut b = b"\x80\x02".to_vec();
        b.extend(start);
        for _ in 0..40 {
            b.extend(step);
        }
        b.push(b'.');
        assert!(b.len() < 1000, "{} bytes", b.len());
        b
    };
    let cases: [(&str, Vec<u8>); 4] = [
        // t = (t, t), through DUP.
        ("dup.pt", bomb(b")", b"2\x86")),
        // t = (memo[0], memo[0]); memo[0] = t.
        ("memo.pt", bomb(b")q\x00", b"h\x00h\x00\x86q\x00")),
        // l = memo[0]; l.append(memo[0]); memo[0] = l.
        ("append.pt", bomb(b"]q\x00", b"h\x00h\x00aq\x00")),
        // d = memo[0]; d[1] = memo[0]; memo[0] = d.
        ("setitem.pt", bomb(b"}q\x00", b"h\x00K\x01h\x00sq\x00")),
    ];
    for (file, pkl) in cases {
        let path = zip_pickle(dir.path(), file, &pkl);
        refused_over_limit(&path, "expands to more than");
    }
}

#[test]
fn copying_a_shared_list_over_and_over_runs_out_of_budget() {
    // A list of 3000 items in the memo, then 3000 times: get it, append to it (a copy of
    // 3000 items, the memo's stays as it was), drop the copy.
    let mut b = b"\x80\x02](".to_vec();
    b.extend(std::iter::repeat_n(b"K\x00".as_slice(), 3000).flatten());
    b.extend(b"eq\x00");
    for _ in 0..3000 {
        b.extend(b"h\x00K\x01a0");
    }
    b.push(b'.');
    let dir = tempfile::tempdir().unwrap();
    let path = zip_pickle(dir.path(), "copies.pt", &b);
    refused_over_limit(&path, "creates more than");
}

#[test]
fn memo_references_are_not_copies() {
    // Shared values may be referenced many times while the object stays small: 20 doublings
    // (a million values counted as a tree) are fine, and reading it is quick.
    let mut b = b"\x80\x02}(X\x01\x00\x00\x00w".to_vec();
    b.extend(tensor("0", 1, 0, &[1], &[1]));
    b.extend(b"X\x01\x00\x00\x00xK\x00");
    for _ in 0..20 {
        b.extend(b"2\x86");
    }
    b.extend(b"u.");
    let dir = tempfile::tempdir().unwrap();
    let path = zip_file(
        dir.path(),
        "shared.pt",
        &[
            ("data.pkl", &b, CompressionMethod::Stored),
            ("data/0", &1f32.to_le_bytes(), CompressionMethod::Stored),
        ],
    );
    let t = Instant::now();
    let w = read_checkpoint(&path).unwrap();
    assert!(t.elapsed() < Duration::from_secs(1));
    assert_eq!(w["w"].data, vec![1.0]);
}

// ----------------------------------------------------------------------------------------
// Deep nesting
// ----------------------------------------------------------------------------------------

#[test]
fn a_million_nested_tuples_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut t1 = b"\x80\x02K\x00".to_vec();
    t1.extend(std::iter::repeat_n(0x85u8, 1_000_000));
    t1.push(b'.');
    let path = zip_pickle(dir.path(), "tuple1.pt", &t1);
    refused_over_limit(&path, &format!("nested more than {MAX_DEPTH} deep"));

    // The same with lists: a million marks, then a million LIST opcodes.
    let mut lists = b"\x80\x02".to_vec();
    lists.extend(std::iter::repeat_n(b'(', 1_000_000));
    lists.extend(std::iter::repeat_n(b'l', 1_000_000));
    lists.push(b'.');
    let path = zip_pickle(dir.path(), "lists.pt", &lists);
    refused_over_limit(&path, "nested more than");

    // Through the legacy format too.
    let path = legacy_file(dir.path(), "tuple1.pth", &t1, &[], &[]);
    refused_over_limit(&path, "pickle `state dict`");
}

#[test]
fn dropping_a_deep_value_does_not_recurse() {
    // Built directly (the unpickler would refuse it): a million nested tuples and lists, one
    // level shared, dropped on this test thread's ordinary stack.
    let t = Instant::now();
    let mut v = Value::Int(0);
    let mut shared = None;
    for i in 0..1_000_000 {
        v = match i % 3 {
            0 => Value::tuple(vec![v]),
            1 => Value::list(vec![Value::None, v]),
            _ => Value::dict(vec![(Value::Int(i), v)]),
        };
        if i == 500_000 {
            shared = Some(v.clone());
        }
    }
    drop(v);
    drop(shared);
    let mut o = Value::None;
    for _ in 0..1_000_000 {
        o = Value::object(o);
    }
    drop(o);
    // Building and dropping three million nodes; the point is that it does not overflow.
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

// ----------------------------------------------------------------------------------------
// Sizes and strides against the storage
// ----------------------------------------------------------------------------------------

#[test]
fn a_huge_stride0_tensor_over_a_tiny_storage_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let one = 1f32.to_le_bytes();
    let case = |file: &str, size: &[u64], stride: &[u64]| {
        let pkl = state_dict(&[("w", tensor("0", 1, 0, size, stride))]);
        zip_file(
            dir.path(),
            file,
            &[
                ("data.pkl", &pkl, CompressionMethod::Stored),
                ("data/0", &one, CompressionMethod::Stored),
            ],
        )
    };
    for (file, size, stride) in [
        ("s0.pt", &[1u64 << 40][..], &[0u64][..]),
        ("s00.pt", &[1 << 20, 1 << 20][..], &[0, 0][..]),
        ("s000.pt", &[1 << 10, 1 << 15, 1 << 15][..], &[0, 0, 0][..]),
    ] {
        let (err, msg) = refused(&case(file, size, stride));
        assert!(matches!(err, ImportError::Tensor { .. }), "{msg}");
        assert!(msg.contains("out of the 1 of storage `0`"), "{msg}");
    }
    // Sizes whose product overflows, and strides that step past the storage.
    let (err, msg) = refused(&case("overflow.pt", &[1 << 40, 1 << 40], &[0, 0]));
    assert!(matches!(err, ImportError::Tensor { .. }), "{msg}");
    assert!(msg.contains("element count overflows"), "{msg}");
    let (_, msg) = refused(&case("stride.pt", &[2], &[u64::MAX >> 1]));
    assert!(
        msg.contains("overflows") || msg.contains("reaches element"),
        "{msg}"
    );
    // Size 1 with a huge stride is never stepped over: fine.
    let w = read_checkpoint(&case("size1.pt", &[1, 1], &[u64::MAX >> 1, 7])).unwrap();
    assert_eq!(w["w"].data, vec![1.0]);
}

#[test]
fn views_repeated_over_the_same_data_are_refused() {
    // One 8M-element broadcast view of a 4-byte storage, named three times (memo): each view
    // is within the broadcast allowance, together they are not.
    let mut pkl = b"\x80\x02}(".to_vec();
    pkl.extend(ustr("a"));
    pkl.extend(tensor("0", 1, 0, &[1 << 23], &[0]));
    pkl.extend(b"q\x09");
    for k in ["b", "c"] {
        pkl.extend(ustr(k));
        pkl.extend(b"h\x09");
    }
    pkl.extend(b"u.");
    let dir = tempfile::tempdir().unwrap();
    let path = zip_file(
        dir.path(),
        "views.pt",
        &[
            ("data.pkl", &pkl, CompressionMethod::Stored),
            ("data/0", &1f32.to_le_bytes(), CompressionMethod::Stored),
        ],
    );
    refused_over_limit(&path, "viewed over and over");
}

#[test]
fn a_legacy_storage_record_of_absurd_size_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pkl = state_dict(&[("w", tensor("0", 4, 0, &[4], &[1]))]);
    let mut records = (1u64 << 40).to_le_bytes().to_vec();
    records.extend([0u8; 16]);
    let path = legacy_file(dir.path(), "huge.pth", &pkl, &["0"], &records);
    refused_over_limit(&path, "storage `0` at byte");
}

// ----------------------------------------------------------------------------------------
// Zip entries: decompression bombs
// ----------------------------------------------------------------------------------------

#[test]
fn an_entry_decompressing_past_its_declared_size_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    // 256 KiB of zeros deflate to a few hundred bytes; the headers say 100.
    let zeros = vec![0u8; 256 << 10];
    let path = zip_file(
        dir.path(),
        "bomb.pt",
        &[("data.pkl", &zeros, CompressionMethod::Deflated)],
    );
    let mut bytes = std::fs::read(&path).unwrap();
    assert!(bytes.len() < 1000, "{} bytes", bytes.len());
    patch_declared_size(&mut bytes, "archive/data.pkl", 100);
    std::fs::write(&path, &bytes).unwrap();
    refused_over_limit(&path, "decompresses to more than the 100 bytes");

    // Headers that declare more than the cap are refused before anything is decompressed.
    patch_declared_size(&mut bytes, "archive/data.pkl", u32::MAX - 1);
    std::fs::write(&path, &bytes).unwrap();
    refused_over_limit(
        &path,
        &format!("declares 4294967294 bytes, over the limit of {MAX_PICKLE_ENTRY_BYTES}"),
    );
}

#[test]
fn a_storage_entry_decompressing_past_its_declared_size_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pkl = state_dict(&[("w", tensor("0", 4, 0, &[4], &[1]))]);
    let zeros = vec![0u8; 256 << 10];
    let path = zip_file(
        dir.path(),
        "storage-bomb.pt",
        &[
            ("data.pkl", &pkl, CompressionMethod::Stored),
            ("data/0", &zeros, CompressionMethod::Deflated),
        ],
    );
    let mut bytes = std::fs::read(&path).unwrap();
    patch_declared_size(&mut bytes, "archive/data/0", 16);
    std::fs::write(&path, &bytes).unwrap();
    refused_over_limit(
        &path,
        "zip entry `archive/data/0` decompresses to more than",
    );
}

#[test]
fn entries_over_the_cap_are_refused_by_read_entry() {
    let dir = tempfile::tempdir().unwrap();
    let zeros = vec![0u8; 1 << 20];
    let path = zip_file(
        dir.path(),
        "big.pt",
        &[("data/0", &zeros, CompressionMethod::Deflated)],
    );
    let mut zip = zip::ZipArchive::new(BufReader::new(File::open(&path).unwrap())).unwrap();
    let err = read_entry(&path, &mut zip, "archive/data/0", 64 << 10).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, ImportError::Limit { .. }), "{msg}");
    assert!(
        msg.contains("declares 1048576 bytes, over the limit of 65536") && msg.contains("big.pt"),
        "{msg}"
    );
    let v = read_entry(&path, &mut zip, "archive/data/0", 1 << 20).unwrap();
    assert_eq!(v.map(|v| v.len()), Some(1 << 20));
    assert!(
        read_entry(&path, &mut zip, "archive/none", 1)
            .unwrap()
            .is_none()
    );
}

// ----------------------------------------------------------------------------------------
// Other bounds of the unpickler
// ----------------------------------------------------------------------------------------

#[test]
fn long_lines_names_and_keys_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    // A text opcode whose line never ends (2 MiB of `a`).
    let mut line = b"\x80\x02c".to_vec();
    line.extend(std::iter::repeat_n(b'a', 2 << 20));
    let path = zip_pickle(dir.path(), "line.pt", &line);
    refused_over_limit(&path, "a line longer than");

    // A global name of 4 KiB.
    let long = "m".repeat(4096);
    let mut g = b"\x80\x02".to_vec();
    g.extend(ustr(&long));
    g.extend(ustr("x"));
    g.extend(b"\x93.");
    let path = zip_pickle(dir.path(), "global.pt", &g);
    refused_over_limit(&path, "a global name of 4096 bytes");

    // A storage key of 4 KiB.
    let pkl = state_dict(&[("w", tensor(&long, 1, 0, &[1], &[1]))]);
    let path = zip_pickle(dir.path(), "key.pt", &pkl);
    refused_over_limit(&path, "a storage key of 4096 bytes");

    // A tensor of rank 100.
    let pkl = state_dict(&[("w", tensor("0", 1, 0, &[1; 100], &[1; 100]))]);
    let path = zip_pickle(dir.path(), "rank.pt", &pkl);
    refused_over_limit(&path, "a tensor of rank 100");

    // A string longer than the cap is refused before it is read.
    let mut s = b"\x80\x02\x8d".to_vec();
    s.extend((1u64 << 40).to_le_bytes());
    let path = zip_pickle(dir.path(), "string.pt", &s);
    refused_over_limit(&path, "a string of 1099511627776 bytes");
}
