//! The sample cache: decoded + preprocessed pixels in shards (see [`super`]).

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use image::RgbImage;
use kestrel_shared::fsutil::AtomicFile;
use kestrel_shared::{ImageLimits, PreprocessError, PreprocessSpec, preprocess::decode};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{CacheError, io, read_json, write_json};
use crate::data::{DataError, Dataset};
use crate::report::progress;

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

/// The sample cache a table maps to before anything is decoded: the canonical sample order — by
/// label, then content hash — and the cache key over it. Paths and table order do not matter, so
/// every source of the same images gives the same cache, split and run.
pub struct SamplePlan {
    pub key: String,
    pub spec: PreprocessSpec,
    /// The cache directory (`meta.json` marks it complete).
    pub dir: PathBuf,
    /// (row of the table, content sha256) in sample order.
    order: Vec<(usize, String)>,
}

impl SamplePlan {
    pub fn new(root: &Path, ds: &Dataset, spec: &PreprocessSpec) -> SamplePlan {
        let mut order: Vec<(usize, String)> = ds
            .samples
            .iter()
            .enumerate()
            .map(|(i, s)| (i, s.sha256.clone()))
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
        let key = hex::encode(h.finalize());
        SamplePlan {
            dir: root.join("samples").join(&key[..32]),
            key,
            spec: spec.clone(),
            order,
        }
    }

    /// Whether the cache is already built.
    pub fn is_built(&self) -> bool {
        self.dir.join("meta.json").exists()
    }

    /// The content hashes of the table's rows, in sample order (invalid images included).
    pub fn content(&self) -> impl Iterator<Item = &str> {
        self.order.iter().map(|(_, sha)| sha.as_str())
    }
}

/// Samples decoded ahead of their consumer, in chunks of this many (the backbone's batch).
const CHUNK: usize = 32;

/// One chunk of decoded samples: each one's pixels, or why its image is invalid.
type Decoded = Vec<Result<Vec<u8>, PreprocessError>>;

