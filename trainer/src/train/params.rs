//! What determines a run: [`FitParams`] (saved as `params.json`) and its choices.

use std::path::PathBuf;

use kestrel_models::EngineKind;
use kestrel_models::backbone::OnnxOpts;
use kestrel_shared::PreprocessSpec;
use serde::{Deserialize, Serialize};

use super::TrainError;
use crate::data::SourceOpts;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Optimizer {
    /// SGD with momentum.
    Sgd,
    /// AdamW (decoupled weight decay).
    Adamw,
    /// L-BFGS on the whole training split: the head as the convex problem it is (L2-regularized
    /// multinomial logistic regression), solved to convergence. Head-only runs.
    Lbfgs,
}

impl Optimizer {
    /// The default for a run that trains the last `unfreeze_last` blocks: the solver for a head
    /// alone, adamw when blocks train. Chosen by what trains, never by which other flags were
    /// given: a flag that asks for more training must not switch a head from its solver to a
    /// worse first-order fit.
    pub fn default_for(unfreeze_last: usize) -> Optimizer {
        if unfreeze_last == 0 {
            Optimizer::Lbfgs
        } else {
            Optimizer::Adamw
        }
    }

    /// The default learning rate of this optimizer (lbfgs: of the `--fine-tune` stage that
    /// follows it).
    pub fn default_lr(self) -> f64 {
        match self {
            Optimizer::Sgd => 0.01,
            Optimizer::Adamw | Optimizer::Lbfgs => 1e-3,
        }
    }
}

/// Per-class loss weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ClassWeights {
    /// Every sample counts once.
    #[default]
    None,
    /// n / (classes x n_c) for class c (scikit-learn's "balanced"): every class weighs the same in total.
    Balanced,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// x0.1 at 1/3 and 2/3 of the epochs.
    Step,
    /// Cosine decay to 0 over the epochs.
    Cosine,
    None,
}

/// How the learning rate changes with the number of workers (ranks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LrScaling {
    /// The same learning rate for any worker count: with the same global batch, N workers train
    /// exactly what 1 worker trains (the default).
    #[default]
    None,
    /// lr x workers (Horovod's recipe, for when the global batch grows with the workers).
    Linear,
}

/// Where the trainable blocks and the head run (`--compute-device`): the CPU, or an NVIDIA GPU
/// through candle's CUDA backend (a trainer built with `--features kestrel-trainer/cuda`; docs/gpu.md). The frozen
/// backbone's features come from the feature cache either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum ComputeDevice {
    #[default]
    Cpu,
    /// `cuda`: each rank takes the GPU of its local rank (one rank per GPU); `cuda:N`: GPU N.
    Cuda(Option<usize>),
}

impl ComputeDevice {
    pub fn is_cpu(&self) -> bool {
        *self == ComputeDevice::Cpu
    }

    /// The candle device of a rank whose rank on its machine is `local_rank`.
    pub fn candle(self, local_rank: usize) -> Result<candle_core::Device, TrainError> {
        let gpu = match self {
            ComputeDevice::Cpu => return Ok(candle_core::Device::Cpu),
            ComputeDevice::Cuda(n) => n.unwrap_or(local_rank),
        };
        candle_core::Device::new_cuda(gpu)
            .map_err(|e| TrainError::Invalid(format!("--compute-device {self}: GPU {gpu}: {e}")))
    }

    /// Refuses a GPU in a trainer built without the `cuda` feature, before any work is done.
    pub fn check_built(self) -> Result<Self, TrainError> {
        if self.is_cpu() || cfg!(feature = "cuda") {
            return Ok(self);
        }
        Err(TrainError::Invalid(format!(
            "--compute-device {self}: this trainer was built without CUDA (cargo build --release \
             --features kestrel-trainer/cuda, with nvcc from scripts/setup-cuda.sh; see docs/gpu.md)"
        )))
    }
}

