//! The console's connections: TCP, or TLS (rustls with ring) when a certificate is given,
//! accepted under a total and a per-client cap, each served by hyper with a header-read timeout
//! (the TLS handshake has the same one) and closed when nothing crossed it for the idle timeout.
//! Every refusal is logged, at most once a second per kind with a count of those in between.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::{self, pki_types};
use tower_service::Service;

use super::{ConsoleError, Limits};

/// The client a request came from (a request extension, for the stream cap).
#[derive(Debug, Clone, Copy)]
pub struct Peer(pub SocketAddr);

/// A TLS acceptor from PEM files: the certificate chain (leaf first) and its private key.
pub fn tls_acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor, ConsoleError> {
    use pki_types::pem::PemObject;
    let bad = |p: &Path, e: String| ConsoleError::Tls(format!("{}: {e}", p.display()));
    let certs = pki_types::CertificateDer::pem_file_iter(cert)
        .map_err(|e| bad(cert, e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(cert, e.to_string()))?;
    if certs.is_empty() {
        return Err(bad(cert, "no certificate in the file".into()));
    }
    let key_der =
        pki_types::PrivateKeyDer::from_pem_file(key).map_err(|e| bad(key, e.to_string()))?;
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| ConsoleError::Tls(e.to_string()))?
    .with_no_client_auth()
    .with_single_cert(certs, key_der)
    .map_err(|e| bad(cert, format!("certificate and key: {e}")))?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// What is open (connections, live streams), in all and per client address.
#[derive(Default)]
pub struct Counts {
    total: usize,
    per_client: HashMap<IpAddr, usize>,
}

/// One counted connection or stream, given back when dropped.
pub struct Slot {
    counts: Arc<Mutex<Counts>>,
    ip: IpAddr,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        c.total -= 1;
        if let Some(n) = c.per_client.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                c.per_client.remove(&self.ip);
            }
        }
    }
}

/// Which cap refused a slot.
#[derive(Debug, PartialEq, Eq)]
pub enum Over {
    Total,
    PerClient,
}

/// A slot for `ip` under `max` in all and `per_client` from one address.
pub fn take(
    counts: &Arc<Mutex<Counts>>,
    ip: IpAddr,
    max: usize,
    per_client: usize,
) -> Result<Slot, Over> {
    let mut c = counts.lock().unwrap_or_else(|e| e.into_inner());
    if c.total >= max {
        return Err(Over::Total);
    }
    let mine = c.per_client.entry(ip).or_default();
    if *mine >= per_client {
        return Err(Over::PerClient);
    }
    *mine += 1;
    c.total += 1;
    Ok(Slot {
        counts: counts.clone(),
        ip,
    })
}

/// Logs a kind of refusal at most once a second, with how many there were since the last line.
pub struct RefusalLog {
    last: Mutex<HashMap<&'static str, (Option<Instant>, u64)>>,
}

impl RefusalLog {
    pub fn new() -> Self {
        Self {
            last: Mutex::new(HashMap::new()),
        }
    }

    pub fn note(&self, kind: &'static str, detail: impl FnOnce() -> String) {
        let mut m = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let e = m.entry(kind).or_insert((None, 0));
        e.1 += 1;
        if e.0
            .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1))
        {
            tracing::warn!(
                "console: refused {}: {kind} ({} of this kind since the last such line)",
                detail(),
                e.1
            );
            *e = (Some(now), 0);
        }
    }
}

/// Accepts connections on `listener` until the process ends, serving `router` on each.
pub async fn serve(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    router: Router,
    limits: Limits,
    refusals: Arc<RefusalLog>,
) {
    let counts = Arc::new(Mutex::new(Counts::default()));
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                // Out of file descriptors, for one: wait for connections to end.
                refusals.note("accept failed", || e.to_string());
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let taken = take(
            &counts,
            peer.ip(),
            limits.max_connections,
            limits.max_connections_per_client,
        );
        let slot = match taken {
            Ok(s) => s,
            Err(over) => {
                let why = match over {
                    Over::Total => "connection cap (--max-connections) reached",
                    Over::PerClient => {
                        "per-client connection cap (--max-connections-per-client) reached"
                    }
                };
                refusals.note(why, || format!("connection from {peer}"));
                drop(tcp);
                continue;
            }
        };
        let (router, tls, limits, refusals) = (
            router.clone(),
            tls.clone(),
            limits.clone(),
            refusals.clone(),
        );
        tokio::spawn(async move {
            let _slot = slot;
            let _ = tcp.set_nodelay(true);
            match tls {
                None => connection(tcp, peer, router, &limits).await,
                Some(acceptor) => {
                    match tokio::time::timeout(limits.header_timeout, acceptor.accept(tcp)).await {
                        Ok(Ok(stream)) => connection(stream, peer, router, &limits).await,
                        Ok(Err(e)) => {
                            refusals.note("TLS handshake failed", || format!("{peer} ({e})"))
                        }
                        Err(_) => refusals.note("TLS handshake timed out", || peer.to_string()),
                    }
                }
            }
        });
    }
}

/// Serves one connection until it ends, or until nothing crossed it for the idle timeout.
async fn connection<S>(io: S, peer: SocketAddr, router: Router, limits: &Limits)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let start = Instant::now();
    let last = Arc::new(AtomicU64::new(0));
    let io = Watched {
        inner: io,
        start,
        last: last.clone(),
    };
    let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
        req.extensions_mut().insert(Peer(peer));
        let mut r = router.clone();
        async move { r.call(req).await }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .serve_connection(TokioIo::new(io), service);
    tokio::pin!(conn);
    let tick = (limits.idle_timeout / 4).max(Duration::from_millis(100));
    loop {
        tokio::select! {
            _ = conn.as_mut() => return,
            () = tokio::time::sleep(tick) => {
                let idle = start.elapsed().saturating_sub(Duration::from_millis(last.load(Ordering::Relaxed)));
                if idle >= limits.idle_timeout {
                    return;
                }
            }
        }
    }
}

/// A connection that notes when bytes last crossed it.
struct Watched<S> {
    inner: S,
    start: Instant,
    last: Arc<AtomicU64>,
}

impl<S> Watched<S> {
    fn touch(&self) {
        self.last
            .store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.touch();
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = r
            && n > 0
        {
            self.touch();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_are_capped_in_all_and_per_client() {
        let counts = Arc::new(Mutex::new(Counts::default()));
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let a1 = take(&counts, a, 3, 2).unwrap();
        let _a2 = take(&counts, a, 3, 2).unwrap();
        assert_eq!(take(&counts, a, 3, 2).err(), Some(Over::PerClient));
        let _b1 = take(&counts, b, 3, 2).unwrap();
        assert_eq!(take(&counts, b, 3, 2).err(), Some(Over::Total));
        drop(a1);
        let _b2 = take(&counts, b, 3, 2).unwrap();
        assert_eq!(counts.lock().unwrap().total, 3);
    }
}
