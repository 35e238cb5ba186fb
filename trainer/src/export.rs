//! `trainer export`: a trained run becomes a self-describing artifact directory —
//! `model.onnx` (backbone + head, one graph, symbolic batch, float logits), `manifest.json`,
//! `model.safetensors`, `head.safetensors` (and `model.int8.safetensors` for int8 forms), and
//! golden images — verified in tract and ONNX Runtime before it is written.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use candle_core::{Device, Tensor as CTensor};
use kestrel_models::artifact::argmax;
use kestrel_models::engine::{Engine, TractEngine};
use kestrel_models::onnx::{self, Linear, LowerOpts};
use kestrel_models::quant::{Quant, quantize_per_channel};
use kestrel_models::weights::FoldedConv;
use kestrel_models::{EngineKind, Tensor, Weights};
use kestrel_shared::manifest::{
    FORMAT_VERSION, FileEntry, Golden, MANIFEST_FILE, Manifest, Quantization, RuntimeCheck,
    TensorSpec, rfc3339,
};
use kestrel_shared::{ImageLimits, PreprocessSpec};
use safetensors::{Dtype, tensor::TensorView};
use serde_json::json;

mod calibrate;

use calibrate::{bias_correct, calibrate};

use crate::data::cache::{sha256_hex, write_atomic};
use crate::data::{Prepared, features as cache};
use crate::distributed::{Job, JobOpts};
use crate::data;
use crate::data::split::Split;
use crate::train::{self, Prepped, TrainError, Trainable};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum QuantForm {
    None,
    Int8Weights,
    Int8,
}

impl QuantForm {
    pub fn name(self) -> &'static str {
        match self {
            QuantForm::None => "none",
            QuantForm::Int8Weights => "int8-weights",
            QuantForm::Int8 => "int8",
        }
    }
}

#[derive(Debug, Clone)]
pub struct ExportOpts {
    pub quantize: QuantForm,
    /// Training samples used to calibrate activation ranges (static int8).
    pub calibration: usize,
    /// Static int8: the stem and this many leading blocks keep float activations.
    pub float_blocks: usize,
    pub f16: bool,
    /// Largest accepted accuracy drop of a quantized form, in percentage points.
    pub max_accuracy_drop: f64,
    /// Largest accepted |logit − reference| of the f32 form in any runtime.
    pub tolerance: f64,
    pub name: Option<String>,
    pub version: u64,
    pub golden: usize,
}

/// Layers kept with float activations in static int8: the stem and the first `blocks` blocks.
fn float_layer(layer: &str, blocks: usize) -> bool {
    layer == "stem"
        || layer
            .strip_prefix("blocks.")
            .and_then(|r| r.split('.').next())
            .and_then(|b| b.parse::<usize>().ok())
            .is_some_and(|b| b < blocks)
}

fn invalid(m: String) -> TrainError {
    TrainError::Invalid(m)
}

/// Folded weights of the whole network as trained: pretrained folded convs with the run's
/// unfrozen blocks substituted, and the run's classifier.
fn trained_network(pp: &Prepped, w: &Weights) -> Result<(Vec<FoldedConv>, Linear), TrainError> {
    let mut folded = pp.backbone.folded().map_err(|e| invalid(e.to_string()))?;
    for (c, f) in pp.backbone.net.convs().zip(folded.iter_mut()) {
        if let Some(t) = w.get(&c.weight_name()) {
            let b = w
                .get(&format!("{}.conv.bias", c.name))
                .ok_or_else(|| invalid(format!("run lacks {}.conv.bias", c.name)))?;
            *f = FoldedConv {
                weight: t.clone(),
                bias: b.data.clone(),
            };
        }
    }
    let get = |n: &str| {
        w.get(n)
            .cloned()
            .ok_or_else(|| invalid(format!("run lacks `{n}`")))
    };
    Ok((
        folded,
        Linear {
            weight: get("classifier.weight")?,
            bias: get("classifier.bias")?.data,
        },
    ))
}

