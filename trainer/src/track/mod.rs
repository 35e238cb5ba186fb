//! Experiment tracking in MLflow: what `fit`, `tune` and `export` send to a tracking server, and
//! what happens when it is down.
//!
//! - [`Tracker`]: hears what a training run or a tuning reports as it happens (features ready, an
//!   epoch, a trial: [`crate::train::Observer`], [`crate::tune::Observer`]) and sends it to MLflow:
//!   one MLflow run tied to a run directory (`mlflow.json` names it). Every call is
//!   retried; one that still fails is appended, with everything after it, to
//!   `RUN_DIR/mlflow-pending.jsonl`, so training never waits on or dies with the server and no
//!   metric is lost. [`sync`] (`trainer mlflow sync RUN_DIR`) replays that file in order.
//! - [`registry`]: `models:/NAME@ALIAS` and `models:/NAME/VERSION` fetched for deployment.
//! - [`client`]: the REST calls.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub mod client;
mod export;
mod fit;
pub mod mlmodel;
pub mod registry;
mod run;
mod tune_run;

pub use client::{Client, KeyValue, LoggedModel, Metric, ModelVersion, RunRef, kv, now_ms};
pub use export::{Registration, TrackedExport, TrackedExportError, tracked_export};
pub use fit::{TrackedFitError, tracked_fit};
pub use run::{fit_metrics, flatten_params, run_tags, trial_run};
pub use tune_run::{TrackedTune, TrackedTuneError, tracked_tune};

use kestrel_shared::error::Cause;
use kestrel_shared::manifest::Manifest;

use crate::report::EpochMetrics;
use crate::train::{self, Summary, TrainingData};
use crate::tune::{self, TrialResult};

/// The files of a run directory logged as artifacts of its MLflow run.
pub const FIT_ARTIFACTS: [&str; 9] = train::RunDir::RECORDS;

/// The file of calls that could not be delivered, in a run (or tune) directory.
pub const PENDING_FILE: &str = "mlflow-pending.jsonl";
/// The MLflow run a directory is tracked as.
pub const RUN_FILE: &str = "mlflow.json";

#[derive(Debug, thiserror::Error)]
pub enum TrackError {
    #[error("MLflow tracking ({uri}, experiment {experiment:?})")]
    Open {
        uri: String,
        experiment: String,
        #[source]
        source: Box<TrackError>,
    },
    #[error("MLflow tracking server {uri} unreachable")]
    Unreachable {
        uri: String,
        #[source]
        source: Cause,
    },
    #[error("MLflow {what}: HTTP {status} {code}: {message}")]
    Api {
        what: String,
        status: u16,
        code: String,
        message: String,
    },
    #[error("{path}")]
    Io {
        path: String,
        #[source]
        source: Cause,
    },
    #[error("{0}")]
    Unsupported(String),
}

impl TrackError {
    /// `e` kept with its causes (reqwest's own message is only "error sending request").
    pub fn unreachable(uri: &str, e: impl Into<Cause>) -> Self {
        TrackError::Unreachable {
            uri: uri.to_string(),
            source: e.into(),
        }
    }

    pub fn io(path: &Path, e: impl Into<Cause>) -> Self {
        TrackError::Io {
            path: path.display().to_string(),
            source: e.into(),
        }
    }

    /// MLflow's error code, for API errors.
    pub fn code(&self) -> Option<&str> {
        match self {
            TrackError::Api { code, .. } => Some(code),
            _ => None,
        }
    }

    /// Whether trying again later may succeed (server down, overloaded or failing).
    pub fn transient(&self) -> bool {
        match self {
            TrackError::Unreachable { .. } => true,
            TrackError::Api { status, .. } => *status >= 500 || *status == 429,
            _ => false,
        }
    }
}

/// One call to the tracking server, as kept in the pending file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Op {
    LogBatch {
        run_id: String,
        #[serde(default)]
        metrics: Vec<Metric>,
        #[serde(default)]
        params: Vec<KeyValue>,
        #[serde(default)]
        tags: Vec<KeyValue>,
    },
    /// A local file stored as an artifact.
    Upload {
        artifact_uri: String,
        path: String,
        file: PathBuf,
    },
    EndRun {
        run_id: String,
        status: String,
        end_ms: i64,
    },
    /// A whole (child) run at once: created, logged and ended (a tuning trial), with the times it
    /// really started and ended (milliseconds since the Unix epoch; absent: when it is logged).
    Run {
        experiment_id: String,
        name: String,
        tags: Vec<KeyValue>,
        params: Vec<KeyValue>,
        metrics: Vec<Metric>,
        status: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        span_ms: Option<(i64, i64)>,
    },
    SetAlias {
        name: String,
        alias: String,
        version: u64,
    },
    /// Datasets as the run's inputs (`{tags, dataset}` objects of MLflow's REST API).
    LogInputs {
        run_id: String,
        datasets: Vec<serde_json::Value>,
    },
    /// A LoggedModel's files are all uploaded (or not): its final status.
    FinalizeLoggedModel { model_id: String, status: String },
    /// A LoggedModel as an output of the run.
    LogOutputs { run_id: String, model_id: String },
}

