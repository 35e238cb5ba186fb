//! An artifact offer whose manifest is the fuzzer's (signed here, so it gets past the signature
//! check), its consistency checks and manifest name checks, then the device's chunk assembly
//! into a store, as a whole bundle or (an odd first byte) in pieces: names must never escape the
//! staging directory, sizes never overflow.
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
        pieces: vec![],
    };
    let Ok(m) = offer.open(&[key.verifying_key()]) else {
        return;
    };
    if artifact::check_names(&m).is_err() {
        return;
    }
    let offer = if data[0] % 2 == 1 {
        let (text, sig) = (offer.manifest.clone(), offer.signature.clone());
        let o = ArtifactOffer::new(&m, text, sig, bundle, chunk_bytes);
        if o.open(&[key.verifying_key()]).is_err() {
            return;
        }
        o
    } else {
        offer
    };
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), &dir.path().join("parts")).unwrap();
    if offer.pieces.is_empty() {
        for (i, c) in bundle.chunks(chunk_bytes).enumerate() {
            store.write_chunk(offer.version, i as u32, c).unwrap();
        }
    } else {
        let mut at = 0;
        for (p, range) in offer.pieces.iter().zip(offer.piece_ranges()) {
            let bytes = &bundle[at..at + p.size as usize];
            at += bytes.len();
            for (i, c) in range.zip(bytes.chunks(chunk_bytes)) {
                store.write_chunk(offer.version, i, c).unwrap();
            }
        }
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
