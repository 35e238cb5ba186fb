//! The embedded broker survives its clients (`trainer broker`): a minute's worth of
//! CONNECT/DISCONNECT loops, half-open connections and oversized packets leaves it answering with
//! every retained message, byte for byte; and the retained messages come back after the broker
//! is killed (SIGKILL) or stopped and started again on the same `--persist` directory.
//!
//! The clients here speak MQTT 3.1.1 as raw bytes, to send what no client library would. Every
//! wait reads packets with a deadline (or polls for the broker's port or files with one).

use std::collections::{BTreeMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kestrel_shared::mqtt::MAX_PAYLOAD_BYTES;
use kestrel_tests::fleet::{Proc, free_port};
use kestrel_tests::{Scratch, bin, s, stderr};

type Retained = BTreeMap<String, Vec<u8>>;

// ---- MQTT 3.1.1 as bytes ----

fn remaining_length(mut n: usize) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let mut b = (n % 128) as u8;
        n /= 128;
        if n > 0 {
            b |= 0x80;
        }
        out.push(b);
        if n == 0 {
            return out;
        }
    }
}

fn packet(first: u8, body: &[u8]) -> Vec<u8> {
    let mut p = vec![first];
    p.extend(remaining_length(body.len()));
    p.extend_from_slice(body);
    p
}

fn mqtt_str(b: &[u8]) -> Vec<u8> {
    let mut v = (b.len() as u16).to_be_bytes().to_vec();
    v.extend_from_slice(b);
    v
}

fn connect_packet(client_id: &str) -> Vec<u8> {
    let mut b = mqtt_str(b"MQTT");
    b.extend([4, 0x02]); // protocol level 4, clean session
    b.extend(30u16.to_be_bytes()); // keep-alive
    b.extend(mqtt_str(client_id.as_bytes()));
    packet(0x10, &b)
}

/// A PUBLISH: QoS 1 with a packet id, QoS 0 without.
fn publish_packet(topic: &str, payload: &[u8], retain: bool, pkid: Option<u16>) -> Vec<u8> {
    let mut b = mqtt_str(topic.as_bytes());
    if let Some(id) = pkid {
        b.extend(id.to_be_bytes());
    }
    b.extend_from_slice(payload);
    let first = 0x30 | if pkid.is_some() { 0x02 } else { 0 } | u8::from(retain);
    packet(first, &b)
}

fn subscribe_packet(pkid: u16, filter: &str) -> Vec<u8> {
    let mut b = pkid.to_be_bytes().to_vec();
    b.extend(mqtt_str(filter.as_bytes()));
    b.push(0); // QoS 0: rumqttd sends a QoS 0 subscription every retained message
    packet(0x82, &b)
}

const DISCONNECT: [u8; 2] = [0xe0, 0x00];

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// A client on a raw socket.
struct Raw(TcpStream);

impl Raw {
    fn open(port: u16) -> io::Result<Raw> {
        let s = TcpStream::connect_timeout(&addr(port), Duration::from_secs(2))?;
        s.set_nodelay(true)?;
        s.set_write_timeout(Some(Duration::from_secs(10)))?;
        Ok(Raw(s))
    }

    /// Opens and connects; a CONNACK accepting the connection must come by `deadline`.
    fn connect(port: u16, client_id: &str, deadline: Instant) -> io::Result<Raw> {
        let mut c = Raw::open(port)?;
        c.send(&connect_packet(client_id))?;
        let (first, body) = c.read(deadline)?;
        if first != 0x20 || body.get(1) != Some(&0) {
            return Err(io::Error::other(format!("no CONNACK: {first:#x} {body:?}")));
        }
        Ok(c)
    }

    fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.0.write_all(bytes)
    }

    /// The next packet (first byte, body), by `deadline`.
    fn read(&mut self, deadline: Instant) -> io::Result<(u8, Vec<u8>)> {
        let mut byte = [0u8; 1];
        self.read_exact(&mut byte, deadline)?;
        let first = byte[0];
        let mut len = 0usize;
        for shift in [0, 7, 14, 21] {
            self.read_exact(&mut byte, deadline)?;
            len |= ((byte[0] & 0x7f) as usize) << shift;
            if byte[0] & 0x80 == 0 {
                let mut body = vec![0; len];
                self.read_exact(&mut body, deadline)?;
                return Ok((first, body));
            }
        }
        Err(io::Error::other("malformed remaining length"))
    }

    fn read_exact(&mut self, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        self.0.set_read_timeout(Some(left))?;
        self.0.read_exact(buf)
    }
}

/// A PUBLISH's (topic, payload, retain).
fn parse_publish(first: u8, body: &[u8]) -> Option<(String, Vec<u8>, bool)> {
    let n = u16::from_be_bytes(body.get(..2)?.try_into().ok()?) as usize;
    let topic = String::from_utf8(body.get(2..2 + n)?.to_vec()).ok()?;
    let start = 2 + n + if (first >> 1) & 0x03 > 0 { 2 } else { 0 };
    Some((topic, body.get(start..)?.to_vec(), first & 1 == 1))
}

static NEXT: AtomicU64 = AtomicU64::new(0);

fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Publishes `(topic, payload)` pairs retained at QoS 1, each acknowledged by the broker (a
/// PUBACK comes once the router has stored the message).
fn put(port: u16, messages: &[(&str, &[u8])]) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut c = Raw::connect(port, &unique("bs-put"), deadline).unwrap();
    for (i, (topic, payload)) in messages.iter().enumerate() {
        let pkid = (i % 60_000 + 1) as u16;
        c.send(&publish_packet(topic, payload, true, Some(pkid)))
            .unwrap();
        loop {
            let (first, body) = c.read(deadline).unwrap();
            if first == 0x40 && body[..] == pkid.to_be_bytes() {
                break;
            }
        }
    }
    // The socket closes without a DISCONNECT, as Kestrel's clients do.
}

/// The retained messages a new subscriber to `root/#` is sent: read until a marker the reader
/// publishes after subscribing comes back (rumqttd sends a new subscription its retained
/// messages before anything published after it). Every one must have RETAIN set.
fn retained_once(port: u16, root: &str, deadline: Instant) -> io::Result<Retained> {
    let mut c = Raw::connect(port, &unique("bs-read"), deadline)?;
    c.send(&subscribe_packet(1, &format!("{root}/#")))?;
    let marker = format!("{root}/{}", unique("marker"));
    c.send(&publish_packet(&marker, b"end", false, None))?;
    let mut got = Retained::new();
    loop {
        let (first, body) = c.read(deadline)?;
        if first >> 4 != 3 {
            continue;
        }
        let (topic, payload, retain) =
            parse_publish(first, &body).ok_or_else(|| io::Error::other("bad PUBLISH"))?;
        if topic == marker {
            return Ok(got);
        }
        if retain {
            got.insert(topic, payload);
        }
    }
}

