//! An artifact offer whose manifest is the fuzzer's (signed here, so it gets past the signature
//! check), its consistency checks and manifest name checks, then the device's chunk assembly
//! into a store: names must never escape the staging directory, sizes never overflow.
#![no_main]

use ed25519_dalek::SigningKey;
use edge_agent::store::Store;
use kestrel_models::artifact;
use kestrel_shared::protocol::{ArtifactOffer, sha256_hex};
use kestrel_shared::signing::{PayloadType, sign};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // [chunk size byte][manifest length u16][manifest][bundle...]
    if data.len() < 3 {
        return;
    }
    let chunk_bytes = 1 + data[0] as usize * 16;
    let len = u16::from_le_bytes([data[1], data[2]]) as usize;
    let rest = &data[3..];
    let (text, bundle) = rest.split_at(len.min(rest.len()));
    let manifest = String::from_utf8_lossy(text).into_owned();
    let key = SigningKey::from_bytes(&[7; 32]);
    let offer = ArtifactOffer {
        name: "m".into(),
        version: 1,
        signature: sign(&key, PayloadType::Manifest, manifest.as_bytes()),
        manifest,
        chunk_bytes: chunk_bytes as u64,
        chunks: bundle.chunks(chunk_bytes).map(sha256_hex).collect(),
        total_bytes: bundle.len() as u64,
    };
    let Ok(m) = offer.open(&[key.verifying_key()]) else {
        return;
    };
    if artifact::check_names(&m).is_err() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    for (i, c) in bundle.chunks(chunk_bytes).enumerate() {
        store.write_chunk(offer.version, i as u32, c).unwrap();
    }
    if let Ok(staged) = store.assemble(&offer, &m) {
        for f in walk(&staged) {
            assert!(f.starts_with(&staged), "{} escaped {}", f.display(), staged.display());
        }
    }
});

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        }
        out.push(p);
    }
    out
}
