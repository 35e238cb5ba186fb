//! [`LocalComm`]: the ranks of a job as worker threads of this process, and [`run_workers`], the
//! one place that spawns them, joins them and picks the error to report.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::{AbortOnPanic, Collective, CollectiveError, ErrorScope, RankError, WorkerError};

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

struct Rendezvous {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

/// One rank of an in-process group of worker threads (see [`local_group`]).
pub struct LocalComm {
    rank: usize,
    seq: AtomicU64,
    shared: Arc<Rendezvous>,
}

/// `world` connected ranks for `world` threads; a collective that waits longer than `timeout`
/// fails naming the ranks that did not arrive.
pub fn local_group(world: usize, timeout: Duration) -> Vec<LocalComm> {
    assert!(world > 0);
    let shared = Arc::new(Rendezvous {
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
            st.result = super::same_operation(seq, contributions).map(Arc::new);
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
        super::sum_in_rank_order(buf, &all);
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

/// Runs `f` on `world` ranks, one thread each (the calling thread is rank 0), connected by a
/// [`local_group`] with `timeout`. A failing or panicking rank aborts the group, so the others stop
/// at their next collective. Returns rank 0's value, or the root cause: the first error that is not
/// "another rank failed", named by its rank ([`WorkerError`]) when it is not rank 0's own.
pub fn run_workers<T: Send, E: RankError>(
    world: usize,
    timeout: Duration,
    f: impl Fn(&LocalComm) -> Result<T, E> + Sync,
) -> Result<T, E> {
    let comms = local_group(world.max(1), timeout);
    let guarded = |c: &LocalComm| {
        let _guard = AbortOnPanic(c);
        let r = f(c);
        if let Err(e) = &r {
            c.abort(&kestrel_shared::chain(e));
        }
        r
    };
    if comms.len() == 1 {
        return f(&comms[0]);
    }
    let (first, rest) = std::thread::scope(|s| {
        let handles: Vec<_> = comms[1..].iter().map(|c| s.spawn(|| guarded(c))).collect();
        let first = guarded(&comms[0]);
        let rest: Vec<Result<T, E>> = handles
            .into_iter()
            .enumerate()
            .map(|(i, h)| {
                h.join().unwrap_or_else(|_| {
                    Err(WorkerError {
                        rank: i + 1,
                        message: "panicked".into(),
                    }
                    .into())
                })
            })
            .collect();
        (first, rest)
    });
    let mut errors: Vec<(usize, E)> = Vec::new();
    let first = first.map_err(|e| errors.push((0, e))).ok();
    for (i, r) in rest.into_iter().enumerate() {
        if let Err(e) = r {
            errors.push((i + 1, e));
        }
    }
    if errors.is_empty() {
        return Ok(first.expect("rank 0 succeeded"));
    }
    let pick = errors
        .iter()
        .position(|(_, e)| e.scope() != ErrorScope::PeerFailed)
        .unwrap_or(0);
    let (rank, e) = errors.swap_remove(pick);
    Err(match e.scope() {
        ErrorScope::Own if rank != 0 => WorkerError {
            rank,
            message: kestrel_shared::chain(&e),
        }
        .into(),
        _ => e,
    })
}
