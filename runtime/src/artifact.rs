//! Loading an exported artifact the way a device does: verify every file against the manifest,
//! run the golden samples (health check), then serve predictions with tract and the manifest's
//! preprocessing. Pure Rust (tract only): this is what the edge agent builds on.

use std::path::{Component, Path};

use kestrel_shared::manifest::{
    Composition, FileEntry, MANIFEST_FILE, MAX_MANIFEST_BYTES, Manifest,
};
use kestrel_shared::protocol::sha256_hex;
pub use kestrel_shared::protocol::{Class, Prediction, device_files};
use kestrel_shared::wire::QuantForm;
use kestrel_shared::{ImageLimits, PreprocessError};

use crate::engine::{self, Engine, EngineError, EngineKind};
use crate::tensor::Tensor;
pub use crate::tensor::max_abs_diff;

/// Largest accepted |logit − expected| of a golden sample.
pub const GOLDEN_TOLERANCE: f32 = 1e-3;

#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    #[error("{path}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: invalid manifest")]
    Manifest {
        path: String,
        #[source]
        source: kestrel_shared::error::Cause,
    },
    #[error("unsafe file name `{0}` in the manifest (absolute, `..` or empty)")]
    UnsafePath(String),
    #[error("{file}: sha256 {found} does not match the manifest's {expected}")]
    Hash {
        file: String,
        expected: String,
        found: String,
    },
    #[error("{file}: {found} bytes, the manifest says {expected}")]
    Size {
        file: String,
        expected: u64,
        found: u64,
    },
    #[error("artifact is {bytes} bytes, over the limit of {limit}")]
    TooLarge { bytes: u64, limit: u64 },
    #[error("{path}: over {limit} bytes, the limit for this file (refused, not read)")]
    FileTooLarge { path: String, limit: u64 },
    #[error("health check failed: {0}")]
    Health(String),
    #[error(transparent)]
    Composition(#[from] kestrel_shared::manifest::CompositionError),
    #[error(transparent)]
    Signature(#[from] kestrel_shared::signing::SignError),
    #[error(transparent)]
    Preprocess(#[from] PreprocessError),
    #[error(transparent)]
    Engine(#[from] EngineError),
}

fn io(path: &Path, e: std::io::Error) -> ArtifactError {
    ArtifactError::Io {
        path: path.display().to_string(),
        source: e,
    }
}

/// A file name from a manifest, accepted only as a plain relative path inside the artifact.
pub fn safe_relative(name: &str) -> Result<&Path, ArtifactError> {
    let p = Path::new(name);
    let ok = !name.is_empty() && p.components().all(|c| matches!(c, Component::Normal(_)));
    if ok {
        Ok(p)
    } else {
        Err(ArtifactError::UnsafePath(name.to_string()))
    }
}

/// The most bytes a `manifest.sig` is read to (a few hundred in practice).
pub const MAX_SIGNATURE_BYTES: u64 = 64 << 10;

/// Reads `path` whole when it is at most `limit` bytes; a larger file is refused after reading
/// `limit + 1` bytes of it.
fn read_capped(path: &Path, limit: u64) -> Result<Vec<u8>, ArtifactError> {
    use std::io::Read;
    let f = std::fs::File::open(path).map_err(|e| io(path, e))?;
    let mut bytes = Vec::new();
    f.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| io(path, e))?;
    if bytes.len() as u64 > limit {
        return Err(ArtifactError::FileTooLarge {
            path: path.display().to_string(),
            limit,
        });
    }
    Ok(bytes)
}

/// Reads `dir/manifest.json` (at most [`MAX_MANIFEST_BYTES`]).
pub fn read_manifest(dir: &Path) -> Result<Manifest, ArtifactError> {
    let path = dir.join(MANIFEST_FILE);
    let bytes = read_capped(&path, MAX_MANIFEST_BYTES)?;
    let invalid = |e: kestrel_shared::error::Cause| ArtifactError::Manifest {
        path: path.display().to_string(),
        source: e,
    };
    let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| invalid(e.into()))?;
    m.preprocess.validate().map_err(|e| invalid(e.into()))?;
    Ok(m)
}

/// Checks `manifest.sig` against the exact bytes of `manifest.json` with the trusted keys;
/// returns the signing key's id.
pub fn verify_signature(
    dir: &Path,
    trusted: &[ed25519_dalek::VerifyingKey],
) -> Result<String, ArtifactError> {
    use kestrel_shared::signing::{PayloadType, SIGNATURE_FILE, SignError, SignatureFile, verify};
    let mpath = dir.join(MANIFEST_FILE);
    let manifest = read_capped(&mpath, MAX_MANIFEST_BYTES)?;
    let spath = dir.join(SIGNATURE_FILE);
    let text = read_capped(&spath, MAX_SIGNATURE_BYTES)?;
    let sig: SignatureFile =
        serde_json::from_slice(&text).map_err(|e| SignError::Format(e.to_string()))?;
    Ok(verify(trusted, PayloadType::Manifest, &manifest, &sig)?)
}

/// Checks every file the manifest lists (safe name, size, sha256) and the total against `max_bytes`.
pub fn verify_files(dir: &Path, m: &Manifest, max_bytes: u64) -> Result<(), ArtifactError> {
    verify_entries(dir, &m.files.iter().collect::<Vec<_>>(), max_bytes)
}

/// Checks the files a device receives and runs ([`device_files`]: the model and the golden
/// samples), and their total against `max_bytes`.
pub fn verify_device_files(dir: &Path, m: &Manifest, max_bytes: u64) -> Result<(), ArtifactError> {
    device_model(dir, m, max_bytes, None).map(drop)
}

/// [`verify_device_files`], returning the model's bytes: `dir/model.onnx`, or, when `dir` has
/// none and `parts` is a directory of content-addressed pieces (a device's part store: each
/// file named by its sha256), the manifest's [`Composition`] of them, every part checked
/// against its hash and the part it follows, and the whole against the manifest.
///
/// [`Composition`]: kestrel_shared::manifest::Composition
pub fn device_model(
    dir: &Path,
    m: &Manifest,
    max_bytes: u64,
    parts: Option<&Path>,
) -> Result<Vec<u8>, ArtifactError> {
    check_names(m)?;
    let files = device_files(m);
    check_total(&files, max_bytes)?;
    let mut model = None;
    for f in files {
        let path = dir.join(safe_relative(&f.path)?);
        let composed = m.composition.as_ref().filter(|c| c.file == f.path);
        let bytes = match (composed, parts) {
            (Some(c), Some(parts)) if f.path == "model.onnx" && !path.exists() => {
                compose(c, m, parts)?
            }
            _ => verify_entry(&path, f)?,
        };
        if f.path == "model.onnx" {
            model = Some(bytes);
        }
    }
    model.ok_or_else(|| ArtifactError::Manifest {
        path: MANIFEST_FILE.into(),
        source: "no model.onnx listed".into(),
    })
}

/// The composed file from the part store `parts`.
fn compose(c: &Composition, m: &Manifest, parts: &Path) -> Result<Vec<u8>, ArtifactError> {
    let mut bytes = Vec::with_capacity(c.parts.len());
    for p in &c.parts {
        if !kestrel_shared::protocol::is_sha256(&p.sha256) {
            return Err(ArtifactError::UnsafePath(p.sha256.clone()));
        }
        let path = parts.join(&p.sha256);
        bytes.push(read_capped(&path, p.size)?);
    }
    let slices: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    Ok(c.compose(&m.files, &slices)?)
}

/// Every file name the manifest mentions (files and golden samples) must be a plain relative path.
pub fn check_names(m: &Manifest) -> Result<(), ArtifactError> {
    for name in m
        .files
        .iter()
        .map(|f| &f.path)
        .chain(m.golden.iter().map(|g| &g.file))
    {
        safe_relative(name)?;
    }
    Ok(())
}

fn verify_entries(dir: &Path, files: &[&FileEntry], max_bytes: u64) -> Result<(), ArtifactError> {
    check_total(files, max_bytes)?;
    if !files.iter().any(|f| f.path == "model.onnx") {
        return Err(ArtifactError::Manifest {
            path: MANIFEST_FILE.into(),
            source: "no model.onnx listed".into(),
        });
    }
    for f in files {
        verify_entry(&dir.join(safe_relative(&f.path)?), f)?;
    }
    Ok(())
}

/// Safe names, and their sizes' total within `max_bytes`.
fn check_total(files: &[&FileEntry], max_bytes: u64) -> Result<(), ArtifactError> {
    for f in files {
        safe_relative(&f.path)?;
    }
    let total = files
        .iter()
        .fold(0u64, |total, f| total.saturating_add(f.size));
    if total > max_bytes {
        return Err(ArtifactError::TooLarge {
            bytes: total,
            limit: max_bytes,
        });
    }
    Ok(())
}

/// `path`'s bytes, checked against the manifest's entry `f` (the size first: a file larger than
/// the manifest says is never read).
fn verify_entry(path: &Path, f: &FileEntry) -> Result<Vec<u8>, ArtifactError> {
    let len = std::fs::metadata(path).map_err(|e| io(path, e))?.len();
    if len != f.size {
        return Err(ArtifactError::Size {
            file: f.path.clone(),
            expected: f.size,
            found: len,
        });
    }
    let bytes = std::fs::read(path).map_err(|e| io(path, e))?;
    if bytes.len() as u64 != f.size {
        return Err(ArtifactError::Size {
            file: f.path.clone(),
            expected: f.size,
            found: bytes.len() as u64,
        });
    }
    let found = sha256_hex(&bytes);
    if found != f.sha256 {
        return Err(ArtifactError::Hash {
            file: f.path.clone(),
            expected: f.sha256.clone(),
            found,
        });
    }
    Ok(bytes)
}

/// A verified, health-checked model ready to serve.
pub struct LoadedModel {
    pub manifest: Manifest,
    engine: Box<dyn Engine>,
    pub limits: ImageLimits,
}

/// The ONNX bytes an engine loads for a verified artifact: an `int8-weights` graph with its
/// weights dequantized once ([`crate::dequant`]; the download stays int8, the engines run f32
/// kernels on the same weights), any other form as it is.
pub fn engine_bytes(onnx: Vec<u8>, m: &Manifest) -> Result<Vec<u8>, ArtifactError> {
    if m.quantization.form == QuantForm::Int8Weights {
        return Ok(crate::dequant::dequantize_weights(&onnx)?.0);
    }
    Ok(onnx)
}

impl LoadedModel {
    /// Verifies the device files, builds the engine's plan and runs the golden samples on it.
    pub fn load(
        dir: &Path,
        max_bytes: u64,
        kind: EngineKind,
        threads: usize,
    ) -> Result<Self, ArtifactError> {
        Self::load_parts(dir, None, max_bytes, kind, threads)
    }

    /// [`Self::load`], composing the model from the part store `parts` when `dir` has no
    /// model.onnx of its own ([`device_model`]).
    pub fn load_parts(
        dir: &Path,
        parts: Option<&Path>,
        max_bytes: u64,
        kind: EngineKind,
        threads: usize,
    ) -> Result<Self, ArtifactError> {
        let manifest = read_manifest(dir)?;
        let bytes = device_model(dir, &manifest, max_bytes, parts)?;
        let bytes = engine_bytes(bytes, &manifest)?;
        let shape: Vec<usize> = manifest.input.shape[1..]
            .iter()
            .map(|d| d.as_u64().unwrap_or(0) as usize)
            .collect();
        let engine = engine::from_onnx(kind, &bytes, shape, engine::EngineOpts::cpu(threads))?;
        let this = Self {
            manifest,
            engine,
            limits: ImageLimits::default(),
        };
        this.health_check(dir)?;
        Ok(this)
    }

    /// The engine serving this model.
    pub fn engine(&self) -> EngineKind {
        self.engine.kind()
    }

    fn logits(&self, data: Vec<f32>) -> Result<Vec<f32>, ArtifactError> {
        let [h, w] = self.manifest.preprocess.input_size.map(|v| v as usize);
        Ok(self.engine.run(&Tensor::new(vec![1, 3, h, w], data))?.data)
    }

    /// Golden samples: the preprocessed tensor must hash as recorded (no preprocessing skew),
    /// top-1 must match and logits agree within [`GOLDEN_TOLERANCE`] with those recorded for
    /// this engine (tract's, unless the manifest has the engine's own).
    pub fn health_check(&self, dir: &Path) -> Result<(), ArtifactError> {
        if self.manifest.golden.is_empty() {
            return Err(ArtifactError::Health(
                "the manifest has no golden samples".into(),
            ));
        }
        for g in &self.manifest.golden {
            let path = dir.join(safe_relative(&g.file)?);
            let bytes = std::fs::read(&path).map_err(|e| io(&path, e))?;
            let x = self
                .manifest
                .preprocess
                .run_bytes(&bytes, &g.file, &self.limits)?;
            let sha = sha256_hex(&x.to_le_bytes());
            if sha != g.input_sha256 {
                return Err(ArtifactError::Health(format!(
                    "{}: preprocessed input hash {sha} differs from {}",
                    g.file, g.input_sha256
                )));
            }
            let logits = self.logits(x.data)?;
            let top = argmax(&logits);
            let want = g
                .runtime_logits
                .get(self.engine.kind().name())
                .unwrap_or(&g.logits);
            let diff = max_abs_diff(&logits, want);
            if top != g.expected_top1 || logits.len() != want.len() || diff > GOLDEN_TOLERANCE {
                return Err(ArtifactError::Health(format!(
                    "{}: top-1 {top} (expected {}), max |logit diff| {diff:.3e} (tolerance {GOLDEN_TOLERANCE:e})",
                    g.file, g.expected_top1
                )));
            }
        }
        Ok(())
    }

    /// Classifies encoded image bytes; `name` names the image in errors.
    pub fn predict(&self, bytes: &[u8], name: &str, k: usize) -> Result<Prediction, ArtifactError> {
        Ok(self.infer(bytes, name, k)?.prediction)
    }

    /// [`Self::predict`], with the logits and, when the graph has them (its second output), the
    /// pooled features: what quality telemetry needs. The latency covers all of it.
    pub fn infer(&self, bytes: &[u8], name: &str, k: usize) -> Result<Inference, ArtifactError> {
        let start = std::time::Instant::now();
        let x = self
            .manifest
            .preprocess
            .run_bytes(bytes, name, &self.limits)?;
        let [h, w] = self.manifest.preprocess.input_size.map(|v| v as usize);
        let mut outputs = self
            .engine
            .run_outputs(&Tensor::new(vec![1, 3, h, w], x.data))?
            .into_iter();
        let logits = outputs.next().map(|t| t.data).unwrap_or_default();
        let features = outputs.next().map(|t| t.data);
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = logits.iter().map(|v| (v - m).exp()).collect();
        let sum: f32 = e.iter().sum();
        let mut idx: Vec<usize> = (0..e.len()).collect();
        idx.sort_by(|&a, &b| e[b].total_cmp(&e[a]).then(a.cmp(&b)));
        let top = idx
            .into_iter()
            .take(k.max(1))
            .map(|i| Class {
                class: i,
                label: self.manifest.labels.get(i).cloned().unwrap_or_default(),
                score: e[i] / sum,
            })
            .collect();
        let prediction = Prediction {
            image: name.to_string(),
            top,
            model: self.manifest.name.clone(),
            version: self.manifest.version,
            latency_ms: start.elapsed().as_secs_f64() * 1000.0,
        };
        Ok(Inference {
            prediction,
            logits,
            features,
        })
    }
}

/// One classified image with what quality telemetry needs besides the prediction.
#[derive(Debug, Clone)]
pub struct Inference {
    pub prediction: Prediction,
    pub logits: Vec<f32>,
    /// The pooled features (the exported graph's second output), when the graph has them.
    pub features: Option<Vec<f32>>,
}

/// Index of the largest value (the first on ties).
pub fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(0, |b, (i, x)| if *x > v[b] { i } else { b })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_like_names_are_rejected() {
        assert!(safe_relative("golden/0.png").is_ok());
        for bad in ["../x", "/etc/passwd", "a/../../b", "", "./."] {
            assert!(
                matches!(safe_relative(bad), Err(ArtifactError::UnsafePath(_))),
                "{bad}"
            );
        }
    }

    /// A manifest or signature larger than its cap is refused without being read whole.
    #[test]
    fn oversized_manifests_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut big = b"{\"name\": \"".to_vec();
        big.resize(MAX_MANIFEST_BYTES as usize + 1, b'a');
        std::fs::write(dir.path().join(MANIFEST_FILE), &big).unwrap();
        let e = read_manifest(dir.path()).unwrap_err();
        assert!(matches!(e, ArtifactError::FileTooLarge { .. }), "{e:?}");
        assert!(e.to_string().contains(MANIFEST_FILE), "{e}");
        let e = verify_signature(dir.path(), &[]).unwrap_err();
        assert!(matches!(e, ArtifactError::FileTooLarge { .. }), "{e:?}");
    }

    /// The causes are kept as sources (a caller can match on them), and `chain` prints them.
    #[test]
    fn errors_keep_their_causes() {
        let dir = tempfile::tempdir().unwrap();
        let e = read_manifest(dir.path()).unwrap_err();
        let io = std::error::Error::source(&e).and_then(|c| c.downcast_ref::<std::io::Error>());
        assert_eq!(io.map(|c| c.kind()), Some(std::io::ErrorKind::NotFound));
        std::fs::write(dir.path().join(MANIFEST_FILE), "{\"name\": 3").unwrap();
        let e = read_manifest(dir.path()).unwrap_err();
        assert!(matches!(e, ArtifactError::Manifest { .. }), "{e:?}");
        let line = kestrel_shared::chain(&e);
        assert!(
            line.contains("invalid manifest: invalid type: integer `3`"),
            "{line}"
        );
        let Err(e) = engine::TractEngine::from_onnx(b"not onnx", vec![3, 8, 8], 1) else {
            panic!("bytes that are not ONNX load");
        };
        assert!(matches!(e, EngineError::Tract(_)), "{e:?}");
        let line = kestrel_shared::chain(&e);
        assert!(
            line.starts_with("tract: ") && line.len() > "tract: ".len() + 10,
            "{line}"
        );
    }
}
