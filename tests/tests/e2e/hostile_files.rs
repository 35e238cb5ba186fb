//! Hostile files through the binaries, as a user runs them (issue 55, point 6): checkpoints built
//! to exhaust `trainer import-weights` (memo and `DUP` doubling bombs, a million nested
//! containers, stride-0 views of a 4-byte storage, deflate bombs in zip entries), an artifact
//! whose `manifest.json` is over its cap (`edge-agent predict`), and Delta tables whose
//! `_delta_log/` holds a file over its cap (`trainer prepare`). Each must fail with a clear error
//! naming the file and what is wrong, within seconds and bounded memory, and write nothing.
//!
//! Every command runs as a child measured around itself: its wall time from spawn to exit, and
//! its peak RSS as GNU time reports it (without `/usr/bin/time`, the RSS checks are skipped, and
//! say so). A child is killed after [`WATCHDOG`] and limited to [`ADDRESS_SPACE`] of virtual
//! memory, so that an unbounded reader fails this test instead of the machine.
//!
//! The checkpoint builders are copied from `models/src/torch/hostile_tests.rs` (the models
//! crate's test helpers are private); zip files and their deflate streams are written here by
//! hand, since this crate has no zip dependency.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kestrel_shared::manifest::{MANIFEST_FILE, MAX_MANIFEST_BYTES};
use kestrel_tests::{bin, copy_dir, fetched, fleet::fixture, lfw, python, run_ok, s, trainer_json};
use serde_json::Value;

/// The longest a refusal may take, process start to exit (the issue asks under a second of
/// reading; the rest is slack for process start on a loaded 2-core machine).
const TIME_LIMIT: Duration = Duration::from_secs(3);
/// A child still running after this is killed (and fails its case).
const WATCHDOG: Duration = Duration::from_secs(120);
/// Virtual memory a child may map: far above what any refusal needs, far below the machine.
const ADDRESS_SPACE: u64 = 8 << 30;
/// Peak RSS a refused checkpoint may add to an empty file's refusal: the largest entry the reader
/// decompresses before parsing (`data.pkl`, `MAX_PICKLE_ENTRY_BYTES` = 256 MiB in
/// models/src/torch/limits.rs) plus 64 MiB.
const CHECKPOINT_RSS_BUDGET_MIB: f64 = 320.0;
/// Peak RSS a refused manifest or Delta log may add to a small malformed one's refusal: neither is
/// read past its cap (4 MiB for a manifest; a Delta log file over its cap is not read at all).
const SMALL_RSS_BUDGET_MIB: f64 = 48.0;

/// `MAX_PICKLE_ENTRY_BYTES` (models/src/torch/limits.rs; not public).
const MAX_PICKLE_ENTRY_BYTES: usize = 256 << 20;
/// `MAX_LOG_JSON_BYTES` and `MAX_LOG_FILE_BYTES` (trainer/src/data/delta.rs; not public).
const MAX_LOG_JSON_BYTES: u64 = 256 << 20;
const MAX_LOG_FILE_BYTES: u64 = 1 << 30;

// ----------------------------------------------------------------------------------------
// Running a binary, measured
// ----------------------------------------------------------------------------------------

/// GNU time, which reports its child's peak RSS. `wait4`'s `ru_maxrss` cannot stand in: Linux
/// counts in it the memory of the process image that `exec` replaced, here a copy of this test
/// process, megabytes of hostile files included.
const GNU_TIME: &str = "/usr/bin/time";

/// What a finished child did.
struct Outcome {
    /// The exit code; `None` when a signal ended it.
    code: Option<i32>,
    /// How a signal ended it, if one did.
    signal: Option<String>,
    stderr: String,
    wall: Duration,
    /// Peak RSS in MiB; `None` without GNU time.
    rss_mib: Option<f64>,
    killed: bool,
}

impl Outcome {
    fn line(&self, what: &str) -> String {
        let rss = match self.rss_mib {
            Some(m) => format!("{m:.1} MiB"),
            None => format!("not measured ({GNU_TIME} is missing)"),
        };
        format!(
            "{what}: exit {:?}{}, {:.3} s, peak RSS {rss}",
            self.code,
            self.signal
                .as_deref()
                .map(|s| format!(" ({s})"))
                .unwrap_or_default(),
            self.wall.as_secs_f64(),
        )
    }
}

