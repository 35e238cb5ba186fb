//! The core's vocabulary with the shell: what comes in ([`Input`]) and what goes out ([`Effect`]).

use std::sync::Arc;

use ed25519_dalek::VerifyingKey;
use kestrel_shared::manifest::Manifest;
use kestrel_shared::protocol::{ArtifactOffer, Class, InferReply};

use serde::{Deserialize, Serialize};

use super::Lane;

/// A message to publish: its topic, whether the broker keeps it, and its text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub topic: String,
    pub retain: bool,
    pub payload: String,
}

/// What the shell observed or finished.
pub enum Input<M> {
    /// Connected to the broker (a new or resumed session).
    Connected,
    /// A message on a subscribed topic.
    Message { topic: String, payload: Vec<u8> },
    /// The clock's tick (every second).
    Tick,
    /// A chunk written to the lane's store ([`Effect::WriteChunk`]); `ok`: it is on disk.
    ChunkWritten {
        lane: Lane,
        version: u64,
        index: u32,
        ok: bool,
    },
    /// The pieces of an offer the part store holds ([`Effect::CheckParts`]).
    PartsHeld {
        lane: Lane,
        version: u64,
        held: Vec<String>,
    },
    /// The assembled files' signature and hashes checked ([`Effect::Verify`]).
    Verified {
        lane: Lane,
        version: u64,
        result: Result<(), String>,
    },
    /// The verified files moved to the lane's staging slot ([`Effect::Stage`]).
    Staged {
        lane: Lane,
        version: u64,
        result: Result<(), String>,
    },
    /// A staged (or running) version loaded and health-checked ([`Effect::Load`]).
    Loaded {
        lane: Lane,
        version: u64,
        result: Result<Arc<M>, String>,
    },
    /// The atomic switch to `version` is durable ([`Effect::Activate`]).
    Activated { version: u64 },
    /// The active version did not load (at start-up, or finishing an activation after a restart).
    ActiveLoadFailed { version: u64, reason: String },
    /// A request was answered (or failed): the reply to publish (none for fed traffic) and what
    /// the active model did, when it answered.
    Answered {
        reply: Option<InferReply>,
        observed: Option<Observed<M>>,
    },
    /// The inference queue did not take a request ([`Effect::Infer`]): full (`busy`), or its
    /// workers stopped.
    NotQueued { request: String, busy: bool },
    /// The shadow model's turn on an answered request (`None`: skipped).
    ShadowRan {
        version: u64,
        run: Option<ShadowRun>,
    },
    /// A capture went into the capture queue ([`Effect::Capture`]): how many older ones it
    /// evicted, or why it could not be stored.
    CaptureQueued {
        id: String,
        result: Result<u64, String>,
    },
    /// The broker acknowledged the capture in flight: its first send (`first`: its file, `bytes`
    /// long, now waits for a collector's acknowledgement), or a resend
    /// ([`Effect::ResendCapture`]).
    CaptureDelivered { id: String, bytes: u64, first: bool },
    /// A capture to send again ([`Effect::ResendCapture`]) has no file any more.
    CaptureGone { id: String },
}

/// What the active model did on one request.
pub struct Observed<M> {
    pub request: String,
    /// The model that answered.
    pub model: Arc<M>,
    pub top: Vec<Class>,
    /// The request's image, when `[capture]` may keep it.
    pub image: Option<Vec<u8>>,
    pub logits: Vec<f32>,
    pub features: Option<Vec<f32>>,
    pub latency_ms: f64,
}

/// Both models on one request: (logits, latency) of the active model and of the shadow.
pub struct ShadowRun {
    pub active: (Vec<f32>, f64),
    pub shadow: (Vec<f32>, f64),
}

/// How a message goes out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum How {
    /// QoS 1 through the on-disk outbox, never dropped (events).
    Durable,
    /// Retained, only the newest per topic kept while offline (status, quality, online).
    Latest,
    /// QoS 0 from memory, within the replies' budget (inference replies).
    Reply,
}

/// What the shell must do.
pub enum Effect<M> {
    Subscribe(String),
    Unsubscribe(String),
    /// Unsubscribe and subscribe again, so the broker resends the topic's retained message.
    Resubscribe(String),
    Publish(How, Message),
    /// Publish the status (built by [`Core::status`] when it goes out).
    Status,
    /// Write the lane's journal ([`Core::journal`]) before the effects after it.
    Journal(Lane),
    /// Save the newest verified key list (its JSON).
    SaveKeys(Vec<u8>),
    /// Save the capture counters and the last hour's capture times (their JSON).
    SaveCaptureState(Vec<u8>),
    /// Which of an offer's pieces the part store holds, each checked against its sha256 (one
    /// that does not match is deleted); answer [`Input::PartsHeld`].
    CheckParts {
        lane: Lane,
        version: u64,
        pieces: Vec<String>,
    },
    /// Keep a checked offer beside its download (a restart reads it back).
    WriteOffer {
        lane: Lane,
        version: u64,
        payload: Vec<u8>,
    },
    /// Write a chunk that matched its sha256; answer [`Input::ChunkWritten`].
    WriteChunk {
        lane: Lane,
        version: u64,
        index: u32,
        payload: Vec<u8>,
    },
    /// Remove what was downloaded for a refused offer.
    RemoveDownload {
        lane: Lane,
        version: u64,
    },
    /// Assemble the chunks and check the signature and file hashes with `keys`; answer
    /// [`Input::Verified`].
    Verify {
        lane: Lane,
        version: u64,
        offer: Option<(ArtifactOffer, Manifest)>,
        keys: Vec<VerifyingKey>,
    },
    /// Move the verified files to the staging slot; answer [`Input::Staged`].
    Stage {
        lane: Lane,
        version: u64,
    },
    /// Load and health-check the version (its golden samples); answer [`Input::Loaded`].
    Load {
        lane: Lane,
        version: u64,
    },
    /// Switch `active` to `version` atomically, then serve `model` (none: load it again);
    /// answer [`Input::Activated`].
    Activate {
        version: u64,
        model: Option<Arc<M>>,
    },
    /// Load the active version for serving (at start-up).
    LoadActive {
        version: u64,
    },
    /// Delete what the lane's store holds of `version` (downloaded, staged or installed).
    Discard {
        lane: Lane,
        version: u64,
    },
    /// Run `model` beside the active one on every `every`-th request (none: stop the shadow).
    RunShadow(Option<(Arc<M>, u64)>),
    /// Queue a request for the inference workers; answer [`Input::NotQueued`] if it is not taken.
    Infer {
        request: String,
        bytes: Vec<u8>,
    },
    /// Keep a capture in the capture queue within `max_disk_bytes`; answer
    /// [`Input::CaptureQueued`], and [`Input::CaptureDelivered`] when the broker has it.
    Capture {
        id: String,
        message: Message,
        max_disk_bytes: u64,
    },
    /// Send capture `id` again from its file; answer [`Input::CaptureGone`] if there is none,
    /// and [`Input::CaptureDelivered`] when the broker has it.
    ResendCapture {
        id: String,
    },
    /// Delete capture `id` wherever it waits (a collector stored it, or it is given up).
    ForgetCapture {
        id: String,
    },
}
