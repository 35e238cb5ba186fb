//! Writing the run directory ([`RunDir`] names its files) as training goes: its records, and
//! `checkpoints/epoch-NNNN.*` (weights + optimizer state, then the state JSON whose presence
//! completes a checkpoint; the two latest are kept).

use std::path::{Path, PathBuf};

use kestrel_models::{Weights, torch};

use super::model::Trainable;
use super::optim::Opt;
use super::prepare::split_records;
use super::run_dir::RunDir;
use super::{FitParams, TrainError, TrainState, TrainingData};
use crate::report::{self, EpochMetrics};

fn ckpt_path(run: &Path, epoch: usize, ext: &str) -> PathBuf {
    run.join(RunDir::CHECKPOINTS)
        .join(format!("epoch-{epoch:04}.{ext}"))
}

fn run_err(run: &Path, e: impl Into<kestrel_shared::error::Cause>) -> TrainError {
    TrainError::Run {
        path: run.display().to_string(),
        source: e.into(),
    }
}

/// Creates the run directory (and its `checkpoints/`), removing the temporary files of writes
/// that a kill cut short (so a run killed again and again leaves nothing growing).
pub fn create(run: &Path) -> Result<(), TrainError> {
    let ckpts = run.join(RunDir::CHECKPOINTS);
    std::fs::create_dir_all(&ckpts)
        .and_then(|_| kestrel_shared::fsutil::remove_temp_files(run))
        .and_then(|_| kestrel_shared::fsutil::remove_temp_files(&ckpts))
        .map(|_| ())
        .map_err(|e| run_err(run, e))
}

/// The latest complete checkpoint (its `.json` is written last).
pub fn latest_checkpoint(run: &Path) -> Option<usize> {
    let dir = std::fs::read_dir(run.join(RunDir::CHECKPOINTS)).ok()?;
    dir.filter_map(|e| {
        let name = e.ok()?.file_name().to_string_lossy().into_owned();
        name.strip_prefix("epoch-")?
            .strip_suffix(".json")?
            .parse()
            .ok()
    })
    .filter(|&e| ckpt_path(run, e, "safetensors").exists())
    .max()
}

/// Loads the latest checkpoint into `model` and `opt`: its epoch and state, or `None` when there
/// is none yet.
pub fn load_latest(
    run: &Path,
    model: &Trainable,
    opt: &mut Opt,
) -> Result<Option<(usize, TrainState)>, TrainError> {
    let Some(e) = latest_checkpoint(run) else {
        return Ok(None);
    };
    let text =
        std::fs::read_to_string(ckpt_path(run, e, "json")).map_err(|err| run_err(run, err))?;
    let state: TrainState = serde_json::from_str(&text)
        .map_err(|err| run_err(run, format!("checkpoint state: {err}")))?;
    let w = torch::read_safetensors(&ckpt_path(run, e, "safetensors"))?;
    model.load_vars(&w)?;
    opt.load(&model.vars, &w, state.opt_step)?;
    Ok(Some((e, state)))
}

/// Writes `params.json` and `split.json`, and rewrites `metrics.jsonl` from the state's history
/// (dropping the lines of an epoch lost with its checkpoint).
pub fn begin(
    run: &Path,
    p: &FitParams,
    pp: &TrainingData,
    state: &TrainState,
) -> Result<(), TrainError> {
    report::write_json_atomic(&run.join(RunDir::PARAMS), p)?;
    report::write_json_atomic(&run.join(RunDir::SPLIT), &split_records(pp))?;
    let metrics = run.join(RunDir::METRICS);
    let _ = std::fs::remove_file(&metrics);
    for m in &state.history {
        report::append_jsonl(&metrics, m)?;
    }
    Ok(())
}

/// Saves epoch `m.epoch`: checkpoint (weights + optimizer state, then the state JSON), the
/// metrics line, and drops the checkpoint two epochs back.
pub fn save_epoch(
    run: &Path,
    model: &Trainable,
    opt: &Opt,
    state: &TrainState,
    m: &EpochMetrics,
) -> Result<(), TrainError> {
    let epoch = m.epoch;
    let mut ck = model.var_weights()?;
    ck.extend(opt.state(&model.vars)?);
    torch::write_safetensors(&ckpt_path(run, epoch, "safetensors"), &ck, None)?;
    report::write_json_atomic(&ckpt_path(run, epoch, "json"), state)?;
    report::append_jsonl(&run.join(RunDir::METRICS), m)?;
    if epoch > 2 {
        for ext in ["json", "safetensors"] {
            let _ = std::fs::remove_file(ckpt_path(run, epoch - 2, ext));
        }
    }
    Ok(())
}

/// The best epoch's weights saved by an earlier process (a run resumed after its best epoch).
pub fn best_weights(run: &Path) -> Result<Weights, TrainError> {
    RunDir(run).best_weights()
}
