//! `kestrel._native`: the Rust side of the `kestrel` Python package. Every entry point runs the
//! trainer's own code — a command line parsed and run by `kestrel_trainer::cli` exactly as the
//! `trainer` binary runs it, a feature extractor, an exported artifact — with the GIL released.
//! The Python modules (`kestrel/__init__.py`, `kestrel/spark.py`) turn keyword arguments into the
//! command's flags and its `--json` output into objects.

use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

mod logs;

use clap::Parser;
use kestrel_models::EngineKind;
use kestrel_models::artifact::LoadedModel;
use kestrel_trainer::cli::exit::{self, Failure};
use kestrel_trainer::cli::{self, Cli};
use kestrel_trainer::data::extract::Extractor as RustExtractor;
use kestrel_trainer::distributed::{TcpComm, tcp};
use kestrel_trainer::interrupt;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyKeyboardInterrupt};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

create_exception!(
    kestrel,
    KestrelError,
    PyException,
    "A Kestrel command or operation failed; the message is the CLI's."
);
create_exception!(
    kestrel,
    DataError,
    KestrelError,
    "A bad input: a table, column, image, label, cache or weights file (the message names it)."
);
create_exception!(
    kestrel,
    ConfigError,
    KestrelError,
    "Wrong or missing configuration: an unknown flag, a broker URL or TLS setting, a backbone or \
     engine not installed where the work runs. Retrying cannot help."
);
create_exception!(
    kestrel,
    ServiceError,
    KestrelError,
    "A service did not answer (broker, MLflow, a peer rank) or a wait ran out of time: worth \
     retrying later."
);
create_exception!(
    kestrel,
    GateError,
    KestrelError,
    "A check refused the result: an export gate, a rollout that did not complete."
);

create_exception!(
    kestrel,
    PeerFailed,
    KestrelError,
    "Another rank of the job failed first; its error is the job's (kestrel.spark's rank tasks \
     leave the reporting to it)."
);

/// A failed command: what kind of failure (the exception class) and the CLI's message.
struct Fail {
    kind: Failure,
    msg: String,
}

impl Fail {
    fn other(msg: impl std::fmt::Display) -> Fail {
        Fail {
            kind: Failure::Other,
            msg: msg.to_string(),
        }
    }

    fn config(msg: impl std::fmt::Display) -> Fail {
        Fail {
            kind: Failure::Config,
            msg: msg.to_string(),
        }
    }

    fn of(e: &anyhow::Error) -> Fail {
        Fail {
            kind: exit::classify(e),
            msg: kestrel_shared::chain(e.as_ref()),
        }
    }
}

impl From<Fail> for PyErr {
    fn from(f: Fail) -> PyErr {
        match f.kind {
            Failure::Data => DataError::new_err(f.msg),
            Failure::Config => ConfigError::new_err(f.msg),
            Failure::Unavailable => ServiceError::new_err(f.msg),
            Failure::Gate => GateError::new_err(f.msg),
            Failure::Interrupted => PyKeyboardInterrupt::new_err(f.msg),
            Failure::Peer => PeerFailed::new_err(f.msg),
            Failure::Other => KestrelError::new_err(f.msg),
        }
    }
}

fn py_err(e: impl std::fmt::Display) -> PyErr {
    Fail::other(e).into()
}

/// Parses `argv` (without the program name) as the `trainer` command line. `--help` and
/// `--version` come back as `Ok(Err(text))`.
fn parse(argv: &[String]) -> Result<Result<cli::Cmd, String>, Fail> {
    let args = std::iter::once("trainer".to_string()).chain(argv.iter().cloned());
    match Cli::try_parse_from(args) {
        Ok(c) => Ok(Ok(c.cmd)),
        Err(e) if !e.use_stderr() => Ok(Err(e.render().to_string())),
        Err(e) => Err(Fail::config(e.render())),
    }
}

