//! Kestrel `shared`: what the trainer and the edge agent must agree on byte for byte.
//!
//! - [`preprocess`]: the preprocessing spec (a serde type carried in every artifact manifest)
//!   and the one implementation of it, used by both binaries.
//! - [`manifest`], [`signing`]: the artifact manifest and its ed25519 signatures.
//! - [`protocol`], [`topics`], [`wire`]: the MQTT messages between trainer and devices, their
//!   topics, and the closed sets of values they carry (enums, never compared as strings).
//! - [`quality`]: model quality without labels (reference profile, live-window statistics).
//! - [`time`]: wall-clock helpers ([`now_unix`]).

pub mod capture;
pub mod error;
pub mod fsutil;
#[cfg(feature = "logging")]
pub mod logging;
pub mod manifest;
#[cfg(feature = "mqtt")]
pub mod mqtt;
pub mod preprocess;
#[cfg(feature = "progress")]
pub mod progress;
pub mod protocol;
pub mod quality;
pub mod resize;
pub mod signing;
pub mod stats;
pub mod time;
pub mod topics;
pub mod wire;

pub use error::{Chain, chain};
pub use preprocess::{ImageLimits, PreprocessError, PreprocessSpec, Preprocessed};
pub use protocol::human_bytes;
pub use time::{issued_now, now_rfc3339, now_unix};
