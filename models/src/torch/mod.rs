//! Reader for PyTorch checkpoints (legacy `torch.save` pickle stream, torch >= 1.6 zip
//! archives) and safetensors files, producing plain f32 [`Weights`].
//!
//! A small protocol-2..5 pickle interpreter lives here rather than reusing
//! `candle_core::pickle`: the legacy format needs several successive pickles read from one
//! stream, a magic number that does not fit in an i64, and a view-metadata field in the
//! persistent ids, none of which the candle VM covers; keeping our own also keeps this
//! module independent of the `candle` feature.
//!
//! Tensors are gathered honouring `storage_offset` and strides, so the returned data is
//! always contiguous row-major. Tensors backed by integer/bool storages (e.g. BatchNorm
//! `num_batches_tracked`) are skipped; f16/bf16/f64 storages are converted to f32.

mod archive;
mod dtype;
#[cfg(test)]
mod hostile_tests;
mod legacy;
mod limits;
mod pickle;
mod rebuild;
mod state_dict;
#[cfg(test)]
mod tests;
mod value;

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use crate::tensor::{Tensor, Weights};
use archive::read_zip;
use dtype::FloatType;
use legacy::read_legacy;

/// Errors from reading or writing checkpoints. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("{}: I/O error: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{}: file is truncated ({context})", path.display())]
    Truncated { path: PathBuf, context: String },
    #[error("{}: unrecognised checkpoint format (not a zip, legacy torch pickle or safetensors file)", path.display())]
    UnknownFormat { path: PathBuf },
    #[error("{}: unsupported checkpoint: {message}", path.display())]
    Unsupported { path: PathBuf, message: String },
    #[error("{}: malformed pickle at byte {offset}: {message}", path.display())]
    Pickle {
        path: PathBuf,
        offset: u64,
        message: String,
    },
    #[error("{}: zip archive error: {message}", path.display())]
    Zip { path: PathBuf, message: String },
    #[error("{}: safetensors error: {message}", path.display())]
    Safetensors { path: PathBuf, message: String },
    #[error("{}: tensor `{tensor}`: {message}", path.display())]
    Tensor {
        path: PathBuf,
        tensor: String,
        message: String,
    },
    #[error("{}: tensor `{tensor}`: storage `{key}` not found in checkpoint", path.display())]
    MissingStorage {
        path: PathBuf,
        tensor: String,
        key: String,
    },
    #[error("{}: tensor `{tensor}`: unsupported dtype {dtype}", path.display())]
    UnsupportedDtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    /// Over one of the reader's bounds (a hostile or absurd file: decompression bomb, memo or
    /// DUP bomb, nesting too deep, views far larger than their storage).
    #[error("{}: refused, over a safety limit: {message}", path.display())]
    Limit { path: PathBuf, message: String },
}

fn io_err(path: &Path, context: &str, e: io::Error) -> ImportError {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        ImportError::Truncated {
            path: path.to_path_buf(),
            context: context.to_string(),
        }
    } else {
        ImportError::Io {
            path: path.to_path_buf(),
            source: e,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Public API
// ---------------------------------------------------------------------------------------

/// Reads a checkpoint, detecting the format from its first bytes: zip (`PK\x03\x04`,
/// torch >= 1.6), legacy pickle stream (`\x80` PROTO opcode, torch < 1.6), otherwise
/// safetensors (header length + `{`, or a `.safetensors` extension).
pub fn read_checkpoint(path: &Path) -> Result<Weights, ImportError> {
    let mut head = [0u8; 16];
    let n = {
        let mut f = File::open(path).map_err(|e| io_err(path, "opening file", e))?;
        let mut n = 0;
        while n < head.len() {
            match f.read(&mut head[n..]) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(path, "reading header", e)),
            }
        }
        n
    };
    let head = &head[..n];
    let is_st_ext = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("safetensors"));
    if head.starts_with(b"PK\x03\x04") || head.starts_with(b"PK\x05\x06") {
        read_zip(path)
    } else if head.first() == Some(&0x80) {
        read_legacy(path)
    } else if is_st_ext || (head.len() > 8 && head[8] == b'{') {
        read_safetensors(path)
    } else if head.is_empty() {
        Err(ImportError::Truncated {
            path: path.to_path_buf(),
            context: "empty file".into(),
        })
    } else {
        Err(ImportError::UnknownFormat {
            path: path.to_path_buf(),
        })
    }
}

/// Reads a safetensors file. F32/F16/BF16/F64 tensors are converted to f32; integer and
/// bool tensors are skipped; other float formats (fp8, fp4, ...) are an error.
pub fn read_safetensors(path: &Path) -> Result<Weights, ImportError> {
    use safetensors::Dtype;
    let bytes = std::fs::read(path).map_err(|e| io_err(path, "reading file", e))?;
    let st =
        safetensors::SafeTensors::deserialize(&bytes).map_err(|e| ImportError::Safetensors {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
    let mut out = Weights::new();
    for (name, view) in st.iter() {
        let dtype = match view.dtype() {
            Dtype::F32 => FloatType::F32,
            Dtype::F64 => FloatType::F64,
            Dtype::F16 => FloatType::F16,
            Dtype::BF16 => FloatType::BF16,
            Dtype::BOOL
            | Dtype::U8
            | Dtype::I8
            | Dtype::I16
            | Dtype::U16
            | Dtype::I32
            | Dtype::U32
            | Dtype::I64
            | Dtype::U64 => continue,
            other => {
                return Err(ImportError::UnsupportedDtype {
                    path: path.to_path_buf(),
                    tensor: name.to_string(),
                    dtype: format!("{other:?}"),
                });
            }
        };
        let shape = view.shape().to_vec();
        let data = view.data();
        let numel: usize = shape.iter().product();
        if data.len() != numel * dtype.size() {
            return Err(ImportError::Tensor {
                path: path.to_path_buf(),
                tensor: name.to_string(),
                message: format!("data length {} does not match shape {shape:?}", data.len()),
            });
        }
        let data = (0..numel).map(|i| dtype.load(data, i)).collect();
        out.insert(name.to_string(), Tensor { shape, data });
    }
    Ok(out)
}

/// Writes `weights` as an f32 safetensors file, crash-safely: the bytes go to a temporary
/// file in the destination directory, which is fsynced and then renamed over `path`.
pub fn write_safetensors(
    path: &Path,
    weights: &Weights,
    metadata: Option<HashMap<String, String>>,
) -> Result<(), ImportError> {
    for (name, t) in weights {
        if t.shape.iter().product::<usize>() != t.data.len() {
            return Err(ImportError::Tensor {
                path: path.to_path_buf(),
                tensor: name.clone(),
                message: format!(
                    "data length {} does not match shape {:?}",
                    t.data.len(),
                    t.shape
                ),
            });
        }
    }
    let bytes = safetensors::serialize(
        weights.iter().map(|(k, t)| (k.as_str(), F32View(t))),
        metadata,
    )
    .map_err(|e| ImportError::Safetensors {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;

    kestrel_shared::fsutil::write_atomic(path, &bytes).map_err(|source| ImportError::Io {
        path: path.to_path_buf(),
        source,
    })
}

struct F32View<'a>(&'a Tensor);

impl safetensors::View for F32View<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        safetensors::Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.0.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        let mut v = Vec::with_capacity(self.0.data.len() * 4);
        for x in &self.0.data {
            v.extend_from_slice(&x.to_le_bytes());
        }
        std::borrow::Cow::Owned(v)
    }
    fn data_len(&self) -> usize {
        self.0.data.len() * 4
    }
}
