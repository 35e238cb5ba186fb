//! A thin client of the MLflow tracking server's REST API (2.0 endpoints, as served by MLflow 2
//! and 3): experiments, runs, batched logging, the proxied artifact store (`--serve-artifacts`,
//! `mlflow-artifacts:` URIs; `file:` stores are read and written directly) and the model registry.
//!
//! Only what Kestrel logs and fetches: a dozen endpoints. The Rust MLflow crates on crates.io
//! (`mlflow`, `mlflow-client`, `trs-mlflow`) are single-author 0.x releases without the artifact
//! proxy or registry aliases, so this talks to the documented REST API itself over `reqwest`
//! (already in the trainer's build through the Delta kernel).

use std::path::{Path, PathBuf};
use std::time::Duration;

use reqwest::blocking::{Client as Http, RequestBuilder};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::TrackError;

/// One metric value at a step (MLflow's `Metric`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Metric {
    pub key: String,
    pub value: f64,
    /// Milliseconds since the Unix epoch.
    pub timestamp: i64,
    pub step: i64,
}

impl Metric {
    /// `key` = `value` at `step`, timestamped now.
    pub fn now(key: impl Into<String>, value: f64, step: i64) -> Metric {
        Metric {
            key: key.into(),
            value,
            timestamp: now_ms(),
            step,
        }
    }
}

/// A key and a string value: a param or a tag.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeyValue {
    pub key: String,
    pub value: String,
}

pub fn kv(key: impl Into<String>, value: impl Into<String>) -> KeyValue {
    KeyValue {
        key: key.into(),
        value: value.into(),
    }
}

/// A run as the server describes it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunRef {
    pub run_id: String,
    pub experiment_id: String,
    pub artifact_uri: String,
}

/// An MLflow 3 LoggedModel: a model with its own id and artifact location, linked to the run
/// that made it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoggedModel {
    pub model_id: String,
    pub artifact_uri: String,
}

/// A registered model version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelVersion {
    pub name: String,
    pub version: u64,
    pub source: String,
    pub run_id: Option<String>,
}

/// A connection to one tracking server.
#[derive(Clone)]
pub struct Client {
    base: String,
    http: Http,
    auth: Auth,
}

/// Credentials from MLflow's own environment variables, as its Python client reads them.
#[derive(Clone)]
enum Auth {
    None,
    /// `MLFLOW_TRACKING_TOKEN`.
    Bearer(String),
    /// `MLFLOW_TRACKING_USERNAME` and `MLFLOW_TRACKING_PASSWORD`.
    Basic(String, String),
}

impl Auth {
    fn from_env() -> Auth {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        match (
            var("MLFLOW_TRACKING_TOKEN"),
            var("MLFLOW_TRACKING_USERNAME"),
            var("MLFLOW_TRACKING_PASSWORD"),
        ) {
            (Some(t), _, _) => Auth::Bearer(t),
            (None, Some(u), Some(p)) => Auth::Basic(u, p),
            _ => Auth::None,
        }
    }

    /// Why the server may have refused these credentials, naming the variables to set.
    fn refused(&self) -> &'static str {
        match self {
            Auth::None => {
                "the server wants credentials: set MLFLOW_TRACKING_USERNAME and \
                 MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN"
            }
            Auth::Bearer(_) => "the server refused MLFLOW_TRACKING_TOKEN",
            Auth::Basic(..) => {
                "the server refused MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD"
            }
        }
    }

    fn apply(&self, req: RequestBuilder) -> RequestBuilder {
        match self {
            Auth::None => req,
            Auth::Bearer(t) => req.bearer_auth(t),
            Auth::Basic(u, p) => req.basic_auth(u, Some(p)),
        }
    }
}

/// MLflow's limits per `log-batch` call.
const BATCH_METRICS: usize = 1000;
const BATCH_PARAMS: usize = 100;

