//! [`Job`]: the run context every trainer operation receives. It says where the ranks of the
//! operation run — one worker, N worker threads of this process, or this process as one rank of an
//! MPI job — how many engine threads each gets, where the caches are, and who logs (rank 0 only).
//! An operation is written once, as what one rank does ([`Job::run`] gives it a [`Rank`]), and runs
//! the same on 1 worker, N local workers or N MPI ranks.

use std::path::{Path, PathBuf};
use std::time::Duration;

use indicatif::ProgressBar;
use kestrel_models::engine::{EngineOpts, OrtDevice};

use super::{
    Collective, CollectiveError, DEFAULT_TIMEOUT, RankError, launched_by_mpi, run_workers,
};

/// How a job is set up: what the command line says.
#[derive(Debug, Clone)]
pub struct JobOpts {
    /// Local worker threads (ranks) for data-parallel operations; 1 under MPI (each process is one).
    pub workers: usize,
    /// Engine threads of this process (split evenly over local workers).
    pub threads: usize,
    /// ONNX Runtime's execution provider for every engine the job builds.
    pub ort_device: OrtDevice,
    /// Root of the sample and feature caches.
    pub cache_root: PathBuf,
    /// How long a collective waits for the other ranks.
    pub timeout: Duration,
    /// Whether the operation may run as an MPI job (under `mpirun`).
    pub distributed: bool,
}

impl Default for JobOpts {
    fn default() -> Self {
        Self {
            workers: 1,
            threads: default_threads(),
            ort_device: OrtDevice::Cpu,
            cache_root: default_cache_root(),
            timeout: DEFAULT_TIMEOUT,
            distributed: false,
        }
    }
}

impl JobOpts {
    /// How the job's engines run: all its threads and ONNX Runtime's execution provider.
    pub fn engine_opts(&self) -> EngineOpts {
        EngineOpts {
            threads: self.threads,
            ort_device: self.ort_device,
        }
    }
}

/// The cores this process may use.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `$KESTREL_HOME/cache`.
pub fn default_cache_root() -> PathBuf {
    kestrel_models::engine::kestrel_home().join("cache")
}

/// The run context of one operation (see the module docs).
pub struct Job {
    opts: JobOpts,
    /// This process's rank of a job of processes: MPI's, when an MPI launcher started it, or one
    /// given by the caller ([`Job::ranked`]: a Spark task over TCP).
    procs: Option<Box<dyn Collective>>,
    /// Whether a failing rank ends the whole job and this process (MPI's `MPI_Abort`).
    exit_on_fail: bool,
    quiet: bool,
}

/// One rank of a [`Job`], as the operation's per-rank code sees it.
pub struct Rank<'a> {
    pub comm: &'a dyn Collective,
    /// Engine threads of this rank.
    pub threads: usize,
    ort_device: OrtDevice,
    /// Whether this process logs (rank 0's process, not quiet).
    logs: bool,
}

impl Job {
    /// A job on this process's own workers (`opts.workers` threads), never MPI.
    pub fn local(opts: JobOpts) -> Job {
        Job {
            opts,
            procs: None,
            exit_on_fail: false,
            quiet: false,
        }
    }

    /// A job whose ranks are processes connected by `comm` (one rank per process, as under MPI),
    /// found by the caller: the tasks of a Spark barrier stage ([`super::tcp::TcpComm`]). A failing
    /// rank aborts the collective and returns its error; the process lives on.
    pub fn ranked(opts: JobOpts, comm: Box<dyn Collective>) -> Job {
        Job {
            opts: JobOpts { workers: 1, ..opts },
            procs: Some(comm),
            exit_on_fail: false,
            quiet: false,
        }
    }

