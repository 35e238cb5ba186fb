//! Kestrel `runtime`: what a device needs of a model, and nothing of how it was made. The
//! artifact loader (manifest, file hashes, signature, golden-sample health check) and the
//! inference engines (tract; ONNX Runtime behind the `ort` feature, loaded at run time).
//!
//! The edge agent depends on this crate alone; `kestrel-models` (architectures, ONNX lowering,
//! weight import, quantization) builds on it and re-exports it, so the trainer's paths
//! (`kestrel_models::artifact`, `kestrel_models::engine`) are unchanged.

pub mod artifact;
pub mod dequant;
pub mod engine;
pub mod tensor;
mod tract_conv;

pub use engine::{Engine, EngineError, EngineKind};
pub use tensor::{Tensor, Weights};
