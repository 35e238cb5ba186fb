//! Collective operations for synchronous data-parallel training (Horovod's vocabulary): allreduce,
//! broadcast, allgather and barrier behind one trait, with
//!
//! - [`LocalComm`]: N worker threads in one process (`trainer fit --workers N`), the default;
//! - `MpiComm` (cargo feature `mpi`): one process per rank under `mpirun`/`srun`;
//! - [`tcp::TcpComm`]: one process per rank that found rank 0's address some other way (the tasks
//!   of a Spark barrier stage).
//!
//! Every operation is *ordered and named*: each rank's k-th call must be the same operation on a
//! buffer of the same length, or every rank gets [`CollectiveError::Mismatch`] (a diverged rank or
//! a mismatched binary/config shows up as an error, never as a hang or silent garbage).
//! A rank that waits longer than the timeout fails with [`CollectiveError::Timeout`] naming the
//! ranks that did not arrive (Horovod's stall detector), and a rank that fails calls
//! [`Collective::abort`] so the others stop at their next collective instead of waiting.
//!
//! Sums are taken in rank order on every rank, so all ranks hold bit-identical results (and so
//! bit-identical parameters after the same optimizer step).
//!
//! ## GPU (designed, not run here: these machines have no GPU or CUDA toolkit)
//! An NCCL implementation fits the same trait: rank 0 creates an `ncclUniqueId`, broadcasts its
//! 128 bytes with the host collective (MPI or [`LocalComm`]), every rank calls
//! `ncclCommInitRank(world, id, rank)` on its device (candle's `cuda`/`nccl` features expose
//! `cudarc::nccl::Comm`), and `allreduce_sum` becomes `ncclAllReduce(sum)` on the device gradient
//! buffer (flattened, as here) followed by the same optimizer step on the device. Broadcast of the
//! initial parameters is `ncclBroadcast` from rank 0; metrics (a few f64) stay on the host path.

use std::time::Duration;

mod job;
mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod tcp;
#[cfg(test)]
mod tests;

pub use job::{Job, JobError, JobOpts, Rank, default_cache_root, default_threads};
pub use local::{LocalComm, local_group, run_workers};
pub use tcp::TcpComm;

/// Default `--collective-timeout`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum CollectiveError {
    #[error(
        "collective #{seq} `{op}` timed out on rank {rank} after {waited:.1}s: rank(s) {} did not arrive \
         (stalled or dead; raise --collective-timeout if a step is legitimately slower)",
        fmt_ranks(.missing)
    )]
    Timeout {
        seq: u64,
        op: String,
        rank: usize,
        missing: Vec<usize>,
        waited: f64,
    },
    #[error("rank {failed} failed, so rank {rank} stops: {reason}")]
    PeerFailed {
        rank: usize,
        failed: usize,
        reason: String,
    },
    #[error("ranks disagree at collective #{seq}: {detail}")]
    Mismatch { seq: u64, detail: String },
    #[error("MPI: {0}")]
    Mpi(String),
    /// A rank of a TCP job ([`tcp`]) could not join it.
    #[error("joining the job: {0}")]
    Connect(String),
}

/// Every rank's bytes of collective `seq`, in rank order, if every rank called the same operation
/// (each part: the operation's signature and the bytes); else the mismatch, naming the odd ranks.
pub(crate) fn same_operation(
    seq: u64,
    parts: Vec<(String, Vec<u8>)>,
) -> Result<Vec<Vec<u8>>, CollectiveError> {
    let odd: Vec<String> = parts
        .iter()
        .enumerate()
        .filter(|(_, (o, _))| *o != parts[0].0)
        .map(|(r, (o, _))| format!("rank {r} called `{o}`"))
        .collect();
    if !odd.is_empty() {
        return Err(CollectiveError::Mismatch {
            seq,
            detail: format!("rank 0 called `{}`, {}", parts[0].0, odd.join(", ")),
        });
    }
    Ok(parts.into_iter().map(|p| p.1).collect())
}

/// `buf` = the element-wise sum of every rank's f32 bytes, added in rank order (the same bits on
/// every rank).
pub(crate) fn sum_in_rank_order(buf: &mut [f32], all: &[Vec<u8>]) {
    buf.iter_mut().for_each(|v| *v = 0.0);
    for b in all {
        for (v, c) in buf.iter_mut().zip(b.chunks_exact(4)) {
            *v += f32::from_le_bytes(c.try_into().expect("4 bytes"));
        }
    }
}

