//! [`Collective`] over TCP between processes that found each other without MPI: the tasks of a
//! Spark barrier stage (`kestrel.spark.fit`), which learn rank 0's address from Spark
//! (`BarrierTaskContext.getTaskInfos` and `allGather`) and connect to it.
//!
//! The same star exchange as [`super::mpi`]: every rank sends (operation signature, bytes) to rank
//! 0, which waits for all of them, checks that every rank called the same operation, and sends
//! every contribution back; reductions are summed in rank order on each rank, so every rank holds
//! the same bits. Rank 0 reads each peer on a thread of its own, so it knows who has arrived (a
//! stall names the missing ranks), sees a peer's abort or closed connection at once, and passes a
//! failure on to every other rank. Unlike MPI, a failure is not fatal to the process: the ranks
//! return errors (a Python worker lives on).
//!
//! Peers prove they belong to the job with a token the driver hands every task (a random string
//! carried in Spark's task closure); connections with another token, rank or world size are
//! refused. Traffic is not encrypted (as MPI's TCP transport): gradients of a head and metrics.

use std::io::{BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::{Duration, Instant};

use super::{Collective, CollectiveError};

const MAGIC: &[u8; 4] = b"KCL1";
/// How much longer than the timeout a rank waits for rank 0's verdict (rank 0 names the ranks
/// that did not arrive; a rank that gives up first could only name rank 0).
const GRACE: Duration = Duration::from_secs(5);
/// Largest frame accepted (a sanity bound against a stray connection's garbage).
const MAX_FRAME: u64 = 1 << 34;

/// What travels between a rank and rank 0.
#[derive(Debug)]
enum Frame {
    /// A rank's part of collective `seq`.
    Part { seq: u64, op: String, data: Vec<u8> },
    /// Every rank's part of collective `seq`, in rank order (rank 0 to a rank).
    All { seq: u64, parts: Vec<Vec<u8>> },
    /// Collective `seq` failed (rank 0 to a rank): a timeout or a mismatch.
    Failed { seq: u64, error: CollectiveError },
    /// Rank `failed` gave up with `reason` (either way).
    Abort { failed: usize, reason: String },
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend((b.len() as u64).to_le_bytes());
    out.extend(b);
}

impl Frame {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Frame::Part { seq, op, data } => {
                out.push(1);
                out.extend(seq.to_le_bytes());
                put_bytes(&mut out, op.as_bytes());
                put_bytes(&mut out, data);
            }
            Frame::All { seq, parts } => {
                out.push(2);
                out.extend(seq.to_le_bytes());
                out.extend((parts.len() as u64).to_le_bytes());
                parts.iter().for_each(|p| put_bytes(&mut out, p));
            }
            Frame::Failed { seq, error } => {
                out.push(3);
                out.extend(seq.to_le_bytes());
                put_bytes(&mut out, &serde_json::to_vec(error).expect("serializable"));
            }
            Frame::Abort { failed, reason } => {
                out.push(4);
                out.extend((*failed as u64).to_le_bytes());
                put_bytes(&mut out, reason.as_bytes());
            }
        }
        let mut framed = (out.len() as u64).to_le_bytes().to_vec();
        framed.extend(out);
        framed
    }

    fn read(r: &mut impl Read) -> std::io::Result<Frame> {
        let len = read_u64(r)?;
        if len > MAX_FRAME {
            return Err(invalid(format!("frame of {len} bytes")));
        }
        let mut body = vec![0u8; len as usize];
        r.read_exact(&mut body)?;
        Frame::decode(&body).ok_or_else(|| invalid("malformed frame".into()))
    }

    fn decode(b: &[u8]) -> Option<Frame> {
        let mut cur = Cursor(b);
        let frame = match cur.u8()? {
            1 => Frame::Part {
                seq: cur.u64()?,
                op: String::from_utf8(cur.bytes()?.to_vec()).ok()?,
                data: cur.bytes()?.to_vec(),
            },
            2 => {
                let seq = cur.u64()?;
                let n = cur.u64()?;
                let parts = (0..n)
                    .map(|_| cur.bytes().map(<[u8]>::to_vec))
                    .collect::<Option<_>>()?;
                Frame::All { seq, parts }
            }
            3 => Frame::Failed {
                seq: cur.u64()?,
                error: serde_json::from_slice(cur.bytes()?).ok()?,
            },
            4 => Frame::Abort {
                failed: cur.u64()? as usize,
                reason: String::from_utf8_lossy(cur.bytes()?).into_owned(),
            },
            _ => return None,
        };
        cur.0.is_empty().then_some(frame)
    }
}

struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (a, b) = (self.0.get(..n)?, self.0.get(n..)?);
        self.0 = b;
        Some(a)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8")))
    }
    fn bytes(&mut self) -> Option<&'a [u8]> {
        let n = usize::try_from(self.u64()?).ok()?;
        self.take(n)
    }
}

fn read_u64(r: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn invalid(m: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, m)
}

fn hello(rank: usize, world: usize, token: &str) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend((rank as u64).to_le_bytes());
    out.extend((world as u64).to_le_bytes());
    put_bytes(&mut out, token.as_bytes());
    out
}

/// One rank of a TCP job (see the module docs).
pub struct TcpComm {
    rank: usize,
    world: usize,
    timeout: Duration,
    seq: AtomicU64,
    /// A rank that failed, as this rank knows it: (rank, reason).
    failed: Mutex<Option<(usize, String)>>,
    side: Side,
}

enum Side {
    /// Rank 0: a writer per peer (rank r at r - 1) and what the peers' reader threads received.
    Lead {
        peers: Vec<Mutex<TcpStream>>,
        inbox: Mutex<Receiver<(usize, std::io::Result<Frame>)>>,
    },
    /// Another rank: its connection to rank 0.
    Peer {
        write: Mutex<TcpStream>,
        read: Mutex<BufReader<TcpStream>>,
    },
}

/// Binds rank 0's listener on `host` (port chosen by the system): its address goes to the other
/// ranks (Spark: `allGather`) before [`TcpComm::lead`] accepts them.
pub fn listen(host: &str) -> std::io::Result<TcpListener> {
    TcpListener::bind((host, 0))
}

