//! Stage 1: the run being exported as the trainer sees it — its parameters, weights and summary,
//! its prepared data, the trainer's own model (the reference every runtime is checked against)
//! and the whole network's folded weights with the run's trained parts in place.

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor as CTensor};
use kestrel_models::Weights;
use kestrel_models::onnx::Linear;
use kestrel_models::weights::FoldedConv;

use super::ExportError;
use crate::distributed::Job;
use crate::train::{self, FitParams, Trainable, TrainingData};

pub(super) struct Trained {
    pub run_dir: PathBuf,
    pub params: FitParams,
    /// The run's weights (trained blocks and classifier).
    pub weights: Weights,
    /// The run's `summary.json`.
    pub summary: serde_json::Value,
    pub pp: TrainingData,
    /// The trainer's model: cached features → logits, in candle.
    pub model: Trainable,
    /// Folded weights of the whole network as trained.
    pub folded: Vec<FoldedConv>,
    /// The run's classifier.
    pub head: Linear,
    /// Every sample's cached pixels (input size).
    pixels: Vec<Vec<u8>>,
}

impl Trained {
    pub fn load(run_dir: &Path, job: &Job) -> Result<Self, ExportError> {
        let (params, weights) = train::load_run(run_dir)?;
        let summary = train::RunDir(run_dir).read_json(train::RunDir::SUMMARY)?;
        let pp = train::prepare(&params, job)?;
        let model = Trainable::new(
            &pp.backbone,
            pp.boundary,
            pp.dataset_labels.len(),
            Some(&weights),
            params.seed,
            None,
            &Device::Cpu,
        )?;
        let (folded, head) = trained_network(&pp, &weights)?;
        let pixels = pp.prepared.load_pixels()?;
        Ok(Self {
            run_dir: run_dir.to_path_buf(),
            params,
            weights,
            summary,
            pp,
            model,
            folded,
            head,
            pixels,
        })
    }

    pub fn net(&self) -> &kestrel_models::Network {
        &self.pp.backbone.net
    }

    pub fn labels(&self) -> &[String] {
        &self.pp.dataset_labels
    }

    /// The samples `idx` as the network's normalised inputs.
    pub fn inputs(&self, idx: &[usize]) -> Vec<Vec<f32>> {
        idx.iter()
            .map(|&i| self.pp.prepared.normalize(&self.pixels[i]))
            .collect()
    }

    /// The trainer's reference logits (cached features + trained part in candle).
    pub fn reference_logits(&self, idx: &[usize]) -> Result<Vec<Vec<f32>>, ExportError> {
        let features = &self.pp.features;
        let per = features.per_sample();
        let mut out = Vec::new();
        for chunk in idx.chunks(128) {
            let mut x = Vec::with_capacity(chunk.len() * per);
            for &i in chunk {
                x.extend_from_slice(features.row(i));
            }
            let mut shape = vec![chunk.len()];
            shape.extend(&features.meta.dims);
            let logits = self
                .model
                .forward(&CTensor::from_vec(x, shape, &Device::Cpu)?)?;
            out.extend(logits.to_vec2::<f32>()?);
        }
        Ok(out)
    }
}

/// Folded weights of the whole network as trained: pretrained folded convs with the run's
/// unfrozen blocks substituted, and the run's classifier.
fn trained_network(
    pp: &TrainingData,
    w: &Weights,
) -> Result<(Vec<FoldedConv>, Linear), ExportError> {
    let mut folded = pp.backbone.folded()?;
    for (c, f) in pp.backbone.net.convs().zip(folded.iter_mut()) {
        if let Some(t) = w.get(&c.weight_name()) {
            let b = w
                .get(&format!("{}.conv.bias", c.name))
                .ok_or_else(|| ExportError::RunLacks(format!("{}.conv.bias", c.name)))?;
            *f = FoldedConv {
                weight: t.clone(),
                bias: b.data.clone(),
            };
        }
    }
    let get = |n: &str| {
        w.get(n)
            .cloned()
            .ok_or_else(|| ExportError::RunLacks(format!("`{n}`")))
    };
    Ok((
        folded,
        Linear {
            weight: get("classifier.weight")?,
            bias: get("classifier.bias")?.data,
        },
    ))
}
