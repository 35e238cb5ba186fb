//! The feature cache: the frozen backbone's output at the freeze boundary for every cached
//! sample, computed once per (samples, backbone weights, boundary) and shared by every fit and trial.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

use indicatif::ProgressBar;
use kestrel_models::backbone::Backbone;
use kestrel_models::onnx::LowerOpts;
use kestrel_models::{Engine, EngineKind, Tensor};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::cache::{CacheError, io, read_json, write_atomic, write_json};
use super::samples::Prepared;
use crate::distributed::{Job, Rank, WorkerError};

/// Identity of a backbone's weights: sha256 over the architecture and every canonical tensor.
pub fn backbone_id(b: &Backbone) -> String {
    let mut h = Sha256::new();
    h.update(b.net.arch.name().as_bytes());
    for (name, t) in &b.weights {
        h.update(name.as_bytes());
        for d in &t.shape {
            h.update((*d as u64).to_le_bytes());
        }
        for v in &t.data {
            h.update(v.to_le_bytes());
        }
    }
    hex::encode(h.finalize())
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FeatureMeta {
    pub samples_key: String,
    pub backbone_id: String,
    pub arch: String,
    /// Blocks `[0, boundary)` are frozen and precomputed; `boundary == blocks.len()` adds pooling.
    pub boundary: usize,
    pub dims: Vec<usize>,
    pub engine: EngineKind,
    pub seconds: f64,
    /// Workers (ranks) that extracted the features (older caches: 1).
    #[serde(default = "one")]
    pub workers: usize,
}

fn one() -> usize {
    1
}

/// Cached backbone outputs for every sample of a [`Prepared`] cache.
pub struct Features {
    pub meta: FeatureMeta,
    pub data: Vec<f32>,
    /// Backbone runs done by this call (0 on a cache hit).
    pub computed: usize,
    /// The cache directory (`meta.json`, `features.f32`).
    pub dir: PathBuf,
}

impl Features {
    pub fn per_sample(&self) -> usize {
        self.meta.dims.iter().product()
    }

    pub fn row(&self, i: usize) -> &[f32] {
        let n = self.per_sample();
        &self.data[i * n..(i + 1) * n]
    }
}

/// The lowering of the frozen part `[0, boundary)`.
pub fn frozen_opts(b: &Backbone, boundary: usize) -> LowerOpts {
    let full = b.net.blocks.len();
    LowerOpts {
        blocks: 0..boundary,
        pool: boundary == full,
        classifier: None,
        output_name: "features".into(),
        quant: Default::default(),
        probe: false,
        features_output: None,
    }
}

/// Runs the frozen part over normalised samples in batches of 32, with a progress bar.
pub fn run_frozen(
    engine: &dyn Engine,
    prepared: &Prepared,
    pixels: &[&[u8]],
    out_per_sample: usize,
    pb: &ProgressBar,
) -> Result<Vec<f32>, CacheError> {
    let [h, w] = prepared.meta.spec.input_size;
    let mut out = Vec::with_capacity(pixels.len() * out_per_sample);
    for chunk in pixels.chunks(32) {
        let mut data = Vec::with_capacity(chunk.len() * prepared.sample_bytes());
        for px in chunk {
            data.extend(prepared.normalize(px));
        }
        let y = engine.run(&Tensor::new(
            vec![chunk.len(), 3, h as usize, w as usize],
            data,
        ))?;
        out.extend(y.data);
        pb.inc(chunk.len() as u64);
    }
    pb.finish_and_clear();
    Ok(out)
}

fn feature_dir(root: &Path, prepared: &Prepared, bid: &str, boundary: usize) -> PathBuf {
    root.join("features").join(format!(
        "{}-{}-b{boundary}",
        &prepared.meta.key[..16],
        &bid[..16]
    ))
}

/// Opens or computes the feature cache of `prepared` at `boundary` on the job's ranks: the ranks
/// agree whether every one of them sees a complete cache; if not, each runs the frozen backbone on
/// its own engine over its own shards ([`extract_rank`]), the features are gathered in sample
/// order and rank 0 writes the cache. Every rank gets all features.
pub fn features(
    job: &Job,
    prepared: &Prepared,
    backbone: &Backbone,
    boundary: usize,
    engine: EngineKind,
) -> Result<Features, CacheError> {
    let root = job.cache_root();
    job.run(|rank| open_or_extract(root, prepared, backbone, boundary, engine, rank))
}

/// Reads a complete feature cache, if there is one.
fn read_features(
    dir: &Path,
    prepared: &Prepared,
    per: usize,
) -> Result<Option<Features>, CacheError> {
    let meta_path = dir.join("meta.json");
    let data_path = dir.join("features.f32");
    if !meta_path.exists() {
        return Ok(None);
    }
    let meta: FeatureMeta = read_json(&meta_path)?;
    let bytes = fs::read(&data_path).map_err(io(&data_path))?;
    let expected = (prepared.len() * per * 4) as u64;
    if bytes.len() as u64 != expected {
        return Err(CacheError::Shard {
            path: data_path.display().to_string(),
            found: bytes.len() as u64,
            expected,
        });
    }
    let data = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Ok(Some(Features {
        meta,
        data,
        computed: 0,
        dir: dir.to_path_buf(),
    }))
}

/// One rank's part of [`features`].
fn open_or_extract(
    root: &Path,
    prepared: &Prepared,
    backbone: &Backbone,
    boundary: usize,
    engine: EngineKind,
    rank: &Rank<'_>,
) -> Result<Features, CacheError> {
    let comm = rank.comm;
    let bid = backbone_id(backbone);
    let dir = feature_dir(root, prepared, &bid, boundary);
    let opts = frozen_opts(backbone, boundary);
    let dims = opts.output_shape(&backbone.net);
    let per: usize = dims.iter().product();
    let cached = read_features(&dir, prepared, per)?;
    let mut have = [f64::from(u8::from(cached.is_some()))];
    comm.allreduce_sum_f64(&mut have)?;
    if have[0] as usize == comm.world() {
        return Ok(cached.expect("this rank has it"));
    }
    let start = Instant::now();
    let data = extract_rank(prepared, backbone, &opts, engine, rank)?;
    let meta = FeatureMeta {
        samples_key: prepared.meta.key.clone(),
        backbone_id: bid,
        arch: backbone.net.arch.to_string(),
        boundary,
        dims,
        engine,
        seconds: start.elapsed().as_secs_f64(),
        workers: comm.world(),
    };
    if comm.rank() == 0 {
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        write_atomic(&dir.join("features.f32"), &bytes)?;
        write_json(&dir.join("meta.json"), &meta)?;
    }
    Ok(Features {
        meta,
        computed: prepared.len(),
        data,
        dir,
    })
}

/// Runs the frozen part (`opts`) over this rank's shards ([`Prepared::rank_samples`]) on its own
/// engine and gathers every rank's output in sample order.
pub fn extract_rank(
    prepared: &Prepared,
    backbone: &Backbone,
    opts: &LowerOpts,
    engine: EngineKind,
    r: &Rank<'_>,
) -> Result<Vec<f32>, CacheError> {
    let (comm, rank, world) = (r.comm, r.rank(), r.world());
    let per: usize = opts.output_shape(&backbone.net).iter().product();
    let engine_impl = backbone.engine(engine, opts, r.threads)?;
    let mut mine: Vec<(usize, Vec<u8>)> = Vec::new();
    for shard in (rank..prepared.meta.shards).step_by(world) {
        mine.extend(prepared.load_shard(shard)?);
    }
    mine.sort_by_key(|m| m.0);
    let refs: Vec<&[u8]> = mine.iter().map(|m| m.1.as_slice()).collect();
    let label = if world == 1 {
        "features".to_string()
    } else {
        format!("features {rank}/{world}")
    };
    let pb = r.progress(refs.len() as u64, &label);
    let local = run_frozen(engine_impl.as_ref(), prepared, &refs, per, &pb)?;
    if world == 1 {
        return Ok(local);
    }
    let gathered = comm.allgather_f32(&local)?;
    let mut data = vec![0f32; prepared.len() * per];
    let mut at = 0;
    for r in 0..world {
        for i in prepared.rank_samples(r, world) {
            data[i * per..(i + 1) * per].copy_from_slice(&gathered[at..at + per]);
            at += per;
        }
    }
    if at != gathered.len() {
        return Err(WorkerError {
            rank,
            message: format!("gathered {} feature values, expected {at}", gathered.len()),
        }
        .into());
    }
    Ok(data)
}
