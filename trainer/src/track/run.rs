//! What Kestrel's runs look like in MLflow: params, tags and metrics from its own records.

use serde::Serialize;
use serde_json::Value;

use super::{KeyValue, Metric, Op, RunLink, kv};
use crate::report::EpochMetrics;
use crate::train::{Summary, TrainingData};
use crate::tune::TrialResult;

/// A serializable value as MLflow params: nested objects flattened with `.` (`source.label_column`),
/// strings as they are, other values as JSON, `null` as `None` (as MLflow's Python client logs it).
pub fn flatten_params(prefix: &str, v: &impl Serialize) -> Vec<KeyValue> {
    let mut out = Vec::new();
    flatten(
        prefix,
        &serde_json::to_value(v).unwrap_or(Value::Null),
        &mut out,
    );
    out
}

fn flatten(prefix: &str, v: &Value, out: &mut Vec<KeyValue>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, v, out);
            }
        }
        Value::String(s) => out.push(kv(prefix, s.as_str())),
        Value::Null => out.push(kv(prefix, "None")),
        v => out.push(kv(prefix, v.to_string())),
    }
}

/// Tags every Kestrel run gets: which command, the Kestrel version, the user and (when the working
/// directory is a git checkout) its commit, under MLflow's own tag names where they exist.
pub fn run_tags(command: &str) -> Vec<KeyValue> {
    let mut t = vec![
        kv("mlflow.source.name", format!("trainer {command}")),
        kv("mlflow.source.type", "LOCAL"),
        kv("kestrel.version", env!("CARGO_PKG_VERSION")),
    ];
    if let Ok(user) = std::env::var("USER") {
        t.push(kv("mlflow.user", user));
    }
    let git = std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .stderr(std::process::Stdio::null())
        .output();
    if let Ok(o) = git
        && o.status.success()
    {
        t.push(kv(
            "mlflow.source.git.commit",
            String::from_utf8_lossy(&o.stdout).trim(),
        ));
    }
    t
}

/// Tags of the data a run trained on: the source (with a Delta table's version) and the caches.
pub fn data_tags(pp: &TrainingData) -> Vec<KeyValue> {
    let m = &pp.prepared.meta;
    let name = |d: &std::path::Path| {
        d.file_name()
            .map_or(String::new(), |n| n.to_string_lossy().to_string())
    };
    vec![
        kv("kestrel.data.source", m.source.as_str()),
        kv("kestrel.data.samples", m.ids.len().to_string()),
        kv("kestrel.data.classes", m.labels.len().to_string()),
        kv("kestrel.cache.samples", m.key.as_str()),
        kv("kestrel.cache.features", name(&pp.features.dir)),
    ]
}

/// The tables a run trained on as MLflow dataset inputs (context `training`): named by the
/// table's last path segment, the digest the sample cache's key (truncated to MLflow's 36
/// characters; the whole key is the `kestrel.cache.samples` tag), the source the table's path or
/// URL, and for a Delta table the version read (`delta_table`, as MLflow's own Delta source).
pub fn dataset_inputs(pp: &TrainingData) -> Vec<Value> {
    let key = &pp.prepared.meta.key;
    let digest = &key[..key.len().min(36)];
    pp.tables
        .iter()
        .map(|t| {
            let name = t
                .location
                .trim_end_matches('/')
                .rsplit('/')
                .next()
                .unwrap_or("");
            let (source_type, source) = match (t.format, t.version) {
                ("delta", Some(v)) => (
                    "delta_table".to_string(),
                    serde_json::json!({ "path": t.location, "delta_table_version": v }),
                ),
                _ => {
                    let scheme = crate::data::source::location::object_url(std::path::Path::new(
                        &t.location,
                    ))
                    .map_or("local".to_string(), |u| u.scheme().to_string());
                    (scheme, serde_json::json!({ "uri": t.location }))
                }
            };
            serde_json::json!({
                "tags": [{ "key": "mlflow.data.context", "value": "training" }],
                "dataset": {
                    "name": name,
                    "digest": digest,
                    "source_type": source_type,
                    "source": source.to_string(),
                    "profile": serde_json::json!({
                        "format": t.format,
                        "samples": pp.prepared.len(),
                    }).to_string(),
                },
            })
        })
        .collect()
}

/// One `metrics.jsonl` line as MLflow metrics at step = epoch.
pub fn epoch_metrics(m: &EpochMetrics) -> Vec<Metric> {
    [
        ("train_loss", m.train_loss),
        ("train_accuracy", m.train_accuracy),
        ("val_loss", m.val_loss),
        ("val_accuracy", m.val_accuracy),
        ("samples_per_s", m.samples_per_s),
    ]
    .into_iter()
    .filter(|(_, v)| v.is_finite())
    .map(|(k, v)| Metric::now(k, v, m.epoch as i64))
    .collect()
}