/// [`retained_once`], tried again while the broker is being restarted.
fn retained(port: u16, root: &str, proc: &mut Proc) -> Retained {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match retained_once(port, root, deadline) {
            Ok(r) => return r,
            Err(e) => {
                assert!(proc.is_running(), "the broker exited: {}", proc.output());
                assert!(
                    Instant::now() < deadline,
                    "no retained messages from the broker in 60 s ({e}): {}",
                    tail(&proc.output())
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Waits until the broker accepts an MQTT connection.
fn wait_answers(port: u16, proc: &mut Proc) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Err(e) = Raw::connect(port, &unique("bs-probe"), deadline) {
        assert!(proc.is_running(), "the broker exited: {}", proc.output());
        assert!(
            Instant::now() < deadline,
            "the broker does not answer ({e}): {}",
            proc.output()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// `want` and `got` are equal; otherwise a message naming the topics that differ.
fn assert_same(got: &Retained, want: &Retained, log: &str) {
    if got == want {
        return;
    }
    let mut diff = Vec::new();
    for (t, w) in want {
        match got.get(t) {
            None => diff.push(format!("{t}: missing ({} bytes expected)", w.len())),
            Some(g) if g != w => diff.push(format!(
                "{t}: {} bytes, {} expected, first difference at byte {:?}",
                g.len(),
                w.len(),
                g.iter().zip(w).position(|(a, b)| a != b)
            )),
            Some(_) => {}
        }
    }
    for t in got.keys().filter(|t| !want.contains_key(*t)) {
        diff.push(format!("{t}: not expected"));
    }
    panic!(
        "retained messages differ ({} of {} expected):\n{}\nbroker log (end):\n{}",
        got.len(),
        want.len(),
        diff.join("\n"),
        tail(log)
    );
}

/// Payload bytes that differ from topic to topic (zeros and 0xff among them).
fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            match i % 97 {
                0 => 0,
                1 => 0xff,
                _ => x as u8,
            }
        })
        .collect()
}

/// Publishes the retained messages of `root` the tests read back: `small` small ones (more than
/// the 199 that fill a subscriber's outgoing buffer in rumqttd), two large ones, a non-ASCII
/// topic, one replaced and one deleted (empty retained payload), and one not retained. Returns
/// what a subscriber must get.
fn publish_set(port: u16, root: &str, small: usize) -> Retained {
    let mut want = Retained::new();
    let mut msgs: Vec<(String, Vec<u8>)> = (0..small)
        .map(|i| (format!("{root}/s/{i}"), bytes(i as u64, 1 + i * 7 % 64)))
        .collect();
    msgs.push((format!("{root}/big/a"), bytes(1000, 200_000)));
    msgs.push((format!("{root}/big/b"), bytes(1001, (1 << 20) + 3)));
    msgs.push((format!("{root}/ü/ñ"), "grüße".as_bytes().to_vec()));
    msgs.push((format!("{root}/replaced"), b"old".to_vec()));
    msgs.push((format!("{root}/deleted"), b"soon gone".to_vec()));
    for (t, p) in &msgs {
        want.insert(t.clone(), p.clone());
    }
    let refs: Vec<(&str, &[u8])> = msgs
        .iter()
        .map(|(t, p)| (t.as_str(), p.as_slice()))
        .collect();
    put(port, &refs);
    let replaced = format!("{root}/replaced");
    let deleted = format!("{root}/deleted");
    put(port, &[(&replaced, b"new"), (&deleted, b"")]);
    want.insert(replaced, b"new".to_vec());
    want.remove(&deleted);
    // Not retained: no subscriber that comes later gets it.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut c = Raw::connect(port, &unique("bs-put"), deadline).unwrap();
    c.send(&publish_packet(
        &format!("{root}/live"),
        b"now",
        false,
        None,
    ))
    .unwrap();
    want
}

// ---- what clients do to the broker ----

/// CONNECT/DISCONNECT loops: a DISCONNECT right after CONNECT; after a SUBSCRIBE to more than
/// 199 retained messages, at once or on its SUBACK (rumqttd's router then forgets the connection
/// while its network task still writes them, and panics on the task's next word); after a
/// PUBLISH; a socket closed without one; client ids shared between loops (rumqttd drops the older
/// connection), and client ids rumqttd refuses (`a/b`: two of them poison a lock every later
/// connection takes).
fn churn(port: u16, root: &str, until: Instant, max: usize, n: usize) -> usize {
    let mut done = 0;
    for i in 0..max {
        if Instant::now() >= until {
            break;
        }
        let Ok(mut c) = Raw::open(port) else {
            // Refused while the broker is started again.
            std::thread::sleep(Duration::from_millis(20));
            continue;
        };
        let id = format!("bs-churn-{n}-{}", i % 7);
        let filter = format!("{root}/s/#");
        let soon = Instant::now() + Duration::from_secs(2);
        let _ = (|| -> io::Result<()> {
            c.send(&connect_packet(&id))?;
            match i % 8 {
                0 => c.send(&DISCONNECT)?,
                6 | 7 if i % 200 == 6 => {
                    // Connections with a client id rumqttd refuses, one after the other (each
                    // closed by the broker).
                    for _ in 0..3 {
                        let mut d = Raw::open(port)?;
                        d.send(&connect_packet(&format!("{root}/refused")))?;
                        let _ = d.read(soon);
                    }
                }
                6 | 7 => {
                    // DISCONNECT on the SUBACK: the retained messages are on their way.
                    c.read(soon)?;
                    c.send(&subscribe_packet(1, &filter))?;
                    while c.read(soon)?.0 != 0x90 {}
                    c.send(&DISCONNECT)?;
                }
                1 => {
                    c.read(soon)?;
                    c.send(&subscribe_packet(1, &filter))?;
                    c.send(&DISCONNECT)?;
                }
                2 => {
                    c.send(&subscribe_packet(1, &filter))?;
                    for _ in 0..3 {
                        c.read(soon)?;
                    }
                    c.send(&DISCONNECT)?;
                }
                3 => {
                    c.send(&publish_packet("bs-noise/x", b"noise", false, None))?;
                    c.send(&DISCONNECT)?;
                }
                4 => {
                    // Subscribe and vanish, no DISCONNECT.
                    c.send(&subscribe_packet(1, &filter))?;
                }
                _ => {
                    c.send(&subscribe_packet(1, &filter))?;
                    c.send(&DISCONNECT)?;
                    c.send(&connect_packet(&id))?; // after DISCONNECT: a protocol error
                }
            }
            Ok(())
        })();
        done += 1;
    }
    done
}

/// Half-open connections: nothing sent, a CONNECT cut in the middle, or only its first byte;
/// up to 64 held open at a time, the oldest closed as new ones come.
fn half_open(port: u16, until: Instant, max: usize) -> usize {
    let mut held = VecDeque::new();
    let connect = connect_packet("bs-half-open");
    let mut done = 0;
    for i in 0..max {
        if Instant::now() >= until {
            break;
        }
        let Ok(mut c) = Raw::open(port) else {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        };
        let _ = match i % 3 {
            0 => Ok(()),
            1 => c.send(&connect[..connect.len() / 2]),
            _ => c.send(&connect[..1]),
        };
        held.push_back(c);
        if held.len() > 64 {
            held.pop_front();
        }
        done += 1;
        // Paced: a connection every 10 ms is plenty to hold the listener's backlog busy.
        std::thread::sleep(Duration::from_millis(10));
    }
    done
}

/// Oversized and malformed packets: a PUBLISH announcing more than the payload limit (half sent,
/// or all of it, retained), a CONNECT announcing 256 MiB, a five-byte remaining length.
fn oversized(port: u16, root: &str, until: Instant, max: usize) -> usize {
    let limit = MAX_PAYLOAD_BYTES;
    let mut done = 0;
    for i in 0..max {
        if Instant::now() >= until {
            break;
        }
        let Ok(mut c) = Raw::open(port) else {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        };
        let soon = Instant::now() + Duration::from_secs(2);
        let _ = (|| -> io::Result<()> {
            match i % 8 {
                0 | 4 => {
                    c.send(&connect_packet(&unique("bs-big")))?;
                    c.read(soon)?;
                    let mut p = vec![0x31];
                    p.extend(remaining_length(limit + (1 << 20)));
                    p.extend(mqtt_str(format!("{root}/oversized").as_bytes()));
                    c.send(&p)?;
                    c.send(&vec![7u8; 64 << 10])?;
                }
                1 | 5 => {
                    let mut p = vec![0x10, 0xff, 0xff, 0xff, 0x7f];
                    p.extend(mqtt_str(b"MQTT"));
                    c.send(&p)?;
                }
                2 | 6 => {
                    c.send(&connect_packet(&unique("bs-big")))?;
                    c.read(soon)?;
                    c.send(&[0x30, 0xff, 0xff, 0xff, 0xff, 0x01, 0x00])?;
                }
                3 => {
                    // A whole retained PUBLISH one byte over the limit: never retained.
                    c.send(&connect_packet(&unique("bs-big")))?;
                    c.read(soon)?;
                    let p = publish_packet(
                        &format!("{root}/oversized"),
                        &vec![1u8; limit + 1],
                        true,
                        None,
                    );
                    c.send(&p)?;
                }
                _ => {
                    // Garbage where a CONNECT belongs.
                    c.send(&bytes(i as u64, 512))?;
                }
            }
            Ok(())
        })();
        done += 1;
    }
    done
}

/// `trainer broker` as a user types it (`args` after `broker`), with `$KESTREL_HOME` in `home`.
fn start_broker(home: &Path, args: &[&str], log: &Path) -> Proc {
    let mut cmd = Command::new(bin("trainer"));
    cmd.arg("broker").args(args).env("KESTREL_HOME", home);
    Proc::spawn(&mut cmd, log)
}

#[test]
fn the_embedded_broker_survives_its_clients_with_its_retained_messages() {
    let w = Scratch::new();
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    // No --persist: the default directory, under $KESTREL_HOME (the test's own).
    let mut b = start_broker(w.tmp.path(), &["--listen", &listen], &w.join("broker.log"));
    wait_answers(port, &mut b);
    let want = publish_set(port, "bs", 300);
    assert_same(&retained(port, "bs", &mut b), &want, &b.output());
    // Written to disk (by default under $KESTREL_HOME/broker) before the abuse starts: a message
    // retained a moment before the router dies may be missing after the restart (docs/fleet.md).
    let store = w.tmp.path().join(format!("broker/port-{port}"));
    wait_on_disk(&store, &want, &mut b);

    // 30 s of abuse from four clients at once (bounded loop counts too).
    let until = Instant::now() + Duration::from_secs(30);
    let counts = std::thread::scope(|sc| {
        let c1 = sc.spawn(|| churn(port, "bs", until, 200_000, 1));
        let c2 = sc.spawn(|| churn(port, "bs", until, 200_000, 2));
        let h = sc.spawn(|| half_open(port, until, 5_000));
        let o = sc.spawn(|| oversized(port, "bs", until, 5_000));
        [c1, c2, h, o].map(|t| t.join().unwrap())
    });
    eprintln!(
        "connect/disconnect loops {} + {}, half-open connections {}, oversized or malformed \
         packets {}",
        counts[0], counts[1], counts[2], counts[3]
    );
    assert!(
        counts[0] + counts[1] > 100,
        "too few loops to mean anything: {counts:?}"
    );

    // Still running (the process `trainer broker` became), answering, and every retained message
    // is there, byte for byte; the oversized one was never retained.
    assert!(b.is_running(), "the broker exited: {}", tail(&b.output()));
    let got = retained(port, "bs", &mut b);
    let log = b.output();
    assert_same(&got, &want, &log);
    let restarts = log.matches("starting it again").count();
    eprintln!("the broker was started again {restarts} times");
    assert_same(&on_disk(&store), &want, &log);
    assert!(!log.contains("giving up"), "{}", tail(&log));
}

/// The message files under `store` (`retained/*.msg`: a header line, the topic's length (u32
/// little-endian), the topic, the payload's length (u64), the payload).
fn on_disk(store: &Path) -> Retained {
    let mut out = Retained::new();
    let Ok(dir) = std::fs::read_dir(store.join("retained")) else {
        return out;
    };
    for e in dir.flatten() {
        let p = e.path();
        if p.extension().is_none_or(|x| x != "msg") {
            continue;
        }
        let Ok(b) = std::fs::read(&p) else { continue };
        let Some(at) = b.iter().position(|&c| c == b'\n') else {
            continue;
        };
        let rest = &b[at + 1..];
        let n = u32::from_le_bytes(rest[..4].try_into().unwrap()) as usize;
        let topic = String::from_utf8(rest[4..4 + n].to_vec()).unwrap();
        let m = u64::from_le_bytes(rest[4 + n..12 + n].try_into().unwrap()) as usize;
        let payload = rest[12 + n..].to_vec();
        assert_eq!(payload.len(), m, "{}", p.display());
        out.insert(topic, payload);
    }
    out
}

/// Waits (60 s at most) until the files under `store` hold `want`.
fn wait_on_disk(store: &Path, want: &Retained, b: &mut Proc) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let got = on_disk(store);
        if got == *want {
            return;
        }
        if Instant::now() >= deadline {
            assert_same(&got, want, &b.output());
        }
        assert!(b.is_running(), "the broker exited: {}", b.output());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// SIGKILL to `trainer broker`'s process and to its child (which runs rumqttd) at once: a
/// power cut, nothing written on the way out.
fn kill_everything(b: Proc) {
    let pid = b.child.id();
    let mut pids = vec![pid.to_string()];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid ...
        let Some((_, after)) = stat.rsplit_once(") ") else {
            continue;
        };
        if after.split(' ').nth(1) == Some(pid.to_string().as_str()) {
            pids.push(e.file_name().to_string_lossy().into_owned());
        }
    }
    assert!(pids.len() > 1, "no child process under {pid}");
    let st = Command::new("kill")
        .arg("-KILL")
        .args(&pids)
        .status()
        .unwrap();
    assert!(st.success());
    b.kill(); // reaps it
}

#[test]
fn retained_messages_come_back_after_the_broker_is_killed_or_stopped() {
    let w = Scratch::new();
    let store = w.join("store");
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let persist = s(&store);
    let args = ["--listen", listen.as_str(), "--persist", persist.as_str()];
    let home = w.join("home");
    let mut b = start_broker(&home, &args, &w.join("broker-1.log"));
    wait_answers(port, &mut b);
    let mut want = publish_set(port, "bk", 50);
    assert_same(&retained(port, "bk", &mut b), &want, &b.output());
    wait_on_disk(&store, &want, &mut b);

    // Killed, then started again on the same directory: everything is back.
    kill_everything(b);
    let mut b = start_broker(&home, &args, &w.join("broker-2.log"));
    wait_answers(port, &mut b);
    assert_same(&retained(port, "bk", &mut b), &want, &b.output());
    assert!(
        b.output().contains("restored 54 retained messages"),
        "{}",
        b.output()
    );

    // Changes, then a stop (SIGTERM) with no wait for the files: the broker writes them on its
    // way out, and the next one has them.
    put(
        port,
        &[
            ("bk/replaced", b"newer"),
            ("bk/s/0", b""),
            ("bk/added", b"+"),
        ],
    );
    want.insert("bk/replaced".into(), b"newer".to_vec());
    want.remove("bk/s/0");
    want.insert("bk/added".into(), b"+".to_vec());
    assert_same(&retained(port, "bk", &mut b), &want, &b.output());
    let log2 = b.log.clone();
    // A clean exit once the child is gone too: the port is free.
    assert!(
        b.terminate().success(),
        "{}",
        std::fs::read_to_string(&log2).unwrap()
    );
    let mut b = start_broker(&home, &args, &w.join("broker-3.log"));
    wait_answers(port, &mut b);
    let log = std::fs::read_to_string(&log2).unwrap() + &b.output();
    assert_same(&retained(port, "bk", &mut b), &want, &log);

    // A second broker on the same directory is refused, naming it.
    let other = format!("127.0.0.1:{}", free_port());
    let o = Command::new(bin("trainer"))
        .args(["broker", "--listen", &other, "--persist", &persist])
        .output()
        .unwrap();
    let e = stderr(&o);
    assert!(!o.status.success(), "{e}");
    assert!(e.contains(&persist) && e.contains("in use"), "{e}");

    // --no-persist on the same port: nothing restored, and the directory left as it was.
    assert!(b.terminate().success());
    let mut b = start_broker(
        &home,
        &["--listen", &listen, "--no-persist"],
        &w.join("broker-4.log"),
    );
    wait_answers(port, &mut b);
    assert_same(&retained(port, "bk", &mut b), &Retained::new(), &b.output());
    assert_same(&on_disk(&store), &want, &b.output());
    assert!(
        !home.join("broker").exists(),
        "nothing written under $KESTREL_HOME"
    );
}