impl std::fmt::Display for ComputeDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ComputeDevice::Cpu => f.write_str("cpu"),
            ComputeDevice::Cuda(None) => f.write_str("cuda"),
            ComputeDevice::Cuda(Some(n)) => write!(f, "cuda:{n}"),
        }
    }
}

impl std::str::FromStr for ComputeDevice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(ComputeDevice::Cpu),
            "cuda" => Ok(ComputeDevice::Cuda(None)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(|n| ComputeDevice::Cuda(Some(n)))
                .ok_or_else(|| format!("`{s}` is not a device: cpu, cuda or cuda:N")),
        }
    }
}

impl From<ComputeDevice> for String {
    fn from(d: ComputeDevice) -> String {
        d.to_string()
    }
}

impl TryFrom<String> for ComputeDevice {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

/// Everything that determines a run (saved as `params.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FitParams {
    /// The (first) table.
    pub data: PathBuf,
    /// Further tables trained together with `data` (`--data A --data B`: one label set).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub more_data: Vec<PathBuf>,
    /// The run whose trained head this one starts from (`--init-from`), classes mapped by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_from: Option<PathBuf>,
    /// The sample and feature cache the run was prepared from, so that a resumed run reads the
    /// same features (the cache is shared by the engines, whose features differ in the last
    /// bits, and a run resumed on other features would not continue bit for bit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<PathBuf>,
    pub source: SourceOpts,
    pub backbone: String,
    pub arch: Option<String>,
    pub engine: EngineKind,
    pub epochs: usize,
    pub batch_size: usize,
    pub lr: f64,
    pub momentum: f64,
    pub weight_decay: f64,
    pub optimizer: Optimizer,
    pub schedule: Schedule,
    pub early_stopping: Option<usize>,
    pub seed: u64,
    pub val_fraction: f64,
    pub test_fraction: f64,
    pub unfreeze_last: usize,
    pub augment_flip: bool,
    pub augment_crop: bool,
    pub workers: usize,
    pub skip_invalid: bool,
    /// Learning-rate scaling with the worker count (absent in older params.json: none).
    #[serde(default)]
    pub lr_scaling: LrScaling,
    /// L2 strength of the L-BFGS head (mean loss + l2/2 |W|^2); `None`: chosen by cross-validation
    /// on the training split.
    #[serde(default)]
    pub l2: Option<f64>,
    #[serde(default)]
    pub class_weights: ClassWeights,
    /// Label smoothing epsilon: targets (1 - eps) one-hot + eps / classes.
    #[serde(default)]
    pub label_smoothing: f64,
    /// Two stages (`--fine-tune N`): the head to convergence with L-BFGS on the pooled features,
    /// then the last `unfreeze_last` blocks and the head with `optimizer` from there.
    #[serde(default)]
    pub head_first: bool,
    /// An ONNX backbone (`--backbone model.onnx`): its feature tensor (`--feature-output`;
    /// absent: the input of the graph's last Gemm/MatMul).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feature_output: Option<String>,
    /// An ONNX backbone's preprocessing (`--preprocess`), kept in full with the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preprocess: Option<PreprocessSpec>,
    /// Where the trainable part runs (`--compute-device`); absent: the CPU. The results do not
    /// depend on it beyond rounding.
    #[serde(default, skip_serializing_if = "ComputeDevice::is_cpu")]
    pub compute_device: ComputeDevice,
    /// sha256 of the ONNX backbone file: a run whose file changed is not prepared again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backbone_sha256: Option<String>,
}

impl FitParams {
    /// Every table of the run: `data`, then `more_data`.
    pub fn data_paths(&self) -> Vec<PathBuf> {
        std::iter::once(self.data.clone())
            .chain(self.more_data.iter().cloned())
            .collect()
    }

    /// How an ONNX backbone is used (empty for the built-in ones).
    pub fn onnx_opts(&self) -> OnnxOpts {
        OnnxOpts {
            feature_output: self.feature_output.clone(),
            preprocess: self.preprocess.clone(),
            sha256: self.backbone_sha256.clone(),
        }
    }

