//! `agent.toml`: who the device is, how it reaches the broker, whom it trusts, where it keeps
//! models and what it accepts; then the drop-ins of `agent.d/` beside it, each over the one
//! before ([`drop_ins`]). Relative paths are resolved against the directory of `agent.toml`.

use std::path::{Path, PathBuf};

use kestrel_runtime::EngineKind;
use kestrel_shared::error::Cause;
use kestrel_shared::protocol::check_name;

pub use crate::core::settings::*;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}")]
    Invalid {
        path: String,
        #[source]
        source: Cause,
    },
}

/// The drop-in files of configuration file `path` (`agent.toml` -> `agent.d/*.toml`), in name
/// order: the device's own settings (its broker, its id) over the shipped defaults, so that the
/// shipped file is never edited and a package upgrade never asks about it.
pub fn drop_ins(path: &Path) -> Result<Vec<PathBuf>, ConfigError> {
    let dir = path.with_extension("d");
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => {
            return Err(ConfigError::Read {
                path: dir.display().to_string(),
                source: e,
            });
        }
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml") && p.is_file())
        .collect();
    files.sort();
    Ok(files)
}

/// `path` with its drop-ins merged over it (tables key by key, any other value replaced), and
/// the files read.
fn merged(path: &Path) -> Result<(toml::Table, Vec<String>), ConfigError> {
    let mut table = toml::Table::new();
    let mut sources = Vec::new();
    for file in std::iter::once(path.to_path_buf()).chain(drop_ins(path)?) {
        let p = file.display().to_string();
        let text = std::fs::read_to_string(&file).map_err(|e| ConfigError::Read {
            path: p.clone(),
            source: e,
        })?;
        let t: toml::Table = toml::from_str(&text).map_err(|e| ConfigError::Invalid {
            path: p.clone(),
            source: e.into(),
        })?;
        merge(&mut table, t);
        sources.push(p);
    }
    Ok((table, sources))
}

fn merge(into: &mut toml::Table, from: toml::Table) {
    for (k, v) in from {
        match (into.get_mut(&k), v) {
            (Some(toml::Value::Table(a)), toml::Value::Table(b)) => merge(a, b),
            (_, v) => {
                into.insert(k, v);
            }
        }
    }
}

/// This machine's host name (the default `device_id`).
fn host_name() -> std::io::Result<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))?;
    Ok(name.trim().to_string())
}

impl Config {
    /// Reads `path` and then its drop-ins ([`drop_ins`]), each over the one before.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let (table, sources) = merged(path)?;
        let p = sources.join(" + ");
        let invalid = |e: Cause| ConfigError::Invalid {
            path: p.clone(),
            source: e,
        };
        let mut c: Config = table.try_into().map_err(|e| invalid(e.into()))?;
        if c.device_id.is_empty() {
            c.device_id = host_name().map_err(|e| {
                invalid(format!("device_id is not set and the host name is unreadable: {e}").into())
            })?;
        }
        let base = path.parent().unwrap_or(Path::new("."));
        let paths = std::iter::once(&mut c.store)
            .chain(c.trusted_keys.iter_mut())
            .chain(c.trusted_root.as_mut())
            .chain(c.inference.ort_library.as_mut());
        for p in paths {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
        c.broker.resolve(base);
        for name in std::iter::once(&c.device_id).chain(&c.groups) {
            check_name(name).map_err(|e| invalid(e.into()))?;
        }
        if c.trusted_keys.is_empty() {
            return Err(invalid(
                "trusted_keys is empty: the agent accepts only signed models".into(),
            ));
        }
        c.broker.endpoint().map_err(|e| invalid(e.into()))?;
        if c.quality.window == 0 || c.quality.period_s == 0 || c.quality.shadow_every == 0 {
            return Err(invalid(
                "[quality] window, period_s and shadow_every must be at least 1".into(),
            ));
        }
        let k = &c.capture;
        if !(0.0..=1.0).contains(&k.rate) || !(0.0..=1.0).contains(&k.min_confidence) {
            return Err(invalid(
                "[capture] rate and min_confidence must be between 0 and 1".into(),
            ));
        }
        if k.resend_after_s == 0 || k.resend_max_s < k.resend_after_s {
            return Err(invalid(
                "[capture] resend_after_s must be at least 1 and resend_max_s at least that".into(),
            ));
        }
        if k.enabled && k.policy == CapturePolicy::Drift && !c.quality.enabled {
            return Err(invalid(
                "[capture] policy = \"drift\" needs [quality] enabled (the drift test)".into(),
            ));
        }
        match c.inference.engine {
            EngineKind::Tract => {}
            EngineKind::Ort if kestrel_runtime::engine::ORT_COMPILED => {}
            EngineKind::Ort => {
                return Err(invalid(
                    "[inference] engine = \"ort\": this edge-agent is built without ONNX Runtime \
                     (cargo feature `ort`; scripts/build-edge.sh --ort builds it)"
                        .into(),
                ));
            }
            EngineKind::Candle => {
                return Err(invalid(
                    "[inference] engine = \"candle\": the agent runs tract or ort".into(),
                ));
            }
        }
        Ok(c)
    }

    /// The root public key, read and parsed, when one is configured.
    pub fn root_key(&self) -> Result<Option<ed25519_dalek::VerifyingKey>, ConfigError> {
        self.trusted_root
            .iter()
            .map(read_public_key)
            .next()
            .transpose()
    }

