//! The collective tests, run on every transport that runs here: worker threads ([`LocalComm`])
//! and TCP on loopback ([`TcpComm`]); the MPI one runs them through `mpirun` in the e2e tests.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kestrel_models::engine::{EngineOpts, OrtDevice};

use super::tcp::{TcpComm, loopback_group};
use super::{Collective, CollectiveError, DEFAULT_TIMEOUT, LocalComm, local_group, share};
use super::{
    ErrorScope, Job, JobOpts, RankError, WorkerError, run_workers, same_operation,
    sum_in_rank_order,
};

/// Runs `f` on every rank of a group of each transport, one thread per rank; `f` gets the
/// transport's name too.
fn run_group<T: Send>(
    world: usize,
    timeout: Duration,
    f: impl Fn(&dyn Collective) -> T + Sync,
) -> Vec<(&'static str, Vec<T>)> {
    fn on<C: Collective + Sync, T: Send>(
        comms: &[C],
        f: &(impl Fn(&dyn Collective) -> T + Sync),
    ) -> Vec<T> {
        std::thread::scope(|s| {
            let hs: Vec<_> = comms.iter().map(|c| s.spawn(move || f(c))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }
    let local: Vec<LocalComm> = local_group(world, timeout);
    let tcp: Vec<TcpComm> = loopback_group(world, timeout);
    vec![("local", on(&local, &f)), ("tcp", on(&tcp, &f))]
}

#[test]
fn allreduce_broadcast_allgather_agree_on_every_rank() {
    for (transport, out) in run_group(3, DEFAULT_TIMEOUT, |c| {
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
    }) {
        for (sums, avg, b, gathered, m) in &out {
            assert_eq!(
                sums[7],
                vec![0.0 + 1.0 + 2.0 + 21.0, 6.0, 0.1 + 0.1 + 0.1],
                "{transport}"
            );
            assert_eq!(avg, &vec![1.0], "{transport}");
            assert_eq!(b, &vec![1.0, 1.0], "{transport}");
            assert_eq!(gathered, &vec![0.0, 1.0, 1.0, 2.0, 2.0, 2.0], "{transport}");
            assert_eq!(m, &[3.0, 3.0], "{transport}");
        }
        assert!(
            out.iter().all(|o| o.0 == out[0].0),
            "{transport}: bit-identical sums"
        );
    }
}

#[test]
fn a_missing_rank_is_named_after_the_timeout() {
    let t = Instant::now();
    for (transport, out) in run_group(3, Duration::from_millis(300), |c| {
        if c.rank() == 2 {
            // Rank 2 stalls past the others' timeout, then arrives late.
            std::thread::sleep(Duration::from_millis(900));
        }
        c.barrier()
    }) {
        for o in &out[..2] {
            let e = o.as_ref().unwrap_err().to_string();
            assert!(
                e.contains("rank(s) 2 did not arrive") || e.contains("timed out"),
                "{transport}: {e}"
            );
        }
        let late = out[2].as_ref().unwrap_err();
        assert!(
            matches!(late, CollectiveError::PeerFailed { .. }),
            "{transport}: {late}"
        );
        let first = out
            .iter()
            .find_map(|o| match o {
                Err(e @ CollectiveError::Timeout { .. }) => Some(e.to_string()),
                _ => None,
            })
            .unwrap();
        assert!(
            first.contains("rank(s) 2 did not arrive"),
            "{transport}: {first}"
        );
    }
    assert!(t.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_failed_rank_stops_the_others_without_waiting() {
    let t = Instant::now();
    for (transport, out) in run_group(3, DEFAULT_TIMEOUT, |c| {
        if c.rank() == 1 {
            c.abort("out of memory");
            return Ok(());
        }
        c.barrier()
    }) {
        for o in [&out[0], &out[2]] {
            let e = o.as_ref().unwrap_err().to_string();
            assert!(
                e.contains("rank 1 failed") && e.contains("out of memory"),
                "{transport}: {e}"
            );
        }
    }
    assert!(t.elapsed() < Duration::from_secs(10));
}

#[test]
fn diverged_ranks_get_a_mismatch() {
    for (transport, out) in run_group(2, DEFAULT_TIMEOUT, |c| {
        let mut g = vec![0.0; 3 + c.rank()];
        c.allreduce_sum(&mut g)
    }) {
        for o in out {
            let e = o.unwrap_err().to_string();
            assert!(
                e.contains("rank 1 called `allreduce_sum[4 f32]`"),
                "{transport}: {e}"
            );
        }
    }
    for (transport, out) in run_group(2, DEFAULT_TIMEOUT, |c| {
        c.check_same("parameters", format!("lr {}", c.rank()).as_bytes())
    }) {
        for o in out {
            let e = o.unwrap_err().to_string();
            assert!(
                e.contains("parameters of rank(s) 1 differ"),
                "{transport}: {e}"
            );
        }
    }
}

#[test]
fn shares_cover_everything_unevenly() {
    let parts: Vec<_> = (0..3).map(|r| share(10, r, 3)).collect();
    assert_eq!(parts, vec![0..3, 3..6, 6..10]);
}

#[test]
fn shares_give_each_item_to_one_rank_and_spare_ranks_nothing() {
    let seven: Vec<_> = (0..3).map(|r| share(7, r, 3)).collect();
    assert_eq!(seven, vec![0..2, 2..4, 4..7]);
    // More ranks than items: ranks 0 and 2 get empty ranges, nothing is given twice.
    let two: Vec<_> = (0..4).map(|r| share(2, r, 4)).collect();
    assert_eq!(two, vec![0..0, 0..1, 1..1, 1..2]);
}

/// Rank r's part: operation `ops[r]`, one byte `r`.
fn parts(ops: &[&str]) -> Vec<(String, Vec<u8>)> {
    ops.iter()
        .enumerate()
        .map(|(r, o)| (o.to_string(), vec![r as u8]))
        .collect()
}

#[test]
fn same_operation_returns_parts_in_rank_order_or_names_every_odd_rank() {
    assert_eq!(
        same_operation(0, parts(&["barrier", "barrier"])).unwrap(),
        vec![vec![0], vec![1]]
    );
    match same_operation(
        9,
        parts(&["allgather", "allgather", "barrier", "broadcast(root 0)"]),
    ) {
        Err(CollectiveError::Mismatch { seq, detail }) => {
            assert_eq!(seq, 9);
            assert_eq!(
                detail,
                "rank 0 called `allgather`, rank 2 called `barrier`, rank 3 called `broadcast(root 0)`"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn sums_are_taken_left_to_right_in_rank_order_replacing_the_buffer() {
    let bytes = |v: [f32; 2]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let all = vec![bytes([1.0, 0.5]), bytes([1e8, 0.25]), bytes([-1e8, -2.0])];
    let mut buf = [7.0f32, 7.0];
    sum_in_rank_order(&mut buf, &all);
    // (0 + 1) + 1e8 rounds to 1e8 in f32 (spacing 8 there): the 1 is lost, every rank alike.
    assert_eq!(buf, [0.0f32, -1.25]);
}

/// An operation's error as the ranks of [`run_workers`] see it (scoped as `TrainError` is).
#[derive(Debug, thiserror::Error)]
enum RankTestError {
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error(transparent)]
    Worker(#[from] WorkerError),
    #[error("{0}")]
    Own(String),
}

impl RankError for RankTestError {
    fn scope(&self) -> ErrorScope {
        match self {
            RankTestError::Collective(e) => ErrorScope::of_collective(Some(e)),
            RankTestError::Worker(_) => ErrorScope::Job,
            RankTestError::Own(_) => ErrorScope::Own,
        }
    }
}

#[test]
fn a_worker_s_own_failure_is_reported_with_its_rank_not_the_peers_stop() {
    let r = run_workers(3, DEFAULT_TIMEOUT, |c| -> Result<usize, RankTestError> {
        if c.rank() == 2 {
            return Err(RankTestError::Own("disk full".into()));
        }
        c.barrier()?;
        Ok(c.rank())
    });
    // Ranks 0 and 1 fail with PeerFailed (secondary); rank 2's own error is the root cause.
    match r {
        Err(RankTestError::Worker(WorkerError { rank, message })) => {
            assert_eq!((rank, message.as_str()), (2, "disk full"));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn rank_0_s_own_failure_is_returned_as_it_is() {
    let r = run_workers(2, DEFAULT_TIMEOUT, |c| -> Result<(), RankTestError> {
        if c.rank() == 0 {
            return Err(RankTestError::Own("bad --lr".into()));
        }
        c.barrier()?;
        Ok(())
    });
    assert!(
        matches!(&r, Err(RankTestError::Own(m)) if m == "bad --lr"),
        "{r:?}"
    );
}

fn job_opts(workers: usize, threads: usize) -> JobOpts {
    JobOpts {
        workers,
        threads,
        ort_device: OrtDevice::Cuda,
        cache_root: PathBuf::from("/nonexistent/kestrel-cache"),
        timeout: Duration::from_secs(7),
        distributed: true,
    }
}

#[test]
fn a_local_job_splits_its_threads_over_its_workers_and_a_trial_runs_alone() {
    let job = Job::local(job_opts(4, 10));
    assert_eq!((job.world(), job.rank(), job.is_lead()), (4, 0, true));
    assert!(job.procs().is_none());
    // 4 worker threads with 10 / 4 = 2 engine threads each; rank 0's value comes back.
    let got = job
        .run(|r| -> Result<(usize, usize, usize), RankTestError> {
            Ok((r.rank(), r.world(), r.threads))
        })
        .unwrap();
    assert_eq!(got, (0, 4, 2));
    let trial = job.single(3);
    assert_eq!(
        (trial.workers, trial.threads, trial.distributed),
        (1, 3, false)
    );
    assert_eq!(
        (trial.cache_root, trial.timeout, trial.ort_device),
        (
            PathBuf::from("/nonexistent/kestrel-cache"),
            Duration::from_secs(7),
            OrtDevice::Cuda
        )
    );
}

#[test]
fn a_ranked_job_is_one_rank_of_its_collective_with_all_the_threads() {
    let comm = local_group(3, DEFAULT_TIMEOUT).swap_remove(1);
    let job = Job::ranked(job_opts(4, 10), Box::new(comm));
    // World and rank come from the collective, not from `workers`.
    assert_eq!((job.world(), job.rank(), job.is_lead()), (3, 1, false));
    let got = job
        .run(|r| -> Result<(usize, usize, usize), RankTestError> {
            Ok((r.rank(), r.world(), r.threads))
        })
        .unwrap();
    assert_eq!(got, (1, 3, 10));
    assert_eq!(
        job.engine_opts(),
        EngineOpts {
            threads: 10,
            ort_device: OrtDevice::Cuda
        }
    );
}