    /// The job this process belongs to: one rank of an MPI job when an MPI launcher (mpirun,
    /// srun) started it and the operation may run distributed, else a local job. A command that
    /// cannot run distributed refuses to run under an MPI launcher.
    pub fn start(opts: JobOpts) -> Result<Job, JobError> {
        if !launched_by_mpi() {
            return Ok(Job::local(opts));
        }
        if !opts.distributed {
            return Err(JobError::NotDistributed);
        }
        let comm = mpi_comm(opts.timeout)?;
        Ok(Job {
            opts: JobOpts { workers: 1, ..opts },
            procs: Some(comm),
            exit_on_fail: true,
            quiet: false,
        })
    }

    /// The same job without log lines or progress bars (tuning trials, library callers).
    pub fn quiet(mut self) -> Job {
        self.quiet = true;
        self
    }

    /// Settings for a one-worker job with this job's caches and `threads` (one tuning trial).
    pub fn single(&self, threads: usize) -> JobOpts {
        JobOpts {
            workers: 1,
            threads,
            distributed: false,
            ..self.opts.clone()
        }
    }

    /// Whether this process logs: rank 0's, when not quiet.
    fn logs(&self) -> bool {
        self.is_lead() && !self.quiet
    }

    pub fn threads(&self) -> usize {
        self.opts.threads
    }

    /// How the job's engines run: its threads and ONNX Runtime's execution provider.
    pub fn engine_opts(&self) -> EngineOpts {
        self.opts.engine_opts()
    }

    pub fn cache_root(&self) -> &Path {
        &self.opts.cache_root
    }

    /// Ranks of the job: local workers, or the MPI world.
    pub fn world(&self) -> usize {
        self.procs
            .as_ref()
            .map_or(self.opts.workers.max(1), |c| c.world())
    }

    /// This process's MPI rank (0 when local).
    pub fn rank(&self) -> usize {
        self.procs.as_ref().map_or(0, |c| c.rank())
    }

    /// Rank 0's process: the one that logs, writes results and prints.
    pub fn is_lead(&self) -> bool {
        self.rank() == 0
    }

    /// This process's rank of a job of processes (MPI's, or [`Job::ranked`]'s), if it is one.
    pub fn procs(&self) -> Option<&dyn Collective> {
        self.procs.as_deref()
    }

    /// Logs a line on rank 0 (not when quiet).
    pub fn log(&self, line: impl AsRef<str>) {
        if self.logs() {
            tracing::info!("{}", line.as_ref());
        }
    }

    /// A progress bar on stderr (hidden off rank 0 and when quiet).
    pub fn progress(&self, len: u64, what: &str) -> ProgressBar {
        progress(self.logs(), len, what)
    }

    /// Runs `f` once per rank: on the job's local worker threads (the calling thread is rank 0;
    /// see [`run_workers`]), or as this process's rank of the MPI job. Returns the value of this
    /// process's rank (rank 0's locally); the first rank's root-cause error otherwise.
    pub fn run<T: Send, E: RankError>(
        &self,
        f: impl Fn(&Rank<'_>) -> Result<T, E> + Sync,
    ) -> Result<T, E> {
        let logs = self.logs();
        if let Some(comm) = self.procs() {
            return f(&Rank {
                comm,
                threads: self.opts.threads,
                ort_device: self.opts.ort_device,
                logs,
            });
        }
        let world = self.world();
        let threads = (self.opts.threads / world).max(1);
        let ort_device = self.opts.ort_device;
        run_workers(world, self.opts.timeout, |comm| {
            f(&Rank {
                comm,
                threads,
                ort_device,
                logs,
            })
        })
    }

    /// Runs `f` on rank 0 first and then on the other processes of an MPI job (a cache that rank 0
    /// builds and the others then find on a shared file system); locally, just once.
    pub fn lead_first<T, E: From<CollectiveError>>(
        &self,
        f: impl Fn() -> Result<T, E>,
    ) -> Result<T, E> {
        let Some(comm) = self.procs().filter(|c| c.world() > 1) else {
            return f();
        };
        let first = if comm.rank() == 0 { Some(f()?) } else { None };
        comm.barrier()?;
        match first {
            Some(v) => Ok(v),
            None => f(),
        }
    }

    /// Ends an MPI job with this rank's error: printed with the rank, then `MPI_Abort` makes every
    /// rank exit non-zero (never a hang). A [`Job::ranked`] rank tells the others and returns the
    /// error; a local job just returns it.
    pub fn fail<E: AsRef<dyn std::error::Error + Send + Sync>>(&self, e: E) -> E {
        if let Some(comm) = self.procs() {
            let line = kestrel_shared::chain(e.as_ref());
            comm.abort(&line);
            if self.exit_on_fail {
                tracing::error!("rank {}: {line}", comm.rank());
                std::process::exit(1)
            }
        }
        e
    }
}

impl Rank<'_> {
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn world(&self) -> usize {
        self.comm.world()
    }