    /// Whether the frozen features are the pooled ones (no block trains).
    pub fn head_only(&self) -> bool {
        self.unfreeze_last == 0
    }

    pub fn lr_at(&self, epoch: usize) -> f64 {
        match self.schedule {
            Schedule::None => self.lr,
            Schedule::Step => {
                let k = (epoch * 3) / self.epochs.max(1);
                self.lr * 0.1f64.powi(k as i32)
            }
            Schedule::Cosine => {
                self.lr
                    * 0.5
                    * (1.0
                        + (std::f64::consts::PI * epoch as f64 / self.epochs.max(1) as f64).cos())
            }
        }
    }

    pub fn validate(&self) -> Result<(), TrainError> {
        let bad = |m: String| Err(TrainError::Invalid(m));
        if self.epochs == 0 || self.batch_size == 0 {
            return bad("--epochs and --batch-size must be positive".into());
        }
        if !(self.lr > 0.0) {
            return bad(format!("--lr must be positive, got {}", self.lr));
        }
        if !(0.0..1.0).contains(&(self.val_fraction + self.test_fraction))
            || self.val_fraction <= 0.0
        {
            return bad("--val-fraction must be > 0 and val + test fractions < 1".into());
        }
        if self.optimizer == Optimizer::Lbfgs && self.unfreeze_last > 0 {
            return bad(
                "--optimizer lbfgs trains a head only: with --unfreeze-last use sgd or adamw, or --fine-tune N (L-BFGS head, then the blocks)".into(),
            );
        }
        if self.l2.is_some_and(|l| !(l >= 0.0)) {
            return bad(format!("--l2 must be >= 0, got {:?}", self.l2));
        }
        if !(0.0..1.0).contains(&self.label_smoothing) {
            return bad(format!(
                "--label-smoothing must be in [0, 1), got {}",
                self.label_smoothing
            ));
        }
        if self.batch_size < self.workers.max(1) {
            return bad(format!(
                "--batch-size {} is smaller than --workers {}: every worker needs at least one sample of each global batch",
                self.batch_size, self.workers
            ));
        }
        Ok(())
    }
}

