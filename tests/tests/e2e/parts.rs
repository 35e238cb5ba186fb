//! model.onnx in parts (issue #57, the artifact side): the parts the manifest lists, one after
//! another, are model.onnx byte for byte; a new head on the same backbone changes only the head
//! part (f32, and int8 weights with `--shared-backbone`); a fine-tuned run adds a part per trained
//! block; parts that do not belong together are refused, naming the part.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use kestrel_shared::manifest::{Composition, CompositionError, Manifest};
use kestrel_tests::{dataset, run_ok, stdout};

/// LFW runs built once per test run (one feature cache): `h1`, `h2` train a head on the frozen
/// backbone (seeds 1, 2); `ft1`, `ft2` fine-tune the last block too (1 epoch; seeds 1, 2).
pub(super) fn runs() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        kestrel_tests::once::fixture("parts-runs", |dir| {
            let cache = dir.join("cache");
            let ft = ["--fine-tune", "1", "--epochs", "1"];
            for (name, seed, extra) in [
                ("h1", 1, &[][..]),
                ("h2", 2, &[]),
                ("ft1", 1, &ft),
                ("ft2", 2, &ft),
            ] {
                fit(&dir.join(name), &cache, seed, extra);
            }
        })
    })
}

/// `trainer fit` on LFW with `seed` (and `extra` flags) into `dir`.
fn fit(dir: &Path, cache: &Path, seed: u64, extra: &[&str]) {
    let mut args: Vec<String> = vec!["fit".into(), "--data".into(), dataset("lfw", "imagefolder")];
    for a in ["--engine", "tract", "--no-mlflow", "--json", "--seed"] {
        args.push(a.into());
    }
    args.push(seed.to_string());
    args.extend([
        "--cache".into(),
        cache.display().to_string(),
        "--out".into(),
        dir.display().to_string(),
    ]);
    args.extend(extra.iter().map(|a| a.to_string()));
    run_ok("trainer", &args);
}

/// `trainer export` of `run` into `out`; the manifest, checked: model.onnx is its parts'
/// bytes one after another.
pub(super) fn export(
    run: &Path,
    out: &Path,
    version: u64,
    extra: &[&str],
) -> (Manifest, Vec<Vec<u8>>) {
    let v = version.to_string();
    let mut args = vec![
        "export",
        "--run",
        run.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--model-version",
        &v,
        "--no-mlflow",
        "--json",
    ];
    args.extend_from_slice(extra);
    let o = run_ok("trainer", &args);
    let m: Manifest = serde_json::from_str(stdout(&o).lines().last().unwrap()).unwrap();
    let c = m.composition.as_ref().expect("a composition");
    let model = std::fs::read(out.join("model.onnx")).unwrap();
    let mut at = 0;
    let parts: Vec<Vec<u8>> = c
        .parts
        .iter()
        .map(|p| {
            let b = model[at..at + p.size as usize].to_vec();
            at += p.size as usize;
            b
        })
        .collect();
    assert_eq!(at, model.len(), "the parts are all of model.onnx");
    let slices: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    assert_eq!(c.compose(&m.files, &slices).unwrap(), model);
    (m, parts)
}

fn roles(m: &Manifest) -> Vec<String> {
    m.composition
        .as_ref()
        .unwrap()
        .parts
        .iter()
        .map(|p| p.role.clone())
        .collect()
}

pub(super) fn sha(m: &Manifest, role: &str) -> String {
    let c = m.composition.as_ref().unwrap();
    c.parts
        .iter()
        .find(|p| p.role == role)
        .unwrap()
        .sha256
        .clone()
}

#[test]
fn a_new_head_changes_only_the_head_part() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |s: u64| runs().join(format!("h{s}"));
    let art = |what: &str, s: u64| tmp.path().join(format!("{what}-{s}"));
    for (form, extra) in [
        ("f32", vec![]),
        (
            "int8w",
            vec!["--quantize", "int8-weights", "--shared-backbone"],
        ),
    ] {
        let (a, _) = export(&run(1), &art(form, 1), 1, &extra);
        let (b, b_parts) = export(&run(2), &art(form, 2), 2, &extra);
        assert_eq!(roles(&a), ["frame", "backbone", "head"]);
        assert_eq!(
            sha(&a, "backbone"),
            sha(&b, "backbone"),
            "{form}: one backbone part"
        );
        assert_ne!(sha(&a, "head"), sha(&b, "head"), "{form}: a new head");
        let moved: usize = b_parts[0].len() + b_parts[2].len();
        eprintln!(
            "{form}: v2 moves {moved} bytes of {} (frame + head)",
            b_parts.iter().map(Vec::len).sum::<usize>()
        );
        assert!(
            moved < 50_000,
            "{form}: {moved} bytes to move for a new head"
        );
    }
    // int8 weights without --shared-backbone: the frozen layers' bias correction comes from each
    // run's samples, so each run has its own backbone part.
    let (a, _) = export(&run(1), &art("int8", 1), 1, &["--quantize", "int8-weights"]);
    let (b, _) = export(&run(2), &art("int8", 2), 2, &["--quantize", "int8-weights"]);
    assert_ne!(sha(&a, "backbone"), sha(&b, "backbone"));
}

#[test]
fn a_fine_tuned_run_has_a_part_per_trained_block_and_refuses_strangers() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, _) = export(&runs().join("ft1"), &tmp.path().join("a1"), 1, &[]);
    let (b, b_parts) = export(&runs().join("ft2"), &tmp.path().join("a2"), 2, &[]);
    let (h, h_parts) = export(&runs().join("h1"), &tmp.path().join("h"), 3, &[]);
    let r = roles(&a);
    assert_eq!(r.len(), 4, "{r:?}");
    assert!(r[2].starts_with("block:"), "{r:?}");
    assert_eq!(sha(&a, "backbone"), sha(&b, "backbone"));
    assert_ne!(sha(&a, &r[2]), sha(&b, &r[2]), "the trained block moves");
    assert_ne!(
        sha(&a, "backbone"),
        sha(&h, "backbone"),
        "a head-only run's backbone holds every block"
    );

    let c = b.composition.clone().unwrap();
    let slices = |p: &[Vec<u8>]| p.iter().map(|b| b.to_vec()).collect::<Vec<_>>();
    // A part whose bytes do not match its hash.
    let mut tampered = slices(&b_parts);
    tampered[3][10] ^= 1;
    let refs: Vec<&[u8]> = tampered.iter().map(Vec::as_slice).collect();
    match c.compose(&b.files, &refs) {
        Err(CompositionError::Part { index: 3, role, .. }) => assert_eq!(role, "head"),
        other => panic!("a tampered head: {other:?}"),
    }
    // The head-only run's head (trained on the whole frozen backbone) in place of this one's,
    // its entry and bytes both: it was cut to follow another part.
    let hc = h.composition.clone().unwrap();
    let mut mixed = c.clone();
    mixed.parts[3] = hc.parts[2].clone();
    let mut bytes = slices(&b_parts);
    bytes[3] = h_parts[2].clone();
    let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    match mixed.compose(&b.files, &refs) {
        Err(e @ CompositionError::Part { index: 3, .. }) => {
            assert!(e.to_string().contains("cut to follow part"), "{e}")
        }
        other => panic!("a head of another model: {other:?}"),
    }
    // Every part genuine but the manifest's model.onnx another: the whole is refused.
    let other: Composition = c;
    let refs: Vec<&[u8]> = b_parts.iter().map(Vec::as_slice).collect();
    assert!(matches!(
        other.compose(&h.files, &refs),
        Err(CompositionError::Whole { .. })
    ));
}