impl Op {
    pub fn apply(&self, c: &Client) -> Result<(), TrackError> {
        match self {
            Op::LogBatch {
                run_id,
                metrics,
                params,
                tags,
            } => c.log_batch(run_id, metrics, params, tags),
            Op::Upload {
                artifact_uri,
                path,
                file,
            } => c.upload(artifact_uri, path, file),
            Op::EndRun {
                run_id,
                status,
                end_ms,
            } => c.end_run(run_id, status, *end_ms),
            Op::Run {
                experiment_id,
                name,
                tags,
                params,
                metrics,
                status,
                span_ms,
            } => {
                let (start, end) = span_ms.unwrap_or_else(|| (now_ms(), now_ms()));
                let r = c.create_run(experiment_id, name, tags, start)?;
                c.log_batch(&r.run_id, metrics, params, &[])?;
                c.end_run(&r.run_id, status, end)
            }
            Op::SetAlias {
                name,
                alias,
                version,
            } => c.set_alias(name, alias, *version),
            Op::LogInputs { run_id, datasets } => c.log_inputs(run_id, datasets),
            Op::FinalizeLoggedModel { model_id, status } => {
                c.finalize_logged_model(model_id, status)
            }
            Op::LogOutputs { run_id, model_id } => c.log_outputs(run_id, model_id),
        }
    }
}

/// A line of the pending file: the call and the server it was for.
#[derive(Debug, Serialize, Deserialize)]
struct Pending {
    uri: String,
    #[serde(flatten)]
    op: Op,
}

/// `mlflow.json`: the MLflow run a directory is tracked as.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunLink {
    pub uri: String,
    pub experiment: String,
    #[serde(flatten)]
    pub run: RunRef,
}

/// Where a command tracks to: `--mlflow` / `MLFLOW_TRACKING_URI`, `--experiment` /
/// `MLFLOW_EXPERIMENT_NAME`, `--run-id` / `MLFLOW_RUN_ID` (an existing run to log into) and
/// `--parent-run-id` / `MLFLOW_PARENT_RUN_ID` (the run a new one is started under).
#[derive(Debug, Clone, Default)]
pub struct TrackTo {
    pub uri: String,
    pub experiment: String,
    pub run_id: Option<String>,
    pub parent_run_id: Option<String>,
}

impl TrackTo {
    /// The MLflow run of `dir` for `command` (started, or with `continued` the one `dir` is
    /// tracked as); an error names the server and the experiment.
    pub fn open(&self, dir: &Path, command: &str, continued: bool) -> Result<Tracker, TrackError> {
        let name = dir
            .file_name()
            .map_or("run".into(), |n| n.to_string_lossy().to_string());
        let tags = run_tags(command);
        let t =
            Tracker::start(self, dir, &name, &tags, continued).map_err(|e| TrackError::Open {
                uri: self.uri.clone(),
                experiment: self.experiment.clone(),
                source: Box::new(e),
            })?;
        tracing::info!(
            "MLflow: run {} in experiment {:?} at {}",
            t.run_id(),
            self.experiment,
            self.uri
        );
        Ok(t)
    }
}

/// One MLflow run tied to a directory, with retries and the pending file (see the module docs).
pub struct Tracker {
    pub client: Client,
    pub link: RunLink,
    dir: PathBuf,
    retries: Vec<Duration>,
    state: Mutex<Delivery>,
    /// The LoggedModel this run's export goes to (MLflow 3), once made.
    logged: Mutex<Option<LoggedModel>>,
}

#[derive(Default)]
struct Delivery {
    /// Calls buffered to the pending file by this process.
    buffered: usize,
    /// The first failure, once there was one: later calls are buffered without trying.
    failed: Option<String>,
}