/// Runs `run` with the command's output captured: the output, or the error as the CLI prints it.
/// A command that ends without an error but not successfully (a rollout that did not complete)
/// is a [`Failure::Gate`].
fn captured(
    argv: Vec<String>,
    run: impl FnOnce(cli::Cmd) -> anyhow::Result<ExitCode>,
) -> Result<String, Fail> {
    let cmd = match parse(&argv)? {
        Ok(cmd) => cmd,
        Err(help) => return Ok(help),
    };
    let (r, out) = cli::out::capture(|| run(cmd));
    match r {
        Ok(code) if code == ExitCode::SUCCESS => Ok(out),
        Ok(_) => Err(Fail {
            kind: Failure::Gate,
            msg: format!("trainer {} failed\n{out}", argv.join(" ")),
        }),
        Err(e) => Err(Fail::of(&e)),
    }
}

/// Runs `work` on a thread of its own while this thread waits without the GIL, taking it back
/// every 100 ms to let Python handle signals: Ctrl-C ("interrupt kernel") asks the work to stop
/// at its next check ([`interrupt`]), waits for it to end, and raises `KeyboardInterrupt`.
fn interruptible<T: Send>(py: Python<'_>, work: impl FnOnce() -> T + Send) -> PyResult<T> {
    let finished = (Mutex::new(false), Condvar::new());
    std::thread::scope(|s| {
        let h = s.spawn(|| {
            let r = work();
            *finished.0.lock().unwrap_or_else(|p| p.into_inner()) = true;
            finished.1.notify_all();
            r
        });
        loop {
            let done = py.detach(|| {
                let g = finished.0.lock().unwrap_or_else(|p| p.into_inner());
                let (g, _) = finished
                    .1
                    .wait_timeout_while(g, Duration::from_millis(100), |d| !*d)
                    .unwrap_or_else(|p| p.into_inner());
                *g
            });
            // Python code runs here (logging, signal handlers): a KeyboardInterrupt may come from
            // either, and the work must hear of it before this thread waits for it to end.
            if let Err(e) = logs::forward(py).and_then(|()| py.check_signals()) {
                interrupt::request();
                let _ = py.detach(|| h.join());
                interrupt::clear();
                return Err(e);
            }
            if done {
                break;
            }
        }
        Ok(h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
    })
}

/// Runs the `trainer` command line `argv` (without the program name) in this process and returns
/// what it printed. Raises `KestrelError` with the CLI's message when it fails.
#[pyfunction]
fn run(py: Python<'_>, argv: Vec<String>) -> PyResult<String> {
    Ok(interruptible(py, || captured(argv, cli::run))??)
}

/// Runs the distributed command `argv` as rank `rank` (> 0) of `world` processes whose rank 0
/// listens at `lead` ("host:port"), proving membership with `token`.
#[pyfunction]
#[pyo3(signature = (argv, rank, world, lead, token, timeout_s=600.0))]
fn run_rank(
    py: Python<'_>,
    argv: Vec<String>,
    rank: usize,
    world: usize,
    lead: String,
    token: String,
    timeout_s: f64,
) -> PyResult<String> {
    // A host name (Spark reports executors by name or address) resolves here.
    let addr: SocketAddr = lead
        .to_socket_addrs()
        .map_err(|e| py_err(format!("rank 0's address `{lead}`: {e}")))?
        .next()
        .ok_or_else(|| py_err(format!("rank 0's address `{lead}` resolves to nothing")))?;
    Ok(interruptible(py, || {
        let comm = TcpComm::join(rank, world, addr, &token, secs(timeout_s))
            .map_err(|e| Fail::of(&anyhow::Error::from(e)))?;
        captured(argv, |cmd| cli::run_as_rank(cmd, Box::new(comm)))
    })??)
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.max(0.001))
}

/// Rank 0 of a job of processes: listens on `host` (a free port) until [`Lead::run`] accepts the
/// other ranks, whose tasks learn the address from Spark.
#[pyclass]
struct Lead {
    listener: Mutex<Option<TcpListener>>,
    #[pyo3(get)]
    port: u16,
}