/// Runs workspace binary `name` with `args` (under GNU time when there is one), its output into
/// files under `logs`, and returns its exit, stderr, wall time (spawn to exit) and peak RSS.
fn measured(name: &str, args: &[&str], logs: &Path) -> Outcome {
    use std::os::unix::process::CommandExt;
    use std::sync::mpsc::{RecvTimeoutError, channel};
    std::fs::create_dir_all(logs).unwrap();
    let err_path = logs.join("stderr");
    let rss_path = logs.join("rss");
    let timed = Path::new(GNU_TIME).exists();
    let mut cmd = if timed {
        let mut c = Command::new(GNU_TIME);
        c.args(["-f", "%M", "-o"]).arg(&rss_path).arg(bin(name));
        c
    } else {
        Command::new(bin(name))
    };
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(File::create(logs.join("stdout")).unwrap())
        .stderr(File::create(&err_path).unwrap())
        .process_group(0);
    // SAFETY: setrlimit is async-signal-safe and touches nothing of the parent.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: ADDRESS_SPACE,
                rlim_max: ADDRESS_SPACE,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let t = Instant::now();
    let mut child = cmd.spawn().unwrap();
    let pid = child.id() as libc::pid_t;
    let (done, until) = channel::<()>();
    let watchdog = std::thread::spawn(move || match until.recv_timeout(WATCHDOG) {
        Err(RecvTimeoutError::Timeout) => {
            // SAFETY: the group's leader is not reaped before this thread is joined, so the
            // group is still the child's.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
            true
        }
        _ => false,
    });
    // Wait for the exit without reaping, so the watchdog can never signal a reused group.
    loop {
        // SAFETY: a zeroed siginfo_t is a valid out-parameter.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waits on this process's own child; WNOWAIT leaves it unreaped.
        let r = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        if r == 0 {
            break;
        }
        let e = std::io::Error::last_os_error();
        assert_eq!(e.kind(), std::io::ErrorKind::Interrupted, "waitid: {e}");
    }
    let wall = t.elapsed();
    let _ = done.send(());
    let killed = watchdog.join().unwrap();
    let status = child.wait().unwrap();
    let mut code = status.code();
    let mut signal = None;
    let mut rss_mib = None;
    if timed {
        // "Command exited with non-zero status 1" or "Command terminated by signal 9", then %M.
        let report = std::fs::read_to_string(&rss_path).unwrap_or_default();
        for l in report.lines() {
            if l.contains("terminated by signal") {
                signal = Some(l.trim().to_string());
                code = None;
            }
            if let Ok(kib) = l.trim().parse::<u64>() {
                rss_mib = Some(kib as f64 / 1024.0);
            }
        }
    } else if code.is_none() {
        signal = Some(format!("{status:?}"));
    }
    Outcome {
        code,
        signal,
        stderr: std::fs::read_to_string(&err_path).unwrap_or_default(),
        wall,
        rss_mib,
        killed,
    }
}

/// The ways `o` is not a clean, fast, bounded refusal naming each of `names` and `expect`
/// (empty when it is one). Its peak RSS may exceed `base`'s by `rss_budget_mib`.
fn refusal_problems(
    o: &Outcome,
    names: &[&str],
    expect: &[&str],
    base: &Outcome,
    rss_budget_mib: f64,
) -> Vec<String> {
    let mut p = Vec::new();
    if o.killed {
        p.push(format!("still running after {WATCHDOG:?}: killed"));
    }
    match (o.code, &o.signal) {
        (Some(0), _) => p.push("exited 0: the hostile file was accepted".into()),
        (_, Some(s)) => p.push(format!("ended by a signal: {s}")),
        (None, None) => p.push("ended without an exit code".into()),
        _ => {}
    }
    if o.stderr.contains("panicked") || o.stderr.contains("overflowed its stack") {
        p.push("panicked or overflowed its stack".into());
    }
    for n in names.iter().chain(expect) {
        if !o.stderr.contains(n) {
            p.push(format!("stderr does not say `{n}`"));
        }
    }
    if o.wall >= TIME_LIMIT {
        p.push(format!(
            "took {:.3} s (limit {TIME_LIMIT:?})",
            o.wall.as_secs_f64()
        ));
    }
    match (o.rss_mib, base.rss_mib) {
        (Some(rss), Some(base)) if rss > base + rss_budget_mib => p.push(format!(
            "peak RSS {rss:.1} MiB, over the baseline {base:.1} MiB + {rss_budget_mib} MiB"
        )),
        (Some(_), Some(_)) => {}
        _ => eprintln!("peak RSS not checked: {GNU_TIME} is missing"),
    }
    p
}