impl TcpComm {
    /// Rank 0 of `world` ranks: accepts the other ranks on `listener` (within `timeout`), each
    /// proving it belongs to the job with `token`.
    pub fn lead(
        listener: TcpListener,
        world: usize,
        token: &str,
        timeout: Duration,
    ) -> Result<TcpComm, CollectiveError> {
        let start = Instant::now();
        let (tx, rx) = channel();
        let mut streams: Vec<Option<TcpStream>> = (1..world).map(|_| None).collect();
        listener
            .set_nonblocking(true)
            .map_err(|e| connect_error(format!("listening: {e}")))?;
        while streams.iter().any(Option::is_none) {
            match listener.accept() {
                Ok((s, from)) => match admit(s, world, token) {
                    Ok((rank, s)) if streams[rank - 1].is_none() => streams[rank - 1] = Some(s),
                    Ok((rank, _)) => tracing::warn!("{from}: rank {rank} connected twice"),
                    Err(e) => tracing::warn!("refused a connection from {from}: {e}"),
                },
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if start.elapsed() >= timeout {
                        let missing = (1..world).filter(|r| streams[r - 1].is_none()).collect();
                        return Err(CollectiveError::Timeout {
                            seq: 0,
                            op: "connect".into(),
                            rank: 0,
                            missing,
                            waited: start.elapsed().as_secs_f64(),
                        });
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(connect_error(format!("accepting: {e}"))),
            }
        }
        let mut peers = Vec::new();
        for (i, s) in streams.into_iter().enumerate() {
            let s = s.expect("all connected");
            spawn_reader(
                i + 1,
                s.try_clone().map_err(|e| connect_error(e.to_string()))?,
                &tx,
            );
            peers.push(Mutex::new(s));
        }
        Ok(TcpComm::new(
            0,
            world,
            timeout,
            Side::Lead {
                peers,
                inbox: Mutex::new(rx),
            },
        ))
    }

    /// Rank `rank` (> 0) of `world`: connects to rank 0 at `lead` (retrying until `timeout`).
    pub fn join(
        rank: usize,
        world: usize,
        lead: SocketAddr,
        token: &str,
        timeout: Duration,
    ) -> Result<TcpComm, CollectiveError> {
        assert!(
            rank > 0 && rank < world,
            "rank {rank} of {world} joins rank 0"
        );
        let start = Instant::now();
        let mut s = loop {
            match TcpStream::connect_timeout(&lead, timeout) {
                Ok(s) => break s,
                Err(e) if start.elapsed() < timeout => {
                    tracing::debug!("rank {rank}: connecting to rank 0 at {lead}: {e}");
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => {
                    return Err(connect_error(format!(
                        "rank {rank}: cannot reach rank 0 at {lead}: {e}"
                    )));
                }
            }
        };
        let lost = |e: std::io::Error| connect_error(format!("rank {rank}: rank 0 at {lead}: {e}"));
        s.set_nodelay(true).map_err(lost)?;
        s.write_all(&hello(rank, world, token)).map_err(lost)?;
        s.set_read_timeout(Some(timeout)).map_err(lost)?;
        let mut ack = [0u8; 1];
        s.read_exact(&mut ack).map_err(lost)?;
        if ack[0] != 1 {
            return Err(connect_error(format!(
                "rank {rank}: rank 0 at {lead} refused this rank (another job's token, or a \
                 different world size)"
            )));
        }
        let read = BufReader::new(s.try_clone().map_err(lost)?);
        Ok(TcpComm::new(
            rank,
            world,
            timeout,
            Side::Peer {
                write: Mutex::new(s),
                read: Mutex::new(read),
            },
        ))
    }

    fn new(rank: usize, world: usize, timeout: Duration, side: Side) -> TcpComm {
        TcpComm {
            rank,
            world,
            timeout,
            seq: AtomicU64::new(0),
            failed: Mutex::new(None),
            side,
        }
    }

    fn peer_failed(&self) -> Option<CollectiveError> {
        let f = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        f.as_ref()
            .map(|(failed, reason)| CollectiveError::PeerFailed {
                rank: self.rank,
                failed: *failed,
                reason: reason.clone(),
            })
    }

    /// Records that `failed` gave up; the first failure is the one remembered.
    fn set_failed(&self, failed: usize, reason: String) -> CollectiveError {
        let mut f = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        f.get_or_insert((failed, reason));
        drop(f);
        self.peer_failed().expect("just set")
    }

    /// The one primitive: every rank's bytes for operation `op`, in rank order.
    fn exchange(&self, op: String, data: Vec<u8>) -> Result<Vec<Vec<u8>>, CollectiveError> {
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        if let Some(e) = self.peer_failed() {
            return Err(e);
        }
        match &self.side {
            Side::Lead { peers, inbox } => self.gather(seq, op, data, peers, inbox),
            Side::Peer { write, read } => self.send_and_wait(seq, op, data, write, read),
        }
    }

    fn gather(
        &self,
        seq: u64,
        op: String,
        data: Vec<u8>,
        peers: &[Mutex<TcpStream>],
        inbox: &Mutex<Receiver<(usize, std::io::Result<Frame>)>>,
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        let start = Instant::now();
        let inbox = inbox.lock().unwrap_or_else(|e| e.into_inner());
        let mut arrived: Vec<Option<(String, Vec<u8>)>> = vec![None; self.world];
        arrived[0] = Some((op.clone(), data));
        while arrived.iter().any(Option::is_none) {
            let left = self.timeout.saturating_sub(start.elapsed());
            let (r, frame) = match inbox.recv_timeout(left) {
                Ok(m) => m,
                Err(RecvTimeoutError::Timeout) => {
                    let missing: Vec<usize> =
                        (0..self.world).filter(|&r| arrived[r].is_none()).collect();
                    let e = CollectiveError::Timeout {
                        seq,
                        op,
                        rank: 0,
                        missing,
                        waited: start.elapsed().as_secs_f64(),
                    };
                    self.set_failed(0, e.to_string());
                    // The ranks that arrived learn why; the late ones find rank 0 gone.
                    for r in 1..self.world {
                        let f = match arrived[r] {
                            Some(_) => Frame::Failed {
                                seq,
                                error: e.clone(),
                            },
                            None => Frame::Abort {
                                failed: 0,
                                reason: e.to_string(),
                            },
                        };
                        send(&peers[r - 1], &f);
                    }
                    return Err(e);
                }
                Err(RecvTimeoutError::Disconnected) => unreachable!("rank 0 keeps a sender"),
            };
            match frame {
                Ok(Frame::Part { seq: s, op, data }) if s == seq => arrived[r] = Some((op, data)),
                other => {
                    let reason = match other {
                        Ok(Frame::Abort { reason, .. }) => reason,
                        Ok(f) => format!("out of step: sent {f:?} during collective #{seq}"),
                        Err(e) => format!("connection lost ({e})"),
                    };
                    let e = self.set_failed(r, reason.clone());
                    self.tell_all(&Frame::Abort { failed: r, reason });
                    return Err(e);
                }
            }
        }
        let parts: Vec<(String, Vec<u8>)> = arrived.into_iter().map(Option::unwrap).collect();
        let parts = match super::same_operation(seq, parts) {
            Ok(parts) => parts,
            Err(error) => {
                self.tell_all(&Frame::Failed {
                    seq,
                    error: error.clone(),
                });
                return Err(error);
            }
        };
        let frame = Frame::All { seq, parts };
        let all = frame.encode();
        for (i, p) in peers.iter().enumerate() {
            let mut s = p.lock().unwrap_or_else(|e| e.into_inner());
            if let Err(e) = s.write_all(&all) {
                let reason = format!("connection lost ({e})");
                let e = self.set_failed(i + 1, reason.clone());
                drop(s);
                self.tell_all(&Frame::Abort {
                    failed: i + 1,
                    reason,
                });
                return Err(e);
            }
        }
        match frame {
            Frame::All { parts, .. } => Ok(parts),
            _ => unreachable!("built above"),
        }
    }

    fn send_and_wait(
        &self,
        seq: u64,
        op: String,
        data: Vec<u8>,
        write: &Mutex<TcpStream>,
        read: &Mutex<BufReader<TcpStream>>,
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        let start = Instant::now();
        let frame = Frame::Part {
            seq,
            op: op.clone(),
            data,
        };
        let lost =
            |e: std::io::Error| self.set_failed(0, format!("connection to rank 0 lost ({e})"));
        write
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .write_all(&frame.encode())
            .map_err(lost)?;
        let mut read = read.lock().unwrap_or_else(|e| e.into_inner());
        read.get_ref()
            .set_read_timeout(Some(self.timeout + GRACE))
            .map_err(lost)?;
        match Frame::read(&mut *read) {
            Ok(Frame::All { seq: s, parts }) if s == seq => Ok(parts),
            Ok(Frame::Failed { seq: s, error }) if s == seq => Err(error),
            Ok(Frame::Abort { failed, reason }) => Err(self.set_failed(failed, reason)),
            Ok(f) => Err(self.set_failed(0, format!("out of step: sent {f:?} at #{seq}"))),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                let e = CollectiveError::Timeout {
                    seq,
                    op,
                    rank: self.rank,
                    missing: vec![0],
                    waited: start.elapsed().as_secs_f64(),
                };
                self.set_failed(self.rank, e.to_string());
                Err(e)
            }
            Err(e) => Err(lost(e)),
        }
    }

    fn tell_all(&self, f: &Frame) {
        if let Side::Lead { peers, .. } = &self.side {
            peers.iter().for_each(|p| send(p, f));
        }
    }
}

/// Best effort: a peer that is gone learns nothing, and needs nothing.
fn send(peer: &Mutex<TcpStream>, f: &Frame) {
    let _ = peer
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .write_all(&f.encode());
}

fn connect_error(m: String) -> CollectiveError {
    CollectiveError::Connect(m)
}

/// Reads a connecting rank's hello: its rank, the world size and the job's token.
fn admit(mut s: TcpStream, world: usize, token: &str) -> Result<(usize, TcpStream), String> {
    s.set_nonblocking(false).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    s.set_nodelay(true).map_err(|e| e.to_string())?;
    let mut magic = [0u8; 4];
    s.read_exact(&mut magic).map_err(|e| e.to_string())?;
    if &magic != MAGIC {
        return Err("not a Kestrel rank".into());
    }
    let rank = read_u64(&mut s).map_err(|e| e.to_string())? as usize;
    let their_world = read_u64(&mut s).map_err(|e| e.to_string())? as usize;
    let len = read_u64(&mut s).map_err(|e| e.to_string())?;
    if len > 1024 {
        return Err(format!("a token of {len} bytes"));
    }
    let mut t = vec![0u8; len as usize];
    s.read_exact(&mut t).map_err(|e| e.to_string())?;
    let ok = t == token.as_bytes() && their_world == world && (1..world).contains(&rank);
    let _ = s.write_all(&[ok as u8]);
    if !ok {
        return Err(format!(
            "rank {rank} of {their_world} with another token or world size (this job: {world} ranks)"
        ));
    }
    s.set_read_timeout(None).map_err(|e| e.to_string())?;
    Ok((rank, s))
}

/// Rank 0's reader of one peer: every frame into the inbox, then the error that ended it.
fn spawn_reader(rank: usize, s: TcpStream, tx: &Sender<(usize, std::io::Result<Frame>)>) {
    let tx = tx.clone();
    std::thread::spawn(move || {
        let mut r = BufReader::new(s);
        loop {
            let f = Frame::read(&mut r);
            let end = f.is_err();
            if tx.send((rank, f)).is_err() || end {
                return;
            }
        }
    });
}

impl Drop for TcpComm {
    fn drop(&mut self) {
        match &self.side {
            Side::Lead { peers, .. } => peers.iter().for_each(|p| {
                let _ = p
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .shutdown(Shutdown::Both);
            }),
            Side::Peer { write, .. } => {
                let _ = write
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .shutdown(Shutdown::Both);
            }
        }
    }
}

impl Collective for TcpComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn allreduce_sum(&self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        let bytes: Vec<u8> = buf.iter().flat_map(|v| v.to_le_bytes()).collect();
        let all = self.exchange(format!("allreduce_sum[{} f32]", buf.len()), bytes)?;
        super::sum_in_rank_order(buf, &all);
        Ok(())
    }