pub(crate) fn fmt_ranks(r: &[usize]) -> String {
    r.iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The collectives data-parallel training needs. Implementations must keep every rank's view
/// identical: after `allreduce_sum`, every rank holds the same bits.
pub trait Collective {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Element-wise sum over ranks, in rank order, written back into `buf` on every rank.
    fn allreduce_sum(&self, buf: &mut [f32]) -> Result<(), CollectiveError>;
    /// Every rank's `local` bytes (lengths may differ), in rank order.
    fn allgather_bytes(&self, local: &[u8]) -> Result<Vec<Vec<u8>>, CollectiveError>;
    /// Replaces `data` on every rank with `root`'s.
    fn broadcast_bytes(&self, data: &mut Vec<u8>, root: usize) -> Result<(), CollectiveError>;
    fn barrier(&self) -> Result<(), CollectiveError>;
    /// Tells the other ranks that this one failed (they stop at their next collective).
    fn abort(&self, reason: &str);

    /// Element-wise mean over ranks.
    fn allreduce_avg(&self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        self.allreduce_sum(buf)?;
        let n = self.world() as f32;
        buf.iter_mut().for_each(|v| *v /= n);
        Ok(())
    }

    /// Element-wise f64 sum over ranks (metrics and counts), in rank order.
    fn allreduce_sum_f64(&self, buf: &mut [f64]) -> Result<(), CollectiveError> {
        let bytes: Vec<u8> = buf.iter().flat_map(|v| v.to_le_bytes()).collect();
        let all = self.allgather_bytes(&bytes)?;
        for (r, b) in all.iter().enumerate() {
            if b.len() != bytes.len() {
                return Err(CollectiveError::Mismatch {
                    seq: 0,
                    detail: format!(
                        "rank {r} sent {} f64 values, rank {} sent {}",
                        b.len() / 8,
                        self.rank(),
                        buf.len()
                    ),
                });
            }
        }
        for (i, v) in buf.iter_mut().enumerate() {
            *v = all
                .iter()
                .map(|b| f64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes")))
                .sum();
        }
        Ok(())
    }

    /// Replaces `buf` on every rank with `root`'s (same length everywhere).
    fn broadcast_f32(&self, buf: &mut [f32], root: usize) -> Result<(), CollectiveError> {
        let mut bytes: Vec<u8> = buf.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.broadcast_bytes(&mut bytes, root)?;
        if bytes.len() != buf.len() * 4 {
            return Err(CollectiveError::Mismatch {
                seq: 0,
                detail: format!(
                    "broadcast of {} f32 values from rank {root}, rank {} expected {}",
                    bytes.len() / 4,
                    self.rank(),
                    buf.len()
                ),
            });
        }
        for (v, b) in buf.iter_mut().zip(bytes.chunks_exact(4)) {
            *v = f32::from_le_bytes(b.try_into().expect("4 bytes"));
        }
        Ok(())
    }

    /// Every rank's f32 values, concatenated in rank order.
    fn allgather_f32(&self, local: &[f32]) -> Result<Vec<f32>, CollectiveError> {
        let bytes: Vec<u8> = local.iter().flat_map(|v| v.to_le_bytes()).collect();
        Ok(self
            .allgather_bytes(&bytes)?
            .iter()
            .flat_map(|b| {
                b.chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            })
            .collect())
    }

    /// Fails on every rank unless all ranks pass the same `value` for `what` (parameters, data,
    /// binary version): a mismatched rank is named instead of training on diverging state.
    fn check_same(&self, what: &str, value: &[u8]) -> Result<(), CollectiveError> {
        let all = self.allgather_bytes(value)?;
        let differ: Vec<usize> = (0..all.len()).filter(|&r| all[r] != all[0]).collect();
        if differ.is_empty() {
            Ok(())
        } else {
            Err(CollectiveError::Mismatch {
                seq: 0,
                detail: format!(
                    "{what} of rank(s) {} differ from rank 0's",
                    fmt_ranks(&differ)
                ),
            })
        }
    }
}

/// True when this process was started by an MPI launcher (Open MPI's mpirun, MPICH/Hydra, Slurm
/// PMI/PMIx): `trainer fit` then runs as one rank of the job (feature `mpi`) or says it cannot.
pub fn launched_by_mpi() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

/// Rank `rank`'s contiguous share of `n` items over `world` ranks: `[r*n/w, (r+1)*n/w)` (sizes
/// differ by at most one).
pub fn share(n: usize, rank: usize, world: usize) -> std::ops::Range<usize> {
    rank * n / world..(rank + 1) * n / world
}

/// Calls [`Collective::abort`] when dropped during a panic, so a panicking worker thread makes the
/// others fail at their next collective instead of waiting for the timeout.
pub struct AbortOnPanic<'a>(pub &'a dyn Collective);

impl Drop for AbortOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.abort("panicked");
        }
    }
}

/// A rank's failure, named by its rank: what [`run_workers`] reports when a worker other than
/// rank 0 fails for a reason of its own (or panics).
#[derive(Debug, Clone, thiserror::Error)]
#[error("worker rank {rank}: {message}")]
pub struct WorkerError {
    pub rank: usize,
    pub message: String,
}

/// How an error relates to the ranks of a job, so the error reported is the root cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorScope {
    /// "Another rank failed": secondary, reported only if nothing better is known.
    PeerFailed,
    /// Already names its rank, or concerns the whole job (a collective, a worker, bad arguments).
    Job,
    /// This rank's own failure: reported as a [`WorkerError`] when it is not rank 0's.
    Own,
}

/// The error type of an operation that runs on ranks ([`Job::run`]).
pub trait RankError: std::error::Error + From<WorkerError> + Send {
    fn scope(&self) -> ErrorScope;
}

impl ErrorScope {
    /// The scope of an error that is a collective's or a worker's (`Some`), or this rank's own.
    pub fn of_collective(e: Option<&CollectiveError>) -> ErrorScope {
        match e {
            Some(CollectiveError::PeerFailed { .. }) => ErrorScope::PeerFailed,
            Some(_) => ErrorScope::Job,
            None => ErrorScope::Own,
        }
    }
}