/// Panics listing every failed case, each with its stderr.
fn assert_no_failures(failures: &[String]) {
    assert!(
        failures.is_empty(),
        "{} case(s) failed:\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

// ----------------------------------------------------------------------------------------
// CRC-32, and deflate streams of periodic data (fixed Huffman codes, back-references)
// ----------------------------------------------------------------------------------------

fn crc_table() -> [u32; 256] {
    let mut t = [0u32; 256];
    for (i, e) in t.iter_mut().enumerate() {
        let mut c = i as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xedb8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
        *e = c;
    }
    t
}

/// The raw CRC-32 register after `data` from `c` (no pre- or post-inversion).
fn crc_feed(t: &[u32; 256], mut c: u32, data: &[u8]) -> u32 {
    for &b in data {
        c = t[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8);
    }
    c
}

fn crc32(data: &[u8]) -> u32 {
    !crc_feed(&crc_table(), !0, data)
}

/// An affine map of the CRC register over GF(2): `c -> A c ^ v`, with `A` by columns.
#[derive(Clone, Copy)]
struct Affine {
    cols: [u32; 32],
    v: u32,
}

impl Affine {
    fn linear(&self, x: u32) -> u32 {
        (0..32)
            .filter(|i| x >> i & 1 != 0)
            .fold(0, |acc, i| acc ^ self.cols[i])
    }

    /// `self` after `g`.
    fn after(&self, g: &Affine) -> Affine {
        let mut cols = [0u32; 32];
        for (c, gc) in cols.iter_mut().zip(&g.cols) {
            *c = self.linear(*gc);
        }
        Affine {
            cols,
            v: self.linear(g.v) ^ self.v,
        }
    }
}

/// The CRC-32 of `prefix` followed by `total - prefix.len()` bytes of its last `period` bytes
/// repeated, in O(period + log total): feeding one period is an affine map of the register,
/// raised to the number of whole periods by squaring.
fn crc32_periodic(prefix: &[u8], period: usize, total: usize) -> u32 {
    let t = crc_table();
    let tail = &prefix[prefix.len() - period..];
    let run = |c: u32| crc_feed(&t, c, tail);
    let v = run(0);
    let mut step = Affine { cols: [0; 32], v };
    for (i, c) in step.cols.iter_mut().enumerate() {
        *c = run(1 << i) ^ v;
    }
    let mut power = Affine {
        cols: std::array::from_fn(|i| 1 << i),
        v: 0,
    };
    let left = total - prefix.len();
    let mut k = left / period;
    while k > 0 {
        if k & 1 == 1 {
            power = step.after(&power);
        }
        step = step.after(&step);
        k >>= 1;
    }
    let c = crc_feed(&t, !0, prefix);
    let c = power.linear(c) ^ power.v;
    !crc_feed(&t, c, &tail[..left % period])
}

/// Bits of a deflate stream, least significant first.
struct Bits {
    out: Vec<u8>,
    acc: u64,
    n: u32,
}

impl Bits {
    fn put(&mut self, v: u32, n: u32) {
        self.acc |= (v as u64) << self.n;
        self.n += n;
        while self.n >= 8 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.n -= 8;
        }
    }

    /// A Huffman code, most significant bit first.
    fn code(&mut self, code: u32, len: u32) {
        self.put(code.reverse_bits() >> (32 - len), len);
    }

    fn literal(&mut self, b: u8) {
        match b {
            0..=143 => self.code(0x30 + b as u32, 8),
            _ => self.code(0x190 + (b as u32 - 144), 9),
        }
    }

    /// A back-reference of `len` (3..=258) bytes at distance `dist` (1..=4).
    fn copy(&mut self, len: usize, dist: usize) {
        // (symbol, base length, extra bits), RFC 1951 3.2.5.
        const LENGTHS: [(u32, u32, u32); 29] = [
            (257, 3, 0),
            (258, 4, 0),
            (259, 5, 0),
            (260, 6, 0),
            (261, 7, 0),
            (262, 8, 0),
            (263, 9, 0),
            (264, 10, 0),
            (265, 11, 1),
            (266, 13, 1),
            (267, 15, 1),
            (268, 17, 1),
            (269, 19, 2),
            (270, 23, 2),
            (271, 27, 2),
            (272, 31, 2),
            (273, 35, 3),
            (274, 43, 3),
            (275, 51, 3),
            (276, 59, 3),
            (277, 67, 4),
            (278, 83, 4),
            (279, 99, 4),
            (280, 115, 4),
            (281, 131, 5),
            (282, 163, 5),
            (283, 195, 5),
            (284, 227, 5),
            (285, 258, 0),
        ];
        assert!((3..=258).contains(&len) && (1..=4).contains(&dist));
        let len = len as u32;
        let &(sym, base, extra) = LENGTHS
            .iter()
            .rev()
            .find(|&&(sym, base, _)| base <= len && (sym != 284 || len < 258))
            .unwrap();
        match sym {
            257..=279 => self.code(sym - 256, 7),
            _ => self.code(0xc0 + (sym - 280), 8),
        }
        self.put(len - base, extra);
        self.code(dist as u32 - 1, 5);
    }
}

/// A raw deflate stream of `total` bytes: `prefix`, then its last `period` (1..=4) bytes over and
/// over (about 13 bits per 258 bytes: 1 GiB of zeros deflates to under 7 MB). Returns the stream
/// and the CRC-32 of what it inflates to.
fn deflate_periodic(prefix: &[u8], period: usize, total: usize) -> (Vec<u8>, u32) {
    assert!(prefix.len() >= period && total >= prefix.len());
    let mut b = Bits {
        out: Vec::with_capacity(total / 150 + 64),
        acc: 0,
        n: 0,
    };
    b.put(1, 1); // the last block
    b.put(1, 2); // fixed Huffman codes
    for &c in prefix {
        b.literal(c);
    }
    let tail = &prefix[prefix.len() - period..];
    let mut left = total - prefix.len();
    while left > 0 {
        let n = left.min(258);
        if n >= 3 && !(1..3).contains(&(left - n)) {
            b.copy(n, period);
            left -= n;
        } else if n >= 6 {
            b.copy(n - 3, period);
            left -= n - 3;
        } else {
            let at = total - left - prefix.len();
            b.literal(tail[at % period]);
            left -= 1;
        }
    }
    b.code(0, 7); // end of block
    b.put(0, 7); // to a byte boundary
    (b.out, crc32_periodic(prefix, period, total))
}

// ----------------------------------------------------------------------------------------
// Zip files, written by hand
// ----------------------------------------------------------------------------------------

/// One zip entry: its name, method (0 stored, 8 deflated), the bytes as stored, the CRC-32 of
/// its contents and the uncompressed size its headers declare.
struct Entry {
    name: String,
    method: u16,
    data: Vec<u8>,
    crc: u32,
    declared: u32,
}

/// A stored entry `archive/NAME`.
fn stored(name: &str, bytes: &[u8]) -> Entry {
    Entry {
        name: format!("archive/{name}"),
        method: 0,
        data: bytes.to_vec(),
        crc: crc32(bytes),
        declared: bytes.len() as u32,
    }
}

/// A deflated entry `archive/NAME` of [`deflate_periodic`]'s contents, declaring `declared`
/// bytes (`None`: its true size).
fn deflated(
    name: &str,
    prefix: &[u8],
    period: usize,
    total: usize,
    declared: Option<u32>,
) -> Entry {
    let (data, crc) = deflate_periodic(prefix, period, total);
    Entry {
        name: format!("archive/{name}"),
        method: 8,
        data,
        crc,
        declared: declared.unwrap_or_else(|| u32::try_from(total).unwrap()),
    }
}

/// A zip archive of `entries` (no zip64: every size fits 32 bits).
fn zip_bytes(entries: &[Entry]) -> Vec<u8> {
    let u16le = |b: &mut Vec<u8>, v: u16| b.extend(v.to_le_bytes());
    let u32le = |b: &mut Vec<u8>, v: u32| b.extend(v.to_le_bytes());
    let mut out = Vec::new();
    let mut central = Vec::new();
    for e in entries {
        let offset = out.len() as u32;
        let compressed = u32::try_from(e.data.len()).unwrap();
        // Local file header.
        u32le(&mut out, 0x0403_4b50);
        for v in [20, 0, e.method, 0, 0x21] {
            u16le(&mut out, v); // version, flags, method, time, date (1980-01-01)
        }
        for v in [e.crc, compressed, e.declared] {
            u32le(&mut out, v);
        }
        u16le(&mut out, e.name.len() as u16);
        u16le(&mut out, 0);
        out.extend(e.name.as_bytes());
        out.extend(&e.data);
        // Central directory header.
        u32le(&mut central, 0x0201_4b50);
        for v in [20, 20, 0, e.method, 0, 0x21] {
            u16le(&mut central, v); // made by, needed, flags, method, time, date
        }
        for v in [e.crc, compressed, e.declared] {
            u32le(&mut central, v);
        }
        for v in [e.name.len() as u16, 0, 0, 0, 0] {
            u16le(&mut central, v); // name, extra, comment, disk, internal attributes
        }
        u32le(&mut central, 0); // external attributes
        u32le(&mut central, offset);
        central.extend(e.name.as_bytes());
    }
    let cd_offset = out.len() as u32;
    let cd_len = central.len() as u32;
    out.extend(central);
    u32le(&mut out, 0x0605_4b50);
    for v in [0, 0, entries.len() as u16, entries.len() as u16] {
        u16le(&mut out, v);
    }
    u32le(&mut out, cd_len);
    u32le(&mut out, cd_offset);
    u16le(&mut out, 0);
    out
}

// ----------------------------------------------------------------------------------------
// Pickles (copied from models/src/torch/hostile_tests.rs)
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

/// A legacy (torch < 1.6) checkpoint: magic, protocol, sys info, `state`, the storage keys,
/// then `records` (raw storage records).
fn legacy_bytes(state: &[u8], keys: &[&str], records: &[u8]) -> Vec<u8> {
    let mut b = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.".to_vec();
    b.extend(b"\x80\x02M\xe9\x03.\x80\x02}.");
    b.extend(state);
    b.extend(b"\x80\x02(");
    for k in keys {
        b.extend(ustr(k));
    }
    b.extend(b"l.");
    b.extend(records);
    b
}

/// `prefix`, `step` `n` times, then `end`.
fn repeated(prefix: &[u8], step: &[u8], n: usize, end: &[u8]) -> Vec<u8> {
    let mut b = prefix.to_vec();
    b.reserve(step.len() * n + end.len());
    for _ in 0..n {
        b.extend(step);
    }
    b.extend(end);
    b
}

/// A zip checkpoint whose `data.pkl` is `pkl`, stored.
fn zip_pickle(pkl: &[u8]) -> Vec<u8> {
    zip_bytes(&[stored("data.pkl", pkl)])
}

/// A zip checkpoint of `pkl` and a 4-byte storage `0` holding 1.0.
fn zip_one_float(pkl: &[u8]) -> Vec<u8> {
    zip_bytes(&[
        stored("data.pkl", pkl),
        stored("data/0", &1f32.to_le_bytes()),
    ])
}

/// A zip checkpoint whose only tensor `w` views storage `0` with `size`, `stride`, `offset`.
fn zip_view(size: &[u64], stride: &[u64], offset: u64) -> Vec<u8> {
    zip_one_float(&state_dict(&[("w", tensor("0", 1, offset, size, stride))]))
}

/// The hostile checkpoints: file name, bytes, and what the refusal must say.
// long-function: a table of hostile files, one short entry per attack
fn hostile_checkpoints() -> Vec<(&'static str, Vec<u8>, Vec<&'static str>)> {
    const LIMIT: &str = "refused, over a safety limit";
    const GIB: usize = 1 << 30;
    let bomb = |start: &[u8], step: &[u8]| {
        let mut b = [&b"\x80\x02"[..], start].concat();
        b.extend(repeated(b"", step, 40, b"."));
        b
    };
    // A list of 3000 items in the memo, then 3000 times: get it, append to it (a copy of 3000
    // items, the memo's stays as it was), drop the copy.
    let copies = {
        let mut b = repeated(b"\x80\x02](", b"K\x00", 3000, b"eq\x00");
        b.extend(repeated(b"", b"h\x00K\x01a0", 3000, b"."));
        b
    };
    let million = 1_000_000;
    let tuple1 = repeated(b"\x80\x02K\x00", &[0x85], million, b".");
    let lists = {
        let mut b = repeated(b"\x80\x02", b"(", million, b"");
        b.extend(repeated(b"", b"l", million, b"."));
        b
    };
    // {0: {0: {0: ...}}}: a million `{} 0`, then None, then a million SETITEM.
    let dicts = {
        let mut b = repeated(b"\x80\x02", b"}K\x00", million, b"N");
        b.extend(repeated(b"", b"s", million, b"."));
        b
    };
    // f(f(f(...f(0)))) for a global f that the reader does not model (an opaque object each).
    let calls = {
        let mut b = [
            b"\x80\x02".to_vec(),
            global("builtins", "print"),
            b"q\x00".to_vec(),
        ]
        .concat();
        b.extend(repeated(b"", b"h\x00", million - 1, b"K\x00"));
        b.extend(repeated(b"", b"\x85R", million, b"."));
        b
    };
    // One 8M-element broadcast view of a 4-byte storage, named three times (memo).
    let views = {
        let mut p = b"\x80\x02}(".to_vec();
        p.extend(ustr("a"));
        p.extend(tensor("0", 1, 0, &[1 << 23], &[0]));
        p.extend(b"q\x09");
        for k in ["b", "c"] {
            p.extend(ustr(k));
            p.extend(b"h\x09");
        }
        p.extend(b"u.");
        p
    };
    let four_floats = state_dict(&[("w", tensor("0", 4, 0, &[4], &[1]))]);
    let huge_record = {
        let mut r = (1u64 << 40).to_le_bytes().to_vec();
        r.extend([0u8; 16]);
        legacy_bytes(&four_floats, &["0"], &r)
    };
    let string = {
        let mut b = b"\x80\x02\x8d".to_vec();
        b.extend((1u64 << 40).to_le_bytes());
        b
    };
    vec![
        // Doubling bombs, 40 steps each, a few hundred bytes.
        // t = (t, t), through DUP.
        (
            "dup.pt",
            zip_pickle(&bomb(b")", b"2\x86")),
            vec![LIMIT, "expands to more than"],
        ),
        // t = (memo[0], memo[0]); memo[0] = t.
        (
            "memo.pt",
            zip_pickle(&bomb(b")q\x00", b"h\x00h\x00\x86q\x00")),
            vec![LIMIT, "expands to more than"],
        ),
        // l = memo[0]; l.append(memo[0]); memo[0] = l.
        (
            "append.pt",
            zip_pickle(&bomb(b"]q\x00", b"h\x00h\x00aq\x00")),
            vec![LIMIT, "expands to more than"],
        ),
        // d = memo[0]; d[1] = memo[0]; memo[0] = d.
        (
            "setitem.pt",
            zip_pickle(&bomb(b"}q\x00", b"h\x00K\x01h\x00sq\x00")),
            vec![LIMIT, "expands to more than"],
        ),
        (
            "copies.pt",
            zip_pickle(&copies),
            vec![LIMIT, "creates more than"],
        ),
        // A million nested containers: tuples, lists, dicts, calls; in zip and legacy files.
        (
            "tuple1.pt",
            zip_pickle(&tuple1),
            vec![LIMIT, "nested more than"],
        ),
        (
            "lists.pt",
            zip_pickle(&lists),
            vec![LIMIT, "nested more than"],
        ),
        (
            "dicts.pt",
            zip_pickle(&dicts),
            // Each nested dict costs more values than a tuple: the value budget (2^20) is met
            // before the depth limit.
            vec![LIMIT, "more than"],
        ),
        (
            "calls.pt",
            zip_pickle(&calls),
            vec![LIMIT, "nested more than"],
        ),
        (
            "tuple1.pth",
            legacy_bytes(&tuple1, &[], &[]),
            vec![LIMIT, "pickle `state dict`", "nested more than"],
        ),
        // Views against their storage.
        (
            "stride0.pt",
            zip_view(&[1 << 40], &[0], 0),
            vec!["tensor `w`", "out of the 1 of storage `0`"],
        ),
        (
            "stride00.pt",
            zip_view(&[1 << 20, 1 << 20], &[0, 0], 0),
            vec!["tensor `w`", "out of the 1 of storage `0`"],
        ),
        (
            "size-overflow.pt",
            zip_view(&[1 << 40, 1 << 40], &[0, 0], 0),
            vec!["tensor `w`", "element count overflows"],
        ),
        (
            "stride1.pt",
            zip_view(&[1 << 40], &[1], 0),
            vec!["tensor `w`", "reaches element", "holds only 1 elements"],
        ),
        (
            "offset.pt",
            zip_view(&[1], &[1], 1 << 40),
            vec!["tensor `w`", "reaches element", "holds only 1 elements"],
        ),
        (
            "views.pt",
            zip_one_float(&views),
            vec![LIMIT, "viewed over and over"],
        ),
        (
            "huge-record.pth",
            huge_record,
            vec![LIMIT, "storage `0` at byte", "(the limit is"],
        ),
        // Deflate bombs: 1 GiB of zeros in under 7 MB, with an honest CRC.
        (
            "bomb.pt",
            zip_bytes(&[deflated("data.pkl", &[0], 1, GIB, Some(100))]),
            vec![
                LIMIT,
                "zip entry `archive/data.pkl`",
                "decompresses to more than the 100 bytes",
            ],
        ),
        (
            "declares-4gib.pt",
            zip_bytes(&[deflated("data.pkl", &[0], 1, GIB, Some(u32::MAX - 1))]),
            vec![LIMIT, "declares 4294967294 bytes, over the limit of"],
        ),
        (
            "storage-bomb.pt",
            zip_bytes(&[
                stored("data.pkl", &four_floats),
                deflated("data/0", &[0], 1, GIB, Some(16)),
            ]),
            vec![
                LIMIT,
                "zip entry `archive/data/0`",
                "decompresses to more than the 16 bytes",
            ],
        ),
        // A data.pkl of exactly the cap (256 MiB from 1.7 MB), all `None; pop`: read whole,
        // then out of values to create.
        (
            "pickle-at-the-cap.pt",
            zip_bytes(&[deflated(
                "data.pkl",
                b"\x80\x02N0",
                2,
                MAX_PICKLE_ENTRY_BYTES,
                None,
            )]),
            vec![LIMIT, "creates more than"],
        ),
        // Unbounded lengths: a string of 1 TiB, a line of 2 MiB.
        (
            "string.pt",
            zip_pickle(&string),
            vec![LIMIT, "a string of 1099511627776 bytes"],
        ),
        (
            "line.pt",
            zip_pickle(&repeated(b"\x80\x02c", b"a", 2 << 20, b"")),
            vec![LIMIT, "a line longer than"],
        ),
    ]
}

/// `trainer import-weights --arch efficientnet-lite0 --from FILE --out OUT`, measured.
fn import(file: &Path, out: &Path, logs: &Path) -> Outcome {
    measured(
        "trainer",
        &[
            "import-weights",
            "--arch",
            "efficientnet-lite0",
            "--from",
            &s(file),
            "--out",
            &s(out),
        ],
        logs,
    )
}

/// Whether `out` or anything beside it in its own directory was written.
fn written(out: &Path) -> bool {
    out.exists()
        || out
            .parent()
            .and_then(|d| std::fs::read_dir(d).ok())
            .is_some_and(|mut d| d.next().is_some())
}

/// Every hostile checkpoint fails `trainer import-weights` with an error naming the file and what
/// is wrong, in under [`TIME_LIMIT`], within [`CHECKPOINT_RSS_BUDGET_MIB`] of an empty file's
/// refusal, and writes no output. The builders are checked to make readable checkpoints first
/// (a `tuple1.pt` of one TUPLE1 is refused for being no state dict, not for a limit).
#[test]
fn hostile_checkpoints_fail_fast_with_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();

    // The baseline: an empty file, refused at once.
    let empty = dir.join("empty.pt");
    std::fs::write(&empty, b"").unwrap();
    let base = import(
        &empty,
        &dir.join("out-empty/w.safetensors"),
        &dir.join("logs/empty"),
    );
    eprintln!("{}", base.line("baseline (empty file)"));
    let problems = refusal_problems(&base, &[&s(&empty)], &["empty file"], &base, 0.0);
    assert!(problems.is_empty(), "{problems:?}: {}", base.stderr);

    // The builders make checkpoints the reader takes (zip, stored and deflated; legacy): each
    // passes the reader and is refused only for not being an EfficientNet-Lite0.
    let data: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let pkl = state_dict(&[("w", tensor("0", 6, 0, &[2, 3], &[1, 2]))]);
    let mut records = 6u64.to_le_bytes().to_vec();
    records.extend(&data);
    let goods = [
        (
            "good.pt",
            zip_bytes(&[stored("data.pkl", &pkl), stored("data/0", &data)]),
        ),
        (
            "good-deflated.pt",
            zip_bytes(&[
                deflated("data.pkl", &pkl, 1, pkl.len(), None),
                deflated("data/0", &data, 1, data.len(), None),
            ]),
        ),
        ("good.pth", legacy_bytes(&pkl, &["0"], &records)),
    ];
    for (name, bytes) in goods {
        let file = dir.join(name);
        std::fs::write(&file, bytes).unwrap();
        let out = dir.join(format!("out-{name}/w.safetensors"));
        let o = import(&file, &out, &dir.join(format!("logs/{name}")));
        eprintln!("{}", o.line(&format!("{name} (read, not a Lite0)")));
        assert!(
            o.stderr.contains("missing tensor") && o.stderr.contains(&s(&file)),
            "{name} was not read: {}",
            o.stderr
        );
    }

    let mut failures = Vec::new();
    for (name, bytes, expect) in hostile_checkpoints() {
        let file = dir.join(name);
        std::fs::write(&file, &bytes).unwrap();
        let size = bytes.len();
        drop(bytes);
        let out = dir.join(format!("out-{name}/w.safetensors"));
        let o = import(&file, &out, &dir.join(format!("logs/{name}")));
        eprintln!("{} ({size} bytes)", o.line(name));
        let mut p = refusal_problems(&o, &[&s(&file)], &expect, &base, CHECKPOINT_RSS_BUDGET_MIB);
        if written(&out) {
            p.push(format!("{} was written", out.display()));
        }
        if !p.is_empty() {
            failures.push(format!(
                "{name} ({size} bytes): {}\n{}\n{}",
                p.join("; "),
                o.line(name),
                o.stderr.trim()
            ));
        }
        std::fs::remove_file(&file).unwrap();
    }
    assert_no_failures(&failures);
}