    pub fn is_lead(&self) -> bool {
        self.comm.rank() == 0
    }

    /// How this rank's engines run: its threads and ONNX Runtime's execution provider.
    pub fn engine_opts(&self) -> EngineOpts {
        EngineOpts {
            threads: self.threads,
            ort_device: self.ort_device,
        }
    }

    /// This rank's index among the ranks on its machine (one GPU each): what the launcher says
    /// (Open MPI, MPICH, Slurm, torchrun), else the rank (local workers share one machine).
    pub fn local_rank(&self) -> usize {
        [
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "MPI_LOCALRANKID",
            "SLURM_LOCALID",
            "LOCAL_RANK",
        ]
        .iter()
        .find_map(|k| std::env::var(k).ok()?.parse().ok())
        .unwrap_or_else(|| self.rank())
    }

    /// Logs a line on rank 0 only.
    pub fn log(&self, line: impl AsRef<str>) {
        if self.is_lead() && self.logs {
            tracing::info!("{}", line.as_ref());
        }
    }

    /// A progress bar shown on rank 0 only.
    pub fn progress(&self, len: u64, what: &str) -> ProgressBar {
        progress(self.is_lead() && self.logs, len, what)
    }
}

fn progress(shown: bool, len: u64, what: &str) -> ProgressBar {
    if shown {
        crate::report::progress(len, what)
    } else {
        ProgressBar::hidden()
    }
}

/// This process's rank of the MPI job: MPI is initialised and every rank checks that the others
/// run the same executable (version and sha256).
#[cfg(feature = "mpi")]
fn mpi_comm(timeout: Duration) -> Result<Box<dyn Collective>, JobError> {
    let comm = super::mpi::MpiComm::init(timeout)?;
    let exe = std::env::current_exe().map_err(|e| JobError::Executable(e.to_string()))?;
    let bytes =
        std::fs::read(&exe).map_err(|e| JobError::Executable(format!("{}: {e}", exe.display())))?;
    let id = format!(
        "{} {}",
        env!("CARGO_PKG_VERSION"),
        kestrel_shared::protocol::sha256_hex(&bytes)
    );
    drop(bytes);
    if let Err(e) = comm.check_same("trainer executables (version and sha256)", id.as_bytes()) {
        comm.fail(&e);
    }
    Ok(Box::new(comm))
}

#[cfg(not(feature = "mpi"))]
fn mpi_comm(_: Duration) -> Result<Box<dyn Collective>, JobError> {
    Err(JobError::NoMpi)
}

#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("only prepare, fit, tune and predict run as MPI jobs; run this command without mpirun")]
    NotDistributed,
    #[error(
        "this process was started by an MPI launcher (mpirun/srun), but this trainer was built \
         without MPI: rebuild with `cargo build --release --features kestrel-trainer/mpi` \
         (needs libopenmpi-dev and libclang-dev), or use --workers N on one machine"
    )]
    NoMpi,
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error("locating the trainer executable: {0}")]
    Executable(String),
}
