//! Stage 5: golden samples — up to `--golden` validation images, one class after another, shipped
//! in the artifact with the outputs tract (the edge's runtime) gives for them: the device's
//! health check replays them. Every other runtime must agree with tract on their top-1.

use std::collections::BTreeMap;

use kestrel_models::artifact::{GOLDEN_TOLERANCE, argmax, max_abs_diff};
use kestrel_shared::ImageLimits;
use kestrel_shared::manifest::{Golden, RuntimeCheck};

use super::ExportError;
use super::trained::Trained;
use super::verify::{Engines, engine_logits};
use crate::data::{self, Split};
use kestrel_shared::protocol::sha256_hex;

pub(super) struct GoldenSamples {
    /// The manifest's entries, expected outputs included.
    pub entries: Vec<Golden>,
    /// The image file of each entry, as it is in the table.
    pub images: Vec<Vec<u8>>,
}

/// Picks and preprocesses the golden samples, runs them in every runtime (`checks[i]` is
/// `engines[i]`'s: its `golden_top1_match` is set here) and applies the golden gate.
pub(super) fn golden(
    run: &Trained,
    engines: &Engines,
    count: usize,
    checks: &mut [RuntimeCheck],
) -> Result<GoldenSamples, ExportError> {
    let (mut samples, inputs) = load(run, &pick(run, count))?;
    let mut expected: Option<Vec<Vec<f32>>> = None;
    for ((name, engine), check) in engines.iter().zip(checks.iter_mut()) {
        let rows = engine_logits(engine.as_ref(), &inputs, &run.net().preprocess)?;
        match &expected {
            // tract: the edge's runtime defines the expected outputs
            None => expected = Some(rows),
            Some(t) => {
                check.golden_top1_match = t.iter().zip(&rows).all(|(a, b)| argmax(a) == argmax(b));
                // A runtime that computes otherwise gets its own expected outputs.
                if t.iter()
                    .zip(&rows)
                    .any(|(a, b)| max_abs_diff(a, b) > GOLDEN_TOLERANCE)
                {
                    for (g, row) in samples.entries.iter_mut().zip(rows) {
                        g.runtime_logits.insert(name.clone(), row);
                    }
                }
            }
        }
    }
    if let Some(c) = checks.iter().find(|c| !c.golden_top1_match) {
        return Err(ExportError::GoldenMismatch {
            runtime: c.runtime.clone(),
        });
    }
    for (g, row) in samples.entries.iter_mut().zip(expected.unwrap_or_default()) {
        g.expected_top1 = argmax(&row);
        g.logits = row;
    }
    Ok(samples)
}

/// Up to `count` validation samples: the first of each class, then the second of each, ...
fn pick(run: &Trained, count: usize) -> Vec<usize> {
    let val = run.pp.indices(Split::Val);
    let labels = run.pp.labels();
    let mut picked: Vec<usize> = Vec::new();
    for round in 0.. {
        let before = picked.len();
        for c in 0..run.labels().len() {
            if let Some(&i) = val.iter().filter(|&&i| labels[i] == c).nth(round) {
                if picked.len() < count {
                    picked.push(i);
                }
            }
        }
        if picked.len() == before || picked.len() >= count {
            break;
        }
    }
    picked
}

/// The samples `idx` from the table (manifest entries without outputs yet, image files) and
/// their preprocessed inputs.
fn load(run: &Trained, idx: &[usize]) -> Result<(GoldenSamples, Vec<Vec<f32>>), ExportError> {
    let ds = data::load_all(&run.params.data_paths(), &run.params.source)?;
    let by_sha: BTreeMap<String, &data::Sample> =
        ds.samples.iter().map(|s| (s.sha256.clone(), s)).collect();
    let spec = &run.net().preprocess;
    let (mut entries, mut images, mut inputs) = (Vec::new(), Vec::new(), Vec::new());
    for (k, &i) in idx.iter().enumerate() {
        let sample = by_sha
            .get(&run.pp.prepared.meta.content_sha256[i])
            .ok_or(ExportError::GoldenNotInTable)?;
        let bytes = sample.bytes()?.into_owned();
        let ext = image::guess_format(&bytes)
            .ok()
            .and_then(|f| f.extensions_str().first().copied())
            .unwrap_or("img");
        let file = format!("golden/{k}.{ext}");
        let pre = spec.run_bytes(&bytes, &file, &ImageLimits::default())?;
        entries.push(Golden {
            file,
            input_sha256: sha256_hex(&pre.to_le_bytes()),
            expected_top1: 0,
            logits: vec![],
            runtime_logits: Default::default(),
        });
        images.push(bytes);
        inputs.push(pre.data);
    }
    Ok((GoldenSamples { entries, images }, inputs))
}