impl Tracker {
    /// Starts the MLflow run of `dir`, or with `continued` continues the one `dir` is already
    /// tracked as on that server (a resumed fit, an export). Fails when the server cannot be
    /// reached: a clear error before any work.
    pub fn start(
        to: &TrackTo,
        dir: &Path,
        name: &str,
        tags: &[KeyValue],
        continued: bool,
    ) -> Result<Tracker, TrackError> {
        let client = Client::new(&to.uri)?;
        let link = read_link(dir).filter(|l| continued && l.uri == client.uri());
        if let Some(link) = link {
            // The run exists (a resumed fit, an export of a tracked run): check it is reachable.
            client.get_run(&link.run.run_id)?;
            return Ok(Tracker::new(client, link, dir));
        }
        let run = match &to.run_id {
            // An existing run (MLFLOW_RUN_ID): logged into as it is, its experiment its own.
            Some(id) => client.get_run(id)?,
            // A child of the parent (a notebook's run), in the parent's experiment, as MLflow's
            // nested runs are.
            None => match &to.parent_run_id {
                Some(parent) => {
                    let p = client.get_run(parent)?;
                    let mut tags = tags.to_vec();
                    tags.push(kv("mlflow.parentRunId", parent.as_str()));
                    client.create_run(&p.experiment_id, name, &tags, now_ms())?
                }
                None => {
                    let experiment_id = client.experiment_id(&to.experiment)?;
                    client.create_run(&experiment_id, name, tags, now_ms())?
                }
            },
        };
        let link = RunLink {
            uri: client.uri().to_string(),
            experiment: to.experiment.clone(),
            run,
        };
        std::fs::create_dir_all(dir).map_err(|e| TrackError::io(dir, e))?;
        crate::report::write_json_atomic(&dir.join(RUN_FILE), &link)
            .map_err(|e| TrackError::io(&dir.join(RUN_FILE), e))?;
        Ok(Tracker::new(client, link, dir))
    }

    fn new(client: Client, link: RunLink, dir: &Path) -> Tracker {
        Tracker {
            client,
            link,
            dir: dir.to_path_buf(),
            retries: [200, 800, 2000].map(Duration::from_millis).to_vec(),
            state: Mutex::new(Delivery::default()),
            logged: Mutex::new(None),
        }
    }

    pub fn run_id(&self) -> &str {
        &self.link.run.run_id
    }

    /// Delivers `op` now (retried), or buffers it to the pending file when the server keeps
    /// failing or an earlier call of this process was buffered (order is kept).
    pub fn submit(&self, op: Op) {
        let mut st = self.state.lock().expect("tracker lock");
        if st.failed.is_none() {
            match with_retries(&self.retries, || op.apply(&self.client)) {
                Ok(()) => return,
                Err(e) => {
                    tracing::warn!(
                        "MLflow: {}; buffering this and later calls to {}",
                        kestrel_shared::Chain(&e),
                        self.dir.join(PENDING_FILE).display()
                    );
                    st.failed = Some(kestrel_shared::chain(&e));
                }
            }
        }
        let line = Pending {
            uri: self.client.uri().to_string(),
            op,
        };
        match append_pending(&self.dir, &line) {
            Ok(()) => st.buffered += 1,
            Err(e) => tracing::warn!("MLflow call lost: {}", kestrel_shared::Chain(&e)),
        }
    }

    pub fn log(&self, metrics: Vec<Metric>, params: Vec<KeyValue>, tags: Vec<KeyValue>) {
        self.submit(Op::LogBatch {
            run_id: self.run_id().to_string(),
            metrics,
            params,
            tags,
        });
    }

    /// Stores the files of `dir` (recursively) under `prefix` of the artifact root `root`.
    fn upload_dir(&self, root: &str, dir: &Path, prefix: &str) -> Result<usize, TrackError> {
        let mut files = Vec::new();
        list_files(dir, "", &mut files)?;
        for rel in &files {
            self.upload_to(root, &dir.join(rel), &join(prefix, rel));
        }
        Ok(files.len())
    }

