//! An exported artifact as an MLflow Model: the `MLmodel` file and the environment files MLflow's
//! tools read, logged beside the artifact's own files under the run's `model/` artifacts, so that
//! `mlflow.pyfunc.load_model("models:/NAME@ALIAS")`, `mlflow.onnx.load_model` and
//! `mlflow models serve` take a registered Kestrel model as it is.
//!
//! Flavors: `onnx` (`model.onnx`, CPU provider), `python_function` (loaded through
//! `mlflow.onnx`, so `predict` takes preprocessed `float32` tensors `[N, 3, H, W]` and returns
//! the logits) and `kestrel` (the manifest, with its labels and preprocessing: what turns an
//! image into that tensor). The signature names the input tensor and the output from the
//! manifest. `MLmodel` is written as JSON, which is YAML too (MLflow reads it with
//! `yaml.safe_load`).

use kestrel_shared::manifest::{Manifest, TensorSpec};
use serde_json::{Value, json};

/// What the pyfunc needs besides MLflow: the ONNX packages its loader imports.
const REQUIREMENTS: &str = "onnx>=1.14\nonnxruntime>=1.16\nnumpy\n";
const PYTHON: &str = "3.11";

/// A tensor as MLflow's signature spells it (`-1` for the batch).
fn tensor_spec(t: &TensorSpec) -> Value {
    let shape: Vec<i64> = t.shape.iter().map(|d| d.as_i64().unwrap_or(-1)).collect();
    json!([{ "type": "tensor", "name": t.name, "tensor-spec": { "dtype": t.dtype, "shape": shape } }])
}

/// The files that make an artifact directory an MLflow Model, by file name: `MLmodel`,
/// `requirements.txt`, `python_env.yaml` and `conda.yaml`. `run_id` is the run logging it,
/// `model_id` its MLflow 3 LoggedModel.
pub fn files(m: &Manifest, run_id: &str, model_id: Option<&str>) -> Vec<(&'static str, String)> {
    let onnx_sha = m
        .files
        .iter()
        .find(|f| f.path == "model.onnx")
        .map_or("", |f| f.sha256.as_str());
    let mut mlmodel = json!({
        "artifact_path": "model",
        "run_id": run_id,
        // Stable for the same file: the model's own hash.
        "model_uuid": &onnx_sha[..onnx_sha.len().min(32)],
        "utc_time_created": m.created,
        "flavors": {
            "onnx": { "data": "model.onnx", "providers": ["CPUExecutionProvider"], "code": null },
            "python_function": {
                "loader_module": "mlflow.onnx",
                "data": "model.onnx",
                "python_version": PYTHON,
                "env": { "conda": "conda.yaml", "virtualenv": "python_env.yaml" },
            },
            "kestrel": {
                "manifest": "manifest.json",
                "format_version": m.format_version,
                "name": m.name,
                "version": m.version,
                "labels": m.labels,
                "preprocess": m.preprocess,
                "quantization": m.quantization.form,
            },
        },
        "signature": {
            "inputs": tensor_spec(&m.input).to_string(),
            "outputs": tensor_spec(&m.output).to_string(),
            "params": null,
        },
    });
    if let Some(id) = model_id {
        mlmodel["model_id"] = json!(id);
    }
    let pip: String = REQUIREMENTS
        .lines()
        .map(|r| format!("    - {r}\n"))
        .collect();
    vec![
        (
            "MLmodel",
            serde_json::to_string_pretty(&mlmodel).expect("JSON") + "\n",
        ),
        ("requirements.txt", REQUIREMENTS.to_string()),
        (
            "python_env.yaml",
            format!(
                "python: {PYTHON}\nbuild_dependencies:\n  - pip\ndependencies:\n  - -r requirements.txt\n"
            ),
        ),
        (
            "conda.yaml",
            format!(
                "channels:\n  - conda-forge\ndependencies:\n  - python={PYTHON}\n  - pip\n  - pip:\n{pip}name: kestrel-env\n"
            ),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mlmodel_names_the_tensors_and_points_at_the_manifest() {
        let m: Manifest = serde_json::from_value(json!({
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
        .unwrap();
        let files = files(&m, "r1", Some("m-1"));
        let mlmodel: Value = serde_json::from_str(&files[0].1).unwrap();
        assert_eq!(mlmodel["model_id"], "m-1");
        assert_eq!(
            mlmodel["flavors"]["python_function"]["loader_module"],
            "mlflow.onnx"
        );
        assert_eq!(
            mlmodel["flavors"]["kestrel"]["labels"],
            json!(["face", "nonface"])
        );
        let inputs: Value =
            serde_json::from_str(mlmodel["signature"]["inputs"].as_str().unwrap()).unwrap();
        assert_eq!(inputs[0]["tensor-spec"]["shape"], json!([-1, 3, 224, 224]));
        assert_eq!(inputs[0]["name"], "input");
        assert_eq!(mlmodel["model_uuid"].as_str().unwrap().len(), 32);
        assert!(
            files
                .iter()
                .any(|(n, t)| *n == "requirements.txt" && t.contains("onnxruntime"))
        );
    }
}