/// The trainer's reference logits (cached features + trained part in candle).
fn reference_logits(
    pp: &Prepped,
    model: &Trainable,
    idx: &[usize],
) -> Result<Vec<Vec<f32>>, TrainError> {
    let per = pp.features.per_sample();
    let mut out = Vec::new();
    for chunk in idx.chunks(128) {
        let mut x = Vec::with_capacity(chunk.len() * per);
        for &i in chunk {
            x.extend_from_slice(pp.features.row(i));
        }
        let mut shape = vec![chunk.len()];
        shape.extend(&pp.features.meta.dims);
        let logits = model.forward(&CTensor::from_vec(x, shape, &Device::Cpu)?)?;
        out.extend(logits.to_vec2::<f32>()?);
    }
    Ok(out)
}

/// Runs normalised samples through an engine in batches of 32; one logits row per sample.
fn engine_logits(
    engine: &dyn Engine,
    inputs: &[Vec<f32>],
    spec: &PreprocessSpec,
) -> Result<Vec<Vec<f32>>, TrainError> {
    let [h, w] = spec.input_size.map(|v| v as usize);
    let mut out = Vec::new();
    for chunk in inputs.chunks(32) {
        let y = engine.run(&Tensor::new(vec![chunk.len(), 3, h, w], chunk.concat()))?;
        out.extend(y.data.chunks(y.shape[1]).map(|r| r.to_vec()));
    }
    Ok(out)
}

/// Every parameter of the exported network by name (folded convs, classifier).
fn named_params(
    net: &kestrel_models::Network,
    folded: &[FoldedConv],
    head: &Linear,
) -> Vec<(String, Tensor)> {
    let mut out = Vec::new();
    for (c, f) in net.convs().zip(folded) {
        out.push((c.weight_name(), f.weight.clone()));
        out.push((
            format!("{}.conv.bias", c.name),
            Tensor::new(vec![c.cout], f.bias.clone()),
        ));
    }
    out.push(("classifier.weight".into(), head.weight.clone()));
    out.push((
        "classifier.bias".into(),
        Tensor::new(vec![head.bias.len()], head.bias.clone()),
    ));
    out
}

/// Serialises tensors of mixed dtypes (`(name, dtype, shape, little-endian bytes)`) crash-safely.
fn write_tensors(
    path: &Path,
    tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
    meta: BTreeMap<String, String>,
) -> Result<(), TrainError> {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            Ok((
                n.clone(),
                TensorView::new(*d, s.clone(), b).map_err(|e| invalid(format!("{n}: {e}")))?,
            ))
        })
        .collect::<Result<_, TrainError>>()?;
    let bytes = safetensors::serialize(views, Some(meta.into_iter().collect()))
        .map_err(|e| invalid(format!("{}: {e}", path.display())))?;
    Ok(write_atomic(path, &bytes)?)
}

fn f32_entry(name: String, t: &Tensor, f16: bool) -> (String, Dtype, Vec<usize>, Vec<u8>) {
    if f16 {
        let b = t
            .data
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect();
        (name, Dtype::F16, t.shape.clone(), b)
    } else {
        (
            name,
            Dtype::F32,
            t.shape.clone(),
            t.data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        )
    }
}