#[pymethods]
impl Lead {
    #[new]
    fn new(host: &str) -> PyResult<Lead> {
        let l = tcp::listen(host).map_err(|e| py_err(format!("listening on {host}: {e}")))?;
        let port = l.local_addr().map_err(py_err)?.port();
        Ok(Lead {
            listener: Mutex::new(Some(l)),
            port,
        })
    }

    /// Runs the distributed command `argv` as rank 0 of `world` (once).
    #[pyo3(signature = (argv, world, token, timeout_s=600.0))]
    fn run(
        &self,
        py: Python<'_>,
        argv: Vec<String>,
        world: usize,
        token: String,
        timeout_s: f64,
    ) -> PyResult<String> {
        let listener = self
            .listener
            .lock()
            .map_err(py_err)?
            .take()
            .ok_or_else(|| py_err("this Lead already ran its job"))?;
        Ok(interruptible(py, || {
            let comm = TcpComm::lead(listener, world, &token, secs(timeout_s))
                .map_err(|e| Fail::of(&anyhow::Error::from(e)))?;
            captured(argv, |cmd| cli::run_as_rank(cmd, Box::new(comm)))
        })??)
    }
}

/// A backbone's frozen network, loaded once (an executor's Python worker keeps it between tasks).
#[pyclass]
struct Extractor {
    inner: RustExtractor,
}

#[pymethods]
impl Extractor {
    /// `flags`: `trainer prepare`'s backbone and engine flags (`--backbone`, `--engine`, ...).
    #[new]
    fn new(py: Python<'_>, flags: Vec<String>) -> PyResult<Extractor> {
        let inner = py.detach(|| cli::features::extractor(&flags).map_err(|e| Fail::of(&e)))?;
        Ok(Extractor { inner })
    }

    /// Features of each image: `(features, dims, errors)`, `features` the little-endian f32 rows
    /// of the images that decoded, one after another, `errors[i]` why image `i` did not (or
    /// None).
    fn extract<'py>(
        &self,
        py: Python<'py>,
        names: Vec<String>,
        images: Vec<Vec<u8>>,
    ) -> PyResult<(Bound<'py, PyBytes>, usize, Vec<Option<String>>)> {
        if names.len() != images.len() {
            return Err(py_err(format!(
                "{} names for {} images",
                names.len(),
                images.len()
            )));
        }
        let rows = py
            .detach(|| {
                let items: Vec<(&str, &[u8])> = names
                    .iter()
                    .map(String::as_str)
                    .zip(images.iter().map(Vec::as_slice))
                    .collect();
                self.inner
                    .extract(&items)
                    .map_err(|e| kestrel_shared::chain(&e))
            })
            .map_err(py_err)?;
        let dims = rows
            .iter()
            .find_map(|r| r.as_ref().ok())
            .map_or(0, Vec::len);
        let mut out: Vec<u8> = Vec::with_capacity(rows.len() * dims * 4);
        let mut errors = Vec::with_capacity(rows.len());
        for r in rows {
            match r {
                Ok(v) => {
                    out.extend(v.iter().flat_map(|f| f.to_le_bytes()));
                    errors.push(None);
                }
                Err(e) => errors.push(Some(kestrel_shared::chain(&e))),
            }
        }
        Ok((PyBytes::new(py, &out), dims, errors))
    }

    /// Stores feature rows (little-endian f32, one after another, as `extract` returns them) of
    /// the images whose encoded bytes have the sha256s `content` as a feature cache under
    /// `cache`, which `trainer fit`/`prepare --cache` (and `kestrel.fit`) reuse instead of
    /// running the backbone on those images. Returns the directory written.
    fn store(
        &self,
        py: Python<'_>,
        cache: PathBuf,
        content: Vec<String>,
        features: Vec<u8>,
        seconds: f64,
    ) -> PyResult<String> {
        let data: Vec<f32> = features
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        py.detach(|| {
            self.inner
                .store(&cache, content, &data, seconds)
                .map(|d| d.display().to_string())
                .map_err(|e| format!("{}: {}", cache.display(), kestrel_shared::chain(&e)))
        })
        .map_err(py_err)
    }
}

