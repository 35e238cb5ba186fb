//! Kestrel fleet operations: the cloud side of the MQTT protocol ([`kestrel_shared::protocol`]).
//!
//! - [`conn`]: a blocking MQTT client ([`Conn`]) whose publishes wait for the broker's
//!   acknowledgement.
//! - [`bundle`]: an exported artifact checked, signed and cut into chunks ([`Bundle`]).
//! - [`publish`]: publishing an artifact and a signed desired state (`trainer publish`).
//! - [`prune`]: clearing retained artifact versions nothing needs (`trainer prune`, `unpublish`).
//! - [`keys`]: the root-signed list of publishing keys (`trainer keys`).
//! - [`status`]: the fleet's retained statuses, or waiting for a device (`trainer status`).
//! - [`collect`]: captures from devices over a persistent session (`trainer collect`).
//! - [`infer`]: inference requests to a device and their replies (`trainer infer`).
//! - [`rollout`]: staged rollouts: a sans-IO controller and its MQTT driver (`trainer rollout`).
//! - [`console`]: the fleet console, a web page and JSON API over the broker (`trainer console`).
//!
//! The embedded broker is the separate `kestrel-broker` package (`fleet/broker/`), so that
//! rumqttd is built only into that binary. This crate needs no ML: it depends on
//! `kestrel-models` without its candle and ONNX Runtime features (for artifact checks only).

pub mod bundle;
pub mod collect;
pub mod conn;
pub mod console;
pub mod infer;
pub mod keys;
pub mod prune;
pub mod publish;
pub mod rollout;
pub mod skipped;
pub mod status;

pub use bundle::Bundle;
pub use conn::Conn;
pub use infer::infer;
pub use keys::{KeysPublished, publish_keys};
pub use publish::{PublishOptions, Published, current_desired, publish};
pub use skipped::Skipped;
pub use status::{qualities, statuses, wait_status};

use kestrel_models::artifact;

use kestrel_shared::error::Cause;

#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// The broker could not be reached, or the connection failed.
    #[error("broker {url}")]
    Broker {
        url: String,
        #[source]
        source: Cause,
    },
    /// The operation was refused (versions, names, plans) or its condition was not met.
    #[error("{0}")]
    Refused(String),
    /// A wait ran out of time (a device's status never met the condition).
    #[error("{0}")]
    TimedOut(String),
    #[error(transparent)]
    Artifact(#[from] artifact::ArtifactError),
    #[error(transparent)]
    Protocol(#[from] kestrel_shared::protocol::ProtocolError),
    #[error(transparent)]
    Config(#[from] kestrel_shared::mqtt::BrokerError),
    #[error("{path}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl FleetError {
    /// The broker at `url` could not be reached, or the connection to it failed, because of `e`.
    pub(crate) fn broker(url: &str, e: impl Into<Cause>) -> Self {
        FleetError::Broker {
            url: url.to_string(),
            source: e.into(),
        }
    }
}

/// A progress bar (stderr, or the host's sink: [`kestrel_shared::progress`]).
pub fn progress(len: u64, what: &str) -> indicatif::ProgressBar {
    kestrel_shared::progress::bar(len, what)
}
