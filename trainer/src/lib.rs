//! Kestrel trainer as a library: every CLI command is a function here, so the pipeline can be
//! driven from Rust code as well as from the `trainer` binary. The fleet commands (publish,
//! status, infer, rollout) are in the `kestrel-fleet` crate, the embedded broker in
//! `kestrel-broker`.

pub mod cache;
pub mod classify;
pub mod collective;
#[cfg(feature = "mpi")]
pub mod collective_mpi;
pub mod data;
pub mod export;
pub mod images;
pub mod model;
pub mod optim;
pub mod predict;
pub mod report;
pub mod split;
pub mod train;
pub mod tune;

pub use kestrel_models as models;
pub use kestrel_shared as shared;