    /// The exported artifact `dir` as an MLflow Model: its files, and beside them `MLmodel` and
    /// the environment files ([`mlmodel`]), written first to `<run dir>/mlflow-model/` (so a
    /// buffered upload still finds them). Stored as the run's `model/` artifacts and, on MLflow 3,
    /// as the run's LoggedModel ([`Tracker::logged_model`]), marked ready once its files are up
    /// and recorded as the run's output. Returns the count of files per copy.
    pub fn log_model(&self, dir: &Path, m: &Manifest) -> Result<usize, TrackError> {
        let logged = self.logged_model(&m.name).unwrap_or_else(|e| {
            tracing::warn!(
                "MLflow: no LoggedModel ({}); the model is in the run's model/ only",
                kestrel_shared::Chain(&e)
            );
            None
        });
        let extra = self.dir.join("mlflow-model");
        std::fs::create_dir_all(&extra).map_err(|e| TrackError::io(&extra, e))?;
        let model_id = logged.as_ref().map(|l| l.model_id.as_str());
        let files = mlmodel::files(m, self.run_id(), model_id);
        for (name, text) in &files {
            let path = extra.join(name);
            kestrel_shared::fsutil::write_atomic(&path, text.as_bytes())
                .map_err(|e| TrackError::io(&path, e))?;
        }
        let run_root = self.link.run.artifact_uri.clone();
        let mut roots = vec![(run_root, "model")];
        roots.extend(logged.iter().map(|l| (l.artifact_uri.clone(), "")));
        let mut n = 0;
        for (root, prefix) in &roots {
            n = self.upload_dir(root, dir, prefix)?;
            for (name, _) in &files {
                self.upload_to(root, &extra.join(name), &join(prefix, name));
            }
        }
        if let Some(l) = logged {
            self.submit(Op::FinalizeLoggedModel {
                model_id: l.model_id.clone(),
                status: "LOGGED_MODEL_READY".into(),
            });
            self.submit(Op::LogOutputs {
                run_id: self.run_id().to_string(),
                model_id: l.model_id,
            });
        }
        Ok(n + files.len())
    }

    /// The run's MLflow 3 LoggedModel: the one a registration made, else a new one named `name`
    /// (needs the server now); `None` from a server before MLflow 3.
    pub fn logged_model(&self, name: &str) -> Result<Option<LoggedModel>, TrackError> {
        let mut logged = self.logged.lock().expect("tracker lock");
        if logged.is_none() {
            let run = &self.link.run;
            *logged = self
                .client
                .create_logged_model(&run.experiment_id, name, &run.run_id)?;
        }
        Ok(logged.clone())
    }

    /// Marks the run's LoggedModel, if any, as failed (an export that did not finish).
    pub fn abandon_logged_model(&self) {
        if let Some(l) = self.logged.lock().expect("tracker lock").take() {
            self.submit(Op::FinalizeLoggedModel {
                model_id: l.model_id,
                status: "LOGGED_MODEL_UPLOAD_FAILED".into(),
            });
        }
    }

    /// Stores `file` as `path` of the run's artifacts.
    pub fn upload(&self, file: &Path, path: &str) {
        self.upload_to(&self.link.run.artifact_uri, file, path);
    }

    fn upload_to(&self, root: &str, file: &Path, path: &str) {
        self.submit(Op::Upload {
            artifact_uri: root.to_string(),
            path: path.to_string(),
            file: std::path::absolute(file).unwrap_or_else(|_| file.to_path_buf()),
        });
    }

    /// A finished fit: the best epoch's results as metrics, and as artifacts the run directory's
    /// records (params, split, metrics, summary), the validation confusion matrix, the curves and
    /// the head's weights. Then ends the run.
    pub fn finish_fit(&self, dir: &Path, s: &Summary) -> Option<String> {
        self.log(run::fit_metrics(s), Vec::new(), Vec::new());
        let confusion = dir.join(train::RunDir::CONFUSION);
        let matrix = serde_json::json!({
            "split": "validation",
            "labels": s.validation.labels,
            "confusion": s.validation.confusion,
        });
        if let Err(e) = crate::report::write_json_atomic(&confusion, &matrix) {
            tracing::warn!("{e}");
        }
        for f in FIT_ARTIFACTS {
            if dir.join(f).is_file() {
                self.upload(&dir.join(f), f);
            }
        }
        self.end("FINISHED")
    }

    /// A new version of registered model `name` (created when missing) whose files will be the
    /// run's LoggedModel's (MLflow 3; named `name`), else the run's `model/` artifacts. Not
    /// buffered: registering needs the server now.
    pub fn register(&self, name: &str) -> Result<ModelVersion, TrackError> {
        self.client.ensure_registered_model(name)?;
        let logged = self.logged_model(name)?;
        let source = match &logged {
            // As MLflow's own `register_model` names a LoggedModel.
            Some(l) => format!("models:/{}", l.model_id),
            None => format!("{}/model", self.link.run.artifact_uri.trim_end_matches('/')),
        };
        let model_id = logged.as_ref().map(|l| l.model_id.as_str());
        self.client
            .create_model_version(name, &source, self.run_id(), model_id)
    }