/// Exports `run_dir` into `out` (replaced if it exists). Returns the manifest written.
pub fn export(
    run_dir: &Path,
    out: &Path,
    o: &ExportOpts,
    cache_root: &Path,
    threads: usize,
    log: &mut dyn FnMut(String),
) -> Result<Manifest, TrainError> {
    let (params, weights) = train::load_run(run_dir)?;
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(run_dir.join("summary.json"))
            .map_err(|e| invalid(format!("{}/summary.json: {e}", run_dir.display())))?,
    )
    .map_err(|e| invalid(format!("{}/summary.json: {e}", run_dir.display())))?;
    let job = Job::local(JobOpts {
        threads,
        cache_root: cache_root.to_path_buf(),
        ..Default::default()
    });
    let pp = train::prepare(&params, &job)?;
    let net = &pp.backbone.net;
    let spec = net.preprocess.clone();
    let labels = pp.dataset_labels.clone();
    let model = Trainable::new(
        &pp.backbone,
        pp.boundary,
        labels.len(),
        Some(&weights),
        params.seed,
    )?;
    let (folded, head) = trained_network(&pp, &weights)?;
    let pixels = pp.prepared.load_pixels()?;
    let inputs = |idx: &[usize]| -> Vec<Vec<f32>> {
        idx.iter()
            .map(|&i| pp.prepared.normalize(&pixels[i]))
            .collect()
    };

    // Quantized forms: calibrate on training samples (activation ranges for int8, input means for
    // the bias correction of both forms), then lower the bias-corrected copy.
    let (quant, qfolded, qhead) = if o.quantize == QuantForm::None {
        (Quant::None, folded.clone(), head.clone())
    } else {
        let train_idx = pp.indices(Split::Train);
        let step = (train_idx.len() / o.calibration.max(1)).max(1);
        let calib: Vec<usize> = train_idx
            .iter()
            .step_by(step)
            .take(o.calibration)
            .copied()
            .collect();
        log(format!("calibrating on {} training samples", calib.len()));
        let samples = inputs(&calib);
        // Static int8: activation ranges of the float network. Both forms: bias correction from
        // the inputs the quantized network sees.
        let quant = match o.quantize {
            QuantForm::Int8 => {
                let mut ranges = calibrate(&pp, &folded, &head, &Quant::None, &samples)?.ranges;
                // The layers nearest the input keep float activations (their weights stay int8):
                // they see the widest, least regular ranges, and quantizing them costs the most.
                ranges.retain(|k, _| !float_layer(k, o.float_blocks));
                Quant::Static(ranges)
            }
            _ => Quant::Weights,
        };
        let (mut qf, mut qh) = (folded.clone(), head.clone());
        let qcal = calibrate(&pp, &qf, &qh, &quant, &samples)?;
        bias_correct(net, (&folded, &head), (&mut qf, &mut qh), &qcal.means);
        (quant, qf, qh)
    };
    let name = o.name.clone().unwrap_or_else(|| {
        format!(
            "{}-{}",
            run_dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or("model".into()),
            o.quantize.name()
        )
    });
    let lower_opts = LowerOpts {
        quant: quant.clone(),
        ..LowerOpts::logits(net, qhead.clone())
    };
    let mut onnx_model = onnx::lower(net, &qfolded, &lower_opts);
    onnx_model.model_version = o.version as i64;
    let meta_props = [
        ("kestrel.name", name.clone()),
        ("kestrel.version", o.version.to_string()),
        ("kestrel.arch", net.arch.to_string()),
        (
            "kestrel.labels",
            serde_json::to_string(&labels).expect("json"),
        ),
        (
            "kestrel.preprocess",
            serde_json::to_string(&spec).expect("json"),
        ),
        ("kestrel.quantization", o.quantize.name().to_string()),
        ("kestrel.input", onnx::INPUT_NAME.to_string()),
        ("kestrel.output", lower_opts.output_name.clone()),
    ];
    onnx::set_metadata(
        &mut onnx_model,
        meta_props
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
    );
    let onnx_bytes = onnx::to_bytes(&onnx_model);

    // Verification on the validation split: every runtime against the trainer's reference.
    let val = pp.indices(Split::Val);
    let truth: Vec<usize> = val.iter().map(|&i| pp.labels()[i]).collect();
    let reference = reference_logits(&pp, &model, &val)?;
    let accuracy = |rows: &[Vec<f32>]| {
        rows.iter()
            .zip(&truth)
            .filter(|(r, t)| argmax(r) == **t)
            .count() as f64
            / truth.len() as f64
    };
    let f32_accuracy = accuracy(&reference);
    let val_inputs = inputs(&val);
    let input_shape = lower_opts.input_shape(net);
    let mut engines: Vec<(String, Box<dyn Engine>)> = vec![(
        "tract".into(),
        Box::new(TractEngine::from_onnx(
            &onnx_bytes,
            input_shape.clone(),
            threads,
        )?),
    )];
    match kestrel_models::engine::OrtEngine::from_onnx(&onnx_bytes, input_shape.clone(), threads) {
        Ok(e) => engines.push(("ort".into(), Box::new(e))),
        Err(e) => log(format!("ONNX Runtime not verified: {e}")),
    }

    // Golden samples: up to `golden` validation images, one class after another.
    let ds = data::load(&params.data, &params.source)?;
    let by_sha: BTreeMap<String, &data::Sample> = ds
        .samples
        .iter()
        .map(|s| (sha256_hex(&s.bytes), s))
        .collect();
    let mut golden_idx: Vec<usize> = Vec::new();
    for round in 0.. {
        let before = golden_idx.len();
        for c in 0..labels.len() {
            if let Some(&i) = val.iter().filter(|&&i| pp.labels()[i] == c).nth(round) {
                if golden_idx.len() < o.golden {
                    golden_idx.push(i);
                }
            }
        }
        if golden_idx.len() == before || golden_idx.len() >= o.golden {
            break;
        }
    }
    let tmp = out.with_extension(format!("tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(tmp.join("golden"))
        .map_err(|e| invalid(format!("{}: {e}", tmp.display())))?;
    let mut golden_inputs = Vec::new();
    let mut golden = Vec::new();
    for (k, &i) in golden_idx.iter().enumerate() {
        let sample = by_sha
            .get(&pp.prepared.meta.content_sha256[i])
            .ok_or_else(|| invalid("golden sample not in the table".into()))?;
        let ext = image::guess_format(&sample.bytes)
            .ok()
            .and_then(|f| f.extensions_str().first().copied())
            .unwrap_or("img");
        let file = format!("golden/{k}.{ext}");
        write_atomic(&tmp.join(&file), &sample.bytes)?;
        let pre = spec.run_bytes(&sample.bytes, &file, &ImageLimits::default())?;
        golden.push(Golden {
            file,
            input_sha256: sha256_hex(&pre.to_le_bytes()),
            expected_top1: 0,
            logits: vec![],
        });
        golden_inputs.push(pre.data);
    }

    let mut checks = Vec::new();
    let mut golden_rows: Option<Vec<Vec<f32>>> = None;
    for (rt, engine) in &engines {
        let rows = engine_logits(engine.as_ref(), &val_inputs, &spec)?;
        let max_diff = rows
            .iter()
            .zip(&reference)
            .flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs() as f64))
            .fold(0.0, f64::max);
        let acc = accuracy(&rows);
        let g = engine_logits(engine.as_ref(), &golden_inputs, &spec)?;
        let golden_match = match &golden_rows {
            None => true,
            Some(t) => t.iter().zip(&g).all(|(a, b)| argmax(a) == argmax(b)),
        };
        if golden_rows.is_none() {
            golden_rows = Some(g); // tract: the edge's runtime defines the expected outputs
        }
        log(format!(
            "{rt}: val accuracy {acc:.4} (reference {f32_accuracy:.4}), max |logit diff| {max_diff:.2e}"
        ));
        checks.push(RuntimeCheck {
            runtime: rt.clone(),
            samples: val.len(),
            accuracy: acc,
            max_abs_logit_diff: max_diff,
            golden_top1_match: golden_match,
        });
    }
    let fail = |m: String| {
        let _ = std::fs::remove_dir_all(&tmp);
        Err(invalid(m))
    };
    for c in &checks {
        if o.quantize == QuantForm::None && c.max_abs_logit_diff > o.tolerance {
            return fail(format!(
                "{} disagrees with the trainer: max |logit diff| {:.3e} > {:.0e}",
                c.runtime, c.max_abs_logit_diff, o.tolerance
            ));
        }
        let drop = (f32_accuracy - c.accuracy) * 100.0;
        if drop > o.max_accuracy_drop {
            return fail(format!(
                "{} form loses {drop:.2} accuracy points in {} (f32 {f32_accuracy:.4} → {:.4}), more than --max-accuracy-drop {}",
                o.quantize.name(),
                c.runtime,
                c.accuracy,
                o.max_accuracy_drop
            ));
        }
        if !c.golden_top1_match {
            return fail(format!(
                "{} and tract disagree on the golden samples' top-1",
                c.runtime
            ));
        }
    }
    for (g, row) in golden.iter_mut().zip(golden_rows.unwrap_or_default()) {
        g.expected_top1 = argmax(&row);
        g.logits = row;
    }

    // Files.
    write_atomic(&tmp.join("model.onnx"), &onnx_bytes)?;
    let st_meta: BTreeMap<String, String> = [
        ("arch".to_string(), net.arch.to_string()),
        (
            "labels".to_string(),
            serde_json::to_string(&labels).expect("json"),
        ),
    ]
    .into();
    let full = named_params(net, &folded, &head)
        .into_iter()
        .map(|(n, t)| f32_entry(n, &t, o.f16))
        .collect();
    if o.quantize != QuantForm::None {
        // The int8 weights and the (bias-corrected) biases that model.onnx carries.
        let mut q = Vec::new();
        for (n, t) in named_params(net, &qfolded, &qhead) {
            if n.ends_with(".weight") {
                let (qw, scales) = quantize_per_channel(&t);
                q.push((
                    n.clone(),
                    Dtype::I8,
                    t.shape.clone(),
                    qw.iter().map(|v| *v as u8).collect(),
                ));
                q.push(f32_entry(
                    format!("{n}.scale"),
                    &Tensor::new(vec![scales.len()], scales),
                    false,
                ));
            } else {
                q.push(f32_entry(n, &t, false));
            }
        }
        write_tensors(&tmp.join("model.int8.safetensors"), q, st_meta.clone())?;
    }
    write_tensors(&tmp.join("model.safetensors"), full, st_meta.clone())?;
    let head_entries = weights
        .iter()
        .map(|(n, t)| f32_entry(n.clone(), t, false))
        .collect();
    write_tensors(&tmp.join("head.safetensors"), head_entries, st_meta)?;

    let mut files = Vec::new();
    let mut names: Vec<PathBuf> = vec![
        "model.onnx".into(),
        "model.safetensors".into(),
        "head.safetensors".into(),
    ];
    if tmp.join("model.int8.safetensors").exists() {
        names.push("model.int8.safetensors".into());
    }
    names.extend(golden.iter().map(|g| PathBuf::from(&g.file)));
    for n in names {
        let bytes =
            std::fs::read(tmp.join(&n)).map_err(|e| invalid(format!("{}: {e}", n.display())))?;
        files.push(FileEntry {
            path: n.display().to_string(),
            sha256: sha256_hex(&bytes),
            size: bytes.len() as u64,
        });
    }
    let out_shape = lower_opts.output_shape(net);
    let accuracy_tract = checks[0].accuracy;
    let manifest = Manifest {
        format_version: FORMAT_VERSION,
        name,
        version: o.version,
        arch: net.arch.to_string(),
        labels,
        preprocess: spec,
        input: TensorSpec {
            name: onnx::INPUT_NAME.into(),
            dtype: "float32".into(),
            shape: std::iter::once(json!(onnx::BATCH_DIM))
                .chain(input_shape.iter().map(|d| json!(d)))
                .collect(),
        },
        output: TensorSpec {
            name: lower_opts.output_name.clone(),
            dtype: "float32".into(),
            shape: std::iter::once(json!(onnx::BATCH_DIM))
                .chain(out_shape.iter().map(|d| json!(d)))
                .collect(),
        },
        quantization: Quantization {
            form: o.quantize.name().into(),
            int8_ops: {
                let mut ops = quant.int8_ops();
                if o.quantize == QuantForm::Int8 {
                    ops.push(format!(
                        "float activations: stem and blocks 0..{} (int8 weights)",
                        o.float_blocks
                    ));
                }
                ops
            },
            calibration_samples: if o.quantize == QuantForm::Int8 {
                o.calibration
            } else {
                0
            },
            f32_accuracy,
            accuracy: accuracy_tract,
            accuracy_delta_pt: (accuracy_tract - f32_accuracy) * 100.0,
        },
        training: json!({
            "run": run_dir.display().to_string(),
            "best_epoch": summary["best_epoch"],
            "val_accuracy": summary["val_accuracy"],
            "val_loss": summary["val_loss"],
            "test_accuracy": summary["test_accuracy"],
            "params": params,
        }),
        verification: checks,
        golden,
        files,
        created: rfc3339(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        ),
    };
    write_atomic(
        &tmp.join(MANIFEST_FILE),
        serde_json::to_string_pretty(&manifest)
            .expect("json")
            .as_bytes(),
    )?;
    if out.exists() {
        std::fs::remove_dir_all(out).map_err(|e| invalid(format!("{}: {e}", out.display())))?;
    }
    std::fs::rename(&tmp, out).map_err(|e| invalid(format!("{}: {e}", out.display())))?;
    Ok(manifest)
}

