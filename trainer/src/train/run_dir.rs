//! The run directory `trainer fit` writes: the one place its file names are spelled and its
//! records read back. [`super::checkpoint`] writes it as training goes.
//!
//! `params.json` (what determines the run), `split.json`, `metrics.jsonl` (one line per epoch),
//! `checkpoints/epoch-NNNN.{safetensors,json}`, `best.safetensors`, `last.safetensors`,
//! `summary.json`, `confusion_matrix.json` and the curves (`loss.png`, `accuracy.png`).

use std::path::{Path, PathBuf};

use kestrel_models::{Weights, torch};
use serde::de::DeserializeOwned;

use super::{FitParams, Summary, TrainError};
use crate::report::{ACCURACY_PLOT, LOSS_PLOT};

/// A run directory (borrowed path).
#[derive(Clone, Copy, Debug)]
pub struct RunDir<'a>(pub &'a Path);

impl<'a> RunDir<'a> {
    pub const PARAMS: &'static str = "params.json";
    pub const SPLIT: &'static str = "split.json";
    pub const METRICS: &'static str = "metrics.jsonl";
    pub const SUMMARY: &'static str = "summary.json";
    pub const CONFUSION: &'static str = "confusion_matrix.json";
    pub const BEST: &'static str = "best.safetensors";
    pub const LAST: &'static str = "last.safetensors";
    pub const CHECKPOINTS: &'static str = "checkpoints";
    /// The files that make a run a record of itself (logged as its MLflow artifacts).
    pub const RECORDS: [&'static str; 9] = [
        Self::PARAMS,
        Self::SPLIT,
        Self::METRICS,
        Self::SUMMARY,
        Self::CONFUSION,
        LOSS_PLOT,
        ACCURACY_PLOT,
        Self::BEST,
        Self::LAST,
    ];

    pub fn path(self) -> &'a Path {
        self.0
    }

    /// The path of `name` (one of the constants above) in this directory.
    pub fn file(self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// Whether the run finished (its best weights and summary are there).
    pub fn is_finished(self) -> Result<(), String> {
        for name in [Self::BEST, Self::SUMMARY] {
            if !self.file(name).is_file() {
                return Err(format!("no {name} (not a finished `trainer fit` run)"));
            }
        }
        Ok(())
    }

    /// The parameters the run was trained with.
    pub fn params(self) -> Result<FitParams, TrainError> {
        self.read_json(Self::PARAMS)
    }

    /// The finished run's summary.
    pub fn summary(self) -> Result<Summary, TrainError> {
        self.read_json(Self::SUMMARY)
    }

    /// The best epoch's weights.
    pub fn best_weights(self) -> Result<Weights, TrainError> {
        Ok(torch::read_safetensors(&self.file(Self::BEST))?)
    }

    /// `name` parsed as JSON; an error names the run and the file.
    pub fn read_json<T: DeserializeOwned>(self, name: &str) -> Result<T, TrainError> {
        let text = std::fs::read_to_string(self.file(name)).map_err(|e| self.err(name, e))?;
        serde_json::from_str(&text).map_err(|e| self.err(name, e))
    }

    fn err(self, name: &str, e: impl Into<kestrel_shared::error::Cause>) -> TrainError {
        TrainError::Run {
            path: self.file(name).display().to_string(),
            source: e.into(),
        }
    }
}
