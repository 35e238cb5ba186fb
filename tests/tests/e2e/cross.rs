//! The edge agent must cross-compile: no OpenSSL, aws-lc, native-tls, C++ or other -sys crates in
//! its dependency tree for the Raspberry Pi targets (and no candle / ONNX Runtime).

use std::process::Command;

#[test]
fn edge_agent_tree_is_pure_rust_for_pi_targets() {
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.toml");
    for target in ["aarch64-unknown-linux-gnu", "armv7-unknown-linux-gnueabihf"] {
        let o = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args([
                "tree",
                "--locked",
                "--manifest-path",
                manifest,
                "-p",
                "edge-agent",
                "--target",
                target,
            ])
            .args(["-e", "normal,build", "--prefix", "none"])
            .output()
            .expect("run cargo tree");
        assert!(
            o.status.success(),
            "{target}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let tree = String::from_utf8_lossy(&o.stdout);
        let crates: Vec<&str> = tree
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        for must in ["tract-onnx", "rumqttc", "ring"] {
            assert!(
                crates.contains(&must),
                "{target}: {must} missing from the tree:\n{tree}"
            );
        }
        let bad: Vec<&&str> = crates
            .iter()
            .filter(|c| {
                // openssl-probe (from rustls-native-certs) only looks up certificate paths.
                (c.contains("openssl") && **c != "openssl-probe")
                    || c.contains("aws-lc")
                    || c.contains("native-tls")
                    || c.starts_with("cxx")
                    || (c.ends_with("-sys") && **c != "linux-raw-sys")
                    || c.starts_with("candle")
                    || **c == "ort"
            })
            .collect();
        assert!(bad.is_empty(), "{target}: edge-agent depends on {bad:?}");
    }
}