/// An exported artifact, loaded and health-checked as the edge agent loads it (tract).
#[pyclass]
struct Predictor {
    model: LoadedModel,
}

#[pymethods]
impl Predictor {
    #[new]
    #[pyo3(signature = (artifact, threads=1, max_bytes=64 << 20))]
    fn new(py: Python<'_>, artifact: PathBuf, threads: usize, max_bytes: u64) -> PyResult<Self> {
        let model = py.detach(|| {
            LoadedModel::load(&artifact, max_bytes, EngineKind::Tract, threads).map_err(|e| Fail {
                kind: Failure::Data,
                msg: format!("{}: {}", artifact.display(), kestrel_shared::Chain(&e)),
            })
        })?;
        Ok(Predictor { model })
    }

    /// The model's class labels, in class order.
    #[getter]
    fn labels(&self) -> Vec<String> {
        self.model.manifest.labels.clone()
    }

    /// Per image, `(top, None)` with the top-`k` `(label, class, score)`, or `(None, error)`.
    fn predict(
        &self,
        py: Python<'_>,
        names: Vec<String>,
        images: Vec<Vec<u8>>,
        k: usize,
    ) -> Vec<(Option<Vec<(String, usize, f32)>>, Option<String>)> {
        py.detach(|| {
            names
                .iter()
                .zip(&images)
                .map(|(n, b)| {
                    self.model
                        .predict(b, n, k)
                        .map(|p| {
                            p.top
                                .into_iter()
                                .map(|c| (c.label, c.class, c.score))
                                .collect()
                        })
                        .map_or_else(
                            |e| (None, Some(kestrel_shared::chain(&e))),
                            |top| (Some(top), None),
                        )
                })
                .collect()
        })
    }
}

/// Where this process keeps the canonical weights of the pretrained backbone `name` (whether or
/// not they are there), or None when `name` is not a backbone with pretrained weights.
#[pyfunction]
fn pretrained_path(name: &str) -> Option<String> {
    let arch = kestrel_models::Arch::parse(name)?;
    (arch == kestrel_models::Arch::EfficientnetLite0).then(|| {
        kestrel_models::backbone::pretrained_path(arch)
            .display()
            .to_string()
    })
}

/// The Rust code's log records, as Python `logging` records (loggers `kestrel.*`), at
/// `verbosity` (0 information, 1 debug, -1 errors only); `RUST_LOG` overrides. Takes effect when
/// called, again and again.
#[pyfunction]
fn init_logging(py: Python<'_>, verbosity: i8) -> PyResult<()> {
    logs::init(verbosity);
    logs::forward(py)
}

/// The visible flags of `trainer COMMAND` as `(keyword, Python type, help)`, in `--help` order
/// (what `scripts/gen-flags.py` writes the type hints from).
#[pyfunction]
fn flag_specs(command: &str) -> PyResult<Vec<(String, String, String)>> {
    let specs = cli::spec::flags_of(command)
        .ok_or_else(|| py_err(format!("trainer has no command `{command}`")))?;
    Ok(specs
        .into_iter()
        .map(|f| (f.name, f.python, f.help))
        .collect())
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("KestrelError", m.py().get_type::<KestrelError>())?;
    m.add("DataError", m.py().get_type::<DataError>())?;
    m.add("ConfigError", m.py().get_type::<ConfigError>())?;
    m.add("ServiceError", m.py().get_type::<ServiceError>())?;
    m.add("GateError", m.py().get_type::<GateError>())?;
    m.add("PeerFailed", m.py().get_type::<PeerFailed>())?;
    m.add_function(wrap_pyfunction!(pretrained_path, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(run, m)?)?;
    m.add_function(wrap_pyfunction!(run_rank, m)?)?;
    m.add_function(wrap_pyfunction!(init_logging, m)?)?;
    m.add_function(wrap_pyfunction!(flag_specs, m)?)?;
    m.add_class::<Lead>()?;
    m.add_class::<Extractor>()?;
    m.add_class::<Predictor>()?;
    Ok(())
}
