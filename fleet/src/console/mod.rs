//! The fleet console (`trainer console`): one web page and a JSON API over what the broker
//! holds: devices (status, presence, quality), rollouts (phases, devices per state, gates) and
//! an event feed, pushed live to the page by server-sent events.
//!
//! - [`view`]: [`FleetView`], the sans-IO state fed the broker's messages and read as JSON rows.
//! - `follow`: the MQTT side, a thread that subscribes and feeds the view (reconnecting).
//! - `server`: the HTTP side (axum on tokio): the page (embedded assets), `/api/...`,
//!   `/api/stream` (server-sent events), `/metrics` (Prometheus text), the request rules and,
//!   with actions allowed, a rollout's pause, resume or abort as a command signed with an
//!   operator key ([`crate::rollout::command`]).
//! - `guard`: those rules without IO: `Host` and `Origin`, security headers, sessions.
//! - `listen`: connections (TCP or TLS) under caps and timeouts.
//!
//! Safe by default: it listens on loopback and answers only requests addressed to it; any other
//! address needs a token and TLS (or `--insecure-http` behind a TLS proxy); it is read-only
//! unless started with an operator key for actions. docs/console.md gives each rule's reason.

mod follow;
mod guard;
mod listen;
mod metrics;
mod server;
#[cfg(test)]
mod tests;
pub mod view;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use ed25519_dalek::SigningKey;
use kestrel_shared::mqtt::BrokerConfig;

pub use metrics::PER_DEVICE_MAX as PER_DEVICE_METRICS_MAX;
pub use view::{DeviceFilter, DeviceRow, EventRow, FleetView, RolloutRow};

/// How the console runs.
pub struct Options {
    pub broker: BrokerConfig,
    pub listen: SocketAddr,
    /// Required on every request when set: `Authorization: Bearer T`, or the session cookie a
    /// browser gets for opening a page with `?token=T` once.
    pub token: Option<String>,
    /// Actions (pause, resume, abort a rollout) are allowed, signed with this operator key.
    pub actions: Option<SigningKey>,
    /// HTTPS with this certificate chain and key (PEM).
    pub tls: Option<TlsFiles>,
    /// Plain HTTP on a non-loopback address, for a TLS-terminating proxy in front.
    pub insecure_http: bool,
    /// The URL a proxy publishes the console under (its host is accepted in `Host`, its origin
    /// in `Origin`).
    pub public_url: Option<String>,
    pub limits: Limits,
    /// `/metrics` has per-device series while the fleet has at most this many devices.
    pub per_device_metrics_max: usize,
}

/// Certificate chain (leaf first) and private key, PEM files.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// What one client, and all of them, may hold of the console.
#[derive(Debug, Clone)]
pub struct Limits {
    /// A request's headers (and a TLS handshake) must arrive within this.
    pub header_timeout: Duration,
    /// A connection nothing crossed for this long is closed (a live stream sends a comment
    /// every 15 s).
    pub idle_timeout: Duration,
    pub max_connections: usize,
    pub max_connections_per_client: usize,
    /// Live streams (`/api/stream`), in all and per client address.
    pub max_streams: usize,
    pub max_streams_per_client: usize,
    /// A browser session ends this long after the token opened it.
    pub session_ttl: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(120),
            max_connections: 256,
            max_connections_per_client: 64,
            max_streams: 64,
            max_streams_per_client: 8,
            session_ttl: Duration::from_secs(12 * 3600),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    #[error(
        "--listen {0} is not a loopback address: give --token-file so that every request must \
         carry the token"
    )]
    OpenWithoutToken(SocketAddr),
    #[error("the token is empty: write at least 16 characters in the token file")]
    WeakToken,
    #[error(
        "--listen {0} is not a loopback address: give --tls-cert and --tls-key (the token and the \
         fleet would cross the network in clear), or --insecure-http behind a TLS-terminating proxy"
    )]
    OpenWithoutTls(SocketAddr),
    #[error("TLS: {0}")]
    Tls(String),
    #[error("{0}")]
    Config(String),
    #[error("listening on {addr}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Runtime(String),
}

/// Refuses a listening address other than loopback without a token or without TLS (unless
/// `insecure_http`), and a short token.
pub fn check_listen(
    listen: SocketAddr,
    token: Option<&str>,
    tls: bool,
    insecure_http: bool,
) -> Result<(), ConsoleError> {
    match token {
        Some(t) if t.len() < 16 => Err(ConsoleError::WeakToken),
        None if !listen.ip().is_loopback() => Err(ConsoleError::OpenWithoutToken(listen)),
        _ if !listen.ip().is_loopback() && !tls && !insecure_http => {
            Err(ConsoleError::OpenWithoutTls(listen))
        }
        _ => Ok(()),
    }
}

/// Runs the console until the process ends: follows the broker and serves HTTP on
/// `opts.listen`; `ready` gets its URL (port 0 picks a port).
pub fn serve(opts: Options, ready: impl FnOnce(&str)) -> Result<(), ConsoleError> {
    check_listen(
        opts.listen,
        opts.token.as_deref(),
        opts.tls.is_some(),
        opts.insecure_http,
    )?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| ConsoleError::Runtime(e.to_string()))?;
    rt.block_on(server::run(opts, ready))
}

#[cfg(test)]
mod listen_tests {
    use super::*;

    #[test]
    fn only_loopback_listens_without_a_token() {
        let lo: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        let lo6: SocketAddr = "[::1]:8080".parse().unwrap();
        let any: SocketAddr = "0.0.0.0:8080".parse().unwrap();
        let token = Some("0123456789abcdef");
        assert!(check_listen(lo, None, false, false).is_ok());
        assert!(check_listen(lo6, None, false, false).is_ok());
        assert!(matches!(
            check_listen(any, None, true, false),
            Err(ConsoleError::OpenWithoutToken(_))
        ));
        assert!(matches!(
            check_listen(any, token, false, false),
            Err(ConsoleError::OpenWithoutTls(_))
        ));
        assert!(check_listen(any, token, true, false).is_ok());
        assert!(check_listen(any, token, false, true).is_ok());
        assert!(matches!(
            check_listen(any, Some("short"), true, false),
            Err(ConsoleError::WeakToken)
        ));
    }
}
