//! Stage 6: the artifact directory, written atomically: every file and the manifest go into a
//! temporary sibling directory, which then replaces `out` in one rename.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use kestrel_models::onnx::{self, Linear};
use kestrel_models::quant::{Quant, quantize_per_channel};
use kestrel_models::weights::FoldedConv;
use kestrel_models::{Network, Tensor};
use kestrel_shared::manifest::{
    Composition, FORMAT_VERSION, FileEntry, Golden, MANIFEST_FILE, Manifest, PartEntry,
    Quantization, TensorSpec, rfc3339,
};
use safetensors::{Dtype, tensor::TensorView};
use serde_json::json;

use super::calibrate::Quantized;
use super::golden::GoldenSamples;
use super::lower::Lowered;
use super::trained::Trained;
use super::verify::Verification;
use super::{ExportError, ExportOpts, Quantize};
use crate::data::cache::write_atomic;
use kestrel_shared::protocol::sha256_hex;

/// Writes the artifact into `out` (replacing it). Returns the manifest written.
pub(super) fn write(
    out: &Path,
    run: &Trained,
    q: &Quantized,
    lowered: &Lowered,
    verification: Verification,
    golden: GoldenSamples,
    o: &ExportOpts,
) -> Result<Manifest, ExportError> {
    let tmp = out.with_extension(format!("tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let written = (|| -> Result<Manifest, ExportError> {
        let files = write_files(&tmp, run, q, lowered, &golden, o)?;
        let manifest = manifest(run, q, lowered, verification, golden.entries, files, o);
        write_atomic(
            &tmp.join(MANIFEST_FILE),
            serde_json::to_string_pretty(&manifest)
                .expect("json")
                .as_bytes(),
        )?;
        Ok(manifest)
    })();
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    let manifest = written?;
    if out.exists() {
        std::fs::remove_dir_all(out).map_err(ExportError::io(out))?;
    }
    std::fs::rename(&tmp, out).map_err(ExportError::io(out))?;
    Ok(manifest)
}

/// Every file but the manifest; returns their entries in the manifest's order.
fn write_files(
    dir: &Path,
    run: &Trained,
    q: &Quantized,
    lowered: &Lowered,
    golden: &GoldenSamples,
    o: &ExportOpts,
) -> Result<Vec<FileEntry>, ExportError> {
    std::fs::create_dir_all(dir.join("golden")).map_err(ExportError::io(dir))?;
    for (g, bytes) in golden.entries.iter().zip(&golden.images) {
        write_atomic(&dir.join(&g.file), bytes)?;
    }
    write_atomic(&dir.join("model.onnx"), &lowered.onnx)?;
    let meta: BTreeMap<String, String> = [
        ("arch".to_string(), run.net().arch.to_string()),
        (
            "labels".to_string(),
            serde_json::to_string(run.labels()).expect("json"),
        ),
    ]
    .into();
    let mut names: Vec<PathBuf> = vec![
        "model.onnx".into(),
        "model.safetensors".into(),
        "head.safetensors".into(),
    ];
    if o.quantize != Quantize::None {
        // The int8 weights and the (bias-corrected) biases that model.onnx carries.
        let int8 = int8_entries(run.net(), &q.folded, &q.head);
        write_tensors(&dir.join("model.int8.safetensors"), int8, meta.clone())?;
        names.push("model.int8.safetensors".into());
    }
    let full = named_params(run.net(), &run.folded, &run.head)
        .into_iter()
        .map(|(n, t)| f32_entry(n, &t, o.f16))
        .collect();
    write_tensors(&dir.join("model.safetensors"), full, meta.clone())?;
    let head = run
        .weights
        .iter()
        .map(|(n, t)| f32_entry(n.clone(), t, false))
        .collect();
    write_tensors(&dir.join("head.safetensors"), head, meta)?;
    names.extend(golden.entries.iter().map(|g| PathBuf::from(&g.file)));
    names
        .into_iter()
        .map(|n| -> Result<FileEntry, ExportError> {
            let bytes = std::fs::read(dir.join(&n)).map_err(ExportError::io(&n))?;
            Ok(FileEntry {
                path: n.display().to_string(),
                sha256: sha256_hex(&bytes),
                size: bytes.len() as u64,
            })
        })
        .collect()
}

