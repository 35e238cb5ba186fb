//! A TCP relay that counts the bytes a broker sends its clients: what the broker delivered to
//! the devices connected through it, whichever broker it is (neither rumqttd nor Mosquitto counts
//! per client). Clients connect to [`Relay::port`]; every connection is relayed to the broker.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub struct Relay {
    pub port: u16,
    down: Arc<AtomicU64>,
}

impl Relay {
    /// Relays a free loopback port to the broker on `upstream` (loopback).
    pub fn start(upstream: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let down = Arc::new(AtomicU64::new(0));
        let counter = down.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(broker) = TcpStream::connect(("127.0.0.1", upstream)) else {
                    continue;
                };
                let (c2, b2) = (client.try_clone().unwrap(), broker.try_clone().unwrap());
                std::thread::spawn(move || copy(client, broker, None));
                let counter = counter.clone();
                std::thread::spawn(move || copy(b2, c2, Some(&counter)));
            }
        });
        Self { port, down }
    }

    /// The relay's address, for an agent's configuration.
    pub fn url(&self) -> String {
        format!("mqtt://127.0.0.1:{}", self.port)
    }

    /// Bytes the broker has sent to clients through the relay so far.
    pub fn delivered(&self) -> u64 {
        self.down.load(Ordering::SeqCst)
    }
}

/// Copies `from` to `to` until either side closes, counting into `count`.
fn copy(mut from: TcpStream, mut to: TcpStream, count: Option<&AtomicU64>) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
                if let Some(c) = count {
                    c.fetch_add(n as u64, Ordering::SeqCst);
                }
            }
        }
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}
