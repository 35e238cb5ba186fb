//! Inference engines for a lowered network: tract (pure Rust, default, also on the edge),
//! ONNX Runtime (loaded at run time from `libonnxruntime.so`) and candle.
//!
//! Every engine takes an NCHW (or boundary-shaped) f32 batch and returns the graph output, and
//! every engine honours a thread count:
//! - tract: `threads` workers on one shared plan each take the batch's next image; a batch
//!   smaller than `threads` (the edge agent's one image per request) instead runs its matrix
//!   products on a `threads`-thread pool (tract's `multithread-mm`, cargo feature `tract-threads`);
//! - ONNX Runtime: `intra_op_num_threads`;
//! - candle: its CPU kernels run on rayon's global pool, which the caller sizes (the trainer does
//!   from `--threads`).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::tensor::Tensor;
use tract_onnx::prelude::{
    Datum, Framework, InferenceFact, InferenceModelExt, IntoTensor, RunOptions, TValue, TypedModel,
    TypedRunnableModel, tvec,
};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("tract")]
    Tract(#[source] tract_onnx::prelude::TractError),
    #[error("ONNX Runtime")]
    Ort(#[source] kestrel_shared::error::Cause),
    #[error("candle")]
    Candle(#[source] kestrel_shared::error::Cause),
    #[error("engine `{0}` is not compiled into this binary (cargo feature `{0}`)")]
    NotCompiled(&'static str),
    #[error("input batch has shape {found:?}, the graph expects [N, {expected:?}]")]
    InputShape {
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("candle runs a lowered network, not an ONNX file: use tract or ort")]
    NotOnnx,
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
    /// Runs a batch `[N, ..input_shape]` and returns every graph output in order, each
    /// `[N, ..]` (an exported graph's second output is its pooled features).
    fn run_outputs(&self, input: &Tensor) -> Result<Vec<Tensor>, EngineError> {
        Ok(vec![self.run(input)?])
    }
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

/// tract on an ONNX graph.
///
/// tract optimises far better for a concrete batch size than for the symbolic `N`, and on these
/// CPUs runs Lite0 fastest one image at a time (measured, 1 thread, decode included: batch 1
/// 31 img/s, batch 4 15 img/s, batch 32 12 img/s, symbolic N 6 img/s). So the plan is built
/// for batch 1 and a batch is spread over `threads` workers, each taking the next image when free.
/// Its depthwise convolutions (with the 1x1 expansions before them), full ones over few input
/// channels (the stem) and 1x1 ones over few channels are Kestrel's own op (`tract_conv/`), put
/// in before tract optimises the plan.
pub struct TractEngine {
    plan: Arc<TypedRunnableModel>,
    input_shape: Vec<usize>,
    threads: usize,
    /// With `threads > 1`: the pool a batch smaller than `threads` runs its matrix products on.
    #[cfg(feature = "tract-threads")]
    pool: Option<tract_onnx::prelude::multithread::Executor>,
}

fn tract_err(e: tract_onnx::prelude::TractError) -> EngineError {
    EngineError::Tract(e)
}

impl TractEngine {
    /// Loads ONNX bytes; `input_shape` is one sample's shape (the graph's batch dimension is symbolic).
    pub fn from_onnx(
        bytes: &[u8],
        input_shape: Vec<usize>,
        threads: usize,
    ) -> Result<Self, EngineError> {
        let mut shape = vec![1];
        shape.extend(&input_shape);
        let model: TypedModel = tract_onnx::onnx()
            .model_for_read(&mut std::io::Cursor::new(bytes))
            .and_then(|m| m.with_input_fact(0, InferenceFact::dt_shape(f32::datum_type(), shape)))
            .and_then(|m| m.into_typed()?.into_decluttered())
            .and_then(|mut m| {
                crate::tract_conv::replace(&mut m)?;
                m.into_optimized()
            })
            .map_err(tract_err)?;
        let plan = model
            .into_runnable_with_options(&RunOptions::default())
            .map_err(tract_err)?;
        Ok(Self {
            plan,
            input_shape,
            threads: threads.max(1),
            #[cfg(feature = "tract-threads")]
            pool: (threads > 1)
                .then(|| tract_onnx::prelude::multithread::Executor::multithread(threads)),
        })
    }

    /// Runs `f` with tract's matrix products on the pool when there is one (the calling thread
    /// takes part), else single-threaded.
    fn on_pool<R>(&self, f: impl FnOnce() -> R) -> R {
        #[cfg(feature = "tract-threads")]
        if let Some(pool) = &self.pool {
            return tract_onnx::prelude::multithread::multithread_tract_scope(pool.clone(), f);
        }
        f()
    }

    /// Runs consecutive samples one at a time (the batch-1 plan): per graph output (the first
    /// only unless `all`), one sample's shape and the samples' values in order.
    fn run_samples(&self, data: &[f32], per: usize, all: bool) -> Result<Outputs, EngineError> {
        let mut outs: Outputs = Vec::new();
        let mut shape = vec![1];
        shape.extend(&self.input_shape);
        for sample in data.chunks(per) {
            let t = tract_onnx::prelude::Tensor::from_shape(&shape, sample).map_err(tract_err)?;
            let ys = self
                .plan
                .run(tvec!(TValue::from(t.into_tensor())))
                .map_err(tract_err)?;
            let take = if all { ys.len() } else { 1 };
            outs.resize_with(take, Default::default);
            for ((out_shape, out), y) in outs.iter_mut().zip(&ys) {
                let view = y.to_plain_array_view::<f32>().map_err(tract_err)?;
                *out_shape = view.shape()[1..].to_vec();
                out.extend(view.iter().copied());
            }
        }
        Ok(outs)
    }

    /// Runs a batch `[N, ..input_shape]`: the first output, or every output with `all`.
    fn run_batch(&self, input: &Tensor, all: bool) -> Result<Vec<Tensor>, EngineError> {
        check_input(&self.input_shape, input)?;
        let n = input.shape[0];
        if n == 0 {
            return Ok(vec![Tensor::new(vec![0], Vec::new())]);
        }
        let per = input.numel() / n;
        let batched = |outs: Outputs| {
            outs.into_iter()
                .map(|(s, data)| Tensor::new([vec![n], s].concat(), data))
                .collect()
        };
        if n < self.threads && cfg!(feature = "tract-threads") {
            // Fewer images than threads: one image at a time, each using every thread.
            return Ok(batched(
                self.on_pool(|| self.run_samples(&input.data, per, all))?,
            ));
        }
        // One worker per thread, each taking the next image as it finishes one (the decoder
        // threads share these cores: fixed halves would leave the slowed worker's partner idle).
        let next = AtomicUsize::new(0);
        let worker = || -> Result<Vec<(usize, Outputs)>, EngineError> {
            let mut done = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return Ok(done);
                }
                done.push((
                    i,
                    self.run_samples(&input.data[i * per..(i + 1) * per], per, all)?,
                ));
            }
        };
        let parts: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..self.threads.min(n).max(1))
                .map(|_| s.spawn(worker))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("tract worker panicked"))
                .collect()
        });
        let mut by_sample: Vec<Outputs> = vec![Vec::new(); n];
        for part in parts {
            for (i, outs) in part? {
                by_sample[i] = outs;
            }
        }
        // Per output: the samples' values in input order.
        let mut outs: Outputs = Vec::new();
        for sample in by_sample {
            outs.resize_with(sample.len(), Default::default);
            for ((shape, data), (s, d)) in outs.iter_mut().zip(sample) {
                *shape = s;
                data.extend(d);
            }
        }
        Ok(batched(outs))
    }
}

