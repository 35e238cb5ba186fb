//! Data ready for training: the table loaded, its sample and feature caches, and the split.

use kestrel_models::backbone::Backbone;
use serde::{Deserialize, Serialize};

use super::head::FeatureRows;
use super::{FitParams, TrainError};
use crate::data::cache::features;
use crate::data::split::{self, Split};
use crate::data::{self, Dataset, Features, Prepared, SamplePlan};
use crate::distributed::Job;

/// Data ready for training: cached samples and features, labels and split.
pub struct TrainingData {
    pub dataset_labels: Vec<String>,
    pub prepared: Prepared,
    pub features: Features,
    pub splits: Vec<Split>,
    pub backbone: Backbone,
    pub boundary: usize,
    /// Rows of the tables left out for having no label (`--skip-unlabelled`).
    pub unlabelled: usize,
    /// The tables read this time (the sample cache's own `source` is the first reader's).
    pub tables: Vec<data::TableRef>,
}

impl TrainingData {
    pub fn indices(&self, s: Split) -> Vec<usize> {
        (0..self.splits.len())
            .filter(|&i| self.splits[i] == s)
            .collect()
    }

    pub fn labels(&self) -> &[usize] {
        &self.prepared.meta.sample_labels
    }

    /// The cached features as rows with their labels.
    pub fn rows(&self) -> FeatureRows<'_> {
        FeatureRows {
            data: &self.features.data,
            dim: self.features.per_sample(),
            labels: self.labels(),
        }
    }
}

/// Which sample went to which split, written into every run directory.

/// One sample's assignment: its id in the table, label, content hash and split.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SplitRecord {
    pub split: Split,
    pub id: String,
    pub label: String,
    pub sha256: String,
}

pub fn split_records(pp: &TrainingData) -> Vec<SplitRecord> {
    let m = &pp.prepared.meta;
    (0..pp.splits.len())
        .map(|i| SplitRecord {
            split: pp.splits[i],
            id: m.ids[i].clone(),
            label: m.labels[m.sample_labels[i]].clone(),
            sha256: m.content_sha256[i].clone(),
        })
        .collect()
}

/// Loads the tables (one dataset), builds or reuses the sample cache (rank 0 first under MPI) and
/// the feature cache (extracted by the job's ranks together), and splits.
pub fn prepare(p: &FitParams, job: &Job) -> Result<TrainingData, TrainError> {
    let ds: Dataset = data::load_all(&p.data_paths(), &p.source)?;
    for (source, n) in &ds.unlabelled {
        job.log(format!("{n} unlabelled rows skipped from {source}"));
    }
    let arch = p
        .arch
        .as_deref()
        .map(|a| {
            kestrel_models::Arch::parse(a)
                .ok_or_else(|| TrainError::Invalid(format!("unknown architecture `{a}`")))
        })
        .transpose()?;
    let backbone = Backbone::open(&p.backbone, arch, &p.onnx_opts())?;
    let blocks = backbone.net.blocks.len();
    if blocks == 0 && p.unfreeze_last > 0 {
        return Err(TrainError::Invalid(format!(
            "--unfreeze-last/--fine-tune {}: an ONNX backbone is frozen whole; to train its last \
             blocks, map its weights onto an architecture Kestrel describes (`trainer import-weights \
             --from {} --arch A`) and pass the result with --arch",
            p.unfreeze_last, p.backbone
        )));
    }
    if p.unfreeze_last >= blocks.max(1) {
        return Err(TrainError::Invalid(format!(
            "--unfreeze-last {} but {} has {blocks} blocks",
            p.unfreeze_last, backbone.net.arch
        )));
    }
    let boundary = blocks - p.unfreeze_last;
    let plan = SamplePlan::new(job.cache_root(), &ds, &backbone.net.preprocess);
    let fused = features::extract_while_decoding(
        job,
        &plan,
        &ds,
        &backbone,
        boundary,
        p.engine,
        p.skip_invalid,
    )?;
    let (prepared, features) = match fused {
        Some(both) => both,
        None => {
            let prepared = job.lead_first(|| {
                Prepared::open_or_build(
                    &plan,
                    &ds,
                    job.world(),
                    job.threads(),
                    p.skip_invalid,
                    &mut |_| Ok(()),
                )
            })?;
            let features = features::features(job, &prepared, &backbone, boundary, p.engine)?;
            (prepared, features)
        }
    };
    job.log(format!(
        "samples: {} from {} ({} classes){}, cache {} {}",
        prepared.len(),
        ds.source,
        ds.labels.len(),
        match prepared.meta.skipped.len() {
            0 => String::new(),
            n => format!(", {n} invalid skipped"),
        },
        if prepared.reused { "reused" } else { "built" },
        prepared.dir.display()
    ));
    for (id, why) in prepared.meta.skipped.iter().take(5) {
        job.log(format!("  skipped {id}: {why}"));
    }
    job.log(format!(
        "features: boundary {boundary}/{blocks} dims {:?}, backbone runs: {} ({})",
        features.meta.dims,
        features.computed,
        match (features.hit, features.computed, features.reused) {
            (true, ..) => "cache hit".to_string(),
            (false, 0, n) => format!("all {n} rows reused from other feature caches"),
            (false, _, copied) => format!(
                "{}{:.1}s on {}, {} worker(s)",
                match copied {
                    0 => String::new(),
                    n => format!("{n} rows reused from other feature caches, "),
                },
                features.meta.seconds,
                p.engine,
                features.meta.workers
            ),
        }
    ));
    let labels = prepared.meta.sample_labels.clone();
    let classes = prepared.meta.labels.len();
    let splits = split::stratified(&labels, classes, p.val_fraction, p.test_fraction, p.seed);
    Ok(TrainingData {
        dataset_labels: prepared.meta.labels.clone(),
        prepared,
        features,
        splits,
        backbone,
        boundary,
        unlabelled: ds.unlabelled_total(),
        tables: ds.tables,
    })
}
