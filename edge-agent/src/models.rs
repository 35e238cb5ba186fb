//! The loaded models: the active one behind a lock the inference workers share, the shadow
//! candidate, the cache shared by the devices of one process, and the watched directory.
//! (Inference over MQTT is driven by the agent's event loop.)

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use kestrel_runtime::EngineKind;
use kestrel_runtime::artifact::{self, LoadedModel};
use kestrel_shared::ImageLimits;
use kestrel_shared::manifest::MANIFEST_FILE;
use kestrel_shared::protocol::sha256_hex;

/// The active model of a device, swapped atomically for readers.
pub type ModelSlot<T> = Arc<RwLock<Option<Arc<T>>>>;

/// A shadow model as the inference workers see it: it runs on every `every`-th request the
/// active model answered (`turn` counts them), after the reply is on its way.
pub struct ShadowModel {
    pub model: Arc<LoadedModel>,
    pub every: u64,
    pub turn: std::sync::atomic::AtomicU64,
}

/// Loaded models shared by the devices of one process (`--simulate N`): every device verifies
/// its own files against the manifest; the tract plan is built and the golden samples run once
/// per distinct signed manifest (which binds every file's hash).
pub struct ModelCache {
    models: Mutex<HashMap<String, Arc<LoadedModel>>>,
    max_bytes: u64,
    engine: EngineKind,
    threads: usize,
    /// What a request's image may cost to decode ([`ImageLimits::device`]).
    limits: ImageLimits,
}

impl ModelCache {
    pub fn new(max_bytes: u64, engine: EngineKind, threads: usize, limits: ImageLimits) -> Self {
        Self {
            models: Mutex::new(HashMap::new()),
            max_bytes,
            engine,
            threads,
            limits,
        }
    }

    /// Verifies `dir`'s device files (its model composed from the part store `parts` when it has
    /// no model.onnx of its own) and returns its health-checked model.
    pub fn load(
        &self,
        dir: &std::path::Path,
        parts: &std::path::Path,
    ) -> Result<Arc<LoadedModel>, String> {
        let mpath = dir.join(MANIFEST_FILE);
        let text = std::fs::read(&mpath).map_err(|e| format!("{}: {e}", mpath.display()))?;
        let key = sha256_hex(&text);
        let mut models = self.models.lock().expect("lock");
        if let Some(m) = models.get(&key) {
            artifact::device_model(dir, &m.manifest, self.max_bytes, Some(parts))
                .map_err(|e| kestrel_shared::chain(&e))?;
            return Ok(m.clone());
        }
        let load =
            LoadedModel::load_parts(dir, Some(parts), self.max_bytes, self.engine, self.threads);
        let mut m = load.map_err(|e| kestrel_shared::chain(&e))?;
        m.limits = self.limits;
        let m = Arc::new(m);
        models.insert(key, m.clone());
        Ok(m)
    }
}

/// Classifies images dropped into `dir` (one JSON line each in `dir/results.jsonl`, the image
/// moved to `dir/done/`), with whatever model is active.
pub fn watch_dir(dir: PathBuf, model: ModelSlot<LoadedModel>, top_k: usize) {
    use std::io::Write;
    let done = dir.join("done");
    let _ = std::fs::create_dir_all(&done);
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let Some(m) = model.read().expect("lock").clone() else {
            continue;
        };
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.is_file()
                    && p.file_name().is_some_and(|n| {
                        n != "results.jsonl" && !n.to_string_lossy().starts_with('.')
                    })
            })
            .collect();
        files.sort();
        for p in files {
            let name = p.display().to_string();
            let line = match std::fs::read(&p)
                .map_err(|e| format!("{name}: {e}"))
                .and_then(|b| {
                    m.predict(&b, &name, top_k)
                        .map_err(|e| kestrel_shared::chain(&e))
                }) {
                Ok(pred) => serde_json::to_string(&pred).expect("serializable"),
                Err(e) => serde_json::json!({ "image": name, "error": e }).to_string(),
            };
            let out = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(dir.join("results.jsonl"))
                .and_then(|mut f| writeln!(f, "{line}"));
            if let Err(e) = out {
                tracing::error!("{}: {e}", dir.join("results.jsonl").display());
            }
            let _ = std::fs::rename(&p, done.join(p.file_name().expect("file")));
        }
    }
}
