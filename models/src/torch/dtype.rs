//! Element types of torch storages and of safetensors tensors.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FloatType {
    F32,
    F64,
    F16,
    BF16,
}

impl FloatType {
    pub(super) fn size(self) -> usize {
        match self {
            FloatType::F32 => 4,
            FloatType::F64 => 8,
            FloatType::F16 | FloatType::BF16 => 2,
        }
    }

    /// Element `i` of little-endian `bytes` (caller guarantees bounds).
    #[inline]
    pub(super) fn load(self, bytes: &[u8], i: usize) -> f32 {
        match self {
            FloatType::F32 => {
                let b = &bytes[i * 4..i * 4 + 4];
                f32::from_le_bytes([b[0], b[1], b[2], b[3]])
            }
            FloatType::F64 => {
                let b = &bytes[i * 8..i * 8 + 8];
                f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32
            }
            FloatType::F16 => {
                let b = &bytes[i * 2..i * 2 + 2];
                half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
            }
            FloatType::BF16 => {
                let b = &bytes[i * 2..i * 2 + 2];
                half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
            }
        }
    }
}

/// Element type of a torch storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum StorageType {
    Float(FloatType),
    /// Not converted (integer, bool, complex, quantized): tensors on it are skipped.
    /// `size` is the element size when known (needed to skip legacy storages).
    Skip {
        name: String,
        size: Option<usize>,
    },
}

impl StorageType {
    pub(super) fn from_class(module: &str, name: &str) -> StorageType {
        let float = |f| StorageType::Float(f);
        let skip = |size: Option<usize>| StorageType::Skip {
            name: format!("{module}.{name}"),
            size,
        };
        if module != "torch" && module != "torch.cuda" {
            return skip(None);
        }
        match name {
            "FloatStorage" => float(FloatType::F32),
            "DoubleStorage" => float(FloatType::F64),
            "HalfStorage" => float(FloatType::F16),
            "BFloat16Storage" => float(FloatType::BF16),
            "LongStorage" | "ComplexFloatStorage" => skip(Some(8)),
            "IntStorage" | "QInt32Storage" => skip(Some(4)),
            "ShortStorage" => skip(Some(2)),
            "CharStorage" | "ByteStorage" | "BoolStorage" | "QInt8Storage" | "QUInt8Storage"
            | "QUInt4x2Storage" | "QUInt2x4Storage" => skip(Some(1)),
            "ComplexDoubleStorage" => skip(Some(16)),
            _ => skip(None),
        }
    }

    /// From a `torch.<dtype>` global (as passed to `_rebuild_tensor_v3`).
    pub(super) fn from_dtype(module: &str, name: &str) -> StorageType {
        let skip = |size: Option<usize>| StorageType::Skip {
            name: format!("{module}.{name}"),
            size,
        };
        if module != "torch" {
            return skip(None);
        }
        match name {
            "float32" | "float" => StorageType::Float(FloatType::F32),
            "float64" | "double" => StorageType::Float(FloatType::F64),
            "float16" | "half" => StorageType::Float(FloatType::F16),
            "bfloat16" => StorageType::Float(FloatType::BF16),
            "int64" | "long" => skip(Some(8)),
            "int32" | "int" => skip(Some(4)),
            "int16" | "short" => skip(Some(2)),
            "int8" | "uint8" | "bool" => skip(Some(1)), // not-wire: PyTorch dtype names
            _ => skip(None),
        }
    }

    pub(super) fn elem_size(&self) -> Option<usize> {
        match self {
            StorageType::Float(f) => Some(f.size()),
            StorageType::Skip { size, .. } => *size,
        }
    }
}