impl FitParams {
    /// These parameters on a job of `world` ranks: `workers` must be 1 or `world` (the ranks are
    /// the workers; it is recorded as `world`).
    pub fn on_ranks(&self, world: usize) -> Result<FitParams, TrainError> {
        if self.workers != 1 && self.workers != world {
            return Err(TrainError::Invalid(format!(
                "--workers {} under a {world}-rank job: the ranks are the workers (pass 1 or {world})",
                self.workers
            )));
        }
        let p = FitParams {
            workers: world,
            ..self.clone()
        };
        p.validate()?;
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::ComputeDevice;
    use super::*;

    /// A valid SGD run: 9 epochs at lr 0.1, batches of 32, one worker.
    fn base() -> FitParams {
        FitParams {
            data: PathBuf::from("t.csv"),
            more_data: Vec::new(),
            init_from: None,
            cache: None,
            source: SourceOpts::default(),
            backbone: "mobilenet".into(),
            arch: None,
            engine: EngineKind::Tract,
            epochs: 9,
            batch_size: 32,
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.0,
            optimizer: Optimizer::Sgd,
            schedule: Schedule::None,
            early_stopping: None,
            seed: 1,
            val_fraction: 0.2,
            test_fraction: 0.1,
            unfreeze_last: 0,
            augment_flip: false,
            augment_crop: false,
            workers: 1,
            skip_invalid: false,
            lr_scaling: LrScaling::None,
            l2: None,
            class_weights: ClassWeights::None,
            label_smoothing: 0.0,
            head_first: false,
            feature_output: None,
            preprocess: None,
            compute_device: ComputeDevice::Cpu,
            backbone_sha256: None,
        }
    }

    /// The message of a `TrainError::Invalid`, failing on anything else.
    fn invalid(r: Result<impl std::fmt::Debug, TrainError>) -> String {
        match r {
            Err(TrainError::Invalid(m)) => m,
            other => panic!("expected TrainError::Invalid, got {other:?}"),
        }
    }

    #[test]
    fn step_schedule_cuts_the_rate_tenfold_at_each_third_of_the_epochs() {
        let p = FitParams {
            schedule: Schedule::Step,
            ..base()
        };
        for (epoch, want) in [
            (0, 0.1f64),
            (2, 0.1),
            (3, 0.01),
            (5, 0.01),
            (6, 0.001),
            (8, 0.001),
        ] {
            let got = p.lr_at(epoch);
            assert!((got - want).abs() < 1e-12, "epoch {epoch}: {got}");
        }
        let flat = base();
        assert_eq!(flat.lr_at(8), 0.1);
    }

    #[test]
    fn cosine_schedule_is_half_the_rate_mid_run_and_zero_at_the_end() {
        let p = FitParams {
            schedule: Schedule::Cosine,
            epochs: 10,
            lr: 0.2,
            ..base()
        };
        assert!((p.lr_at(0) - 0.2).abs() < 1e-12);
        assert!((p.lr_at(5) - 0.1).abs() < 1e-12, "{}", p.lr_at(5));
        assert!(p.lr_at(10).abs() < 1e-12, "{}", p.lr_at(10));
        assert!(p.lr_at(2) > p.lr_at(3));
    }

    #[test]
    fn validate_refuses_lbfgs_with_unfrozen_blocks_and_batches_smaller_than_the_workers() {
        assert!(base().validate().is_ok());
        let lbfgs = FitParams {
            optimizer: Optimizer::Lbfgs,
            unfreeze_last: 2,
            ..base()
        };
        assert!(invalid(lbfgs.validate()).starts_with("--optimizer lbfgs trains a head only"));
        let small = FitParams {
            batch_size: 2,
            workers: 4,
            ..base()
        };
        assert!(
            invalid(small.validate()).starts_with("--batch-size 2 is smaller than --workers 4")
        );
        let smooth = FitParams {
            label_smoothing: 1.0,
            ..base()
        };
        assert!(invalid(smooth.validate()).contains("--label-smoothing must be in [0, 1)"));
    }

    #[test]
    fn on_ranks_records_the_world_as_the_workers_and_refuses_another_count() {
        assert_eq!(base().on_ranks(4).unwrap().workers, 4);
        let three = FitParams {
            workers: 3,
            ..base()
        };
        assert!(invalid(three.on_ranks(2)).starts_with("--workers 3 under a 2-rank job"));
        // The batch is checked against the world, not the 1 worker asked for.
        let small = FitParams {
            batch_size: 2,
            ..base()
        };
        assert!(
            invalid(small.on_ranks(4)).starts_with("--batch-size 2 is smaller than --workers 4")
        );
    }

    /// `--compute-device` reads back as written, in params.json too, and refuses other words.
    #[test]
    fn compute_device_round_trips() {
        for (s, d) in [
            ("cpu", ComputeDevice::Cpu),
            ("cuda", ComputeDevice::Cuda(None)),
            ("cuda:3", ComputeDevice::Cuda(Some(3))),
        ] {
            assert_eq!(s.parse::<ComputeDevice>().unwrap(), d);
            assert_eq!(d.to_string(), s);
            let json = serde_json::to_string(&d).unwrap();
            assert_eq!(json, format!("\"{s}\""));
            assert_eq!(serde_json::from_str::<ComputeDevice>(&json).unwrap(), d);
        }
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "CPU"] {
            let e = bad.parse::<ComputeDevice>().unwrap_err();
            assert!(e.contains(&format!("`{bad}`")), "{e}");
        }
        assert!(serde_json::from_str::<ComputeDevice>("\"tpu\"").is_err());
        assert!(ComputeDevice::Cpu.candle(5).unwrap().is_cpu());
    }
}
