//! Exported artifacts at work: `trainer evaluate --model` and `trainer latency` load
//! `model.onnx` as described by its manifest, exactly as the edge does.

use std::path::{Path, PathBuf};

use kestrel_models::artifact::argmax;
use kestrel_models::engine::{self, Engine, EngineOpts};
use kestrel_models::{EngineKind, Tensor};
use kestrel_shared::ImageLimits;
use kestrel_shared::manifest::Manifest;
use kestrel_shared::stats::quantile;

use super::ExportError;
use crate::data::cache::features;
use crate::data::{self, Prepared, SamplePlan};

/// Reads the manifest beside an exported `model.onnx` (or in an artifact directory).
pub fn read_manifest(model: &Path) -> Result<(PathBuf, Manifest), ExportError> {
    let dir = if model.is_dir() {
        model.to_path_buf()
    } else {
        model.parent().unwrap_or(Path::new(".")).to_path_buf()
    };
    let m = kestrel_models::artifact::read_manifest(&dir)?;
    Ok((dir, m))
}

/// Loads an exported model on `kind` (tract or ort), as described by its manifest.
fn load_model(
    model: &Path,
    kind: EngineKind,
    run: EngineOpts,
) -> Result<(Manifest, Box<dyn Engine>), ExportError> {
    let (dir, m) = read_manifest(model)?;
    let onnx_path = if model.is_dir() {
        dir.join("model.onnx")
    } else {
        model.to_path_buf()
    };
    let bytes = std::fs::read(&onnx_path).map_err(ExportError::io(&onnx_path))?;
    let bytes = kestrel_models::artifact::engine_bytes(bytes, &m)?;
    let input_shape: Vec<usize> = m.input.shape[1..]
        .iter()
        .map(|d| d.as_u64().unwrap_or(0) as usize)
        .collect();
    if kind == EngineKind::Candle {
        return Err(ExportError::CandleEngine);
    }
    Ok((m, engine::from_onnx(kind, &bytes, input_shape, run)?))
}

/// Median (nearest rank) batch-1 inference time in milliseconds over `rounds` timed runs (after
/// one warm-up run): the median, not the mean, so that a burst of load on a shared machine moves it less.
pub fn latency_ms(
    model: &Path,
    kind: EngineKind,
    image: &Path,
    rounds: usize,
    run: EngineOpts,
) -> Result<f64, ExportError> {
    let (m, engine) = load_model(model, kind, run)?;
    let x = m.preprocess.run_file(image, &ImageLimits::default())?;
    let [h, w] = m.preprocess.input_size.map(|v| v as usize);
    let input = Tensor::new(vec![1, 3, h, w], x.data);
    engine.run(&input)?;
    let mut ms = Vec::with_capacity(rounds.max(1));
    for _ in 0..rounds.max(1) {
        let t = std::time::Instant::now();
        engine.run(&input)?;
        ms.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    ms.sort_by(f64::total_cmp);
    Ok(quantile(&ms, 0.5))
}

/// `trainer evaluate --model`: evaluates an exported artifact exactly as the edge will, using only
/// its manifest (preprocessing, labels, tensor names).
pub fn evaluate_model(
    model: &Path,
    data_path: &Path,
    source: &data::SourceOpts,
    engine: EngineKind,
    cache_root: &Path,
    run: EngineOpts,
) -> Result<crate::report::Evaluation, ExportError> {
    let (m, engine) = load_model(model, engine, run)?;
    let ds = data::load(data_path, source)?;
    let plan = SamplePlan::new(cache_root, &ds, &m.preprocess);
    let prepared = Prepared::open_or_build(&plan, &ds, 1, run.threads, false, &mut |_| Ok(()))?;
    let map: Vec<usize> = prepared
        .meta
        .labels
        .iter()
        .map(|l| {
            m.labels
                .iter()
                .position(|x| x == l)
                .ok_or_else(|| ExportError::UnknownLabel {
                    data: data_path.display().to_string(),
                    label: l.clone(),
                    labels: m.labels.clone(),
                })
        })
        .collect::<Result<_, _>>()?;
    let pixels = prepared.load_pixels()?;
    let refs: Vec<&[u8]> = pixels.iter().map(|p| p.as_slice()).collect();
    let logits = features::run_frozen(
        engine.as_ref(),
        &m.preprocess,
        &refs,
        m.labels.len(),
        &crate::report::progress(refs.len() as u64, "evaluate"),
    )?;
    let pred: Vec<usize> = logits.chunks(m.labels.len()).map(argmax).collect();
    let truth: Vec<usize> = prepared
        .meta
        .sample_labels
        .iter()
        .map(|&l| map[l])
        .collect();
    Ok(crate::report::evaluate(&pred, &truth, &m.labels, None))
}
