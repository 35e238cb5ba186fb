//! The feature cache: the frozen backbone's output at the freeze boundary for every cached
//! sample, computed once per (samples, backbone weights, boundary) and shared by every fit and trial.
//! A new sample set (a table with rows added, several tables together) copies the rows other
//! caches of the same backbone, boundary and preprocessing already hold, by content hash, and runs
//! the backbone only on the samples none has. Rows computed elsewhere (a Spark task of
//! `kestrel.spark.features(..., cache=)`) are stored the same way ([`store_rows`]): a feature
//! cache whose meta names its rows' contents itself, found by content like any other.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::Instant;

use indicatif::ProgressBar;
use kestrel_models::backbone::Backbone;
use kestrel_models::onnx::LowerOpts;
use kestrel_models::{Engine, EngineKind, Tensor};
use kestrel_shared::PreprocessSpec;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::samples::{Prepared, PreparedMeta, SamplePlan};
use super::{CacheError, io, read_json, write_f32s, write_json};
use crate::data::Dataset;
use crate::distributed::{self, Job, Rank, WorkerError};

/// Identity of a backbone's weights: sha256 over the architecture and every canonical tensor.
pub fn backbone_id(b: &Backbone) -> String {
    let mut h = Sha256::new();
    h.update(b.net.arch.name().as_bytes());
    if let Some(g) = &b.graph {
        h.update(g.id().as_bytes());
    }
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
    /// Rows copied from other feature caches when this one was built (the backbone ran on the
    /// others; older caches: 0).
    #[serde(default)]
    pub reused: usize,
    /// Rows stored apart from any sample cache ([`store_rows`]): what they are; `None` for a
    /// sample cache's features (its `samples_key` names them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows: Option<RowsMeta>,
}

