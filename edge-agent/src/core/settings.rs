//! The agent's settings as plain values (`agent.toml` and its drop-ins, read by [`crate::config`]):
//! who the device is, where it keeps models, whom it trusts, what it accepts. The core decides
//! with them; reading and merging the files is the shell's.

use std::path::PathBuf;

use kestrel_runtime::EngineKind;
use kestrel_shared::mqtt::BrokerConfig;
use serde::Deserialize;

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
