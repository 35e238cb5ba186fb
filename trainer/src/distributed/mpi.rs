//! [`Collective`] over MPI (cargo feature `mpi`, Open MPI through the `mpi` crate): one process per
//! rank, launched by `mpirun -np N trainer fit ...` (or `srun`, or the Kubernetes MPI Operator).
//!
//! Every collective is a star exchange over non-blocking point-to-point messages: each rank sends
//! (operation signature, bytes) to rank 0, which waits for all of them, checks that every rank
//! called the same operation on a buffer of the same shape, and sends every contribution back;
//! reductions are then summed in rank order on each rank (bit-identical everywhere, as with
//! [`super::LocalComm`]). Because rank 0 sees who has arrived, a stall is reported with
//! the ranks that did not arrive — which a blocking `MPI_Allreduce` cannot tell. The gradients of
//! a head are kilobytes, so the star costs nothing here; large unfrozen models would want
//! `MPI_Iallreduce` (or NCCL, see the collective module's docs) with the same trait.
//!
//! MPI cannot cancel a pending operation, so a timeout or a failure is fatal: the error is printed
//! (naming the ranks) and `MPI_Abort` ends every rank; `mpirun` exits non-zero. A rank that dies
//! (killed, crashed) is noticed by `mpirun`, which ends the job and names it.

use std::cell::Cell;
use std::time::{Duration, Instant};

use mpi::point_to_point::MatchedReceiveVec;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use super::{Collective, CollectiveError};

/// One MPI rank (owns MPI's initialisation: dropping it finalizes MPI).
pub struct MpiComm {
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
    timeout: Duration,
    seq: Cell<u64>,
    // Last: MPI_Finalize after the communicator is gone.
    _universe: mpi::environment::Universe,
}

impl MpiComm {
    /// Initialises MPI (single-threaded use: only the main thread calls MPI).
    pub fn init(timeout: Duration) -> Result<Self, CollectiveError> {
        let universe = mpi::initialize()
            .ok_or_else(|| CollectiveError::Mpi("MPI was already initialised".into()))?;
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        Ok(Self {
            world,
            rank,
            size,
            timeout,
            seq: Cell::new(0),
            _universe: universe,
        })
    }

    /// Prints `e` as this rank's error and ends the whole job (`MPI_Abort`).
    pub fn fail(&self, e: &dyn std::fmt::Display) -> ! {
        tracing::error!("rank {} of {}: {e}", self.rank, self.size);
        self.world.abort(1)
    }