/// What the rows of a feature cache stored by [`store_rows`] are.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RowsMeta {
    /// Each row's image: the sha256 of its encoded bytes, in row order.
    pub content_sha256: Vec<String>,
    pub spec: PreprocessSpec,
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
    /// Rows this call did not run the backbone for: every row on a cache hit, else the rows
    /// copied from other feature caches of the same backbone, boundary and preprocessing.
    pub reused: usize,
    /// True when this call found the cache already built.
    pub hit: bool,
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
    spec: &PreprocessSpec,
    pixels: &[&[u8]],
    out_per_sample: usize,
    pb: &ProgressBar,
) -> Result<Vec<f32>, CacheError> {
    let [h, w] = spec.input_size;
    let per = 3 * (h * w) as usize;
    let mut out = Vec::with_capacity(pixels.len() * out_per_sample);
    for chunk in pixels.chunks(32) {
        crate::interrupt::check()?;
        let mut data = vec![0f32; chunk.len() * per];
        for (px, dst) in chunk.iter().zip(data.chunks_exact_mut(per)) {
            spec.normalize_into(px, dst);
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

fn feature_dir(root: &Path, samples_key: &str, bid: &str, boundary: usize) -> PathBuf {
    root.join("features")
        .join(format!("{}-{}-b{boundary}", &samples_key[..16], &bid[..16]))
}

/// Stores feature rows the backbone computed elsewhere (the pooled features of `backbone`, for
/// images whose encoded bytes have the sha256s `content`, `data` their rows one after another)
/// as a feature cache under `root` that later fits find by content ([`Reusable`]) and do not
/// run the backbone for. The directory is named by a hash of the contents, so storing the same
/// rows again (a retried task) rewrites the same files. Returns the directory.
pub fn store_rows(
    root: &Path,
    backbone: &Backbone,
    content: Vec<String>,
    data: &[f32],
    engine: EngineKind,
    seconds: f64,
) -> Result<PathBuf, CacheError> {
    let spec = backbone.net.preprocess.clone();
    let mut h = Sha256::new();
    h.update(b"kestrel-feature-rows-v1\0");
    h.update(serde_json::to_vec(&spec).expect("spec serializes"));
    for sha in &content {
        h.update(sha.as_bytes());
        h.update([0]);
    }
    let key = hex::encode(h.finalize());
    let target = FeatureDir::new(root, &key, backbone, backbone.net.blocks.len());
    let per = target.per_sample();
    if data.len() != content.len() * per {
        return Err(CacheError::Meta {
            path: root.display().to_string(),
            source: format!(
                "{} feature values for {} images of {per}",
                data.len(),
                content.len()
            )
            .into(),
        });
    }
    let meta = FeatureMeta {
        samples_key: key,
        backbone_id: target.bid,
        arch: target.arch,
        boundary: target.boundary,
        dims: target.dims,
        engine,
        seconds,
        workers: 1,
        reused: 0,
        rows: Some(RowsMeta {
            content_sha256: content,
            spec,
        }),
    };
    write_f32s(&target.dir.join("features.f32"), data)?;
    write_json(&target.dir.join("meta.json"), &meta)?;
    Ok(target.dir)
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
        reused: prepared.len(),
        hit: true,
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
    let target = FeatureDir::new(root, &prepared.meta.key, backbone, boundary);
    let per = target.per_sample();
    let cached = read_features(&target.dir, prepared, per)?;
    let mut have = [f64::from(u8::from(cached.is_some()))];
    comm.allreduce_sum_f64(&mut have)?;
    if have[0] as usize == comm.world() {
        return Ok(cached.expect("this rank has it"));
    }
    let start = Instant::now();
    let content: Vec<&str> = prepared
        .meta
        .content_sha256
        .iter()
        .map(String::as_str)
        .collect();
    let reuse = Reusable::find(root, &content, &prepared.meta.spec, &target)?;
    let reuse = reuse.agreed(prepared.len(), per, comm)?;
    let computed = reuse.missing.len();
    let opts = &target.opts;
    let data = if computed == prepared.len() {
        extract_rank(prepared, backbone, opts, engine, rank)?
    } else {
        let mut data = reuse.data;
        let new = extract_samples(prepared, backbone, opts, engine, rank, &reuse.missing)?;
        for (&i, row) in reuse.missing.iter().zip(new.chunks_exact(per)) {
            data[i * per..(i + 1) * per].copy_from_slice(row);
        }
        data
    };
    let ran = Ran {
        engine,
        start,
        workers: comm.world(),
        computed,
    };
    target.store(prepared, data, ran, comm.rank() == 0)
}

/// Where a sample set's features at a boundary go, and how the frozen part is lowered for them.
struct FeatureDir {
    bid: String,
    boundary: usize,
    arch: String,
    opts: LowerOpts,
    dims: Vec<usize>,
    dir: PathBuf,
}

/// How a feature cache's rows were computed.
struct Ran {
    engine: EngineKind,
    start: Instant,
    workers: usize,
    /// Rows the backbone ran on (the others were reused).
    computed: usize,
}

impl FeatureDir {
    fn new(root: &Path, samples_key: &str, backbone: &Backbone, boundary: usize) -> FeatureDir {
        let bid = backbone_id(backbone);
        let opts = frozen_opts(backbone, boundary);
        FeatureDir {
            dims: opts.output_shape(&backbone.net),
            dir: feature_dir(root, samples_key, &bid, boundary),
            arch: backbone.net.arch.to_string(),
            bid,
            boundary,
            opts,
        }
    }

    fn per_sample(&self) -> usize {
        self.dims.iter().product()
    }

    /// Writes the cache (when `write`: rank 0) and returns it.
    fn store(
        self,
        prepared: &Prepared,
        data: Vec<f32>,
        ran: Ran,
        write: bool,
    ) -> Result<Features, CacheError> {
        let reused = prepared.len() - ran.computed;
        let meta = FeatureMeta {
            samples_key: prepared.meta.key.clone(),
            backbone_id: self.bid,
            arch: self.arch,
            boundary: self.boundary,
            dims: self.dims,
            engine: ran.engine,
            seconds: ran.start.elapsed().as_secs_f64(),
            workers: ran.workers,
            reused,
            rows: None,
        };
        if write {
            write_f32s(&self.dir.join("features.f32"), &data)?;
            write_json(&self.dir.join("meta.json"), &meta)?;
        }
        Ok(Features {
            meta,
            computed: ran.computed,
            reused,
            hit: false,
            data,
            dir: self.dir,
        })
    }
}

/// Builds a new sample cache and its feature cache in one pass, for a one-worker job whose
/// samples no cache holds yet (neither pixels nor any feature row by content): the frozen
/// backbone runs on each chunk of samples as soon as it is decoded, while the next chunks
/// decode ([`Prepared::open_or_build`]'s bounded pipeline), instead of after the whole table.
/// `None` when that does not apply (then [`Prepared::open_or_build`] and [`features`]).
pub fn extract_while_decoding(
    job: &Job,
    plan: &SamplePlan,
    ds: &Dataset,
    backbone: &Backbone,
    boundary: usize,
    engine: EngineKind,
    skip_invalid: bool,
) -> Result<Option<(Prepared, Features)>, CacheError> {
    if job.world() != 1 || job.procs().is_some() || plan.is_built() {
        return Ok(None);
    }
    let root = job.cache_root();
    let target = FeatureDir::new(root, &plan.key, backbone, boundary);
    let content: Vec<&str> = plan.content().collect();
    if Reusable::find(root, &content, &plan.spec, &target)?
        .missing
        .len()
        != content.len()
    {
        return Ok(None);
    }
    let start = Instant::now();
    let frozen = backbone.engine(engine, &target.opts, job.engine_opts())?;
    let per = target.per_sample();
    let mut data = Vec::with_capacity(content.len() * per);
    let prepared = Prepared::open_or_build(plan, ds, 1, job.threads(), skip_invalid, &mut |px| {
        let refs: Vec<&[u8]> = px.iter().map(Vec::as_slice).collect();
        let hidden = ProgressBar::hidden();
        data.extend(run_frozen(
            frozen.as_ref(),
            &plan.spec,
            &refs,
            per,
            &hidden,
        )?);
        Ok(())
    })?;
    let ran = Ran {
        engine,
        start,
        workers: 1,
        computed: prepared.len(),
    };
    let features = target.store(&prepared, data, ran, true)?;
    Ok(Some((prepared, features)))
}

/// Rows of other feature caches that hold some of a sample set's features: the features of every
/// sample whose content (sha256) another cache of the same backbone weights, boundary, dims and
/// preprocessing already has. Adding rows to a table thus runs the backbone on the new rows only.
struct Reusable {
    /// `n * per` values; the rows of `missing` are zeros.
    data: Vec<f32>,
    /// The samples found nowhere, in sample order.
    missing: Vec<usize>,
}

impl Reusable {
    /// Looks through the feature caches under `root` other than `own` (only their small
    /// `meta.json` files and their sample caches' `meta.json`, then the matching rows of the
    /// candidates that have some): a cache that cannot be read is passed over.
    fn find(
        root: &Path,
        content: &[&str],
        spec: &PreprocessSpec,
        target: &FeatureDir,
    ) -> Result<Reusable, CacheError> {
        let n = content.len();
        let per = target.per_sample();
        let mut wanted: HashMap<&str, Vec<usize>> = HashMap::new();
        for (i, sha) in content.iter().enumerate() {
            wanted.entry(sha).or_default().push(i);
        }
        let mut data = vec![0f32; n * per];
        let suffix = format!("-{}-b{}", &target.bid[..16], target.boundary);
        let mut dirs: Vec<PathBuf> = fs::read_dir(root.join("features"))
            .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default();
        dirs.retain(|d| {
            *d != target.dir
                && d.file_name()
                    .is_some_and(|f| f.to_string_lossy().ends_with(&suffix))
        });
        dirs.sort();
        for dir in dirs {
            if wanted.is_empty() {
                break;
            }
            let Some(rows) = candidate_rows(root, &dir, spec, target, &wanted) else {
                continue;
            };
            if read_rows(&dir.join("features.f32"), per, &rows, &mut data).is_ok() {
                for (_, dst) in &rows {
                    wanted.remove(content[dst[0]]);
                }
            }
        }
        let mut missing: Vec<usize> = wanted.into_values().flatten().collect();
        missing.sort_unstable();
        Ok(Reusable { data, missing })
    }

    /// This rank's finding if every rank found the same missing samples (ranks on other hosts may
    /// see other caches), else nothing reused: every rank then extracts its share of everything.
    fn agreed(
        self,
        n: usize,
        per: usize,
        comm: &dyn crate::distributed::Collective,
    ) -> Result<Reusable, CacheError> {
        if comm.world() == 1 {
            return Ok(self);
        }
        // Equal on every rank iff the sum of squares is world x the mean square (counts and a
        // 20-bit hash of the list keep the sums exact in f64).
        let c = self.missing.len() as f64;
        let h = self.missing.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &i| {
            (h ^ i as u64).wrapping_mul(0x0100_0000_01b3)
        }) % (1 << 20);
        let h = h as f64;
        let mut sums = [c, c * c, h, h * h];
        comm.allreduce_sum_f64(&mut sums)?;
        let w = comm.world() as f64;
        if sums[1] * w == sums[0] * sums[0] && sums[3] * w == sums[2] * sums[2] {
            return Ok(self);
        }
        Ok(Reusable {
            data: vec![0f32; n * per],
            missing: (0..n).collect(),
        })
    }
}

/// The rows of the feature cache `dir` that hold `wanted` contents, as (its row, our samples),
/// sorted by its row; `None` when it is not a usable candidate (other backbone, boundary, dims or
/// preprocessing, unreadable, or nothing wanted).
fn candidate_rows(
    root: &Path,
    dir: &Path,
    spec: &PreprocessSpec,
    target: &FeatureDir,
    wanted: &HashMap<&str, Vec<usize>>,
) -> Option<Vec<(usize, Vec<usize>)>> {
    let meta: FeatureMeta = read_json(&dir.join("meta.json")).ok()?;
    if meta.backbone_id != target.bid
        || meta.boundary != target.boundary
        || meta.dims != target.dims
    {
        return None;
    }
    let (content, their_spec) = match meta.rows {
        Some(r) => (r.content_sha256, r.spec),
        None => {
            let key = meta.samples_key.get(..32)?;
            let samples: PreparedMeta =
                read_json(&root.join("samples").join(key).join("meta.json")).ok()?;
            if samples.key != meta.samples_key {
                return None;
            }
            (samples.content_sha256, samples.spec)
        }
    };
    if their_spec != *spec {
        return None;
    }
    let mut rows: Vec<(usize, Vec<usize>)> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (j, sha) in content.iter().enumerate() {
        if let Some(dst) = wanted
            .get(sha.as_str())
            .filter(|_| seen.insert(sha.as_str()))
        {
            rows.push((j, dst.clone()));
        }
    }
    let bytes = fs::metadata(dir.join("features.f32")).ok()?.len();
    let per = target.per_sample();
    let complete = bytes == (content.len() * per * 4) as u64;
    (complete && !rows.is_empty()).then_some(rows)
}

/// Copies rows `(source row, destination samples)` of the features file `path` into `data`.
fn read_rows(
    path: &Path,
    per: usize,
    rows: &[(usize, Vec<usize>)],
    data: &mut [f32],
) -> Result<(), CacheError> {
    let mut f = File::open(path).map_err(io(path))?;
    let mut buf = vec![0u8; per * 4];
    for (j, dst) in rows {
        f.seek(SeekFrom::Start((j * per * 4) as u64))
            .and_then(|_| f.read_exact(&mut buf))
            .map_err(io(path))?;
        for &i in dst {
            let out = &mut data[i * per..(i + 1) * per];
            for (o, b) in out.iter_mut().zip(buf.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
    }
    Ok(())
}

/// Runs the frozen part over the samples `idx` (sample order, the same on every rank): each rank
/// takes an even contiguous share ([`distributed::share`]) on its own engine, and the outputs are
/// gathered in `idx` order.
fn extract_samples(
    prepared: &Prepared,
    backbone: &Backbone,
    opts: &LowerOpts,
    engine: EngineKind,
    r: &Rank<'_>,
    idx: &[usize],
) -> Result<Vec<f32>, CacheError> {
    let (comm, rank, world) = (r.comm, r.rank(), r.world());
    let per: usize = opts.output_shape(&backbone.net).iter().product();
    let mine = &idx[distributed::share(idx.len(), rank, world)];
    let local = if mine.is_empty() {
        Vec::new()
    } else {
        let engine_impl = backbone.engine(engine, opts, r.engine_opts())?;
        let pixels = prepared.load_samples(mine)?;
        let refs: Vec<&[u8]> = pixels.iter().map(Vec::as_slice).collect();
        let label = match world {
            1 => "features (new rows)".to_string(),
            _ => format!("features (new rows) {rank}/{world}"),
        };
        let pb = r.progress(refs.len() as u64, &label);
        run_frozen(engine_impl.as_ref(), &prepared.meta.spec, &refs, per, &pb)?
    };
    if world == 1 {
        return Ok(local);
    }
    let gathered = comm.allgather_f32(&local)?;
    if gathered.len() != idx.len() * per {
        return Err(WorkerError {
            rank,
            message: format!(
                "gathered {} feature values, expected {}",
                gathered.len(),
                idx.len() * per
            ),
        }
        .into());
    }
    Ok(gathered)
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
    let engine_impl = backbone.engine(engine, opts, r.engine_opts())?;
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
    let local = run_frozen(engine_impl.as_ref(), &prepared.meta.spec, &refs, per, &pb)?;
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