    /// Ends the run with `status` (FINISHED, FAILED) and tries the pending calls once more;
    /// returns a line to print when some remain.
    pub fn end(&self, status: &str) -> Option<String> {
        self.submit(Op::EndRun {
            run_id: self.run_id().to_string(),
            status: status.to_string(),
            end_ms: now_ms(),
        });
        let st = self.state.lock().expect("tracker lock");
        if st.buffered == 0 {
            return None;
        }
        drop(st);
        match sync(&self.dir, None) {
            Ok(n) => {
                tracing::info!("MLflow: the server is back; replayed {n} buffered calls");
                None
            }
            Err(e) => Some(format!(
                "MLflow: calls buffered in {} ({}); replay them with `trainer mlflow sync {}`",
                self.dir.join(PENDING_FILE).display(),
                kestrel_shared::Chain(&e),
                self.dir.display()
            )),
        }
    }
}

impl train::Observer for Tracker {
    fn prepared(&self, pp: &TrainingData) {
        self.log(Vec::new(), Vec::new(), run::data_tags(pp));
        self.submit(Op::LogInputs {
            run_id: self.run_id().to_string(),
            datasets: run::dataset_inputs(pp),
        });
    }

    fn epoch(&self, m: &EpochMetrics) {
        self.log(run::epoch_metrics(m), Vec::new(), Vec::new());
    }
}

impl tune::Observer for Tracker {
    fn trial(&self, t: &TrialResult) {
        self.submit(trial_run(&self.link, t));
    }
}

fn with_retries<T>(
    waits: &[Duration],
    mut f: impl FnMut() -> Result<T, TrackError>,
) -> Result<T, TrackError> {
    let mut waits = waits.iter();
    loop {
        match f() {
            Err(e) if e.transient() => match waits.next() {
                Some(w) => std::thread::sleep(*w),
                None => return Err(e),
            },
            r => return r,
        }
    }
}

/// The run a directory is tracked as, if it is.
pub fn read_link(dir: &Path) -> Option<RunLink> {
    let text = std::fs::read_to_string(dir.join(RUN_FILE)).ok()?;
    serde_json::from_str(&text).ok()
}

fn append_pending(dir: &Path, line: &Pending) -> Result<(), TrackError> {
    let path = dir.join(PENDING_FILE);
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(|e| TrackError::io(&path, e))?;
    let mut text = serde_json::to_string(line).expect("serializable");
    text.push('\n');
    f.write_all(text.as_bytes())
        .and_then(|()| f.sync_data())
        .map_err(|e| TrackError::io(&path, e))
}

/// Replays `dir`'s pending calls in order (to `uri`, or the server each was meant for), removing
/// each from the file once delivered; stops at the first failure, keeping the rest. Returns how
/// many were delivered.
pub fn sync(dir: &Path, uri: Option<&str>) -> Result<usize, TrackError> {
    let path = dir.join(PENDING_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(TrackError::io(&path, e)),
    };
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let mut done = 0;
    let mut result = Ok(());
    for (i, line) in lines.iter().enumerate() {
        let p: Pending = serde_json::from_str(line)
            .map_err(|e| TrackError::io(&path, format!("line {}: {e}", i + 1)))?;
        let client = Client::new(uri.unwrap_or(&p.uri))?;
        if let Err(e) = p.op.apply(&client) {
            result = Err(e);
            break;
        }
        done += 1;
    }
    // Keep what was not delivered (atomically: a crash here leaves the old file or the new one).
    let rest = &lines[done..];
    if rest.is_empty() {
        std::fs::remove_file(&path).map_err(|e| TrackError::io(&path, e))?;
    } else if done > 0 {
        let tmp = path.with_extension("jsonl.tmp");
        std::fs::write(&tmp, rest.join("\n") + "\n").map_err(|e| TrackError::io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| TrackError::io(&path, e))?;
    }
    result.map(|()| done)
}

fn list_files(dir: &Path, rel: &str, out: &mut Vec<String>) -> Result<(), TrackError> {
    let here = dir.join(rel);
    let mut entries: Vec<_> = std::fs::read_dir(&here)
        .map_err(|e| TrackError::io(&here, e))?
        .filter_map(Result::ok)
        .collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let path = join(rel, &e.file_name().to_string_lossy());
        if e.path().is_dir() {
            list_files(dir, &path, out)?;
        } else {
            out.push(path);
        }
    }
    Ok(())
}

fn join(a: &str, b: &str) -> String {
    if a.is_empty() {
        b.to_string()
    } else {
        format!("{a}/{b}")
    }
}

#[cfg(test)]
mod tests;
