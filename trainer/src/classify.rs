//! `trainer classify`: ImageNet predictions of a pretrained backbone with its original head.

use std::path::PathBuf;
use std::time::Instant;

use kestrel_models::backbone::{Backbone, BackboneError};
use kestrel_models::engine::EngineOpts;
use kestrel_models::onnx::LowerOpts;
use kestrel_models::{Engine, EngineKind};
use kestrel_shared::{ImageLimits, PreprocessError};
use serde::Serialize;

use crate::images::{preprocess_paths, softmax, stack, top_k};

#[derive(Debug, thiserror::Error)]
pub enum ClassifyError {
    #[error(transparent)]
    Backbone(#[from] BackboneError),
    #[error("backbone {0} has no classifier weights to classify with")]
    NoClassifier(String),
    #[error(transparent)]
    Engine(#[from] kestrel_models::EngineError),
    #[error(transparent)]
    Preprocess(#[from] PreprocessError),
}

#[derive(Debug, Serialize, Clone, PartialEq)]
pub struct Class {
    pub class: usize,
    pub score: f32,
}

#[derive(Debug, Serialize)]
pub struct Prediction {
    pub image: String,
    pub top: Vec<Class>,
    #[serde(skip)]
    pub logits: Vec<f32>,
}

/// A backbone with its pretrained classifier on one engine.
pub struct Classifier {
    pub backbone: Backbone,
    engine: Box<dyn Engine>,
}

impl Classifier {
    pub fn new(
        backbone: Backbone,
        kind: EngineKind,
        run: EngineOpts,
    ) -> Result<Self, ClassifyError> {
        let head = backbone
            .classifier()
            .ok_or_else(|| ClassifyError::NoClassifier(backbone.net.arch.to_string()))?;
        let opts = LowerOpts::logits(&backbone.net, head);
        let engine = backbone.engine(kind, &opts, run)?;
        Ok(Self { backbone, engine })
    }

    /// Classifies images; each entry is a prediction or the reason that image failed.
    pub fn classify(
        &self,
        paths: &[PathBuf],
        k: usize,
    ) -> Result<Vec<Result<Prediction, PreprocessError>>, ClassifyError> {
        let spec = &self.backbone.net.preprocess;
        let pre = preprocess_paths(spec, paths, &ImageLimits::default());
        let good: Vec<&[f32]> = pre
            .iter()
            .filter_map(|r| r.as_ref().ok().map(|v| v.as_slice()))
            .collect();
        let mut logits = if good.is_empty() {
            Vec::new().into_iter()
        } else {
            let out = self.engine.run(&stack(spec, &good))?;
            let classes = out.shape[1];
            out.data
                .chunks(classes)
                .map(|c| c.to_vec())
                .collect::<Vec<_>>()
                .into_iter()
        };
        Ok(pre
            .into_iter()
            .zip(paths)
            .map(|(r, p)| {
                r.map(|_| {
                    let l = logits.next().expect("one output per good image");
                    let top = top_k(&softmax(&l), k)
                        .into_iter()
                        .map(|(class, score)| Class { class, score })
                        .collect();
                    Prediction {
                        image: p.display().to_string(),
                        top,
                        logits: l,
                    }
                })
            })
            .collect())
    }
}

/// Throughput of the feature extractor (decode + preprocess + backbone) in images per second.
#[derive(Debug, Serialize)]
pub struct Throughput {
    pub engine: EngineKind,
    pub arch: String,
    pub batch: usize,
    pub threads: usize,
    pub images: usize,
    pub seconds: f64,
    pub images_per_s: f64,
}

/// Runs `rounds` batches of `batch` images (cycling through `paths`) after one warm-up batch.
pub fn throughput(
    backbone: &Backbone,
    kind: EngineKind,
    paths: &[PathBuf],
    batch: usize,
    engine_opts: EngineOpts,
    rounds: usize,
) -> Result<Throughput, ClassifyError> {
    let threads = engine_opts.threads;
    let engine = backbone.engine(kind, &LowerOpts::features(&backbone.net), engine_opts)?;
    let spec = &backbone.net.preprocess;
    let batch_paths: Vec<PathBuf> = paths.iter().cycle().take(batch).cloned().collect();
    let run = || -> Result<(), ClassifyError> {
        let pre = preprocess_paths(spec, &batch_paths, &ImageLimits::default());
        let pre = pre.into_iter().collect::<Result<Vec<_>, _>>()?;
        let refs: Vec<&[f32]> = pre.iter().map(|v| v.as_slice()).collect();
        engine.run(&stack(spec, &refs))?;
        Ok(())
    };
    run()?;
    let start = Instant::now();
    for _ in 0..rounds {
        run()?;
    }
    let seconds = start.elapsed().as_secs_f64();
    let images = rounds * batch;
    Ok(Throughput {
        engine: kind,
        arch: backbone.net.arch.to_string(),
        batch,
        threads,
        images,
        seconds,
        images_per_s: images as f64 / seconds,
    })
}