impl Client {
    /// A client of the server at `uri` (`http://` or `https://`); nothing is sent yet.
    pub fn new(uri: &str) -> Result<Client, TrackError> {
        if !(uri.starts_with("http://") || uri.starts_with("https://")) {
            return Err(TrackError::Unsupported(format!(
                "tracking URI {uri:?}: only an MLflow tracking server (http:// or https://) is supported"
            )));
        }
        let http = Http::builder()
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(120))
            .build()
            .map_err(|e| TrackError::unreachable(uri, e))?;
        Ok(Client {
            base: uri.trim_end_matches('/').to_string(),
            http,
            auth: Auth::from_env(),
        })
    }

    pub fn uri(&self) -> &str {
        &self.base
    }

    fn url(&self, api: &str, query: &[(&str, &str)]) -> String {
        let mut u = format!("{}/api/2.0/{api}", self.base);
        if !query.is_empty() {
            let q: String = url::form_urlencoded::Serializer::new(String::new())
                .extend_pairs(query)
                .finish();
            u = format!("{u}?{q}");
        }
        u
    }

    fn send(
        &self,
        what: &str,
        req: RequestBuilder,
    ) -> Result<reqwest::blocking::Response, TrackError> {
        let resp = self
            .auth
            .apply(req)
            .send()
            .map_err(|e| TrackError::unreachable(&self.base, e))?;
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let body: Value = resp.json().unwrap_or(Value::Null);
        let mut message = body["message"].as_str().unwrap_or("").to_string();
        if matches!(status.as_u16(), 401 | 403) {
            // The auth app answers in plain text, not MLflow's JSON error: say what to set.
            let refused = self.auth.refused();
            message = match message.trim() {
                "" => refused.to_string(),
                detail => format!("{refused} ({detail})"),
            };
        }
        Err(TrackError::Api {
            what: what.to_string(),
            status: status.as_u16(),
            code: body["error_code"].as_str().unwrap_or("").to_string(),
            message,
        })
    }

    fn get(&self, api: &str, query: &[(&str, &str)]) -> Result<Value, TrackError> {
        let r = self.send(api, self.http.get(self.url(api, query)))?;
        r.json().map_err(|e| TrackError::unreachable(&self.base, e))
    }

    fn post(&self, api: &str, body: &Value) -> Result<Value, TrackError> {
        let r = self.send(api, self.http.post(self.url(api, &[])).json(body))?;
        r.json().map_err(|e| TrackError::unreachable(&self.base, e))
    }

    /// The id of experiment `name`, created when it does not exist.
    pub fn experiment_id(&self, name: &str) -> Result<String, TrackError> {
        match self.get(
            "mlflow/experiments/get-by-name",
            &[("experiment_name", name)],
        ) {
            Ok(v) => Ok(str_of(&v["experiment"]["experiment_id"])),
            Err(e) if e.code() == Some("RESOURCE_DOES_NOT_EXIST") => {
                let v = self.post("mlflow/experiments/create", &json!({ "name": name }))?;
                Ok(str_of(&v["experiment_id"]))
            }
            Err(e) => Err(e),
        }
    }

    /// Starts a run (status RUNNING) that started at `start_ms` (milliseconds since the epoch).
    pub fn create_run(
        &self,
        experiment_id: &str,
        name: &str,
        tags: &[KeyValue],
        start_ms: i64,
    ) -> Result<RunRef, TrackError> {
        let v = self.post(
            "mlflow/runs/create",
            &json!({
                "experiment_id": experiment_id,
                "run_name": name,
                "start_time": start_ms,
                "tags": tags,
            }),
        )?;
        Ok(run_ref(&v["run"]["info"]))
    }

    pub fn get_run(&self, run_id: &str) -> Result<RunRef, TrackError> {
        let v = self.get("mlflow/runs/get", &[("run_id", run_id)])?;
        Ok(run_ref(&v["run"]["info"]))
    }

    /// Logs metrics, params and tags, in as many calls as MLflow's batch limits need.
    pub fn log_batch(
        &self,
        run_id: &str,
        metrics: &[Metric],
        params: &[KeyValue],
        tags: &[KeyValue],
    ) -> Result<(), TrackError> {
        let mut first = true;
        let (mut m, mut p) = (metrics, params);
        while first || !m.is_empty() || !p.is_empty() {
            let (mh, mt) = m.split_at(m.len().min(BATCH_METRICS));
            let (ph, pt) = p.split_at(p.len().min(BATCH_PARAMS));
            let tags: &[KeyValue] = if first { tags } else { &[] };
            self.post(
                "mlflow/runs/log-batch",
                &json!({ "run_id": run_id, "metrics": mh, "params": ph, "tags": tags }),
            )?;
            (m, p, first) = (mt, pt, false);
        }
        Ok(())
    }

    /// Records datasets as the run's inputs (`runs/log-inputs`): each a `{tags, dataset}` object.
    pub fn log_inputs(&self, run_id: &str, datasets: &[Value]) -> Result<(), TrackError> {
        self.post(
            "mlflow/runs/log-inputs",
            &json!({ "run_id": run_id, "datasets": datasets }),
        )?;
        Ok(())
    }

    /// Ends a run: `FINISHED`, `FAILED` or `KILLED`.
    pub fn end_run(&self, run_id: &str, status: &str, end_ms: i64) -> Result<(), TrackError> {
        self.post(
            "mlflow/runs/update",
            &json!({ "run_id": run_id, "status": status, "end_time": end_ms }),
        )?;
        Ok(())
    }

    /// Stores `file` as `path` (relative, `/`-separated) under the artifact root `artifact_uri`.
    pub fn upload(&self, artifact_uri: &str, path: &str, file: &Path) -> Result<(), TrackError> {
        match ArtifactRoot::parse(artifact_uri)? {
            ArtifactRoot::Proxied(root) => {
                let bytes = std::fs::read(file).map_err(|e| TrackError::io(file, e))?;
                let url = format!(
                    "{}/api/2.0/mlflow-artifacts/artifacts/{}",
                    self.base,
                    encode_path(&join(&root, path))
                );
                self.send("mlflow-artifacts upload", self.http.put(url).body(bytes))?;
                Ok(())
            }
            ArtifactRoot::Local(root) => {
                let to = root.join(path);
                if let Some(d) = to.parent() {
                    std::fs::create_dir_all(d).map_err(|e| TrackError::io(d, e))?;
                }
                std::fs::copy(file, &to).map_err(|e| TrackError::io(&to, e))?;
                Ok(())
            }
        }
    }

    /// Downloads every file under `uri` (an artifact directory) into `to`; returns the files' paths
    /// relative to `to`.
    pub fn download_dir(&self, uri: &str, to: &Path) -> Result<Vec<String>, TrackError> {
        // A LoggedModel (`models:/<model_id>`, MLflow 3's source of a version registered from
        // one): its own artifact location.
        if let Some(id) = uri.strip_prefix("models:/").filter(|id| !id.contains('/')) {
            let api = format!("mlflow/logged-models/{}", encode_path(id));
            let v = self.get(&api, &[])?;
            let root = str_of(&v["model"]["info"]["artifact_uri"]);
            if root.is_empty() || root.starts_with("models:") {
                return Err(TrackError::Unsupported(format!(
                    "{uri}: the server names no artifact location for it"
                )));
            }
            return self.download_dir(&root, to);
        }
        let mut files = Vec::new();
        match ArtifactRoot::parse(uri)? {
            ArtifactRoot::Proxied(root) => self.download_proxied(&root, "", to, &mut files)?,
            ArtifactRoot::Local(root) => copy_tree(&root, "", to, &mut files)?,
        }
        if files.is_empty() {
            return Err(TrackError::Unsupported(format!(
                "{uri}: no artifact files there"
            )));
        }
        Ok(files)
    }

    fn download_proxied(
        &self,
        root: &str,
        rel: &str,
        to: &Path,
        files: &mut Vec<String>,
    ) -> Result<(), TrackError> {
        let listing = self.get("mlflow-artifacts/artifacts", &[("path", &join(root, rel))])?;
        for f in listing["files"].as_array().into_iter().flatten() {
            let name = f["path"].as_str().unwrap_or_default();
            let Some(name) = safe_name(name) else {
                return Err(TrackError::Unsupported(format!(
                    "{root}: artifact entry {name:?} is not a plain file name"
                )));
            };
            let path = join(rel, name);
            if f["is_dir"].as_bool().unwrap_or(false) {
                self.download_proxied(root, &path, to, files)?;
                continue;
            }
            let url = format!(
                "{}/api/2.0/mlflow-artifacts/artifacts/{}",
                self.base,
                encode_path(&join(root, &path))
            );
            let bytes = self
                .send("mlflow-artifacts download", self.http.get(url))?
                .bytes()
                .map_err(|e| TrackError::unreachable(&self.base, e))?;
            let dest = to.join(&path);
            if let Some(d) = dest.parent() {
                std::fs::create_dir_all(d).map_err(|e| TrackError::io(d, e))?;
            }
            std::fs::write(&dest, &bytes).map_err(|e| TrackError::io(&dest, e))?;
            files.push(path);
        }
        Ok(())
    }

    /// Creates registered model `name` unless it exists.
    pub fn ensure_registered_model(&self, name: &str) -> Result<(), TrackError> {
        match self.post("mlflow/registered-models/create", &json!({ "name": name })) {
            Err(e) if e.code() == Some("RESOURCE_ALREADY_EXISTS") => Ok(()),
            r => r.map(|_| ()),
        }
    }

    /// Registers a new version of `name` whose files are at `source`, made by `run_id` (and, on
    /// MLflow 3, LoggedModel `model_id`).
    pub fn create_model_version(
        &self,
        name: &str,
        source: &str,
        run_id: &str,
        model_id: Option<&str>,
    ) -> Result<ModelVersion, TrackError> {
        let mut body = json!({ "name": name, "source": source, "run_id": run_id });
        if let Some(id) = model_id {
            body["model_id"] = json!(id);
        }
        let v = self.post("mlflow/model-versions/create", &body)?;
        model_version(&v["model_version"])
    }

    /// Creates an MLflow 3 LoggedModel (status pending) made by run `run_id`; `None` from a server
    /// that predates them (no such endpoint).
    pub fn create_logged_model(
        &self,
        experiment_id: &str,
        name: &str,
        run_id: &str,
    ) -> Result<Option<LoggedModel>, TrackError> {
        let body = json!({
            "experiment_id": experiment_id,
            "name": name,
            "source_run_id": run_id,
            "model_type": "kestrel",
        });
        match self.post("mlflow/logged-models", &body) {
            Ok(v) => {
                let info = &v["model"]["info"];
                Ok(Some(LoggedModel {
                    model_id: str_of(&info["model_id"]),
                    artifact_uri: str_of(&info["artifact_uri"]),
                }))
            }
            Err(TrackError::Api { status: 404, .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Sets a LoggedModel's final status: `LOGGED_MODEL_READY` or `LOGGED_MODEL_UPLOAD_FAILED`.
    pub fn finalize_logged_model(&self, model_id: &str, status: &str) -> Result<(), TrackError> {
        let api = format!("mlflow/logged-models/{}", encode_path(model_id));
        let body = json!({ "model_id": model_id, "status": status });
        self.send(&api, self.http.patch(self.url(&api, &[])).json(&body))?;
        Ok(())
    }

    /// Records LoggedModel `model_id` as an output of run `run_id`.
    pub fn log_outputs(&self, run_id: &str, model_id: &str) -> Result<(), TrackError> {
        let body = json!({ "run_id": run_id, "models": [{ "model_id": model_id, "step": 0 }] });
        self.post("mlflow/runs/outputs", &body)?;
        Ok(())
    }

    pub fn delete_model_version(&self, name: &str, version: u64) -> Result<(), TrackError> {
        let url = self.url("mlflow/model-versions/delete", &[]);
        let body = json!({ "name": name, "version": version.to_string() });
        self.send("model-versions/delete", self.http.delete(url).json(&body))?;
        Ok(())
    }

    pub fn set_alias(&self, name: &str, alias: &str, version: u64) -> Result<(), TrackError> {
        self.post(
            "mlflow/registered-models/alias",
            &json!({ "name": name, "alias": alias, "version": version.to_string() }),
        )?;
        Ok(())
    }

    pub fn set_version_tag(
        &self,
        name: &str,
        version: u64,
        key: &str,
        value: &str,
    ) -> Result<(), TrackError> {
        self.post(
            "mlflow/model-versions/set-tag",
            &json!({ "name": name, "version": version.to_string(), "key": key, "value": value }),
        )?;
        Ok(())
    }

    /// The version an alias points to.
    pub fn version_by_alias(&self, name: &str, alias: &str) -> Result<ModelVersion, TrackError> {
        let v = self.get(
            "mlflow/registered-models/alias",
            &[("name", name), ("alias", alias)],
        )?;
        model_version(&v["model_version"])
    }

    pub fn model_version(&self, name: &str, version: u64) -> Result<ModelVersion, TrackError> {
        let v = self.get(
            "mlflow/model-versions/get",
            &[("name", name), ("version", &version.to_string())],
        )?;
        model_version(&v["model_version"])
    }
}

/// Where a run's artifacts live, as far as this client can reach them.
enum ArtifactRoot {
    /// Through the tracking server (`mlflow-artifacts:/<path>`): the path under its artifact root.
    Proxied(String),
    /// A local directory (`file://` or a plain path).
    Local(PathBuf),
}

impl ArtifactRoot {
    fn parse(uri: &str) -> Result<ArtifactRoot, TrackError> {
        if let Some(rest) = uri.strip_prefix("mlflow-artifacts:") {
            // mlflow-artifacts:/1/abc/artifacts or mlflow-artifacts://host:port/1/abc/artifacts
            let path = match rest.strip_prefix("//") {
                Some(r) => r.split_once('/').map_or("", |(_, p)| p),
                None => rest,
            };
            return Ok(ArtifactRoot::Proxied(path.trim_matches('/').to_string()));
        }
        if let Some(p) = uri.strip_prefix("file://") {
            return Ok(ArtifactRoot::Local(PathBuf::from(p)));
        }
        if uri.starts_with('/') {
            return Ok(ArtifactRoot::Local(PathBuf::from(uri)));
        }
        Err(TrackError::Unsupported(format!(
            "artifact store {uri:?}: Kestrel reaches artifacts through the tracking server \
             (start it with --serve-artifacts) or a local file: store"
        )))
    }
}

fn copy_tree(root: &Path, rel: &str, to: &Path, files: &mut Vec<String>) -> Result<(), TrackError> {
    let dir = root.join(rel);
    let entries = std::fs::read_dir(&dir).map_err(|e| TrackError::io(&dir, e))?;
    for e in entries {
        let e = e.map_err(|e| TrackError::io(&dir, e))?;
        let name = e.file_name().to_string_lossy().to_string();
        let path = join(rel, &name);
        if e.path().is_dir() {
            copy_tree(root, &path, to, files)?;
        } else {
            let dest = to.join(&path);
            if let Some(d) = dest.parent() {
                std::fs::create_dir_all(d).map_err(|e| TrackError::io(d, e))?;
            }
            std::fs::copy(e.path(), &dest).map_err(|e| TrackError::io(&dest, e))?;
            files.push(path);
        }
    }
    Ok(())
}

/// The last segment of a listed artifact path, if it is a plain name (no `..`, no separators
/// beyond the listing's own prefix).
fn safe_name(listed: &str) -> Option<&str> {
    let name = listed.rsplit('/').next()?;
    (!name.is_empty() && name != "." && name != "..").then_some(name)
}

fn join(a: &str, b: &str) -> String {
    match (a.is_empty(), b.is_empty()) {
        (true, _) => b.to_string(),
        (_, true) => a.to_string(),
        _ => format!("{a}/{b}"),
    }
}

fn encode_path(p: &str) -> String {
    p.split('/')
        .map(|s| {
            percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
        })
        .collect::<Vec<_>>()
        .join("/")
}

fn str_of(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        v => v.to_string(),
    }
}

fn run_ref(info: &Value) -> RunRef {
    RunRef {
        run_id: str_of(&info["run_id"]),
        experiment_id: str_of(&info["experiment_id"]),
        artifact_uri: str_of(&info["artifact_uri"]),
    }
}

fn model_version(v: &Value) -> Result<ModelVersion, TrackError> {
    let version = str_of(&v["version"]);
    Ok(ModelVersion {
        name: str_of(&v["name"]),
        version: version.parse().map_err(|_| {
            TrackError::Unsupported(format!("model version {version:?} is not a number"))
        })?,
        source: str_of(&v["source"]),
        run_id: Some(str_of(&v["run_id"])).filter(|s| !s.is_empty()),
    })
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

#[cfg(test)]
mod tests;