/// The manifest: what the artifact is, how it was made and verified, and its files.
fn manifest(
    run: &Trained,
    q: &Quantized,
    lowered: &Lowered,
    verification: Verification,
    golden: Vec<Golden>,
    files: Vec<FileEntry>,
    o: &ExportOpts,
) -> Manifest {
    let net = run.net();
    let Verification {
        f32_accuracy,
        checks,
        reference,
    } = verification;
    let accuracy_tract = checks[0].accuracy;
    let shape = |dims: &[usize]| -> Vec<serde_json::Value> {
        std::iter::once(json!(onnx::BATCH_DIM))
            .chain(dims.iter().map(|d| json!(d)))
            .collect()
    };
    let mut int8_ops = q.quant.int8_ops();
    match &q.quant {
        Quant::Static(_) => int8_ops.push(format!(
            "float activations and f32 weights: stem and blocks 0..{}",
            o.float_blocks
        )),
        Quant::Weights { float_blocks } if run.pp.backbone.graph.is_none() => {
            int8_ops.push(format!("f32 weights: stem and blocks 0..{float_blocks}"))
        }
        _ => {}
    }
    if o.quantize == Quantize::Int8 {
        int8_ops.push(
            "onnxruntime: integer kernels (QLinearConv, QLinearAdd, QGemm); tract: the              QuantizeLinear/DequantizeLinear pairs run in float, slower than the f32 form              (roll int8-weights out to tract devices)"
                .into(),
        );
    }
    Manifest {
        format_version: FORMAT_VERSION,
        name: lowered.name.clone(),
        version: o.version,
        arch: net.arch.to_string(),
        labels: run.labels().to_vec(),
        preprocess: net.preprocess.clone(),
        input: TensorSpec {
            name: onnx::INPUT_NAME.into(),
            dtype: "float32".into(),
            shape: shape(&lowered.input_shape),
        },
        output: TensorSpec {
            name: lowered.opts.output_name.clone(),
            dtype: "float32".into(),
            shape: shape(&lowered.output_shape),
        },
        quantization: Quantization {
            form: o.quantize.form(),
            int8_ops,
            calibration_samples: if o.quantize == Quantize::Int8 {
                o.calibration
            } else {
                0
            },
            f32_accuracy,
            accuracy: accuracy_tract,
            accuracy_delta_pt: (accuracy_tract - f32_accuracy) * 100.0,
        },
        training: json!({
            "run": run.run_dir.display().to_string(),
            "best_epoch": run.summary["best_epoch"],
            "val_accuracy": run.summary["val_accuracy"],
            "val_loss": run.summary["val_loss"],
            "test_accuracy": run.summary["test_accuracy"],
            "params": run.params,
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
        registry: o.registry.clone(),
        reference,
        composition: Some(composition(lowered)),
    }
}

/// `model.onnx` as its parts, each following the one before it (but the first after the frame,
/// which belongs to no version).
fn composition(lowered: &Lowered) -> Composition {
    let mut parts: Vec<PartEntry> = Vec::new();
    for p in &lowered.parts {
        let after = parts
            .last()
            .filter(|b| b.role != "frame")
            .map(|b| b.sha256.clone());
        parts.push(PartEntry {
            role: p.role.clone(),
            sha256: sha256_hex(&p.bytes),
            size: p.bytes.len() as u64,
            reads: p.reads.clone(),
            after,
        });
    }
    Composition {
        file: "model.onnx".into(),
        parts,
    }
}

/// A safetensors entry: `(name, dtype, shape, little-endian bytes)`.
type Entry = (String, Dtype, Vec<usize>, Vec<u8>);

/// Every parameter of the exported network by name (folded convs, classifier).
fn named_params(net: &Network, folded: &[FoldedConv], head: &Linear) -> Vec<(String, Tensor)> {
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

/// Weights as int8 with their per-channel `.scale`s; biases as f32.
fn int8_entries(net: &Network, folded: &[FoldedConv], head: &Linear) -> Vec<Entry> {
    let mut q = Vec::new();
    for (n, t) in named_params(net, folded, head) {
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
    q
}

fn f32_entry(name: String, t: &Tensor, f16: bool) -> Entry {
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

/// Serialises tensors of mixed dtypes crash-safely.
fn write_tensors(
    path: &Path,
    tensors: Vec<Entry>,
    meta: BTreeMap<String, String>,
) -> Result<(), ExportError> {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            let view =
                TensorView::new(*d, s.clone(), b).map_err(|source| ExportError::Safetensors {
                    what: n.clone(),
                    source,
                })?;
            Ok((n.clone(), view))
        })
        .collect::<Result<_, ExportError>>()?;
    let bytes =
        safetensors::serialize(views, Some(meta.into_iter().collect())).map_err(|source| {
            ExportError::Safetensors {
                what: path.display().to_string(),
                source,
            }
        })?;
    Ok(write_atomic(path, &bytes)?)
}