    fn poll_pause(polls: &mut u32) {
        *polls += 1;
        if *polls < 200 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(if *polls < 2000 {
                100
            } else {
                1000
            }));
        }
    }

    fn send(&self, to: usize, tag: i32, buf: &[u8], deadline: Instant, what: &str) {
        mpi::request::scope(|scope| {
            let mut req = self
                .world
                .process_at_rank(to as i32)
                .immediate_send_with_tag(scope, buf, tag);
            let mut polls = 0;
            loop {
                match req.test() {
                    Ok(_) => return,
                    Err(r) => req = r,
                }
                if Instant::now() > deadline {
                    self.fail(&format!(
                        "{what}: rank {to} did not receive within {:.1}s (--collective-timeout): \
                         it stalled or died",
                        self.timeout.as_secs_f64()
                    ));
                }
                Self::poll_pause(&mut polls);
            }
        })
    }

    fn try_recv(&self, from: usize, tag: i32) -> Option<Vec<u8>> {
        self.world
            .process_at_rank(from as i32)
            .immediate_matched_probe_with_tag(tag)
            .map(|m| m.matched_receive_vec::<u8>().0)
    }

    fn exchange(&self, op: String, data: &[u8]) -> Result<Vec<Vec<u8>>, CollectiveError> {
        let seq = self.seq.get();
        self.seq.set(seq + 1);
        let tag = (seq % 30_000) as i32;
        let start = Instant::now();
        let frame = encode(&[op.as_bytes(), data]);
        if self.rank != 0 {
            self.send(
                0,
                tag,
                &frame,
                start + self.timeout,
                &format!("collective #{seq} `{op}`"),
            );
            // Rank 0 answers once every rank arrived; it reports missing ranks itself, so wait longer.
            let deadline = start + 2 * self.timeout;
            let mut polls = 0;
            let reply = loop {
                if let Some(b) = self.try_recv(0, tag) {
                    break b;
                }
                if Instant::now() > deadline {
                    self.fail(&CollectiveError::Timeout {
                        seq,
                        op,
                        rank: self.rank,
                        missing: vec![0],
                        waited: start.elapsed().as_secs_f64(),
                    });
                }
                Self::poll_pause(&mut polls);
            };
            let parts = decode(&reply)
                .ok_or_else(|| CollectiveError::Mpi(format!("collective #{seq}: bad reply")))?;
            return match parts.first().map(|p| p.as_slice()) {
                Some(b"ok") => Ok(parts[1..].to_vec()),
                _ => Err(CollectiveError::Mismatch {
                    seq,
                    detail: String::from_utf8_lossy(parts.get(1).map_or(&[][..], |p| p))
                        .into_owned(),
                }),
            };
        }
        let mut got: Vec<Option<Vec<u8>>> = vec![None; self.size];
        got[0] = Some(frame);
        let deadline = start + self.timeout;
        let mut polls = 0;
        while got.iter().any(Option::is_none) {
            for (r, slot) in got.iter_mut().enumerate().skip(1) {
                if slot.is_none() {
                    *slot = self.try_recv(r, tag);
                }
            }
            if got.iter().all(Option::is_some) {
                break;
            }
            if Instant::now() > deadline {
                let missing = (0..self.size).filter(|&r| got[r].is_none()).collect();
                self.fail(&CollectiveError::Timeout {
                    seq,
                    op,
                    rank: 0,
                    missing,
                    waited: start.elapsed().as_secs_f64(),
                });
            }
            Self::poll_pause(&mut polls);
        }
        let mut ops = Vec::with_capacity(self.size);
        let mut datas = Vec::with_capacity(self.size);
        for (r, g) in got.into_iter().enumerate() {
            let mut parts = decode(&g.expect("all arrived")).ok_or_else(|| {
                CollectiveError::Mpi(format!("collective #{seq}: bad frame from rank {r}"))
            })?;
            if parts.len() != 2 {
                return Err(CollectiveError::Mpi(format!(
                    "collective #{seq}: bad frame from rank {r}"
                )));
            }
            datas.push(parts.pop().unwrap());
            ops.push(String::from_utf8_lossy(&parts[0]).into_owned());
        }
        let odd: Vec<String> = (1..self.size)
            .filter(|&r| ops[r] != ops[0])
            .map(|r| format!("rank {r} called `{}`", ops[r]))
            .collect();
        let (reply, result) = if odd.is_empty() {
            let mut parts: Vec<&[u8]> = vec![b"ok"];
            parts.extend(datas.iter().map(|d| d.as_slice()));
            (encode(&parts), Ok(datas))
        } else {
            let detail = format!("rank 0 called `{}`, {}", ops[0], odd.join(", "));
            (
                encode(&[b"mismatch", detail.as_bytes()]),
                Err(CollectiveError::Mismatch { seq, detail }),
            )
        };
        for r in 1..self.size {
            self.send(
                r,
                tag,
                &reply,
                start + 2 * self.timeout,
                &format!("collective #{seq} `{op}` reply"),
            );
        }
        result
    }
}

/// Length-prefixed parts.
fn encode(parts: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::with_capacity(parts.iter().map(|p| p.len() + 8).sum());
    for p in parts {
        out.extend((p.len() as u64).to_le_bytes());
        out.extend_from_slice(p);
    }
    out
}

fn decode(mut b: &[u8]) -> Option<Vec<Vec<u8>>> {
    let mut out = Vec::new();
    while !b.is_empty() {
        let n = u64::from_le_bytes(b.get(..8)?.try_into().ok()?) as usize;
        out.push(b.get(8..8 + n)?.to_vec());
        b = &b[8 + n..];
    }
    Some(out)
}

impl Collective for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.size
    }

    fn allreduce_sum(&self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        if self.size == 1 {
            return Ok(());
        }
        let bytes: Vec<u8> = buf.iter().flat_map(|v| v.to_le_bytes()).collect();
        let all = self.exchange(format!("allreduce_sum[{} f32]", buf.len()), &bytes)?;
        buf.iter_mut().for_each(|v| *v = 0.0);
        for b in &all {
            for (v, c) in buf.iter_mut().zip(b.chunks_exact(4)) {
                *v += f32::from_le_bytes(c.try_into().expect("4 bytes"));
            }
        }
        Ok(())
    }

    fn allgather_bytes(&self, local: &[u8]) -> Result<Vec<Vec<u8>>, CollectiveError> {
        if self.size == 1 {
            return Ok(vec![local.to_vec()]);
        }
        self.exchange("allgather".into(), local)
    }

    fn broadcast_bytes(&self, data: &mut Vec<u8>, root: usize) -> Result<(), CollectiveError> {
        if self.size == 1 {
            return Ok(());
        }
        let mine = if self.rank == root {
            data.clone()
        } else {
            Vec::new()
        };
        let mut all = self.exchange(format!("broadcast(root {root})"), &mine)?;
        *data = std::mem::take(&mut all[root]);
        Ok(())
    }

    fn barrier(&self) -> Result<(), CollectiveError> {
        if self.size == 1 {
            return Ok(());
        }
        self.exchange("barrier".into(), &[]).map(|_| ())
    }

    fn abort(&self, reason: &str) {
        self.fail(&reason)
    }
}
