//! `agent.toml`: who the device is, how it reaches the broker, whom it trusts, where it keeps
//! models and what it accepts; then the drop-ins of `agent.d/` beside it, each over the one
//! before ([`drop_ins`]). Relative paths are resolved against the directory of `agent.toml`.

use std::path::{Path, PathBuf};

use kestrel_runtime::EngineKind;
use kestrel_shared::error::Cause;
use kestrel_shared::mqtt::BrokerConfig;
use kestrel_shared::protocol::check_name;
use serde::Deserialize;

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

fn default_max_artifact() -> u64 {
    64 << 20
}
fn default_max_image() -> usize {
    kestrel_shared::mqtt::MAX_PAYLOAD_BYTES
}
fn default_queue() -> usize {
    16
}
fn default_max_outbox() -> u64 {
    16 << 20
}
fn default_download_stall() -> u64 {
    20
}
fn default_threads() -> usize {
    1
}
fn default_top_k() -> usize {
    3
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Largest artifact (sum of the device files) accepted.
    #[serde(default = "default_max_artifact")]
    pub max_artifact_bytes: u64,
    /// Largest image accepted in an inference request.
    #[serde(default = "default_max_image")]
    pub max_image_bytes: usize,
    /// Inference requests waiting at most; more get a "busy" error reply.
    #[serde(default = "default_queue")]
    pub queue: usize,
    /// Memory budget of the inference replies waiting for the broker (`crate::replies`): beyond
    /// it the oldest are dropped; the device's events (the on-disk outbox) are never dropped.
    #[serde(default = "default_max_outbox")]
    pub max_outbox_bytes: u64,
    /// Decode BMP, GIF and TIFF requests too (default: JPEG and PNG only). Images are decoded
    /// within a device's bounds either way (4096 pixels a side, 48 MiB).
    #[serde(default)]
    pub any_image_format: bool,
    /// Seconds without a new chunk after which a download asks again for the chunks it misses
    /// (lost on the way, not yet published, or dropped when the store was full).
    #[serde(default = "default_download_stall")]
    pub download_stall_s: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_artifact_bytes: default_max_artifact(),
            max_image_bytes: default_max_image(),
            queue: default_queue(),
            max_outbox_bytes: default_max_outbox(),
            any_image_format: false,
            download_stall_s: default_download_stall(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Inference {
    #[serde(default = "default_threads")]
    pub threads: usize,
    #[serde(default = "default_top_k")]
    pub top_k: usize,
    /// `tract` (default, built in) or `ort` (ONNX Runtime, loaded at run time from
    /// `ort_library`; needs an agent built with the cargo feature `ort`). The golden-sample
    /// health check runs on the engine chosen here.
    #[serde(default = "default_engine")]
    pub engine: EngineKind,
    /// The ONNX Runtime library (`libonnxruntime.so`) for `engine = "ort"`; default:
    /// `ORT_DYLIB_PATH`, else `$KESTREL_HOME/onnxruntime/libonnxruntime.so`.
    #[serde(default)]
    pub ort_library: Option<PathBuf>,
}

fn default_engine() -> EngineKind {
    EngineKind::Tract
}

impl Default for Inference {
    fn default() -> Self {
        Self {
            threads: default_threads(),
            top_k: default_top_k(),
            engine: default_engine(),
            ort_library: None,
        }
    }
}

fn default_window() -> usize {
    100
}
fn default_period() -> u64 {
    10
}
fn default_every() -> u64 {
    1
}
fn yes() -> bool {
    true
}

/// Quality telemetry over live requests (`[quality]`) and shadow models' share of the CPU.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quality {
    /// Off: no window, no `P/devices/<id>/quality`, no shadow model.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Requests in the sliding window (and in each judged window).
    #[serde(default = "default_window")]
    pub window: usize,
    /// Seconds between quality reports (a report goes out only when requests came in).
    #[serde(default = "default_period")]
    pub period_s: u64,
    /// A shadow model runs on every k-th request, and never while requests are waiting.
    #[serde(default = "default_every")]
    pub shadow_every: u64,
}

impl Default for Quality {
    fn default() -> Self {
        Self {
            enabled: true,
            window: default_window(),
            period_s: default_period(),
            shadow_every: default_every(),
        }
    }
}

/// Which inputs `[capture]` keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CapturePolicy {
    /// Top-1 score below `min_confidence`, or top-1 minus top-2 below `min_margin`.
    LowConfidence,
    /// A share `rate` of all requests.
    Random,
    /// Every request while the last judged quality window is flagged as drifted.
    Drift,
}