/// Checkpoints of a few KB or MB that stay within every one of the reader's limits and still make
/// it take a GiB or seconds: the amplification the limits leave. Each must be refused (or read)
/// as fast and in as little memory as the hostile checkpoints above.
///
/// - A storage entry that declares (honestly) 1 GiB of zeros, 6.7 MB deflated, for a storage the
///   pickle says holds one float (its persistent id's element count) and that one 1-element view
///   reads: a reader that trusts the entry's header inflates all of it. (At the 4 GiB storage cap,
///   and with one such entry per storage, each fully viewed, a file of tens of MB asks for many
///   GiB.)
/// - 8M values (just under the unpickler's first budget of 2^23; it is 2^20 since this test
///   found it too generous), each of them costly: empty dicts
///   (`EMPTY_DICT`, a heap node each) or memo entries (`MEMOIZE` of the same value, a hash-map
///   slot each), one opcode byte apiece: 50 KB deflated with the fixed Huffman codes written
///   here (8 KB with zlib's).
#[test]
fn a_few_kilobytes_within_every_limit_cannot_take_a_gigabyte() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let empty = dir.join("empty.pt");
    std::fs::write(&empty, b"").unwrap();
    let base = import(
        &empty,
        &dir.join("out-empty/w.safetensors"),
        &dir.join("logs/empty"),
    );
    eprintln!("{}", base.line("baseline (empty file)"));

    let values = (1 << 23) - 8;
    let one_float = state_dict(&[("w", tensor("0", 1, 0, &[1], &[1]))]);
    let cases = [
        (
            "inflated-storage.pt",
            zip_bytes(&[
                stored("data.pkl", &one_float),
                deflated("data/0", &[0], 1, 1 << 30, None),
            ]),
        ),
        (
            "empty-dicts.pt",
            zip_bytes(&[deflated("data.pkl", b"\x80\x02}", 1, 2 + values, None)]),
        ),
        (
            "memoize.pt",
            zip_bytes(&[deflated("data.pkl", b"\x80\x02N\x94", 1, 3 + values, None)]),
        ),
    ];
    let mut failures = Vec::new();
    for (name, bytes) in cases {
        let file = dir.join(name);
        std::fs::write(&file, &bytes).unwrap();
        let out = dir.join(format!("out-{name}/w.safetensors"));
        let o = import(&file, &out, &dir.join(format!("logs/{name}")));
        eprintln!("{} ({} bytes)", o.line(name), bytes.len());
        let mut p = refusal_problems(&o, &[&s(&file)], &[], &base, CHECKPOINT_RSS_BUDGET_MIB);
        if written(&out) {
            p.push(format!("{} was written", out.display()));
        }
        if !p.is_empty() {
            failures.push(format!(
                "{name} ({} bytes): {}\n{}\n{}",
                bytes.len(),
                p.join("; "),
                o.line(name),
                o.stderr.trim()
            ));
        }
    }
    assert_no_failures(&failures);
}

