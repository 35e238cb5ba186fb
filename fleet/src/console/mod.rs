//! The fleet console (`trainer console`): one web page and a JSON API over what the broker
//! holds: devices (status, presence, quality), rollouts (phases, devices per state, gates) and
//! an event feed, pushed live to the page by server-sent events.
//!
//! - [`view`]: [`FleetView`], the sans-IO state fed the broker's messages and read as JSON rows.
//! - `follow`: the MQTT side, a thread that subscribes and feeds the view (reconnecting).
//! - `server`: the HTTP side (axum on tokio): the page (embedded assets), `/api/...`,
//!   `/api/stream` (server-sent events), `/metrics` (Prometheus text), the token check and, with
//!   actions allowed, a rollout's abort as a signed command ([`crate::rollout::command`]).
//!
//! Safe by default: it listens on loopback; any other address needs a token, checked on every
//! request; it is read-only unless started with a signing key for actions.

mod follow;
mod metrics;
mod server;
#[cfg(test)]
mod tests;
pub mod view;

use std::net::SocketAddr;

use ed25519_dalek::SigningKey;
use kestrel_shared::mqtt::BrokerConfig;

pub use view::{DeviceFilter, DeviceRow, EventRow, FleetView, RolloutRow};

/// How the console runs.
pub struct Options {
    pub broker: BrokerConfig,
    pub listen: SocketAddr,
    /// Required on every request when set (header `Authorization: Bearer T`, cookie or `?token=`).
    pub token: Option<String>,
    /// Actions (abort a rollout) are allowed, signed with this key.
    pub actions: Option<SigningKey>,
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
    #[error("listening on {addr}: {reason}")]
    Listen { addr: SocketAddr, reason: String },
    #[error("{0}")]
    Runtime(String),
}

/// Refuses a listening address other than loopback without a token, and a short token.
pub fn check_listen(listen: SocketAddr, token: Option<&str>) -> Result<(), ConsoleError> {
    match token {
        Some(t) if t.len() < 16 => Err(ConsoleError::WeakToken),
        None if !listen.ip().is_loopback() => Err(ConsoleError::OpenWithoutToken(listen)),
        _ => Ok(()),
    }
}

/// Runs the console until the process ends: follows the broker and serves HTTP on
/// `opts.listen`; `ready` gets the bound address (port 0 picks one).
pub fn serve(opts: Options, ready: impl FnOnce(SocketAddr)) -> Result<(), ConsoleError> {
    check_listen(opts.listen, opts.token.as_deref())?;
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
        assert!(check_listen(lo, None).is_ok());
        assert!(check_listen(lo6, None).is_ok());
        assert!(matches!(
            check_listen(any, None),
            Err(ConsoleError::OpenWithoutToken(_))
        ));
        assert!(check_listen(any, Some("0123456789abcdef")).is_ok());
        assert!(matches!(
            check_listen(any, Some("short")),
            Err(ConsoleError::WeakToken)
        ));
    }
}
