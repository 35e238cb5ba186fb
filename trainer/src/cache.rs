//! `trainer prepare`: the sample cache (decoded + preprocessed pixels in shards) and the feature
//! cache (the frozen backbone's output at the freeze boundary), both content-addressed.
//!
//! - The **sample cache** key is a hash of the preprocessing spec and, per sample, the sha256 of its
//!   encoded bytes and its label name, in a canonical order (label, then content hash). Paths and
//!   row order do not enter it: the same images read through ImageFolder, CSV or Parquet share one
//!   cache (and so one split and one training run per seed). A changed image, label or spec is a new key.
//!   Samples are stored as 8-bit RGB pixels after resize + crop (`PreprocessSpec::to_pixels`),
//!   sample `i` in shard `i % shards`; normalisation happens on read, with the same code as inference.
//! - The **feature cache** key adds the backbone's weight hash and the freeze boundary. The backbone
//!   runs once per sample per key, whatever the engine; later fits and tuning trials only read it.
//!
//! Every file is written to a temporary name, fsynced and renamed, so a crash leaves either the
//! old state or the new one.

use std::fs::{self, File};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

use image::RgbImage;
use indicatif::{ProgressBar, ProgressStyle};
use kestrel_models::backbone::Backbone;
use kestrel_models::onnx::LowerOpts;
use kestrel_models::{Engine, EngineKind, Tensor};
use kestrel_shared::{ImageLimits, PreprocessError, PreprocessSpec, preprocess::decode};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::data::Dataset;

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{0}\n(pass --skip-invalid to skip undecodable images and continue)")]
    Invalid(PreprocessError),
    #[error("{path}: corrupt cache metadata: {reason}")]
    Meta { path: String, reason: String },
    #[error("{path}: shard has {found} bytes, expected {expected}")]
    Shard {
        path: String,
        found: u64,
        expected: u64,
    },
    #[error("only {samples} usable samples for {workers} workers: every worker needs at least one")]
    TooFewSamples { samples: usize, workers: usize },
    #[error("no usable samples in {0}")]
    Empty(String),
    #[error(transparent)]
    Backbone(#[from] kestrel_models::backbone::BackboneError),
    #[error(transparent)]
    Engine(#[from] kestrel_models::EngineError),
    #[error(transparent)]
    Collective(#[from] crate::collective::CollectiveError),
    #[error("feature extraction worker {rank}: {message}")]
    Worker { rank: usize, message: String },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CacheError + '_ {
    move |source| CacheError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Writes `bytes` to `path` crash-safely (see [`kestrel_shared::fsutil::write_atomic`]), creating
/// the directory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CacheError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(io(dir))?;
    kestrel_shared::fsutil::write_atomic(path, bytes).map_err(io(path))
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, CacheError> {
    let text = fs::read_to_string(path).map_err(io(path))?;
    serde_json::from_str(&text).map_err(|e| CacheError::Meta {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

fn write_json<T: Serialize>(path: &Path, v: &T) -> Result<(), CacheError> {
    write_atomic(
        path,
        serde_json::to_string_pretty(v)
            .expect("serializable")
            .as_bytes(),
    )
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// What the sample cache holds, besides the pixels.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PreparedMeta {
    pub key: String,
    pub source: String,
    pub spec: PreprocessSpec,
    pub labels: Vec<String>,
    pub ids: Vec<String>,
    pub sample_labels: Vec<usize>,
    pub content_sha256: Vec<String>,
    pub shards: usize,
    /// Samples left out with `--skip-invalid`: (id, reason).
    pub skipped: Vec<(String, String)>,
}

/// An opened sample cache.
pub struct Prepared {
    pub dir: PathBuf,
    pub meta: PreparedMeta,
    /// True when this call found the cache already built.
    pub reused: bool,
}

/// Shard count for `workers`: never fewer than the workers, and shards of at most 4096 samples.
pub fn shard_count(samples: usize, workers: usize) -> usize {
    let workers = workers.max(1);
    workers * samples.div_ceil(workers * 4096).max(1)
}

/// The canonical sample order — by label, then content hash — and the cache key over it. Paths and
/// table order do not matter, so every source of the same images gives the same cache, split and run.
fn canonical_order(ds: &Dataset, spec: &PreprocessSpec) -> (String, Vec<(usize, String)>) {
    let mut order: Vec<(usize, String)> = ds
        .samples
        .iter()
        .enumerate()
        .map(|(i, s)| (i, sha256_hex(&s.bytes)))
        .collect();
    order.sort_by(|a, b| (ds.samples[a.0].label, &a.1).cmp(&(ds.samples[b.0].label, &b.1)));
    let mut h = Sha256::new();
    h.update(b"kestrel-samples-v1\0");
    h.update(serde_json::to_vec(spec).expect("spec serializes"));
    for (i, sha) in &order {
        h.update(sha.as_bytes());
        h.update(ds.labels[ds.samples[*i].label].as_bytes());
        h.update([0]);
    }
    (hex::encode(h.finalize()), order)
}

pub fn progress(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{msg:>12} [{bar:30}] {pos}/{len} {per_sec} eta {eta}")
            .expect("template")
            .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

impl Prepared {
    /// Opens the cache for `ds` under `root`, building it (or re-sharding it) when needed.
    pub fn open_or_build(
        root: &Path,
        ds: &Dataset,
        spec: &PreprocessSpec,
        workers: usize,
        skip_invalid: bool,
    ) -> Result<Prepared, CacheError> {
        let (key, order) = canonical_order(ds, spec);
        let dir = root.join("samples").join(&key[..32]);
        let meta_path = dir.join("meta.json");
        if meta_path.exists() {
            let meta: PreparedMeta = read_json(&meta_path)?;
            let p = Prepared {
                dir,
                meta,
                reused: true,
            };
            if p.meta.ids.len() < workers.max(1) {
                return Err(CacheError::TooFewSamples {
                    samples: p.meta.ids.len(),
                    workers,
                });
            }
            if p.meta.shards >= workers.max(1) && p.meta.key == key {
                return Ok(p);
            }
            // Fewer shards than workers: re-shard the cached pixels, no decoding.
            let pixels = p.load_pixels()?;
            let meta = PreparedMeta {
                shards: shard_count(pixels.len(), workers),
                ..p.meta.clone()
            };
            return Self::write(p.dir, meta, &pixels, true);
        }
        let limits = ImageLimits::default();
        let pb = progress(ds.samples.len() as u64, "decoding");
        let mut pixels = Vec::with_capacity(ds.samples.len());
        let (mut ids, mut labels, mut content, mut skipped) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (i, sha) in order {
            let s = &ds.samples[i];
            pb.inc(1);
            match decode(&s.bytes, &s.id, &limits).and_then(|img| spec.to_pixels(&img)) {
                Ok(px) => {
                    pixels.push(px.into_raw());
                    ids.push(s.id.clone());
                    labels.push(s.label);
                    content.push(sha);
                }
                Err(e) if skip_invalid => skipped.push((s.id.clone(), e.to_string())),
                Err(e) => return Err(CacheError::Invalid(e)),
            }
        }
        pb.finish_and_clear();
        if pixels.is_empty() {
            return Err(CacheError::Empty(ds.source.clone()));
        }
        if pixels.len() < workers.max(1) {
            return Err(CacheError::TooFewSamples {
                samples: pixels.len(),
                workers,
            });
        }
        let meta = PreparedMeta {
            key,
            source: ds.source.clone(),
            spec: spec.clone(),
            labels: ds.labels.clone(),
            ids,
            sample_labels: labels,
            content_sha256: content,
            shards: shard_count(pixels.len(), workers),
            skipped,
        };
        Self::write(dir, meta, &pixels, false)
    }

    fn write(
        dir: PathBuf,
        meta: PreparedMeta,
        pixels: &[Vec<u8>],
        reused: bool,
    ) -> Result<Prepared, CacheError> {
        fs::create_dir_all(&dir).map_err(io(&dir))?;
        for shard in 0..meta.shards {
            let mut buf = Vec::new();
            for px in pixels.iter().skip(shard).step_by(meta.shards) {
                buf.extend_from_slice(px);
            }
            write_atomic(&dir.join(format!("shard-{shard:05}.bin")), &buf)?;
        }
        // meta.json last: its presence marks a complete cache.
        write_json(&dir.join("meta.json"), &meta)?;
        Ok(Prepared { dir, meta, reused })
    }

    pub fn len(&self) -> usize {
        self.meta.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.meta.ids.is_empty()
    }

    fn sample_bytes(&self) -> usize {
        let [h, w] = self.meta.spec.input_size;
        3 * h as usize * w as usize
    }

    /// Indices of the samples stored in `shard`, in order.
    pub fn shard_samples(&self, shard: usize) -> impl Iterator<Item = usize> {
        (shard..self.len()).step_by(self.meta.shards)
    }

    /// All samples' pixels (RGB8 HWC, `input_size`), in sample order.
    pub fn load_pixels(&self) -> Result<Vec<Vec<u8>>, CacheError> {
        let mut out = vec![Vec::new(); self.len()];
        for shard in 0..self.meta.shards {
            for (i, px) in self.load_shard(shard)? {
                out[i] = px;
            }
        }
        Ok(out)
    }

    /// The samples of one shard with their pixels, in sample order.
    pub fn load_shard(&self, shard: usize) -> Result<Vec<(usize, Vec<u8>)>, CacheError> {
        let per = self.sample_bytes();
        let path = self.dir.join(format!("shard-{shard:05}.bin"));
        let mut buf = Vec::new();
        File::open(&path)
            .and_then(|mut f| f.read_to_end(&mut buf))
            .map_err(io(&path))?;
        let idx: Vec<usize> = self.shard_samples(shard).collect();
        let expected = (idx.len() * per) as u64;
        if buf.len() as u64 != expected {
            return Err(CacheError::Shard {
                path: path.display().to_string(),
                found: buf.len() as u64,
                expected,
            });
        }
        Ok(idx
            .into_iter()
            .zip(buf.chunks(per))
            .map(|(i, c)| (i, c.to_vec()))
            .collect())
    }

    /// The samples rank `rank` of `world` owns: those of shards `rank, rank + world, ...`
    /// (every rank reads only its own shards), in sample order.
    pub fn rank_samples(&self, rank: usize, world: usize) -> Vec<usize> {
        let mut v: Vec<usize> = (rank..self.meta.shards)
            .step_by(world)
            .flat_map(|s| self.shard_samples(s))
            .collect();
        v.sort_unstable();
        v
    }

    /// One sample's normalised tensor (CHW f32), from its cached pixels.
    pub fn normalize(&self, pixels: &[u8]) -> Vec<f32> {
        let [h, w] = self.meta.spec.input_size;
        let img = RgbImage::from_raw(w, h, pixels.to_vec()).expect("cached pixels have input_size");
        self.meta.spec.normalize(&img)
    }
}

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
    }
}

/// Runs the frozen part over normalised samples in batches of 32, with a progress bar.
pub fn run_frozen(
    engine: &dyn Engine,
    prepared: &Prepared,
    pixels: &[&[u8]],
    out_per_sample: usize,
    label: &str,
) -> Result<Vec<f32>, CacheError> {
    let pb = progress(pixels.len() as u64, label);
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

/// Opens or computes the feature cache of `prepared` at `boundary` with one worker.
pub fn features(
    root: &Path,
    prepared: &Prepared,
    backbone: &Backbone,
    boundary: usize,
    engine: EngineKind,
    threads: usize,
) -> Result<Features, CacheError> {
    features_local(root, prepared, backbone, boundary, engine, threads, 1)
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

/// Opens or computes the feature cache with `workers` local workers: each builds its own engine
/// (`threads / workers` threads), runs the frozen backbone over its own shards of the sample cache,
/// and the features are gathered in sample order ([`extract_rank`]).
pub fn features_local(
    root: &Path,
    prepared: &Prepared,
    backbone: &Backbone,
    boundary: usize,
    engine: EngineKind,
    threads: usize,
    workers: usize,
) -> Result<Features, CacheError> {
    let world = workers.max(1);
    let comms = crate::collective::local_group(world, crate::collective::DEFAULT_TIMEOUT);
    if world == 1 {
        return features_on(
            root, prepared, backbone, boundary, engine, threads, &comms[0],
        );
    }
    let per_worker = (threads / world).max(1);
    let results: Vec<Result<Features, CacheError>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let _guard = crate::collective::AbortOnPanic(c);
                    let r = features_on(root, prepared, backbone, boundary, engine, per_worker, c);
                    if let Err(e) = &r {
                        crate::collective::Collective::abort(c, &e.to_string());
                    }
                    r
                })
            })
            .collect();
        hs.into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|_| {
                    Err(CacheError::Worker {
                        rank,
                        message: "panicked".into(),
                    })
                })
            })
            .collect()
    });
    let mut first_err = None;
    let mut lead = None;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(f) if rank == 0 => lead = Some(f),
            Ok(_) => {}
            Err(CacheError::Collective(crate::collective::CollectiveError::PeerFailed {
                ..
            })) if first_err.is_some() => {}
            Err(e) => {
                if first_err.is_none()
                    || matches!(
                        first_err,
                        Some(CacheError::Collective(
                            crate::collective::CollectiveError::PeerFailed { .. }
                        ))
                    )
                {
                    first_err = Some(match e {
                        e @ (CacheError::Collective(_) | CacheError::Worker { .. }) => e,
                        e => CacheError::Worker {
                            rank,
                            message: e.to_string(),
                        },
                    });
                }
            }
        }
    }
    match (first_err, lead) {
        (Some(e), _) => Err(e),
        (None, Some(f)) => Ok(f),
        (None, None) => unreachable!("rank 0 returns features or an error"),
    }
}

