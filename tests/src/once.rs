//! What many tests read and one test run builds once: trained runs, exported artifacts, keys.
//!
//! The test command runs the tests with nextest, one process per test, so a `OnceLock` would
//! build a fixture once per *test*. A fixture lives instead in `target/tmp/fixtures/NAME`: the
//! first process to ask for it builds it while holding an exclusive lock on
//! `target/tmp/fixtures/NAME.lock` (the others wait on the lock), and stamps it with the run's id
//! (nextest's `NEXTEST_RUN_ID`; under plain `cargo test`, whose tests are threads of one
//! process, the process id). A later run rebuilds it, so a fixture never outlives the binaries
//! that made it, and no test depends on another having run first: whichever comes first builds.
//!
//! Tests only *read* a fixture; one that needs to change it copies it first
//! ([`crate::copy_dir`]).

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};

/// This test run's id: the same in every test process of one `cargo nextest run`.
pub fn run_id() -> String {
    std::env::var("NEXTEST_RUN_ID").unwrap_or_else(|_| format!("pid-{}", std::process::id()))
}

/// `target/tmp`, beside the profile directory of the binaries under test.
pub fn target_tmp() -> PathBuf {
    let dir = crate::bin("trainer")
        .parent()
        .and_then(Path::parent)
        .expect("target dir")
        .join("tmp");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// An exclusive lock on `path` (created if absent), held until the file is dropped.
fn locked(path: &Path) -> File {
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    f.lock()
        .unwrap_or_else(|e| panic!("lock {}: {e}", path.display()));
    f
}

/// The directory of fixture `name`, built by `build` (given the empty directory) unless this test
/// run has built it already. A build that panics leaves no stamp, and the next test to ask builds it
/// again (and fails the same way, naming the fixture).
pub fn fixture(name: &str, build: impl FnOnce(&Path)) -> PathBuf {
    let root = target_tmp().join("fixtures");
    std::fs::create_dir_all(&root).unwrap();
    let dir = root.join(name);
    let stamp = root.join(format!("{name}.run"));
    let _lock = locked(&root.join(format!("{name}.lock")));
    let id = run_id();
    if std::fs::read_to_string(&stamp).is_ok_and(|s| s == id) && dir.is_dir() {
        return dir;
    }
    // Built in place (runs record their own paths), stamped only once complete.
    let _ = std::fs::remove_file(&stamp);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    build(&dir);
    std::fs::write(&stamp, &id).unwrap();
    dir
}

/// A free loopback TCP port that no other test of this run was given.
///
/// Ports come from 20000-32767, below Linux's ephemeral range (32768-60999), so the outgoing
/// connections of the many processes a test run starts never hold one; the ports handed out are
/// recorded, under a lock, in `target/tmp/ports` with the run's id, because the tests run in
/// processes of their own and a port one test has been given but not yet bound looks free.
pub fn free_port() -> u16 {
    let mut f = locked(&target_tmp().join("ports"));
    let mut text = String::new();
    f.read_to_string(&mut text).unwrap();
    let id = run_id();
    let mut given: Vec<u16> = match text.split_once('\n') {
        Some((run, ports)) if run == id => ports
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect(),
        _ => Vec::new(),
    };
    let seed =
        std::process::id() as u64 ^ std::time::UNIX_EPOCH.elapsed().unwrap().as_nanos() as u64;
    let mut x = seed | 1;
    let port = loop {
        // xorshift: a different walk through the range in every process.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let port = 20000 + (x % 12768) as u16;
        if !given.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            break port;
        }
    };
    given.push(port);
    let ports: Vec<String> = given.iter().map(u16::to_string).collect();
    f.set_len(0).unwrap();
    f.rewind().unwrap();
    write!(f, "{id}\n{}", ports.join(" ")).unwrap();
    port
}