// ----------------------------------------------------------------------------------------
// Manifests
// ----------------------------------------------------------------------------------------

/// Rewrites `dir`'s manifest as the same JSON with a `padding` string, `total` bytes in all.
fn pad_manifest(dir: &Path, original: &Value, total: usize) {
    let mut m = original.clone();
    m["padding"] = Value::String(String::new());
    let short = serde_json::to_vec(&m).unwrap().len();
    m["padding"] = Value::String("a".repeat(total - short));
    let bytes = serde_json::to_vec(&m).unwrap();
    assert_eq!(bytes.len(), total);
    std::fs::write(dir.join(MANIFEST_FILE), bytes).unwrap();
}

/// A real artifact (the fleet fixture's v1) predicts; with its manifest padded to exactly
/// [`MAX_MANIFEST_BYTES`] it still does; one byte more, 64 MiB (also with `--trusted-key`, which
/// reads the manifest for its signature, and through `edge-agent check`) or a sparse 1 GiB
/// manifest are refused fast, naming the file and the limit, without reading the file whole.
#[test]
fn an_oversized_artifact_manifest_is_refused() {
    let f = fixture();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let art = dir.join("art");
    copy_dir(&f.v1, &art);
    let original: Value =
        serde_json::from_slice(&std::fs::read(art.join(MANIFEST_FILE)).unwrap()).unwrap();
    let face = Path::new(&lfw()).join("face");
    let mut images: Vec<PathBuf> = std::fs::read_dir(&face)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    images.sort();
    let image = s(&images[0]);
    let art_s = s(&art);
    let predict = ["predict", "--model", &art_s, &image];
    run_ok("edge-agent", &predict);

    // At the limit: accepted.
    let limit = usize::try_from(MAX_MANIFEST_BYTES).unwrap();
    pad_manifest(&art, &original, limit);
    run_ok("edge-agent", &predict);

    // The baseline: a small malformed manifest, refused.
    std::fs::write(art.join(MANIFEST_FILE), b"{").unwrap();
    let base = measured("edge-agent", &predict, &dir.join("logs/base"));
    eprintln!("{}", base.line("baseline (manifest `{`)"));
    assert_ne!(base.code, Some(0), "{}", base.stderr);

    let manifest = s(&art.join(MANIFEST_FILE));
    let limit_s = MAX_MANIFEST_BYTES.to_string();
    let pubkey = s(&f.keys.join("kestrel.pub"));
    let signed = [
        "predict",
        "--trusted-key",
        &pubkey,
        "--model",
        &art_s,
        &image,
    ];
    let check = ["check", "--model", &art_s];
    let mut failures = Vec::new();
    let mut case = |what: &str, args: &[&str]| {
        let o = measured("edge-agent", args, &dir.join(format!("logs/{what}")));
        eprintln!("{}", o.line(what));
        let p = refusal_problems(&o, &[&manifest], &[&limit_s], &base, SMALL_RSS_BUDGET_MIB);
        if !p.is_empty() {
            failures.push(format!(
                "{what}: {}\n{}\n{}",
                p.join("; "),
                o.line(what),
                o.stderr.trim()
            ));
        }
    };
    pad_manifest(&art, &original, limit + 1);
    case("one byte over", &predict);
    pad_manifest(&art, &original, 64 << 20);
    case("64 MiB", &predict);
    case("64 MiB, --trusted-key", &signed);
    case("64 MiB, check", &check);
    let sparse = File::create(art.join(MANIFEST_FILE)).unwrap();
    sparse.set_len(1 << 30).unwrap();
    drop(sparse);
    case("sparse 1 GiB", &predict);
    assert_no_failures(&failures);
}

