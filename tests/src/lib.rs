//! Helpers for Kestrel's end-to-end tests: locating the built binaries and the fetched data.
//! The tests live in `tests/tests/`; run them through `scripts/test.sh`, which fetches and builds
//! what they need.

pub mod fleet;

use std::path::PathBuf;
use std::process::{Command, Output};

/// `$KESTREL_HOME` (default `~/.cache/kestrel`), as in scripts/env.sh.
pub fn kestrel_home() -> PathBuf {
    match std::env::var_os("KESTREL_HOME") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/kestrel"),
    }
}

/// A file fetched by scripts/setup.sh; panics with the remedy when absent.
pub fn fetched(rel: &str) -> PathBuf {
    let p = kestrel_home().join(rel);
    assert!(
        p.exists(),
        "{} is missing: run scripts/setup.sh first",
        p.display()
    );
    p
}

pub fn photo(name: &str) -> PathBuf {
    fetched(&format!("photos/{name}"))
}

/// A workspace binary from the same profile directory as the running test.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target profile dir");
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} not built: run `cargo build --release --bins` (scripts/test.sh does)",
        p.display()
    );
    p
}

/// Runs a workspace binary with the given arguments.
pub fn run(name: &str, args: &[&str]) -> Output {
    Command::new(bin(name))
        .args(args)
        .output()
        .expect("spawn binary")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Copies a directory tree (test fixtures that a test then damages).
pub fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}
