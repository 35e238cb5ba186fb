//! Kestrel `shared`: what the trainer and the edge agent must agree on byte for byte.
//!
//! - [`preprocess`]: the preprocessing spec (a serde type carried in every artifact manifest)
//!   and the one implementation of it, used by both binaries.

pub mod fsutil;
pub mod manifest;
pub mod preprocess;
pub mod signing;

pub use preprocess::{ImageLimits, PreprocessError, PreprocessSpec, Preprocessed};
