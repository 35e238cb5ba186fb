//! Helpers for Kestrel's end-to-end tests: locating the built binaries and the fetched data,
//! running them, and reading what they write. The tests live in `tests/tests/e2e/` (one test
//! binary, a module per area); run them through `scripts/test.sh`, which fetches and builds what
//! they need.

pub mod browser;
pub mod fleet;
pub mod once;
pub mod proxy;
pub mod tls;

use std::ffi::OsStr;
use std::fmt::Debug;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// `$KESTREL_HOME` (default `~/.cache/kestrel`), as in scripts/env.sh.
pub use kestrel_shared::fsutil::kestrel_home;

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

/// A fetched table: `dataset("lfw", "imagefolder")`, `dataset("digits", "manifest.csv")`, ...
pub fn dataset(name: &str, form: &str) -> String {
    s(&fetched(&format!("datasets/{name}/{form}")))
}

/// The LFW subset as an image folder (200 images, `face` and `nonface`).
pub fn lfw() -> String {
    dataset("lfw", "imagefolder")
}

/// A path as a command-line argument.
pub fn s(p: &Path) -> String {
    p.display().to_string()
}

/// Where scripts/build-edge.sh put the ARM agents and packages: `KESTREL_DIST`, else the
/// repository's `dist/`.
pub fn dist() -> PathBuf {
    match std::env::var_os("KESTREL_DIST") {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../dist"),
    }
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
pub fn run<S: AsRef<OsStr>>(name: &str, args: &[S]) -> Output {
    Command::new(bin(name))
        .args(args)
        .output()
        .expect("spawn binary")
}

/// Runs a workspace binary that must succeed; returns its output.
pub fn run_ok<S: AsRef<OsStr> + Debug>(name: &str, args: &[S]) -> Output {
    let o = run(name, args);
    assert!(
        o.status.success(),
        "{name} {args:?}: {}{}",
        stdout(&o),
        stderr(&o)
    );
    o
}

/// Runs a workspace binary that must fail; returns its output.
pub fn run_fails<S: AsRef<OsStr> + Debug>(name: &str, args: &[S]) -> Output {
    let o = run(name, args);
    assert!(!o.status.success(), "{name} {args:?} should fail");
    o
}

/// Trainer CLI call that must succeed; returns stdout.
pub fn trainer_ok<S: AsRef<OsStr> + Debug>(args: &[S]) -> String {
    stdout(&run_ok("trainer", args))
}

/// Trainer CLI call that must succeed and print one JSON document (`--json`); returns it.
pub fn trainer_json<S: AsRef<OsStr> + Debug>(args: &[S]) -> Value {
    json(&run_ok("trainer", args))
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `trainer export --run RUN --out ART EXTRA...`, which must succeed.
pub fn export_ok(run: &Path, art: &Path, extra: &[&str]) -> Output {
    let mut a = vec![
        "export",
        "--run",
        run.to_str().unwrap(),
        "--out",
        art.to_str().unwrap(),
    ];
    a.extend(extra);
    run_ok("trainer", &a)
}

/// Standard output as one JSON document.
pub fn json(o: &Output) -> Value {
    serde_json::from_str(&stdout(o)).unwrap_or_else(|e| panic!("{e}: {}{}", stdout(o), stderr(o)))
}

/// Standard output as JSON lines.
pub fn json_lines(o: &Output) -> Vec<Value> {
    stdout(o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON line {l:?}: {e}")))
        .collect()
}

/// A JSON file (summary.json, params.json, best.json, ...).
pub fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A JSON-lines file (metrics.jsonl, trials.jsonl, results.jsonl, ...).
pub fn read_jsonl(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Runs `code` in the venv's Python (`python -c CODE ARGS...`), which must succeed.
///
/// The script leaves through `os._exit(0)` once its output is flushed: pyarrow and delta-rs
/// sometimes abort in interpreter shutdown (`terminate called without an active exception`,
/// apache/arrow#34314, delta-rs#2184) after all their work is done, which CI saw once here.
pub fn python<S: AsRef<OsStr>>(code: &str, args: &[S]) -> Output {
    let code =
        format!("{code}\nimport os, sys\nsys.stdout.flush()\nsys.stderr.flush()\nos._exit(0)\n");
    let o = Command::new(fetched("venv/bin/python"))
        .arg("-c")
        .arg(code)
        .args(args)
        .output()
        .unwrap();
    assert!(o.status.success(), "python: {}", stderr(&o));
    o
}

/// Largest absolute difference between the same tensors of two safetensors files (which must
/// hold the same tensor names and shapes).
pub fn max_abs_diff(a: &Path, b: &Path) -> f32 {
    use kestrel_models::torch::read_safetensors;
    let (a, b) = (read_safetensors(a).unwrap(), read_safetensors(b).unwrap());
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "different tensors"
    );
    let mut worst = 0f32;
    for (name, ta) in &a {
        let tb = &b[name];
        assert_eq!(ta.shape, tb.shape, "{name}");
        for (x, y) in ta.data.iter().zip(&tb.data) {
            worst = worst.max((x - y).abs());
        }
    }
    worst
}

/// Copies the first `per_class` images (by name) of every class of the image folder `src` into
/// the image folder `dst`: a small table.
pub fn table_subset(src: &Path, dst: &Path, per_class: usize) {
    for class in std::fs::read_dir(src).unwrap() {
        let class = class.unwrap().path();
        let mut files: Vec<_> = std::fs::read_dir(&class)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        let to = dst.join(class.file_name().unwrap());
        std::fs::create_dir_all(&to).unwrap();
        for f in &files[..per_class] {
            std::fs::copy(f, to.join(f.file_name().unwrap())).unwrap();
        }
    }
}

/// Starts a training run (`cmd`, writing `run_dir`), SIGKILLs it once `epochs` epochs are in its
/// metrics.jsonl and returns how many epochs it had written then.
pub fn kill_after_epochs(cmd: &mut Command, run_dir: &Path, epochs: usize) -> usize {
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let epochs_done = || {
        std::fs::read_to_string(run_dir.join("metrics.jsonl"))
            .map(|s| s.lines().count())
            .unwrap_or(0)
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    while epochs_done() < epochs {
        assert!(
            Instant::now() < deadline && child.try_wait().unwrap().is_none(),
            "run ended before it could be killed"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    epochs_done()
}

/// A test's temporary directory (removed on drop) with a feature cache, `cache/`, that the runs
/// of that test share.
pub struct Scratch {
    pub tmp: tempfile::TempDir,
    pub cache: PathBuf,
}

impl Scratch {
    pub fn new() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let cache = tmp.path().join("cache");
        Self { tmp, cache }
    }

    /// A path in the directory.
    pub fn join(&self, name: &str) -> PathBuf {
        self.tmp.path().join(name)
    }

    /// The cache as an argument.
    pub fn cache_arg(&self) -> String {
        s(&self.cache)
    }
}

impl Default for Scratch {
    fn default() -> Self {
        Self::new()
    }
}

/// Copies a directory tree (test fixtures that a test then damages).
pub fn copy_dir(from: &Path, to: &Path) {
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