/// Reads the manifest beside an exported `model.onnx` (or in an artifact directory).
pub fn read_manifest(model: &Path) -> Result<(PathBuf, Manifest), TrainError> {
    let dir = if model.is_dir() {
        model.to_path_buf()
    } else {
        model.parent().unwrap_or(Path::new(".")).to_path_buf()
    };
    let m = kestrel_models::artifact::read_manifest(&dir).map_err(|e| invalid(e.to_string()))?;
    Ok((dir, m))
}

/// Loads an exported model on `kind` (tract or ort), as described by its manifest.
fn load_model(
    model: &Path,
    kind: EngineKind,
    threads: usize,
) -> Result<(Manifest, Box<dyn Engine>), TrainError> {
    let (dir, m) = read_manifest(model)?;
    let onnx_path = if model.is_dir() {
        dir.join("model.onnx")
    } else {
        model.to_path_buf()
    };
    let bytes =
        std::fs::read(&onnx_path).map_err(|e| invalid(format!("{}: {e}", onnx_path.display())))?;
    let input_shape: Vec<usize> = m.input.shape[1..]
        .iter()
        .map(|d| d.as_u64().unwrap_or(0) as usize)
        .collect();
    let engine: Box<dyn Engine> = match kind {
        EngineKind::Tract => Box::new(TractEngine::from_onnx(&bytes, input_shape, threads)?),
        EngineKind::Ort => Box::new(kestrel_models::engine::OrtEngine::from_onnx(
            &bytes,
            input_shape,
            threads,
        )?),
        EngineKind::Candle => {
            return Err(invalid(
                "exported models run on tract or ort, not candle".into(),
            ));
        }
    };
    Ok((m, engine))
}

