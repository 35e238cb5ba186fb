//! `trainer fit --init-from RUN_DIR`: the head starts from a previous run's trained head
//! (`best.safetensors`), classes mapped by name (the run's `summary.json` labels): a class of
//! both keeps its row, a new class starts at zero, a class the new tables lack is dropped. The
//! L-BFGS head solve starts from it (the solution is the same convex optimum, reached in fewer
//! iterations); sgd/adamw train from it instead of a seeded random head. Blocks are not carried
//! over: a run that trained blocks gives its head only.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::TrainError;
use super::run_dir::RunDir;

/// Where a head started (in `summary.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InitHead {
    /// The run directory it came from.
    pub run: String,
    /// Classes of both runs (their rows carried over).
    pub matched: usize,
    /// Classes the previous run did not have (rows started at zero).
    pub new_classes: Vec<String>,
    /// Classes of the previous run that these tables lack (rows dropped).
    pub dropped_classes: Vec<String>,
}

/// A head to start from, on raw features: `weight` is `[classes, dim]` row-major.
pub struct StartHead {
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
    pub info: InitHead,
}

fn init_err(run_dir: &Path, reason: String) -> TrainError {
    TrainError::InitFrom {
        path: run_dir.display().to_string(),
        source: reason.into(),
    }
}

/// Fails unless `run_dir` is a finished run (a check before any work).
pub fn check(run_dir: &Path) -> Result<(), TrainError> {
    if !run_dir.is_dir() {
        return Err(init_err(run_dir, "no such run directory".into()));
    }
    RunDir(run_dir)
        .is_finished()
        .map_err(|reason| init_err(run_dir, reason))
}

/// The head of the run in `run_dir` for classes `labels` on `dim` features.
pub fn load(run_dir: &Path, labels: &[String], dim: usize) -> Result<StartHead, TrainError> {
    let err = |reason: String| init_err(run_dir, reason);
    check(run_dir)?;
    #[derive(Deserialize)]
    struct Labels {
        labels: Vec<String>,
    }
    let run = RunDir(run_dir);
    let old_labels = run.read_json::<Labels>(RunDir::SUMMARY)?.labels;
    let w = run.best_weights()?;
    let (Some(wt), Some(b)) = (w.get("classifier.weight"), w.get("classifier.bias")) else {
        return Err(err("best.safetensors has no classifier".into()));
    };
    let [k, d] = wt.shape[..] else {
        return Err(err(format!("classifier weight of shape {:?}", wt.shape)));
    };
    if d != dim {
        return Err(err(format!(
            "its head takes {d} features, this backbone gives {dim}: the feature dims differ"
        )));
    }
    if k != old_labels.len() || b.data.len() != k {
        return Err(err(format!(
            "{k} classifier rows for {} labels in summary.json",
            old_labels.len()
        )));
    }
    let mut weight = vec![0f32; labels.len() * dim];
    let mut bias = vec![0f32; labels.len()];
    let (mut matched, mut new_classes) = (0, Vec::new());
    for (c, name) in labels.iter().enumerate() {
        match old_labels.iter().position(|o| o == name) {
            Some(j) => {
                weight[c * dim..(c + 1) * dim].copy_from_slice(&wt.data[j * dim..(j + 1) * dim]);
                bias[c] = b.data[j];
                matched += 1;
            }
            None => new_classes.push(name.clone()),
        }
    }
    let dropped_classes = old_labels
        .iter()
        .filter(|o| !labels.contains(o))
        .cloned()
        .collect();
    Ok(StartHead {
        weight,
        bias,
        info: InitHead {
            run: run_dir.display().to_string(),
            matched,
            new_classes,
            dropped_classes,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kestrel_models::{Tensor, torch};

    #[test]
    fn classes_map_by_name_and_dims_must_match() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path();
        let summary = serde_json::json!({"labels": ["cat", "dog"]});
        std::fs::write(run.join(RunDir::SUMMARY), summary.to_string()).unwrap();
        let mut w = kestrel_models::Weights::new();
        w.insert(
            "classifier.weight".into(),
            Tensor::new(vec![2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
        );
        w.insert(
            "classifier.bias".into(),
            Tensor::new(vec![2], vec![0.5, -0.5]),
        );
        torch::write_safetensors(&run.join(RunDir::BEST), &w, None).unwrap();
        let labels: Vec<String> = ["bird", "dog", "cat"].map(String::from).into();
        let h = load(run, &labels, 3).unwrap();
        assert_eq!(h.weight, [0.0, 0.0, 0.0, 4.0, 5.0, 6.0, 1.0, 2.0, 3.0]);
        assert_eq!(h.bias, [0.0, -0.5, 0.5]);
        assert_eq!(
            (h.info.matched, h.info.new_classes.clone()),
            (2, vec!["bird".to_string()])
        );
        let e = kestrel_shared::chain(&load(run, &labels, 4).err().unwrap());
        assert!(e.contains("feature dims differ"), "{e}");
        let e = kestrel_shared::chain(&load(&run.join("absent"), &labels, 3).err().unwrap());
        assert!(
            e.contains("--init-from") && e.contains("no such run"),
            "{e}"
        );
    }
}
