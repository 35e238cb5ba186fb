//! `trainer predict`: batch inference of an exported artifact over a whole image table, spread over
//! workers (threads here, ranks under MPI), written as Parquet.
//!
//! Every worker loads the artifact exactly as the edge does ([`LoadedModel::load`]: file sizes and
//! hashes, then the golden-sample health check), classifies its contiguous share of the table's rows
//! (decode + the manifest's preprocessing + tract), and the rows are gathered in table order;
//! rank 0 writes the Parquet file (temporary name, fsync, rename). An image that cannot be decoded
//! gets its `error` column filled instead of failing the whole table.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use arrow::array::{ArrayRef, Float32Array, StringArray, UInt32Array};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use kestrel_models::EngineKind;
use kestrel_models::artifact::{ArtifactError, LoadedModel};
use serde::{Deserialize, Serialize};

use crate::data::{self, Dataset, SourceOpts};
use crate::distributed::{self, CollectiveError, ErrorScope, Job, Rank, RankError, WorkerError};

#[derive(Debug, thiserror::Error)]
pub enum PredictError {
    #[error(transparent)]
    Data(#[from] data::DataError),
    #[error(transparent)]
    Artifact(#[from] ArtifactError),
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error("{path}")]
    Output {
        path: String,
        #[source]
        source: kestrel_shared::error::Cause,
    },
    #[error("only {rows} rows for {workers} workers: every worker needs at least one")]
    TooFewRows { rows: usize, workers: usize },
    #[error(transparent)]
    Worker(#[from] WorkerError),
}

impl RankError for PredictError {
    fn scope(&self) -> ErrorScope {
        match self {
            PredictError::Collective(e) => ErrorScope::of_collective(Some(e)),
            PredictError::Worker(_) | PredictError::TooFewRows { .. } => ErrorScope::Job,
            _ => ErrorScope::Own,
        }
    }
}

/// One output row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    pub path: String,
    /// The table's label for the row.
    pub label: String,
    pub prediction: Option<String>,
    pub class: Option<u32>,
    /// Softmax probability of the prediction.
    pub score: Option<f32>,
    pub error: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct PredictSummary {
    pub model: String,
    pub version: u64,
    pub rows: usize,
    pub errors: usize,
    /// Share of rows whose prediction equals the table's label (when the labels are the model's).
    pub accuracy: Option<f64>,
    pub workers: usize,
    pub seconds: f64,
    pub images_per_s: f64,
    pub out: String,
}

/// Classifies every row of `data` with the artifact in `model_dir` on the job's ranks (local
/// worker threads or MPI ranks), each its contiguous share of the rows; rank 0's process writes
/// `out` (Parquet) and returns the summary, the others `None`.
pub fn predict(
    model_dir: &Path,
    data_path: &Path,
    source: &SourceOpts,
    out: &Path,
    max_bytes: u64,
    job: &Job,
) -> Result<Option<PredictSummary>, PredictError> {
    let start = Instant::now();
    let ds = data::load(data_path, source)?;
    let Some(rows) = job.run(|rank| predict_rank(model_dir, &ds, rank, max_bytes))? else {
        return Ok(None);
    };
    let model = kestrel_models::artifact::read_manifest(model_dir)?;
    write_parquet(out, &rows)?;
    Ok(Some(summarize(
        &model,
        &rows,
        job.world(),
        start.elapsed().as_secs_f64(),
        out,
    )))
}

/// Summary of gathered rows.
pub fn summarize(
    model: &kestrel_shared::manifest::Manifest,
    rows: &[Row],
    workers: usize,
    seconds: f64,
    out: &Path,
) -> PredictSummary {
    let errors = rows.iter().filter(|r| r.error.is_some()).count();
    let known = rows.iter().all(|r| model.labels.contains(&r.label));
    let correct = rows
        .iter()
        .filter(|r| r.prediction.as_deref() == Some(r.label.as_str()))
        .count();
    PredictSummary {
        model: model.name.clone(),
        version: model.version,
        rows: rows.len(),
        errors,
        accuracy: (known && !rows.is_empty()).then(|| correct as f64 / rows.len() as f64),
        workers,
        seconds,
        images_per_s: rows.len() as f64 / seconds.max(1e-9),
        out: out.display().to_string(),
    }
}

/// One rank's part: load and health-check the artifact, classify rows `share(n, rank, world)`,
/// gather. Rank 0 returns every row in table order, the others `None`.
pub fn predict_rank(
    model_dir: &Path,
    ds: &Dataset,
    r: &Rank<'_>,
    max_bytes: u64,
) -> Result<Option<Vec<Row>>, PredictError> {
    let (comm, rank, world) = (r.comm, r.rank(), r.world());
    if ds.samples.len() < world {
        return Err(PredictError::TooFewRows {
            rows: ds.samples.len(),
            workers: world,
        });
    }
    let model = LoadedModel::load(model_dir, max_bytes, EngineKind::Tract, r.threads)?;
    comm.check_same(
        "model (manifest name, version and files)",
        serde_json::to_string(&(
            &model.manifest.name,
            model.manifest.version,
            &model.manifest.files,
        ))
        .expect("manifest serializes")
        .as_bytes(),
    )?;
    let mine = distributed::share(ds.samples.len(), rank, world);
    let rows: Vec<Row> = ds.samples[mine]
        .iter()
        .map(|s| {
            let label = ds.labels[s.label].clone();
            Ok(match model.predict(&s.bytes()?, &s.id, 1) {
                Ok(p) => Row {
                    path: s.id.clone(),
                    label,
                    prediction: Some(p.top[0].label.clone()),
                    class: Some(p.top[0].class as u32),
                    score: Some(p.top[0].score),
                    error: None,
                },
                Err(e) => Row {
                    path: s.id.clone(),
                    label,
                    prediction: None,
                    class: None,
                    score: None,
                    error: Some(kestrel_shared::chain(&e)),
                },
            })
        })
        .collect::<Result<_, PredictError>>()?;
    let bytes = serde_json::to_vec(&rows).expect("rows serialize");
    let all = comm.allgather_bytes(&bytes)?;
    if rank != 0 {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(ds.samples.len());
    for (r, b) in all.iter().enumerate() {
        let part: Vec<Row> = serde_json::from_slice(b).map_err(|e| WorkerError {
            rank: r,
            message: format!("its rows do not parse: {e}"),
        })?;
        out.extend(part);
    }
    Ok(Some(out))
}

/// Writes rows as Parquet (`path`, `label`, `prediction`, `class`, `score`, `error`), crash-safely:
/// a local file through a renamed temporary, an object-store URL (`s3://...`) in one PUT.
pub fn write_parquet(out: &Path, rows: &[Row]) -> Result<(), PredictError> {
    let err = |e: kestrel_shared::error::Cause| PredictError::Output {
        path: out.display().to_string(),
        source: e,
    };
    let schema = Arc::new(Schema::new(vec![
        Field::new("path", DataType::Utf8, false),
        Field::new("label", DataType::Utf8, false),
        Field::new("prediction", DataType::Utf8, true),
        Field::new("class", DataType::UInt32, true),
        Field::new("score", DataType::Float32, true),
        Field::new("error", DataType::Utf8, true),
    ]));
    let cols: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from_iter_values(rows.iter().map(|r| &r.path))),
        Arc::new(StringArray::from_iter_values(rows.iter().map(|r| &r.label))),
        Arc::new(StringArray::from_iter(
            rows.iter().map(|r| r.prediction.as_deref()),
        )),
        Arc::new(UInt32Array::from_iter(rows.iter().map(|r| r.class))),
        Arc::new(Float32Array::from_iter(rows.iter().map(|r| r.score))),
        Arc::new(StringArray::from_iter(
            rows.iter().map(|r| r.error.as_deref()),
        )),
    ];
    let batch = RecordBatch::try_new(schema.clone(), cols).map_err(|e| err(e.into()))?;
    let mut buf = Vec::new();
    let mut w =
        parquet::arrow::ArrowWriter::try_new(&mut buf, schema, None).map_err(|e| err(e.into()))?;
    w.write(&batch).map_err(|e| err(e.into()))?;
    w.close().map_err(|e| err(e.into()))?;
    if let Some(url) = crate::data::source::location::object_url(out) {
        return Ok(crate::data::source::location::put(&url, buf)?);
    }
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| err(e.into()))?;
    }
    kestrel_shared::fsutil::write_atomic(out, &buf).map_err(|e| err(e.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The manifest of model `faces` version 3, labels `face` and `nonface`.
    fn manifest() -> kestrel_shared::manifest::Manifest {
        serde_json::from_value(serde_json::json!({
            "format_version": 1, "name": "faces", "version": 3, "arch": "efficientnet-lite0",
            "labels": ["face", "nonface"],
            "preprocess": serde_json::to_value(kestrel_models::Network::new(kestrel_models::Arch::EfficientnetLite0).preprocess).unwrap(),
            "input": { "name": "input", "dtype": "float32", "shape": ["N", 3, 224, 224] },
            "output": { "name": "logits", "dtype": "float32", "shape": ["N", 2] },
            "quantization": { "form": "none", "int8_ops": [], "calibration_samples": 0,
                              "accuracy": 1.0, "f32_accuracy": 1.0, "accuracy_delta_pt": 0.0 },
            "training": {}, "verification": [], "golden": [],
            "files": [{ "path": "model.onnx", "sha256": "ab".repeat(32), "size": 1 }],
            "created": "2026-12-05T08:00:00Z"
        }))
        .unwrap()
    }

    /// A row labelled `label`, predicted `prediction` (none: the image failed).
    fn row(label: &str, prediction: Option<&str>) -> Row {
        Row {
            path: format!("{label}.jpg"),
            label: label.into(),
            prediction: prediction.map(str::to_string),
            class: None,
            score: None,
            error: prediction.is_none().then(|| "cannot decode".to_string()),
        }
    }

    #[test]
    fn accuracy_counts_matching_predictions_only_when_every_label_is_the_models() {
        let m = manifest();
        let out = Path::new("preds.parquet");
        let rows = [
            row("face", Some("face")),
            row("face", Some("nonface")),
            row("nonface", Some("nonface")),
            row("nonface", None),
        ];
        let s = summarize(&m, &rows, 2, 2.0, out);
        assert_eq!((s.rows, s.errors, s.workers), (4, 1, 2));
        // Two of four right; the failed image counts as wrong.
        assert_eq!(s.accuracy, Some(0.5));
        assert_eq!(s.images_per_s, 2.0);
        assert_eq!(
            (s.model.as_str(), s.version, s.out.as_str()),
            ("faces", 3, "preds.parquet")
        );
        // A label the model does not know: no accuracy; nor over no rows.
        let other = [row("face", Some("face")), row("cat", Some("face"))];
        assert_eq!(summarize(&m, &other, 1, 1.0, out).accuracy, None);
        assert_eq!(summarize(&m, &[], 1, 0.0, out).accuracy, None);
    }
}