// ----------------------------------------------------------------------------------------
// Delta logs
// ----------------------------------------------------------------------------------------

/// A Delta table of the LFW rows (delta-rs) that `trainer prepare` reads; copies of it with a file
/// over the cap in `_delta_log/` (sparse: the caps are on the listed size) are refused fast,
/// naming the log file and the cap: a commit, `_last_checkpoint`, a Parquet checkpoint.
#[test]
fn an_oversized_delta_log_file_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let table = dir.join("lfw-delta");
    python(
        "import sys, pyarrow.parquet as pq\n\
         from deltalake import write_deltalake\n\
         write_deltalake(sys.argv[2], pq.read_table(sys.argv[1]))\n",
        &[s(&fetched("datasets/lfw/lfw.parquet")), s(&table)],
    );
    let cache = s(&dir.join("cache"));
    let prepare = |t: &Path| {
        vec![
            "prepare".to_string(),
            "--json".into(),
            "--engine".into(),
            "ort".into(),
            "--data".into(),
            s(t),
            "--cache".into(),
            cache.clone(),
        ]
    };
    let v = trainer_json(&prepare(&table)[..]);
    assert_eq!(v["samples"], 200, "{v}");

    // A copy of the table with `name` in its log: `len` bytes, sparse, or `text`.
    let with_log_file = |case: &str, name: &str, len: u64, text: &[u8]| -> PathBuf {
        let t = dir.join(case);
        copy_dir(&table, &t);
        let p = t.join("_delta_log").join(name);
        std::fs::write(&p, text).unwrap();
        if len > text.len() as u64 {
            File::options()
                .write(true)
                .open(&p)
                .unwrap()
                .set_len(len)
                .unwrap();
        }
        t
    };
    let run = |case: &str, t: &Path| {
        let args = prepare(t);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        measured("trainer", &args, &dir.join(format!("logs/{case}")))
    };

    // The baseline: a small malformed commit, refused.
    let t = with_log_file("malformed", "00000000000000000001.json", 0, b"{");
    let base = run("malformed", &t);
    eprintln!("{}", base.line("baseline (commit `{`)"));
    assert_ne!(base.code, Some(0), "{}", base.stderr);

    let json_cap = MAX_LOG_JSON_BYTES.to_string();
    let file_cap = MAX_LOG_FILE_BYTES.to_string();
    let cases = [
        (
            "commit",
            "00000000000000000001.json",
            MAX_LOG_JSON_BYTES + 1,
            &json_cap,
        ),
        (
            "last-checkpoint",
            "_last_checkpoint",
            MAX_LOG_JSON_BYTES + 1,
            &json_cap,
        ),
        (
            "parquet-checkpoint",
            "00000000000000000000.checkpoint.parquet",
            MAX_LOG_FILE_BYTES + 1,
            &file_cap,
        ),
    ];
    let mut failures = Vec::new();
    for (case, name, len, cap) in cases {
        let t = with_log_file(case, name, len, b"");
        let o = run(case, &t);
        eprintln!("{}", o.line(case));
        let log_file = format!("_delta_log/{name}");
        let p = refusal_problems(
            &o,
            &[&s(&t), &log_file],
            &[cap.as_str()],
            &base,
            SMALL_RSS_BUDGET_MIB,
        );
        if !p.is_empty() {
            failures.push(format!(
                "{case}: {}\n{}\n{}",
                p.join("; "),
                o.line(case),
                o.stderr.trim()
            ));
        }
    }
    assert_no_failures(&failures);
}