/// The final results of a fit (the best epoch's), as metrics at step 0.
pub fn fit_metrics(s: &Summary) -> Vec<Metric> {
    let mut v = vec![
        ("best_val_accuracy", s.val_accuracy),
        ("best_val_loss", s.val_loss),
        ("best_epoch", s.best_epoch as f64),
        ("feature_seconds", s.feature_seconds),
        ("train_seconds", s.train_seconds),
    ];
    if let Some(a) = s.test_accuracy {
        v.push(("test_accuracy", a));
    }
    v.into_iter()
        .filter(|(_, v)| v.is_finite())
        .map(|(k, v)| Metric::now(k, v, 0))
        .collect()
}

/// A tuning trial as a child run of the tune run (Hyperopt's SparkTrials does the same).
pub fn trial_run(parent: &RunLink, t: &TrialResult) -> Op {
    let metric = |key: &str, value: f64| Metric::now(key, value, 0);
    let mut metrics = vec![
        metric("val_accuracy", t.val_accuracy),
        metric("best_epoch", t.best_epoch as f64),
        metric("seconds", t.seconds),
    ];
    if let Some(l) = t.val_loss.filter(|l| l.is_finite()) {
        metrics.push(metric("val_loss", l));
    }
    let mut tags = vec![
        kv("mlflow.parentRunId", parent.run.run_id.as_str()),
        kv("kestrel.trial", t.trial.to_string()),
        kv("kestrel.trial.source", t.source.as_str()),
    ];
    if let Some(e) = &t.error {
        tags.push(kv("kestrel.trial.error", e.as_str()));
    }
    Op::Run {
        experiment_id: parent.run.experiment_id.clone(),
        name: format!("trial-{:03}", t.trial),
        tags,
        params: flatten_params("", &t.params),
        metrics,
        status: if t.error.is_some() {
            "FAILED"
        } else {
            "FINISHED"
        }
        .into(),
        span_ms: (t.ended_ms > 0).then(|| {
            let end = t.ended_ms as i64;
            (end - (t.seconds * 1000.0).round() as i64, end)
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_flatten_with_dots() {
        let v = serde_json::json!({"lr": 0.01, "source": {"label_column": "label", "data_version": null}, "flip": true});
        let p = flatten_params("", &v);
        let get = |k: &str| p.iter().find(|x| x.key == k).map(|x| x.value.clone());
        assert_eq!(get("lr").as_deref(), Some("0.01"));
        assert_eq!(get("source.label_column").as_deref(), Some("label"));
        assert_eq!(get("source.data_version").as_deref(), Some("None"));
        assert_eq!(get("flip").as_deref(), Some("true"));
    }

    #[test]
    fn a_failed_trial_is_a_failed_child_run_timed_back_from_its_end() {
        let parent = RunLink {
            uri: "http://h:5000".into(),
            experiment: "faces".into(),
            run: crate::track::RunRef {
                run_id: "p1".into(),
                experiment_id: "7".into(),
                artifact_uri: String::new(),
            },
        };
        let t = TrialResult {
            trial: 7,
            source: "tpe".into(),
            params: crate::tune::TrialParams {
                lr: 0.01,
                momentum: 0.9,
                weight_decay: 0.0,
                batch_size: 32,
                optimizer: crate::train::Optimizer::Sgd,
                epochs: 5,
            },
            val_loss: Some(f64::NAN),
            val_accuracy: 0.5,
            best_epoch: 3,
            seconds: 2.4996,
            ended_ms: 10_000,
            error: Some("diverged".into()),
        };
        let Op::Run {
            experiment_id,
            name,
            tags,
            params,
            metrics,
            status,
            span_ms,
        } = trial_run(&parent, &t)
        else {
            panic!("a trial is logged as a whole run");
        };
        assert_eq!((experiment_id.as_str(), name.as_str()), ("7", "trial-007"));
        assert_eq!(
            (status.as_str(), span_ms),
            ("FAILED", Some((7_500, 10_000)))
        );
        let keys: Vec<&str> = metrics.iter().map(|m| m.key.as_str()).collect();
        assert_eq!(keys, ["val_accuracy", "best_epoch", "seconds"]);
        assert!(tags.contains(&kv("mlflow.parentRunId", "p1")));
        assert!(tags.contains(&kv("kestrel.trial.error", "diverged")));
        assert!(params.contains(&kv("optimizer", "sgd")));
        assert!(params.contains(&kv("batch_size", "32")));
    }

    #[test]
    fn epoch_metrics_leave_out_non_finite_values_and_step_at_the_epoch() {
        let m = EpochMetrics {
            epoch: 4,
            train_loss: 0.5,
            train_accuracy: 0.8,
            val_loss: f64::NAN,
            val_accuracy: 0.75,
            samples_per_s: f64::INFINITY,
        };
        let got: Vec<(String, f64, i64)> = epoch_metrics(&m)
            .into_iter()
            .map(|x| (x.key, x.value, x.step))
            .collect();
        let want = [
            ("train_loss", 0.5),
            ("train_accuracy", 0.8),
            ("val_accuracy", 0.75),
        ];
        let want: Vec<(String, f64, i64)> =
            want.iter().map(|&(k, v)| (k.to_string(), v, 4)).collect();
        assert_eq!(got, want);
    }
}
