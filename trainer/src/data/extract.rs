//! [`Extractor`]: the frozen backbone over encoded images one batch at a time, outside the caches:
//! what a Spark executor runs for `kestrel.spark.features` on its Arrow batches. The pipeline is
//! `trainer prepare`'s (decode with the same limits, the backbone's preprocessing to 8-bit pixels,
//! normalisation, the frozen network with pooling), so the features equal the feature cache's.
//! [`Extractor::store`] writes rows it computed as a feature cache that later fits reuse.

use image::RgbImage;
use indicatif::ProgressBar;
use kestrel_models::backbone::{Backbone, BackboneError};
use kestrel_models::engine::EngineOpts;
use kestrel_models::{Engine, EngineKind};
use kestrel_shared::preprocess::decode;
use kestrel_shared::{ImageLimits, PreprocessError};

use super::cache::CacheError;
use super::cache::features::{frozen_opts, run_frozen};

#[derive(Debug, thiserror::Error)]
pub enum ExtractError {
    #[error(transparent)]
    Backbone(#[from] BackboneError),
    #[error("running the backbone")]
    Run(#[source] CacheError),
    #[error("storing features")]
    Store(#[source] CacheError),
}

/// A backbone's frozen network (every block, pooled) on one engine.
pub struct Extractor {
    backbone: Backbone,
    engine: Box<dyn Engine>,
    kind: EngineKind,
    limits: ImageLimits,
}

impl Extractor {
    pub fn new(
        backbone: Backbone,
        kind: EngineKind,
        run: EngineOpts,
    ) -> Result<Self, ExtractError> {
        let opts = frozen_opts(&backbone, backbone.net.blocks.len());
        let engine = backbone.engine(kind, &opts, run)?;
        Ok(Extractor {
            backbone,
            engine,
            kind,
            limits: ImageLimits::default(),
        })
    }

    pub fn backbone(&self) -> &Backbone {
        &self.backbone
    }

    /// The features of each image (`(name, encoded bytes)`, the name for errors), or why that
    /// image was refused; the backbone runs once over the images that decode.
    pub fn extract(
        &self,
        images: &[(&str, &[u8])],
    ) -> Result<Vec<Result<Vec<f32>, PreprocessError>>, ExtractError> {
        let spec = &self.backbone.net.preprocess;
        let pixels: Vec<Result<Vec<u8>, PreprocessError>> = images
            .iter()
            .map(|(name, bytes)| {
                decode(bytes, name, &self.limits)
                    .and_then(|img| spec.to_pixels(&img))
                    .map(RgbImage::into_raw)
            })
            .collect();
        let good: Vec<&[u8]> = pixels.iter().filter_map(|p| p.as_deref().ok()).collect();
        let out = if good.is_empty() {
            Vec::new()
        } else {
            run_frozen(&*self.engine, spec, &good, 0, &ProgressBar::hidden())
                .map_err(ExtractError::Run)?
        };
        let per = if good.is_empty() {
            0
        } else {
            out.len() / good.len()
        };
        let mut rows = out.chunks_exact(per.max(1));
        Ok(pixels
            .into_iter()
            .map(|p| p.map(|_| rows.next().expect("a row per decoded image").to_vec()))
            .collect())
    }

    /// Stores rows this extractor computed (`data`, one after another, for the images whose
    /// encoded bytes have the sha256s `content`) as a feature cache under `root`, which a later
    /// `trainer fit`/`prepare` with that `--cache` reuses instead of running the backbone
    /// ([`super::cache::features::store_rows`]).
    pub fn store(
        &self,
        root: &std::path::Path,
        content: Vec<String>,
        data: &[f32],
        seconds: f64,
    ) -> Result<std::path::PathBuf, ExtractError> {
        super::cache::features::store_rows(root, &self.backbone, content, data, self.kind, seconds)
            .map_err(ExtractError::Store)
    }
}