/// Per graph output: one sample's shape (without the batch) and the values of the samples run.
type Outputs = Vec<(Vec<usize>, Vec<f32>)>;

impl Engine for TractEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::Tract
    }

    fn run_outputs(&self, input: &Tensor) -> Result<Vec<Tensor>, EngineError> {
        self.run_batch(input, true)
    }

    fn run(&self, input: &Tensor) -> Result<Tensor, EngineError> {
        Ok(self.run_batch(input, false)?.swap_remove(0))
    }
}

/// Builds an engine of `kind` over ONNX bytes; `input_shape` is one sample's shape. candle runs
/// a lowered [`crate::arch::Network`], not ONNX bytes (see `backbone::build_engine`).
pub fn from_onnx(
    kind: EngineKind,
    bytes: &[u8],
    input_shape: Vec<usize>,
    opts: EngineOpts,
) -> Result<Box<dyn Engine>, EngineError> {
    match kind {
        EngineKind::Tract => Ok(Box::new(TractEngine::from_onnx(
            bytes,
            input_shape,
            opts.threads,
        )?)),
        #[cfg(feature = "ort")]
        EngineKind::Ort => Ok(Box::new(OrtEngine::from_onnx(bytes, input_shape, opts)?)),
        #[cfg(not(feature = "ort"))]
        EngineKind::Ort => Err(EngineError::NotCompiled("ort")),
        EngineKind::Candle => Err(EngineError::NotOnnx),
    }
}

