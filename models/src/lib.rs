//! Kestrel `models`: architecture descriptions (one per network), lowered to ONNX and to candle,
//! weight import from PyTorch checkpoints and safetensors, quantization; the artifact loader and
//! the inference engines come from `kestrel-runtime` (what the device links) and are re-exported.
//!
//! Features: `candle` (candle lowering, PyTorch import) and `ort` (ONNX Runtime engine, loaded at
//! run time).

pub mod arch;
pub mod onnx;
pub mod onnx_backbone;
pub mod onnx_graph;
pub mod onnx_weights;
pub mod parts;
pub mod quant;
pub mod weights;
pub use kestrel_runtime::{artifact, dequant, engine, tensor};

#[cfg(test)]
mod dequant_tests;

#[cfg(feature = "candle")]
pub mod backbone;
#[cfg(feature = "candle")]
pub mod candle;
#[cfg(feature = "candle")]
pub mod depthwise;
#[cfg(feature = "candle")]
pub mod op_timing;
#[cfg(feature = "candle")]
pub mod planes;
#[cfg(feature = "candle")]
pub mod torch;

pub use arch::{Arch, Network};
pub use engine::{Engine, EngineError, EngineKind};
pub use tensor::{Tensor, Weights};