fn default_policy() -> CapturePolicy {
    CapturePolicy::LowConfidence
}
fn default_min_confidence() -> f64 {
    0.5
}
fn default_rate() -> f64 {
    0.01
}
fn default_per_hour() -> u64 {
    60
}
fn default_disk() -> u64 {
    64 << 20
}
fn default_true() -> bool {
    true
}
fn default_resend_after() -> u64 {
    600
}
fn default_resend_max() -> u64 {
    3600
}
fn default_max_resends() -> u32 {
    24
}

/// Input capture (`[capture]`, off unless `enabled = true`): which answered requests keep their
/// image for the next training round, and the limits on what is stored and sent.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Capture {
    #[serde(default)]
    pub enabled: bool,
    #[serde(default = "default_policy")]
    pub policy: CapturePolicy,
    /// low-confidence: keep inputs whose top-1 score is below this.
    #[serde(default = "default_min_confidence")]
    pub min_confidence: f64,
    /// low-confidence: also keep inputs whose top-1 and top-2 scores are closer than this (0: off).
    #[serde(default)]
    pub min_margin: f64,
    /// random: the share of requests kept.
    #[serde(default = "default_rate")]
    pub rate: f64,
    /// At most this many captures in any hour (across restarts).
    #[serde(default = "default_per_hour")]
    pub max_per_hour: u64,
    /// Captures not yet acknowledged by a collector (waiting to be sent, or sent and waiting
    /// for the acknowledgement) take at most this many bytes on disk; the oldest go first.
    #[serde(default = "default_disk")]
    pub max_disk_bytes: u64,
    /// Upload cap for captures in bytes per second (0: none); other messages are not held back.
    #[serde(default)]
    pub max_upload_bytes_per_s: u64,
    /// Keep each capture until a collector acknowledges having stored it
    /// (`P/devices/<id>/capture-ack`), sending it again while it does not; false: delete it
    /// when the broker acknowledges it (for a collector older than acknowledgements).
    #[serde(default = "default_true")]
    pub collector_acks: bool,
    /// Seconds after a send without a collector's acknowledgement before the capture is sent
    /// again; the wait doubles after each resend, up to `resend_max_s`.
    #[serde(default = "default_resend_after")]
    pub resend_after_s: u64,
    #[serde(default = "default_resend_max")]
    pub resend_max_s: u64,
    /// Resends of a capture no collector acknowledges before it is deleted (and counted as
    /// `unacked_dropped`): about a day with the default waits.
    #[serde(default = "default_max_resends")]
    pub max_resends: u32,
}

impl Default for Capture {
    fn default() -> Self {
        Self {
            enabled: false,
            policy: default_policy(),
            min_confidence: default_min_confidence(),
            min_margin: 0.0,
            rate: default_rate(),
            max_per_hour: default_per_hour(),
            max_disk_bytes: default_disk(),
            max_upload_bytes_per_s: 0,
            collector_acks: true,
            resend_after_s: default_resend_after(),
            resend_max_s: default_resend_max(),
            max_resends: default_max_resends(),
        }
    }
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

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Default: the host name (so one SD-card image serves a fleet).
    #[serde(default)]
    pub device_id: String,
    #[serde(default)]
    pub groups: Vec<String>,
    /// Model store: versions/, active and previous links, downloads, journal, outbox.
    pub store: PathBuf,
    /// Public keys (`trainer keygen`'s kestrel.pub) whose signatures are accepted; with
    /// `trusted_root`, only until the first key list signed by the root arrives.
    pub trusted_keys: Vec<PathBuf>,
    /// The fleet's root public key (`trainer keygen --root`'s root.pub): the device then follows
    /// the root-signed key lists on `P/keys` (rotation and revocation of publishing keys).
    #[serde(default)]
    pub trusted_root: Option<PathBuf>,
    pub broker: BrokerConfig,
    #[serde(default)]
    pub limits: Limits,
    #[serde(default)]
    pub inference: Inference,
    #[serde(default)]
    pub quality: Quality,
    #[serde(default)]
    pub capture: Capture,
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
