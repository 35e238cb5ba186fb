//! The sample cache: decoded + preprocessed pixels in shards (see [`super::cache`]).

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use image::RgbImage;
use kestrel_shared::{ImageLimits, PreprocessError, PreprocessSpec, preprocess::decode};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::Dataset;
use super::cache::{CacheError, io, read_json, sha256_hex, write_atomic, write_json};
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

/// Decodes and preprocesses the samples of `order` (to `input_size` RGB8 pixels) on `threads`
/// threads, with a progress bar; results in `order`.
fn decode_all(
    ds: &Dataset,
    spec: &PreprocessSpec,
    order: &[(usize, String)],
    threads: usize,
) -> Vec<Result<Vec<u8>, PreprocessError>> {
    let limits = ImageLimits::default();
    let pb = progress(order.len() as u64, "decoding");
    let one = |&(i, _): &(usize, String)| {
        let s = &ds.samples[i];
        let px = decode(&s.bytes, &s.id, &limits).and_then(|img| spec.to_pixels(&img));
        pb.inc(1);
        px.map(RgbImage::into_raw)
    };
    let out = match rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
    {
        Ok(pool) => pool.install(|| order.par_iter().map(one).collect()),
        Err(_) => order.iter().map(one).collect(),
    };
    pb.finish_and_clear();
    out
}

impl Prepared {
    /// Opens the cache for `ds` under `root`, building it (or re-sharding it) when needed; a
    /// build decodes on `threads` threads.
    pub fn open_or_build(
        root: &Path,
        ds: &Dataset,
        spec: &PreprocessSpec,
        workers: usize,
        threads: usize,
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
        let decoded = decode_all(ds, spec, &order, threads);
        let mut pixels = Vec::with_capacity(ds.samples.len());
        let (mut ids, mut labels, mut content, mut skipped) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for ((i, sha), px) in order.into_iter().zip(decoded) {
            let s = &ds.samples[i];
            match px {
                Ok(px) => {
                    pixels.push(px);
                    ids.push(s.id.clone());
                    labels.push(s.label);
                    content.push(sha);
                }
                Err(e) if skip_invalid => skipped.push((s.id.clone(), e.to_string())),
                Err(e) => return Err(CacheError::Invalid(e)),
            }
        }
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
        let [h, w] = self.meta.spec.input_size;
        let img = RgbImage::from_raw(w, h, pixels.to_vec()).expect("cached pixels have input_size");
        self.meta.spec.normalize(&img)
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
