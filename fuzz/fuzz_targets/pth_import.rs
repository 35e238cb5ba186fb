//! A PyTorch checkpoint a user imports (`trainer import-weights`): zip and legacy `.pth` through
//! our own pickle VM, and safetensors. It must never execute anything (the VM has no `REDUCE` to
//! arbitrary callables) and never allocate without bound (libFuzzer's -malloc_limit_mb).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.pth");
    std::fs::write(&path, data).unwrap();
    let _ = kestrel_models::torch::read_checkpoint(&path);
});
