//! Inference engines for a lowered network: tract (pure Rust, default, also on the edge),
//! ONNX Runtime (loaded at run time from `libonnxruntime.so`) and candle.
//!
//! Every engine takes an NCHW (or boundary-shaped) f32 batch and returns the graph output, and
//! every engine honours a thread count:
//! - tract: the batch is split into `threads` chunks run concurrently on one shared plan;
//! - ONNX Runtime: `intra_op_num_threads`;
//! - candle: its CPU kernels use rayon, sized by `RAYON_NUM_THREADS` (see [`set_candle_threads`]).

use std::path::PathBuf;
use std::sync::Arc;

use tract_onnx::prelude::{
    Framework, InferenceModelExt, IntoTensor, RunOptions, TValue, TypedModel, TypedRunnableModel,
    tvec,
};

use crate::tensor::Tensor;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("tract: {0}")]
    Tract(String),
    #[error("ONNX Runtime: {0}")]
    Ort(String),
    #[error("candle: {0}")]
    Candle(String),
    #[error("engine `{0}` is not compiled into this binary (cargo feature `{0}`)")]
    NotCompiled(&'static str),
    #[error("input batch has shape {found:?}, the graph expects [N, {expected:?}]")]
    InputShape {
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("unknown engine `{0}` (expected tract, ort or candle)")]
    Unknown(String),
}

/// Which engine runs a graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    Tract,
    Ort,
    Candle,
}

impl EngineKind {
    pub const ALL: [EngineKind; 3] = [EngineKind::Tract, EngineKind::Ort, EngineKind::Candle];

    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Tract => "tract",
            EngineKind::Ort => "ort",
            EngineKind::Candle => "candle",
        }
    }
}

impl std::str::FromStr for EngineKind {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<Self, EngineError> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| EngineError::Unknown(s.into()))
    }
}

impl std::fmt::Display for EngineKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A ready-to-run graph.
pub trait Engine: Send + Sync {
    fn kind(&self) -> EngineKind;
    /// Runs a batch `[N, ..input_shape]` and returns `[N, ..output_shape]`.
    fn run(&self, input: &Tensor) -> Result<Tensor, EngineError>;
}

fn check_input(expected: &[usize], input: &Tensor) -> Result<(), EngineError> {
    if input.shape.len() != expected.len() + 1 || input.shape[1..] != *expected {
        return Err(EngineError::InputShape {
            expected: expected.to_vec(),
            found: input.shape.clone(),
        });
    }
    Ok(())
}

type Plan = Arc<TypedRunnableModel>;

/// tract on an ONNX graph.
pub struct TractEngine {
    plan: Plan,
    input_shape: Vec<usize>,
    threads: usize,
}

impl TractEngine {
    /// Loads ONNX bytes; `input_shape` is one sample's shape (the batch dimension is symbolic).
    pub fn from_onnx(
        bytes: &[u8],
        input_shape: Vec<usize>,
        threads: usize,
    ) -> Result<Self, EngineError> {
        let err = |e: tract_onnx::prelude::TractError| EngineError::Tract(format!("{e:#}"));
        let model: TypedModel = tract_onnx::onnx()
            .model_for_read(&mut std::io::Cursor::new(bytes))
            .map_err(err)?
            .into_optimized()
            .map_err(err)?;
        let plan = model
            .into_runnable_with_options(&RunOptions::default())
            .map_err(err)?;
        Ok(Self {
            plan,
            input_shape,
            threads: threads.max(1),
        })
    }

    fn run_chunk(&self, shape: &[usize], data: &[f32]) -> Result<Tensor, EngineError> {
        let err = |e: tract_onnx::prelude::TractError| EngineError::Tract(format!("{e:#}"));
        let t = tract_onnx::prelude::Tensor::from_shape(shape, data).map_err(err)?;
        let out = self
            .plan
            .run(tvec!(TValue::from(t.into_tensor())))
            .map_err(err)?;
        let view = out[0].to_plain_array_view::<f32>().map_err(err)?;
        Ok(Tensor::new(
            view.shape().to_vec(),
            view.iter().copied().collect(),
        ))
    }
}

