//! Kestrel trainer as a library: the machine-learning side of Kestrel. Every `trainer` command
//! is a function here, so the pipeline can be driven from Rust code as well as from the binary.
//!
//! - [`data`]: image tables, the split, the sample and feature caches;
//! - [`distributed`]: the run context ([`distributed::Job`]) and the collectives (local threads, MPI);
//! - [`train`]: head (and last blocks) training; [`tune`]: TPE search over trials;
//! - [`export`]: artifacts (ONNX f32/int8, manifest, safetensors, golden samples);
//! - [`track`]: MLflow tracking and registry;
//! - [`predict`], [`classify`], [`report`]; [`interrupt`]: a stop asked for by the Python package;
//! - [`cli`]: the `trainer` command line over all of these (the binary and the Python package
//!   both run it).
//!
//! The fleet commands (publish, status, infer, rollout) are in the `kestrel-fleet` crate, the
//! embedded broker in `kestrel-broker`.

pub mod classify;
pub mod cli;
pub mod collect;
pub mod data;
pub mod distributed;
pub mod export;
pub mod images;
pub mod interrupt;
pub mod predict;
pub mod report;
pub mod track;
pub mod train;
pub mod tune;

pub use kestrel_models as models;
pub use kestrel_shared as shared;