/// Decodes and preprocesses the samples of `order` (to `input_size` RGB8 pixels) on `threads`
/// threads, a chunk at a time, handing each chunk to `consume` in order while the next ones are
/// decoded: a bounded pipeline (at most three chunks of pixels exist at once), so the consumer's
/// work overlaps decoding and memory stays flat whatever the table's size.
fn decode_stream(
    ds: &Dataset,
    spec: &PreprocessSpec,
    order: &[(usize, String)],
    threads: usize,
    mut consume: impl FnMut(Decoded) -> Result<(), CacheError>,
) -> Result<(), CacheError> {
    let limits = ImageLimits::default();
    let one = |&(i, _): &(usize, String)| {
        let s = &ds.samples[i];
        let bytes = s.bytes()?;
        Ok(decode(&bytes, &s.id, &limits)
            .and_then(|img| spec.to_pixels(&img))
            .map(RgbImage::into_raw))
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
        .ok();
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    std::thread::scope(|scope| {
        scope.spawn(move || {
            for chunk in order.chunks(CHUNK) {
                let decoded: Result<Decoded, DataError> = match &pool {
                    Some(pool) => pool.install(|| chunk.par_iter().map(one).collect()),
                    None => chunk.iter().map(one).collect(),
                };
                let failed = decoded.is_err();
                if tx.send(decoded).is_err() || failed {
                    break; // the consumer stopped on an error, or this is one
                }
            }
        });
        // An error returns here, dropping `rx`: the decoder's next send fails and it stops.
        rx.into_iter()
            .try_for_each(|chunk| consume(chunk.map_err(CacheError::Data)?))
    })
}

/// What a sample cache build hands each chunk of decoded pixels to (the samples that were
/// kept, in sample order), besides the cache: the frozen backbone, while the next chunks decode.
pub type Sink<'a> = &'a mut dyn FnMut(&[Vec<u8>]) -> Result<(), CacheError>;

/// The shard files of a sample cache being written: sample `i` goes to shard `i % shards`, each
/// file appended in sample order and put in place only when complete.
struct ShardWriter {
    files: Vec<AtomicFile>,
    next: usize,
}

impl ShardWriter {
    fn create(dir: &Path, shards: usize) -> Result<ShardWriter, CacheError> {
        fs::create_dir_all(dir).map_err(io(dir))?;
        let files = (0..shards)
            .map(|s| {
                let path = dir.join(format!("shard-{s:05}.bin"));
                AtomicFile::create(&path).map_err(io(&path))
            })
            .collect::<Result<_, _>>()?;
        Ok(ShardWriter { files, next: 0 })
    }

    fn push(&mut self, dir: &Path, pixels: &[u8]) -> Result<(), CacheError> {
        let shard = self.next % self.files.len();
        self.next += 1;
        self.files[shard].write_all(pixels).map_err(io(dir))
    }

    /// Commits every shard, then `meta.json`: its presence marks a complete cache.
    fn finish(
        self,
        dir: PathBuf,
        meta: PreparedMeta,
        reused: bool,
    ) -> Result<Prepared, CacheError> {
        for f in self.files {
            f.commit().map_err(io(&dir))?;
        }
        write_json(&dir.join("meta.json"), &meta)?;
        Ok(Prepared { dir, meta, reused })
    }
}

impl Prepared {
    /// Opens the cache of `plan`, building it (or re-sharding it) when needed; a build decodes on
    /// `threads` threads and hands every chunk of kept samples to `sink` as it goes.
    pub fn open_or_build(
        plan: &SamplePlan,
        ds: &Dataset,
        workers: usize,
        threads: usize,
        skip_invalid: bool,
        sink: Sink<'_>,
    ) -> Result<Prepared, CacheError> {
        let meta_path = plan.dir.join("meta.json");
        if !meta_path.exists() {
            return Self::build(plan, ds, workers, threads, skip_invalid, sink);
        }
        let meta: PreparedMeta = read_json(&meta_path)?;
        let p = Prepared {
            dir: plan.dir.clone(),
            meta,
            reused: true,
        };
        if p.meta.ids.len() < workers.max(1) {
            return Err(CacheError::TooFewSamples {
                samples: p.meta.ids.len(),
                workers,
            });
        }
        if p.meta.shards >= workers.max(1) && p.meta.key == plan.key {
            return Ok(p);
        }
        // Fewer shards than workers: re-shard the cached pixels, no decoding.
        let pixels = p.load_pixels()?;
        let meta = PreparedMeta {
            shards: shard_count(pixels.len(), workers),
            ..p.meta.clone()
        };
        let mut w = ShardWriter::create(&p.dir, meta.shards)?;
        for px in &pixels {
            w.push(&p.dir, px)?;
        }
        w.finish(p.dir, meta, true)
    }

    fn build(
        plan: &SamplePlan,
        ds: &Dataset,
        workers: usize,
        threads: usize,
        skip_invalid: bool,
        sink: Sink<'_>,
    ) -> Result<Prepared, CacheError> {
        let dir = plan.dir.clone();
        // Shards for every row: one an invalid image leaves out never makes fewer than the workers.
        let shards = shard_count(plan.order.len(), workers);
        let mut w = ShardWriter::create(&dir, shards)?;
        let (mut ids, mut labels, mut content, mut skipped) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let pb = progress(plan.order.len() as u64, "decoding");
        let mut rows = plan.order.iter();
        decode_stream(ds, &plan.spec, &plan.order, threads, |chunk| {
            let mut kept = Vec::with_capacity(chunk.len());
            // The chunk first: `zip` would take a row past the chunk's end and lose it.
            for (px, (i, sha)) in chunk.into_iter().zip(rows.by_ref()) {
                let s = &ds.samples[*i];
                match px {
                    Ok(px) => {
                        w.push(&dir, &px)?;
                        kept.push(px);
                        ids.push(s.id.clone());
                        labels.push(s.label);
                        content.push(sha.clone());
                    }
                    Err(e) if skip_invalid => {
                        skipped.push((s.id.clone(), kestrel_shared::chain(&e)))
                    }
                    Err(e) => return Err(CacheError::Invalid(e)),
                }
            }
            sink(&kept)?;
            pb.inc(kept.len() as u64);
            Ok(())
        })?;
        pb.finish_and_clear();
        if ids.is_empty() {
            return Err(CacheError::Empty(ds.source.clone()));
        }
        if ids.len() < workers.max(1) {
            return Err(CacheError::TooFewSamples {
                samples: ids.len(),
                workers,
            });
        }
        let meta = PreparedMeta {
            key: plan.key.clone(),
            source: ds.source.clone(),
            spec: plan.spec.clone(),
            labels: ds.labels.clone(),
            ids,
            sample_labels: labels,
            content_sha256: content,
            shards,
            skipped,
        };
        w.finish(dir, meta, false)
    }

    pub fn len(&self) -> usize {
        self.meta.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.meta.ids.is_empty()
    }

    pub fn sample_bytes(&self) -> usize {
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

    /// The pixels of the samples `idx`, each read from its place in its shard (not whole shards).
    pub fn load_samples(&self, idx: &[usize]) -> Result<Vec<Vec<u8>>, CacheError> {
        let per = self.sample_bytes();
        let mut files: HashMap<usize, File> = HashMap::new();
        let mut out = Vec::with_capacity(idx.len());
        for &i in idx {
            let shard = i % self.meta.shards;
            let path = self.dir.join(format!("shard-{shard:05}.bin"));
            let f = match files.entry(shard) {
                Entry::Occupied(e) => e.into_mut(),
                Entry::Vacant(e) => e.insert(File::open(&path).map_err(io(&path))?),
            };
            let mut px = vec![0u8; per];
            f.seek(SeekFrom::Start(((i / self.meta.shards) * per) as u64))
                .and_then(|_| f.read_exact(&mut px))
                .map_err(io(&path))?;
            out.push(px);
        }
        Ok(out)
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
        let mut out = vec![0f32; pixels.len()];
        self.meta.spec.normalize_into(pixels, &mut out);
        out
    }
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