/// Whether this build has the ONNX Runtime engine (cargo feature `ort`).
pub const ORT_COMPILED: bool = cfg!(feature = "ort");

static ORT_LIBRARY: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// Sets where the ONNX Runtime library is loaded from (the edge agent's `[inference] ort_library`);
/// takes precedence over `ORT_DYLIB_PATH`. Call before the first ONNX Runtime engine is built.
pub fn set_ort_library(path: PathBuf) {
    let _ = ORT_LIBRARY.set(path);
}

/// Where the ONNX Runtime shared library is looked for: [`set_ort_library`], else `ORT_DYLIB_PATH`,
/// else `$KESTREL_HOME/onnxruntime/libonnxruntime.so` (`KESTREL_HOME` defaults to `~/.cache/kestrel`),
/// which `scripts/setup.sh` fills from the PyPI `onnxruntime` wheel.
pub fn ort_library_path() -> PathBuf {
    if let Some(p) = ORT_LIBRARY.get() {
        return p.clone();
    }
    if let Some(p) = std::env::var_os("ORT_DYLIB_PATH") {
        return PathBuf::from(p);
    }
    kestrel_home().join("onnxruntime").join("libonnxruntime.so")
}

/// Loads the ONNX Runtime library now (once per process), so a missing or wrong library is
/// reported at start rather than by every model's health check.
pub fn ort_ready() -> Result<(), EngineError> {
    #[cfg(feature = "ort")]
    return ort_engine::init().map(|_| ());
    #[cfg(not(feature = "ort"))]
    Err(EngineError::NotCompiled("ort"))
}

pub use kestrel_shared::fsutil::kestrel_home;

#[cfg(feature = "ort")]
pub use ort_engine::OrtEngine;

/// Where ONNX Runtime runs its graphs: the CPU execution provider (default) or CUDA (loaded from
/// the ONNX Runtime library at run time, so this builds without CUDA; docs/gpu.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OrtDevice {
    #[default]
    Cpu,
    Cuda,
}

/// How an engine runs: its threads and, for ONNX Runtime, the execution provider. Each engine is
/// built with its own (no process-wide setting).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineOpts {
    pub threads: usize,
    pub ort_device: OrtDevice,
}

impl EngineOpts {
    /// `threads` threads on the CPU.
    pub fn cpu(threads: usize) -> Self {
        Self {
            threads,
            ort_device: OrtDevice::Cpu,
        }
    }
}

#[cfg(feature = "ort")]
mod ort_engine {
    use super::*;
    use std::sync::{Mutex, OnceLock};

    static ENV: OnceLock<Result<ort::environment::Environment, String>> = OnceLock::new();

