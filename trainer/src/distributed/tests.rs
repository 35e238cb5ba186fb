//! The collective tests, run on every transport that runs here: worker threads ([`LocalComm`])
//! and TCP on loopback ([`TcpComm`]); the MPI one runs them through `mpirun` in the e2e tests.

use std::time::{Duration, Instant};

use super::tcp::{TcpComm, loopback_group};
use super::{Collective, CollectiveError, DEFAULT_TIMEOUT, LocalComm, local_group, share};

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
