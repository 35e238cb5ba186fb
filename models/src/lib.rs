//! Kestrel `models`: architecture descriptions (one per network), lowered to ONNX and to candle,
//! weight import from PyTorch checkpoints and safetensors, and inference engines.
//!
//! Features: `candle` (candle lowering, PyTorch import) and `ort` (ONNX Runtime engine, loaded at
//! run time). Without them the crate is tract-only, which is what the edge agent builds.

pub mod arch;
pub mod artifact;
pub mod dequant;
pub mod engine;
pub mod onnx;
pub mod onnx_backbone;
pub mod onnx_weights;
pub mod quant;
pub mod tensor;
mod tract_conv;
pub mod weights;

#[cfg(feature = "candle")]
pub mod backbone;
#[cfg(feature = "candle")]
pub mod candle;
#[cfg(feature = "candle")]
pub mod depthwise;
#[cfg(feature = "candle")]
pub mod planes;
#[cfg(feature = "candle")]
pub mod torch;

pub use arch::{Arch, Network};
pub use engine::{Engine, EngineError, EngineKind};
pub use tensor::{Tensor, Weights};