    pub(super) fn init() -> Result<&'static ort::environment::Environment, EngineError> {
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
        r.as_ref().map_err(|e| EngineError::Ort(e.clone().into()))
    }

    /// ONNX Runtime loads its CUDA execution provider from `libonnxruntime_providers_cuda.so`
    /// beside its own library: a CPU build (the `onnxruntime` wheel) has none.
    fn cuda_provider_present() -> Result<(), EngineError> {
        let lib = ort_library_path();
        let provider = lib.with_file_name("libonnxruntime_providers_cuda.so");
        if provider.exists() {
            return Ok(());
        }
        Err(EngineError::Ort(
            format!(
                "--execution-provider cuda: {} is missing: the ONNX Runtime at {} is a CPU build; \
                 scripts/setup-cuda.sh --runtime installs onnxruntime-gpu, and `source \
                 $KESTREL_HOME/cuda/env.sh` sets ORT_DYLIB_PATH to it",
                provider.display(),
                lib.display()
            )
            .into(),
        ))
    }

    /// ONNX Runtime (its CPU or CUDA execution provider) on an ONNX graph.
    pub struct OrtEngine {
        session: Mutex<ort::session::Session>,
        input_shape: Vec<usize>,
    }

    impl OrtEngine {
        pub fn from_onnx(
            bytes: &[u8],
            input_shape: Vec<usize>,
            opts: EngineOpts,
        ) -> Result<Self, EngineError> {
            let env = init()?;
            let err = |e: ort::Error| EngineError::Ort(e.into());
            // The builder's errors carry the builder back (to recover it): keep their code and words.
            let builder_err = |e: ort::Error<ort::session::builder::SessionBuilder>| {
                EngineError::Ort(ort::Error::new_with_code(e.code(), e.message()).into())
            };
            let mut builder = ort::session::Session::builder(env)
                .map_err(err)?
                .with_intra_threads(opts.threads.max(1))
                .map_err(builder_err)?
                // What Python's `InferenceSession` uses by default: every optimization, layout
                // ones included (NHWC integer convolutions for static int8: without them its
                // QLinearConvs ran 1.4x slower here).
                .with_optimization_level(ort::session::builder::GraphOptimizationLevel::All)
                .map_err(builder_err)?;
            if opts.ort_device == OrtDevice::Cuda {
                cuda_provider_present()?;
                builder = builder
                    .with_execution_providers([ort::ep::CUDA::default()
                        .build()
                        .error_on_failure()])
                    .map_err(|e| {
                        let e = e.to_string();
                        let needs = if e.contains("libcuda.so") {
                            "libcuda.so.1 is the NVIDIA driver's: this machine has no GPU driver"
                        } else {
                            "it needs the CUDA 13 libraries it names (cuBLAS, cuDNN 9, cuFFT, cuRAND: \
                             scripts/setup-cuda.sh --runtime fetches them, and `source \
                             $KESTREL_HOME/cuda/env.sh` puts them on LD_LIBRARY_PATH) and a GPU"
                        };
                        EngineError::Ort(
                            format!(
                                "--execution-provider cuda: the CUDA execution provider is unavailable ({}); {needs}",
                                e.trim_end()
                            )
                            .into(),
                        )
                    })?;
            }
            let session = builder.commit_from_memory(bytes).map_err(err)?;
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
            Ok(self.run_outputs(input)?.swap_remove(0))
        }

        /// Every output of a batch (ONNX Runtime runs any batch size as one).
        fn run_outputs(&self, input: &Tensor) -> Result<Vec<Tensor>, EngineError> {
            check_input(&self.input_shape, input)?;
            let err = |e: ort::Error| EngineError::Ort(e.into());
            let value = ort::value::Tensor::from_array((input.shape.clone(), input.data.clone()))
                .map_err(err)?;
            let mut session = self.session.lock().expect("ort session lock");
            let outputs = session.run(ort::inputs![value]).map_err(err)?;
            outputs
                .iter()
                .map(|(_, v)| {
                    let (shape, data) = v.try_extract_tensor::<f32>().map_err(err)?;
                    Ok(Tensor::new(
                        shape.iter().map(|&d| d as usize).collect(),
                        data.to_vec(),
                    ))
                })
                .collect()
        }
    }
}
