//! Collective operations for synchronous data-parallel training (Horovod's vocabulary): allreduce,
//! broadcast, allgather and barrier behind one trait, with
//!
//! - [`LocalComm`]: N worker threads in one process (`trainer fit --workers N`), the default;
//! - `MpiComm` (cargo feature `mpi`): one process per rank under `mpirun`/`srun`.
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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Default `--collective-timeout`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, thiserror::Error)]
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
}

fn fmt_ranks(r: &[usize]) -> String {
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

type Round = Result<Arc<Vec<Vec<u8>>>, CollectiveError>;

struct State {
    /// The round being gathered.
    round: u64,
    /// This round's contributions: (operation signature, bytes).
    arrived: Vec<Option<(String, Vec<u8>)>>,
    /// Rounds completed; `result` holds round `done - 1`'s.
    done: u64,
    result: Round,
    /// A rank that failed or timed out: (rank, reason).
    failed: Option<(usize, String)>,
}

struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

/// One rank of an in-process group of worker threads (see [`local_group`]).
pub struct LocalComm {
    rank: usize,
    seq: AtomicU64,
    shared: Arc<Shared>,
}

/// `world` connected ranks for `world` threads; a collective that waits longer than `timeout`
/// fails naming the ranks that did not arrive.
pub fn local_group(world: usize, timeout: Duration) -> Vec<LocalComm> {
    assert!(world > 0);
    let shared = Arc::new(Shared {
        world,
        timeout,
        state: Mutex::new(State {
            round: 0,
            arrived: vec![None; world],
            done: 0,
            result: Ok(Arc::new(Vec::new())),
            failed: None,
        }),
        cv: Condvar::new(),
    });
    (0..world)
        .map(|rank| LocalComm {
            rank,
            seq: AtomicU64::new(0),
            shared: shared.clone(),
        })
        .collect()
}

impl LocalComm {
    /// The one primitive: every rank contributes bytes under an operation signature and receives
    /// every rank's contribution once all have arrived.
    fn exchange(&self, op: String, data: Vec<u8>) -> Round {
        let sh = &*self.shared;
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let mut st = sh.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((failed, reason)) = &st.failed {
            return Err(CollectiveError::PeerFailed {
                rank: self.rank,
                failed: *failed,
                reason: reason.clone(),
            });
        }
        debug_assert_eq!(st.round, seq, "a round cannot complete without every rank");
        st.arrived[self.rank] = Some((op.clone(), data));
        if st.arrived.iter().all(Option::is_some) {
            let contributions: Vec<(String, Vec<u8>)> =
                st.arrived.iter_mut().map(|a| a.take().unwrap()).collect();
            let odd: Vec<String> = contributions
                .iter()
                .enumerate()
                .filter(|(_, (o, _))| *o != contributions[0].0)
                .map(|(r, (o, _))| format!("rank {r} called `{o}`"))
                .collect();
            st.result = if odd.is_empty() {
                Ok(Arc::new(contributions.into_iter().map(|c| c.1).collect()))
            } else {
                Err(CollectiveError::Mismatch {
                    seq,
                    detail: format!("rank 0 called `{}`, {}", contributions[0].0, odd.join(", ")),
                })
            };
            st.round += 1;
            st.done = st.round;
            sh.cv.notify_all();
            return st.result.clone();
        }
        let start = Instant::now();
        loop {
            if st.done > seq {
                return st.result.clone();
            }
            if let Some((failed, reason)) = &st.failed {
                return Err(CollectiveError::PeerFailed {
                    rank: self.rank,
                    failed: *failed,
                    reason: reason.clone(),
                });
            }
            let waited = start.elapsed();
            if waited >= sh.timeout {
                let missing: Vec<usize> =
                    (0..sh.world).filter(|&r| st.arrived[r].is_none()).collect();
                let e = CollectiveError::Timeout {
                    seq,
                    op,
                    rank: self.rank,
                    missing,
                    waited: waited.as_secs_f64(),
                };
                // A late rank fails at once instead of waiting for its own timeout.
                st.failed = Some((self.rank, e.to_string()));
                sh.cv.notify_all();
                return Err(e);
            }
            st = sh
                .cv
                .wait_timeout(st, sh.timeout - waited)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Collective for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.shared.world
    }

    fn allreduce_sum(&self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        if self.world() == 1 {
            return Ok(());
        }
        let bytes: Vec<u8> = buf.iter().flat_map(|v| v.to_le_bytes()).collect();
        let all = self.exchange(format!("allreduce_sum[{} f32]", buf.len()), bytes)?;
        buf.iter_mut().for_each(|v| *v = 0.0);
        for b in all.iter() {
            for (v, c) in buf.iter_mut().zip(b.chunks_exact(4)) {
                *v += f32::from_le_bytes(c.try_into().expect("4 bytes"));
            }
        }
        Ok(())
    }

    fn allgather_bytes(&self, local: &[u8]) -> Result<Vec<Vec<u8>>, CollectiveError> {
        if self.world() == 1 {
            return Ok(vec![local.to_vec()]);
        }
        Ok(self
            .exchange("allgather".into(), local.to_vec())?
            .as_ref()
            .clone())
    }

    fn broadcast_bytes(&self, data: &mut Vec<u8>, root: usize) -> Result<(), CollectiveError> {
        if self.world() == 1 {
            return Ok(());
        }
        let mine = if self.rank == root {
            std::mem::take(data)
        } else {
            Vec::new()
        };
        let all = self.exchange(format!("broadcast(root {root})"), mine)?;
        *data = all[root].clone();
        Ok(())
    }

    fn barrier(&self) -> Result<(), CollectiveError> {
        if self.world() == 1 {
            return Ok(());
        }
        self.exchange("barrier".into(), Vec::new()).map(|_| ())
    }

    fn abort(&self, reason: &str) {
        let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.failed.is_none() {
            st.failed = Some((self.rank, reason.to_string()));
        }
        self.shared.cv.notify_all();
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn run_group<T: Send>(
        world: usize,
        timeout: Duration,
        f: impl Fn(&LocalComm) -> T + Sync,
    ) -> Vec<T> {
        let comms = local_group(world, timeout);
        std::thread::scope(|s| {
            let hs: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn allreduce_broadcast_allgather_agree_on_every_rank() {
        let out = run_group(3, DEFAULT_TIMEOUT, |c| {
            let r = c.rank() as f32;
            let mut sums = Vec::new();
            for step in 0..50 {
                let mut g = vec![r + step as f32, 2.0 * r, 0.1];
                c.allreduce_sum(&mut g).unwrap();
                sums.push(g);
            }
            let mut avg = vec![r];
            c.allreduce_avg(&mut avg).unwrap();
            let mut b = vec![r; 2];
            c.broadcast_f32(&mut b, 1).unwrap();
            let gathered = c.allgather_f32(&vec![r; c.rank() + 1]).unwrap();
            let mut m = [r as f64, 1.0];
            c.allreduce_sum_f64(&mut m).unwrap();
            c.barrier().unwrap();
            (sums, avg, b, gathered, m)
        });
        for (sums, avg, b, gathered, m) in &out {
            assert_eq!(sums[7], vec![0.0 + 1.0 + 2.0 + 21.0, 6.0, 0.1 + 0.1 + 0.1]);
            assert_eq!(avg, &vec![1.0]);
            assert_eq!(b, &vec![1.0, 1.0]);
            assert_eq!(gathered, &vec![0.0, 1.0, 1.0, 2.0, 2.0, 2.0]);
            assert_eq!(m, &[3.0, 3.0]);
        }
        assert!(out.iter().all(|o| o.0 == out[0].0), "bit-identical sums");
    }

    #[test]
    fn a_missing_rank_is_named_after_the_timeout() {
        let t = Instant::now();
        let out = run_group(3, Duration::from_millis(300), |c| {
            if c.rank() == 2 {
                // Rank 2 stalls past the others' timeout, then arrives late.
                std::thread::sleep(Duration::from_millis(900));
            }
            c.barrier()
        });
        assert!(t.elapsed() < Duration::from_secs(5));
        for o in &out[..2] {
            let e = o.as_ref().unwrap_err().to_string();
            assert!(
                e.contains("rank(s) 2 did not arrive") || e.contains("timed out"),
                "{e}"
            );
        }
        let late = out[2].as_ref().unwrap_err();
        assert!(matches!(late, CollectiveError::PeerFailed { .. }), "{late}");
        let first = out
            .iter()
            .find_map(|o| match o {
                Err(e @ CollectiveError::Timeout { .. }) => Some(e.to_string()),
                _ => None,
            })
            .unwrap();
        assert!(first.contains("rank(s) 2 did not arrive"), "{first}");
    }

    #[test]
    fn a_failed_rank_stops_the_others_without_waiting() {
        let t = Instant::now();
        let out = run_group(2, DEFAULT_TIMEOUT, |c| {
            if c.rank() == 1 {
                c.abort("out of memory");
                return Ok(());
            }
            c.barrier()
        });
        assert!(t.elapsed() < Duration::from_secs(5));
        let e = out[0].as_ref().unwrap_err().to_string();
        assert!(
            e.contains("rank 1 failed") && e.contains("out of memory"),
            "{e}"
        );
    }

    #[test]
    fn diverged_ranks_get_a_mismatch() {
        let out = run_group(2, DEFAULT_TIMEOUT, |c| {
            let mut g = vec![0.0; 3 + c.rank()];
            c.allreduce_sum(&mut g)
        });
        for o in out {
            let e = o.unwrap_err().to_string();
            assert!(e.contains("rank 1 called `allreduce_sum[4 f32]`"), "{e}");
        }
        let out = run_group(2, DEFAULT_TIMEOUT, |c| {
            c.check_same("parameters", format!("lr {}", c.rank()).as_bytes())
        });
        for o in out {
            let e = o.unwrap_err().to_string();
            assert!(e.contains("parameters of rank(s) 1 differ"), "{e}");
        }
    }

    #[test]
    fn shares_cover_everything_unevenly() {
        let parts: Vec<_> = (0..3).map(|r| share(10, r, 3)).collect();
        assert_eq!(parts, vec![0..3, 3..6, 6..10]);
    }
}