    fn allgather_bytes(&self, local: &[u8]) -> Result<Vec<Vec<u8>>, CollectiveError> {
        self.exchange("allgather".into(), local.to_vec())
    }

    fn broadcast_bytes(&self, data: &mut Vec<u8>, root: usize) -> Result<(), CollectiveError> {
        let mine = if self.rank == root {
            std::mem::take(data)
        } else {
            Vec::new()
        };
        let mut all = self.exchange(format!("broadcast(root {root})"), mine)?;
        *data = std::mem::take(&mut all[root]);
        Ok(())
    }

    fn barrier(&self) -> Result<(), CollectiveError> {
        self.exchange("barrier".into(), Vec::new()).map(|_| ())
    }

    fn abort(&self, reason: &str) {
        self.set_failed(self.rank, reason.to_string());
        let f = Frame::Abort {
            failed: self.rank,
            reason: reason.to_string(),
        };
        match &self.side {
            Side::Lead { .. } => self.tell_all(&f),
            Side::Peer { write, .. } => send(write, &f),
        }
    }
}

/// Shared so that the collective tests run over TCP too.
#[cfg(test)]
pub(crate) fn loopback_group(world: usize, timeout: Duration) -> Vec<TcpComm> {
    let listener = listen("127.0.0.1").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::scope(|s| {
        let peers: Vec<_> = (1..world)
            .map(|r| s.spawn(move || TcpComm::join(r, world, addr, "t0ken", timeout).unwrap()))
            .collect();
        let mut all = vec![TcpComm::lead(listener, world, "t0ken", timeout).unwrap()];
        all.extend(peers.into_iter().map(|h| h.join().unwrap()));
        all
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_with_another_token_is_refused_and_named_missing() {
        let listener = listen("127.0.0.1").unwrap();
        let addr = listener.local_addr().unwrap();
        let t = Duration::from_millis(800);
        let (lead, intruder) = std::thread::scope(|s| {
            let i = s.spawn(move || TcpComm::join(1, 2, addr, "guess", t));
            (TcpComm::lead(listener, 2, "secret", t), i.join().unwrap())
        });
        let e = intruder.err().expect("refused").to_string();
        assert!(e.contains("refused this rank"), "{e}");
        let e = lead.err().expect("nobody joined").to_string();
        assert!(e.contains("rank(s) 1 did not arrive"), "{e}");
    }

    #[test]
    fn frames_round_trip_and_garbage_is_refused() {
        let f = Frame::All {
            seq: 7,
            parts: vec![vec![1, 2], vec![]],
        };
        let b = f.encode();
        match Frame::read(&mut &b[..]).unwrap() {
            Frame::All { seq: 7, parts } => assert_eq!(parts, vec![vec![1, 2], vec![]]),
            f => panic!("{f:?}"),
        }
        let mut bad = b.clone();
        bad[8] = 9;
        assert!(Frame::read(&mut &bad[..]).is_err());
        let huge = u64::MAX.to_le_bytes();
        assert!(Frame::read(&mut &huge[..]).is_err());
    }
}