/// Mean batch-1 inference time in milliseconds over `rounds` runs (after one warm-up run).
pub fn latency_ms(
    model: &Path,
    kind: EngineKind,
    image: &Path,
    rounds: usize,
    threads: usize,
) -> Result<f64, TrainError> {
    let (m, engine) = load_model(model, kind, threads)?;
    let x = m.preprocess.run_file(image, &ImageLimits::default())?;
    let [h, w] = m.preprocess.input_size.map(|v| v as usize);
    let input = Tensor::new(vec![1, 3, h, w], x.data);
    engine.run(&input)?;
    let t = std::time::Instant::now();
    for _ in 0..rounds.max(1) {
        engine.run(&input)?;
    }
    Ok(t.elapsed().as_secs_f64() * 1000.0 / rounds.max(1) as f64)
}

/// `trainer evaluate --model`: evaluates an exported artifact exactly as the edge will, using only
/// its manifest (preprocessing, labels, tensor names).
pub fn evaluate_model(
    model: &Path,
    data_path: &Path,
    source: &data::SourceOpts,
    engine: EngineKind,
    cache_root: &Path,
    threads: usize,
) -> Result<crate::report::Evaluation, TrainError> {
    let (m, engine) = load_model(model, engine, threads)?;
    let ds = data::load(data_path, source)?;
    let prepared = Prepared::open_or_build(cache_root, &ds, &m.preprocess, 1, false)?;
    let map: Vec<usize> = prepared
        .meta
        .labels
        .iter()
        .map(|l| {
            m.labels.iter().position(|x| x == l).ok_or_else(|| {
                invalid(format!(
                    "{} has label `{l}`, unknown to the model (labels {:?})",
                    data_path.display(),
                    m.labels
                ))
            })
        })
        .collect::<Result<_, _>>()?;
    let pixels = prepared.load_pixels()?;
    let refs: Vec<&[u8]> = pixels.iter().map(|p| p.as_slice()).collect();
    let logits = cache::run_frozen(
        engine.as_ref(),
        &prepared,
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