/// One rank's part of opening or computing the feature cache (local workers or MPI ranks): the
/// ranks agree whether every one of them sees a complete cache; if not, each extracts its own
/// shards ([`extract_rank`]) and rank 0 writes the cache. Every rank returns all features.
pub fn features_on(
    root: &Path,
    prepared: &Prepared,
    backbone: &Backbone,
    boundary: usize,
    engine: EngineKind,
    threads: usize,
    comm: &dyn crate::collective::Collective,
) -> Result<Features, CacheError> {
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
    let data = extract_rank(prepared, backbone, &opts, engine, threads, comm)?;
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
    threads: usize,
    comm: &dyn crate::collective::Collective,
) -> Result<Vec<f32>, CacheError> {
    let (rank, world) = (comm.rank(), comm.world());
    let per: usize = opts.output_shape(&backbone.net).iter().product();
    let engine_impl = backbone.engine(engine, opts, threads)?;
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
    let local = run_frozen(engine_impl.as_ref(), prepared, &refs, per, &label)?;
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
        return Err(CacheError::Worker {
            rank,
            message: format!("gathered {} feature values, expected {at}", gathered.len()),
        });
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_never_fewer_than_workers() {
        assert_eq!(shard_count(10, 1), 1);
        assert_eq!(shard_count(10, 4), 4);
        assert_eq!(shard_count(10_000, 1), 3);
        assert_eq!(shard_count(10_000, 2), 4);
    }
}