impl Engine for TractEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::Tract
    }

    fn run(&self, input: &Tensor) -> Result<Tensor, EngineError> {
        check_input(&self.input_shape, input)?;
        let n = input.shape[0];
        let per = input.numel() / n.max(1);
        let threads = self.threads.min(n).max(1);
        if threads == 1 {
            return self.run_chunk(&input.shape, &input.data);
        }
        let chunk = n.div_ceil(threads);
        let parts: Vec<Result<Tensor, EngineError>> = std::thread::scope(|s| {
            let handles: Vec<_> = input
                .data
                .chunks(chunk * per)
                .map(|d| {
                    let mut shape = input.shape.clone();
                    shape[0] = d.len() / per;
                    s.spawn(move || self.run_chunk(&shape, d))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("tract worker panicked"))
                .collect()
        });
        let mut out: Option<Tensor> = None;
        for p in parts {
            let p = p?;
            match &mut out {
                None => out = Some(p),
                Some(o) => {
                    o.shape[0] += p.shape[0];
                    o.data.extend_from_slice(&p.data);
                }
            }
        }
        Ok(out.expect("at least one chunk"))
    }
}

/// Where the ONNX Runtime shared library is looked for: `ORT_DYLIB_PATH`, else
/// `$KESTREL_HOME/onnxruntime/libonnxruntime.so` (`KESTREL_HOME` defaults to `~/.cache/kestrel`),
/// which `scripts/setup.sh` fills from the PyPI `onnxruntime` wheel.
pub fn ort_library_path() -> PathBuf {
    if let Some(p) = std::env::var_os("ORT_DYLIB_PATH") {
        return PathBuf::from(p);
    }
    kestrel_home().join("onnxruntime").join("libonnxruntime.so")
}

/// Kestrel's cache directory for fetched weights, data and libraries.
pub fn kestrel_home() -> PathBuf {
    if let Some(p) = std::env::var_os("KESTREL_HOME") {
        return PathBuf::from(p);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("kestrel")
}

#[cfg(feature = "ort")]
pub use ort_engine::OrtEngine;

#[cfg(feature = "ort")]
mod ort_engine {
    use super::*;
    use std::sync::{Mutex, OnceLock};

    static ENV: OnceLock<Result<ort::environment::Environment, String>> = OnceLock::new();

    fn init() -> Result<&'static ort::environment::Environment, EngineError> {
        let r = ENV.get_or_init(|| {
            let path = ort_library_path();
            if !path.exists() {
                return Err(format!(
                    "library not found at {} (set ORT_DYLIB_PATH, or run scripts/setup.sh to install it from the PyPI onnxruntime wheel)",
                    path.display()
                ));
            }
            ort::init_from(&path)
                .map_err(|e| format!("cannot load {}: {e}", path.display()))?
                .build()
                .map_err(|e| format!("cannot create environment from {}: {e}", path.display()))
        });
        r.as_ref().map_err(|e| EngineError::Ort(e.clone()))
    }

    /// ONNX Runtime (CPU execution provider) on an ONNX graph.
    pub struct OrtEngine {
        session: Mutex<ort::session::Session>,
        input_shape: Vec<usize>,
    }

    impl OrtEngine {
        pub fn from_onnx(
            bytes: &[u8],
            input_shape: Vec<usize>,
            threads: usize,
        ) -> Result<Self, EngineError> {
            let env = init()?;
            let err = |e: ort::Error| EngineError::Ort(e.to_string());
            let session = ort::session::Session::builder(env)
                .map_err(err)?
                .with_intra_threads(threads.max(1))
                .map_err(|e| EngineError::Ort(e.to_string()))?
                .commit_from_memory(bytes)
                .map_err(err)?;
            Ok(Self {
                session: Mutex::new(session),
                input_shape,
            })
        }
    }

    impl Engine for OrtEngine {
        fn kind(&self) -> EngineKind {
            EngineKind::Ort
        }

        fn run(&self, input: &Tensor) -> Result<Tensor, EngineError> {
            check_input(&self.input_shape, input)?;
            let err = |e: ort::Error| EngineError::Ort(e.to_string());
            let value = ort::value::Tensor::from_array((input.shape.clone(), input.data.clone()))
                .map_err(err)?;
            let mut session = self.session.lock().expect("ort session lock");
            let outputs = session.run(ort::inputs![value]).map_err(err)?;
            let (shape, data) = outputs[0].try_extract_tensor::<f32>().map_err(err)?;
            Ok(Tensor::new(
                shape.iter().map(|&d| d as usize).collect(),
                data.to_vec(),
            ))
        }
    }
}

/// Sets the thread count candle's CPU kernels use. Call before the first candle operation
/// (the binaries do it first thing in `main`).
pub fn set_candle_threads(threads: usize) {
    // SAFETY: called from `main` before any other thread is started.
    unsafe { std::env::set_var("RAYON_NUM_THREADS", threads.max(1).to_string()) };
}