    /// The trusted public keys, read and parsed.
    pub fn keys(&self) -> Result<Vec<ed25519_dalek::VerifyingKey>, ConfigError> {
        self.trusted_keys.iter().map(read_public_key).collect()
    }
}

fn read_public_key(p: &PathBuf) -> Result<ed25519_dalek::VerifyingKey, ConfigError> {
    let path = p.display().to_string();
    let text = std::fs::read_to_string(p).map_err(|e| ConfigError::Read {
        path: path.clone(),
        source: e,
    })?;
    kestrel_shared::signing::public_key(&text, &path).map_err(|e| ConfigError::Invalid {
        path,
        source: e.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_config_parses_and_bad_ones_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let sample = concat!(env!("CARGO_MANIFEST_DIR"), "/agent.toml");
        let c = Config::load(Path::new(sample)).unwrap();
        assert_eq!(c.broker.prefix, "kestrel");
        assert!(c.store.is_absolute());
        let write = |body: &str| {
            let p = dir.path().join("agent.toml");
            std::fs::write(&p, body).unwrap();
            kestrel_shared::chain(&Config::load(&p).map(|_| ()).unwrap_err())
        };
        let base = "store = \"s\"\ntrusted_keys = [\"k.pub\"]\n[broker]\nurl = \"mqtt://h:1\"\n";
        let e = write(&format!("device_id = \"a/b\"\n{base}"));
        assert!(e.contains("a/b") && e.contains("agent.toml"), "{e}");
        let e = write(&format!("device_id = \"a\"\nbogus = 1\n{base}"));
        assert!(e.contains("bogus"), "{e}");
        let e = write(
            "device_id = \"a\"\nstore = \"s\"\ntrusted_keys = []\n[broker]\nurl = \"mqtt://h:1\"\n",
        );
        assert!(e.contains("trusted_keys"), "{e}");
        let e = write(
            "device_id = \"a\"\nstore = \"s\"\ntrusted_keys = [\"k\"]\n[broker]\nurl = \"ftp://h\"\n",
        );
        assert!(e.contains("ftp://h"), "{e}");
        let e = write(&format!(
            "device_id = \"a\"\n{base}[inference]\nengine = \"candle\"\n"
        ));
        assert!(e.contains("tract or ort"), "{e}");
        let e = write(&format!(
            "device_id = \"a\"\n{base}[inference]\nengine = \"onnx\"\n"
        ));
        assert!(e.contains("onnx"), "{e}");
        let ort = write(&format!(
            "device_id = \"a\"\n{base}[inference]\nengine = \"ort\"\nbogus = 1\n"
        ));
        assert!(ort.contains("bogus"), "{ort}");
        let p = dir.path().join("agent.toml");
        std::fs::write(
            &p,
            format!("device_id = \"a\"\n{base}[inference]\nengine = \"ort\"\nort_library = \"lib/x.so\"\n"),
        )
        .unwrap();
        match Config::load(&p) {
            Ok(c) => {
                assert!(kestrel_runtime::engine::ORT_COMPILED);
                assert_eq!(c.inference.ort_library, Some(dir.path().join("lib/x.so")));
            }
            Err(e) => {
                assert!(!kestrel_runtime::engine::ORT_COMPILED);
                let e = kestrel_shared::chain(&e);
                assert!(e.contains("without ONNX Runtime"), "{e}");
            }
        }
    }

    /// Shipped defaults in `agent.toml`, the device's own settings in `agent.d/*.toml` (in name
    /// order, tables merged key by key); without `device_id`, the host name.
    #[test]
    fn drop_ins_override_the_shipped_file_and_the_id_defaults_to_the_host_name() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("agent.toml");
        std::fs::write(
            &p,
            "store = \"s\"\ntrusted_keys = [\"k.pub\"]\n[broker]\nurl = \"mqtt://127.0.0.1:1883\"\n\
             keep_alive_s = 30\n[limits]\nqueue = 16\n",
        )
        .unwrap();
        let c = Config::load(&p).unwrap();
        assert_eq!(c.device_id, host_name().unwrap());
        let d = dir.path().join("agent.d");
        std::fs::create_dir(&d).unwrap();
        std::fs::write(
            d.join("10-fleet.toml"),
            "groups = [\"kitchen\"]\n[broker]\nurl = \"mqtts://broker.lan\"\nca_file = \"ca.pem\"\n",
        )
        .unwrap();
        std::fs::write(
            d.join("20-device.toml"),
            "device_id = \"pi-7\"\n[limits]\nqueue = 4\n",
        )
        .unwrap();
        std::fs::write(d.join("README"), "not a drop-in").unwrap();
        let c = Config::load(&p).unwrap();
        assert_eq!(c.device_id, "pi-7");
        assert_eq!(c.groups, ["kitchen"]);
        assert_eq!(c.broker.url, "mqtts://broker.lan");
        assert_eq!(c.broker.keep_alive_s, 30, "kept from the shipped file");
        assert_eq!(c.broker.ca_file, Some(dir.path().join("ca.pem")));
        assert_eq!(c.limits.queue, 4);
        // A bad drop-in is named.
        std::fs::write(d.join("30-bad.toml"), "[broker\n").unwrap();
        let e = kestrel_shared::chain(&Config::load(&p).unwrap_err());
        assert!(e.contains("30-bad.toml"), "{e}");
        std::fs::write(d.join("30-bad.toml"), "bogus = 1\n").unwrap();
        let e = kestrel_shared::chain(&Config::load(&p).unwrap_err());
        assert!(e.contains("bogus") && e.contains("30-bad.toml"), "{e}");
    }
}
