//! From a configuration to a running agent and back: open the store, journal and MQTT client,
//! resume a journaled update, serve until a signal, stop cleanly; and the inference worker thread.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kestrel_runtime::EngineKind;
use kestrel_runtime::artifact::LoadedModel;
use kestrel_shared::manifest::{MANIFEST_FILE, Manifest};
use kestrel_shared::protocol::{ArtifactOffer, InferReply, sha256_hex};
use kestrel_shared::topics::Topics;
use rumqttc::{AsyncClient, Event as MqttEvent, LastWill, QoS};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

use super::{Agent, CaptureQueue, InferJob, Inputs, KEYS_FILE};
use crate::config::Config;
use crate::core::Message;
use crate::core::capture::CaptureState;
use crate::core::trust::Trust;
use crate::core::update::Updater;
use crate::core::{Core, Input, Observed, Saved, ShadowRun};
use crate::models::{ModelCache, ModelSlot, ShadowModel};
use crate::outbox::Outbox;
use crate::replies::Replies;
use crate::store::Store;

/// How `[inference] threads` cores are used: (requests run at once, threads each request's
/// engine gets). ONNX Runtime, and tract built with its multithreaded matrix products
/// (`multicore`), run one request at a time on every thread; the default tract build runs
/// `threads` requests side by side, one core each (the same cores without the 2.3 MB of
/// per-kernel thread-pool code that `multicore` adds to the binary).
pub fn inference_plan(engine: EngineKind, threads: usize) -> (usize, usize) {
    let threads = threads.max(1);
    if engine == EngineKind::Tract && !cfg!(feature = "multicore") {
        (threads, 1)
    } else {
        (1, threads)
    }
}

/// The bounded queue of inference requests, with how many wait in it (a shadow model runs only
/// when none do).
#[derive(Clone)]
pub(super) struct Jobs {
    tx: SyncSender<InferJob>,
    waiting: Arc<AtomicUsize>,
}

impl Jobs {
    pub(super) fn try_send(&self, job: InferJob) -> Result<(), TrySendError<InferJob>> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        self.tx.try_send(job).inspect_err(|_| {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
        })
    }
}

/// What an inference worker works with.
struct Worker {
    rx: Arc<Mutex<Receiver<InferJob>>>,
    waiting: Arc<AtomicUsize>,
    model: ModelSlot<LoadedModel>,
    shadow: ModelSlot<ShadowModel>,
    done: Inputs,
    device: String,
    top_k: usize,
    /// `[capture]` is on: observations carry the image.
    capture: bool,
}

impl Worker {
    /// Takes jobs from the queue (shared by the workers) and answers through `done`; then, on
    /// its turn and when no request waits, runs the shadow model on the same image.
    fn run(self) {
        loop {
            let next = self.rx.lock().expect("lock").recv();
            let Ok(job) = next else { return };
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            let current = self.model.read().expect("lock").clone();
            let name = format!("request {}", job.request);
            let answer = match &current {
                None => Err("no active model".to_string()),
                Some(m) => m
                    .infer(&job.bytes, &name, self.top_k)
                    .map_err(|e| kestrel_shared::chain(&e)),
            };
            let observed = answer
                .as_ref()
                .ok()
                .zip(current)
                .map(|(i, model)| Observed {
                    request: job.request.clone(),
                    model,
                    top: i.prediction.top.clone(),
                    image: self.capture.then(|| job.bytes.clone()),
                    logits: i.logits.clone(),
                    features: i.features.clone(),
                    latency_ms: i.prediction.latency_ms,
                });
            // The active model's answer, kept for a shadow model's comparison only when one runs.
            let shadow = self.shadow.read().expect("lock").clone();
            let active = observed
                .as_ref()
                .filter(|_| shadow.is_some())
                .map(|o| (o.logits.clone(), o.latency_ms));
            let (prediction, error) = match answer {
                Ok(i) => (Some(i.prediction), None),
                Err(e) => (None, Some(e)),
            };
            let reply = job.reply.then(|| InferReply {
                request: job.request,
                device: self.device.clone(),
                prediction,
                error,
            });
            if self.done.send(Input::Answered { reply, observed }).is_err() {
                return;
            }
            if let (Some(s), Some(active)) = (shadow, active) {
                self.shadow_turn(&s, &job.bytes, &name, active);
            }
        }
    }

    fn shadow_turn(&self, s: &ShadowModel, bytes: &[u8], name: &str, active: (Vec<f32>, f64)) {
        let turn = s.turn.fetch_add(1, Ordering::Relaxed);
        let waiting = self.waiting.load(Ordering::SeqCst);
        let run = crate::core::shadow_runs_on(turn, s.every, waiting)
            .then(|| s.model.infer(bytes, name, 1).ok())
            .flatten()
            .map(|i| ShadowRun {
                active,
                shadow: (i.logits, i.prediction.latency_ms),
            });
        let version = s.model.manifest.version;
        let _ = self.done.send(Input::ShadowRan { version, run });
    }
}

/// Traffic for a device from a directory of images (`edge-agent run --feed`): once the device
/// has an active model, the images in an order of the device's own, round and round (or once),
/// `rate` requests a second, answered and observed as MQTT requests are but not published. A
/// request that finds the queue full is dropped (with `once`, it waits instead).
#[derive(Debug, Clone)]
pub struct Feed {
    pub dir: PathBuf,
    pub rate: f64,
    /// Each image once, then no more traffic.
    pub once: bool,
    /// A group the fed devices join (so a rollout can pick them by it).
    pub group: Option<String>,
}

impl Feed {
    /// The images of the directory, read once (files that are not images are refused by the
    /// model like any bad request).
    pub fn images(&self) -> Result<Vec<Vec<u8>>> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(&self.dir)
            .with_context(|| format!("--feed {}", self.dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file())
            .collect();
        files.sort();
        anyhow::ensure!(
            !files.is_empty(),
            "--feed {}: no files in it",
            self.dir.display()
        );
        files
            .into_iter()
            .map(|p| std::fs::read(&p).with_context(|| format!("{}", p.display())))
            .collect()
    }

    fn spawn(&self, device: &str, jobs: Jobs, model: ModelSlot<LoadedModel>) -> Result<()> {
        let mut images = self.images()?;
        // A stable order of the device's own (a seeded Fisher-Yates).
        let mut state = u64::from_str_radix(&sha256_hex(device.as_bytes())[..16], 16).unwrap_or(1);
        for i in (1..images.len()).rev() {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            images.swap(i, (state >> 33) as usize % (i + 1));
        }
        let period = Duration::from_secs_f64(1.0 / self.rate.max(1e-3));
        let count = if self.once { images.len() } else { usize::MAX };
        std::thread::spawn(move || {
            while model.read().expect("lock").is_none() {
                std::thread::sleep(Duration::from_millis(100));
            }
            let mut next = Instant::now();
            for (n, bytes) in images.iter().cycle().take(count).enumerate() {
                next += period;
                std::thread::sleep(next.saturating_duration_since(Instant::now()));
                let mut job = InferJob {
                    request: format!("feed-{n}"),
                    bytes: bytes.clone(),
                    reply: false,
                };
                loop {
                    match jobs.try_send(job) {
                        Err(TrySendError::Full(j)) if count == images.len() => {
                            job = j;
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        Err(TrySendError::Disconnected(_)) => return,
                        _ => break,
                    }
                }
            }
        });
        Ok(())
    }
}

/// Starts the inference workers over a bounded queue of `[limits] queue` requests.
fn spawn_workers(
    cfg: &Config,
    model: &ModelSlot<LoadedModel>,
    shadow: &ModelSlot<ShadowModel>,
    inputs: &Inputs,
) -> Jobs {
    let (tx, rx) = std::sync::mpsc::sync_channel(cfg.limits.queue.max(1));
    let jobs = Jobs {
        tx,
        waiting: Arc::new(AtomicUsize::new(0)),
    };
    let rx = Arc::new(Mutex::new(rx));
    let (workers, _) = inference_plan(cfg.inference.engine, cfg.inference.threads);
    for _ in 0..workers {
        let w = Worker {
            rx: rx.clone(),
            waiting: jobs.waiting.clone(),
            model: model.clone(),
            shadow: shadow.clone(),
            done: inputs.clone(),
            device: cfg.device_id.clone(),
            top_k: cfg.inference.top_k,
            capture: cfg.capture.enabled,
        };
        std::thread::spawn(move || w.run());
    }
    jobs
}

/// Virtual devices in one process (`edge-agent run --simulate N`).
#[derive(Debug, Clone, Copy)]
pub struct Simulation {
    pub devices: usize,
    /// One file per part on disk, hard-linked into each device's part store.
    pub share_part_files: bool,
}

/// `edge-agent run`: connects, resumes any journaled update and serves until SIGINT/SIGTERM.
/// With `simulate`, runs its `devices` virtual devices `<device_id>-000`... in this process
/// (each with its own connection, store `<store>/<id>` and update machine; one model cache).
/// `feeds`: traffic from image directories, one per device in turn (device `i` gets feed
/// `i % feeds.len()` and joins its group, if it names one).
pub fn run(
    cfg: Config,
    watch: Option<PathBuf>,
    simulate: Option<Simulation>,
    feeds: &[Feed],
) -> Result<()> {
    if simulate.is_none() && feeds.len() > 1 {
        anyhow::bail!("one device takes one --feed; several need --simulate N");
    }
    kestrel_shared::time::process_started_ms(); // the statuses' `started`: now
    for f in feeds {
        f.images()?; // a bad directory is named before anything starts
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    if cfg.inference.engine == EngineKind::Ort {
        if let Some(lib) = &cfg.inference.ort_library {
            kestrel_runtime::engine::set_ort_library(lib.clone());
        }
        kestrel_runtime::engine::ort_ready().context("[inference] engine = \"ort\"")?;
    }
    let (_, engine_threads) = inference_plan(cfg.inference.engine, cfg.inference.threads);
    let models = Arc::new(ModelCache::new(
        cfg.limits.max_artifact_bytes,
        cfg.inference.engine,
        engine_threads,
        kestrel_shared::ImageLimits {
            jpeg_png_only: !cfg.limits.any_image_format,
            ..kestrel_shared::ImageLimits::device(cfg.limits.max_image_bytes as u64)
        },
    ));
    rt.block_on(async move {
        let Some(Simulation {
            devices: n,
            share_part_files,
        }) = simulate
        else {
            return run_device(cfg, watch, models, feeds.first().cloned(), None).await;
        };
        let shared = share_part_files.then(|| cfg.store.join("shared-parts"));
        let mut tasks = Vec::new();
        for i in 0..n {
            let mut c = cfg.clone();
            c.device_id = format!("{}-{i:03}", cfg.device_id);
            kestrel_shared::protocol::check_name(&c.device_id)?;
            c.store = cfg.store.join(&c.device_id);
            let feed = (!feeds.is_empty()).then(|| feeds[i % feeds.len()].clone());
            if let Some(g) = feed.as_ref().and_then(|f| f.group.clone()) {
                kestrel_shared::protocol::check_name(&g)?;
                c.groups.push(g);
            }
            let device = run_device(c, None, models.clone(), feed, shared.clone());
            tasks.push(tokio::spawn(device));
        }
        for t in tasks {
            t.await??;
        }
        Ok(())
    })
}

/// MQTT events (or connection errors) as the event loop's task reports them.
type MqttRx = mpsc::UnboundedReceiver<Result<MqttEvent, rumqttc::ConnectionError>>;

/// Inputs from the other threads, as the serving loop takes them.
type InputsRx = mpsc::UnboundedReceiver<Input<LoadedModel>>;

async fn run_device(
    cfg: Config,
    watch: Option<PathBuf>,
    models: Arc<ModelCache>,
    feed: Option<Feed>,
    shared_parts: Option<PathBuf>,
) -> Result<()> {
    let (mut agent, eventloop, mut inputs) = Agent::open(cfg, watch, models, feed, shared_parts)?;
    agent.resume().await?;
    let mut mqtt_rx = spawn_event_loop(eventloop);
    agent.serve(&mut mqtt_rx, &mut inputs).await?;
    agent.stop(&mut mqtt_rx).await
}

/// A JSON file of the store, or `None` when there is none.
fn read_json<T: DeserializeOwned>(path: &std::path::Path) -> Result<Option<T>> {
    match std::fs::read(path) {
        Ok(b) => Ok(Some(
            serde_json::from_slice(&b).with_context(|| format!("{}", path.display()))?,
        )),
        Err(_) => Ok(None),
    }
}

/// What the core starts from: the journals (a broken install journal is an error; a broken
/// shadow journal starts the shadow over), the offers of the downloads in progress, the trusted
/// keys, the capture state.
fn saved(cfg: &Config, store: &Store, shadow_store: &Store) -> Result<Saved> {
    let journal: crate::core::Journal =
        read_json(&store.root().join("state.json"))?.unwrap_or_default();
    let shadow: crate::core::ShadowJournal = read_json(&shadow_store.root().join("state.json"))
        .ok()
        .flatten()
        .unwrap_or_default();
    let offer = saved_offer(store, journal.updater.as_ref());
    let shadow_offer = saved_offer(shadow_store, shadow.updater.as_ref());
    let capture = match cfg.capture.enabled {
        true => {
            let dir = cfg.store.join("captures");
            let mut state: CaptureState = read_json(&dir.join("state.json"))?.unwrap_or_default();
            let on_disk = super::captures::unacked_on_disk(&dir);
            state.reconcile(&on_disk, kestrel_shared::time::now_ms());
            let seed = sha256_hex(
                format!("{}{}", cfg.device_id, kestrel_shared::time::now_ms()).as_bytes(),
            );
            Some((state, u64::from_str_radix(&seed[..16], 16).unwrap_or(1)))
        }
        false => None,
    };
    Ok(Saved {
        trust: saved_trust(cfg)?,
        journal,
        offer,
        installed: (store.active(), store.previous()),
        active_manifest: store.active().and_then(|v| {
            let m = std::fs::read(store.version_dir(v).join(MANIFEST_FILE)).ok()?;
            Some(sha256_hex(&m))
        }),
        shadow,
        shadow_offer,
        capture,
    })
}

/// The trusted keys: the configured ones, or the newest root-signed key list in the store.
fn saved_trust(cfg: &Config) -> Result<Trust> {
    let path = cfg.store.join(KEYS_FILE);
    let saved = read_json(&path)?;
    Trust::new(cfg.root_key()?, cfg.keys()?, saved)
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// The accepted offer of the download in progress, as saved beside it.
fn saved_offer(store: &Store, updater: Option<&Updater>) -> Option<(ArtifactOffer, Manifest)> {
    updater?.phase.target().and_then(|v| {
        let p = store.offer_path(v);
        let o: ArtifactOffer = serde_json::from_slice(&std::fs::read(p).ok()?).ok()?;
        let m = serde_json::from_str(&o.manifest).ok()?;
        Some((o, m))
    })
}

/// The event loop runs in a task of its own and is never cancelled mid-poll (a cancelled poll
/// can lose an acknowledgement; brokers drop clients whose acknowledgements come out of order).
fn spawn_event_loop(mut eventloop: rumqttc::EventLoop) -> MqttRx {
    let (mqtt_tx, mqtt_rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut backoff = Duration::from_millis(200);
        loop {
            let ev = eventloop.poll().await;
            let failed = ev.is_err();
            if mqtt_tx.send(ev).is_err() {
                return;
            }
            if failed {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            } else {
                backoff = Duration::from_millis(200);
            }
        }
    });
    mqtt_rx
}

impl Agent {
    /// Opens the store, the journal and the outbox, sets up the MQTT client (its event loop is
    /// returned, not yet polled) and starts the inference worker and the watched directory.
    fn open(
        cfg: Config,
        watch: Option<PathBuf>,
        models: Arc<ModelCache>,
        feed: Option<Feed>,
        shared_parts: Option<PathBuf>,
    ) -> Result<(Self, rumqttc::EventLoop, InputsRx)> {
        let parts = cfg.store.join("parts");
        let open = |dir: PathBuf| {
            Store::open(&dir, &parts)
                .map(|s| s.sharing_part_files(shared_parts.clone()))
                .with_context(|| format!("store {}", dir.display()))
        };
        let store = open(cfg.store.clone())?;
        let shadow_store = open(cfg.store.join("shadow"))?;
        let core = Core::new(
            cfg.clone(),
            saved(&cfg, &store, &shadow_store)?,
            super::clock(),
        );
        let topics = Topics::new(&cfg.broker.prefix);
        let mut opts = cfg
            .broker
            .options(&format!("kestrel-agent-{}", cfg.device_id), false)?;
        opts.set_last_will(LastWill::new(
            topics.online(&cfg.device_id),
            "0",
            QoS::AtLeastOnce,
            true,
        ));
        let (client, mut eventloop) = AsyncClient::new(opts, 256);
        kestrel_shared::mqtt::no_delay(&mut eventloop);
        let (inputs, inputs_rx) = mpsc::unbounded_channel();
        let (model, shadow): (ModelSlot<LoadedModel>, ModelSlot<ShadowModel>) = Default::default();
        let jobs = spawn_workers(&cfg, &model, &shadow, &inputs);
        if let Some(f) = feed {
            f.spawn(&cfg.device_id, jobs.clone(), model.clone())?;
        }
        if let Some(dir) = watch {
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("watch dir {}", dir.display()))?;
            let (model, k) = (model.clone(), cfg.inference.top_k);
            std::thread::spawn(move || crate::models::watch_dir(dir, model, k));
        }
        let outbox = Outbox::open(&cfg.store.join("outbox"))?;
        let captures = match cfg.capture.enabled {
            true => {
                let dir = cfg.store.join("captures");
                let queue = CaptureQueue::open(&dir)
                    .with_context(|| format!("captures {}", dir.display()))?;
                Some(queue)
            }
            false => None,
        };
        let agent = Agent {
            topics,
            core,
            store,
            shadow_store,
            model,
            shadow,
            models,
            outbox,
            replies: Replies::default(),
            captures,
            client,
            inputs,
            jobs,
            connected: false,
            pause: super::hooks::Pause::from_env(),
            cfg,
        };
        Ok((agent, eventloop, inputs_rx))
    }

    /// Loads the active model and continues a journaled update and shadow (re-fetch missing
    /// chunks, re-verify, redo activation).
    async fn resume(&mut self) -> Result<()> {
        let effects = self.core.resume(super::clock());
        self.carry_out(effects).await
    }

    /// Handles MQTT events, finished work and the clock until SIGINT/SIGTERM.
    async fn serve(&mut self, mqtt_rx: &mut MqttRx, inputs: &mut InputsRx) -> Result<()> {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let mut quiet = false;
        // Under systemd (Type=notify): ready once serving, and a watchdog ping from this loop's
        // tick, so a loop that stops turning stops pinging and WatchdogSec= restarts the agent.
        // Without NOTIFY_SOCKET both do nothing.
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
        let watchdog = sd_notify::watchdog_enabled(false, &mut 0);
        loop {
            self.flush().await;
            tokio::select! {
                Some(ev) = mqtt_rx.recv() => match ev {
                    Ok(ev) => {
                        quiet = false;
                        self.on_mqtt(ev).await?;
                    }
                    Err(e) => {
                        if !quiet {
                            // The first failure after a success (or at start); retries stay quiet.
                            tracing::warn!(
                                "{}: broker {}: {e}; retrying (up to every 5 s), serving and journaling meanwhile",
                                self.cfg.device_id, self.cfg.broker.url
                            );
                            quiet = true;
                        }
                        self.connected = false;
                    }
                },
                Some(input) = inputs.recv() => self.apply(input).await?,
                _ = tick.tick() => {
                    if watchdog {
                        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Watchdog]);
                    }
                    self.apply(Input::Tick).await?
                }
                _ = tokio::signal::ctrl_c() => break,
                _ = term.recv() => break,
            }
        }
        Ok(())
    }

    /// Marks the device offline (retained) and delivers the outbox, for up to 3 s.
    async fn stop(&mut self, mqtt_rx: &mut MqttRx) -> Result<()> {
        tracing::info!("{}: stopping", self.cfg.device_id);
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
        let deadline = Instant::now() + Duration::from_secs(3);
        self.outbox.push_latest(Message {
            topic: self.topics.online(&self.cfg.device_id),
            retain: true,
            payload: "0".into(),
        });
        while self.connected && !self.outbox.is_idle() && Instant::now() < deadline {
            self.flush().await;
            match tokio::time::timeout(Duration::from_millis(200), mqtt_rx.recv()).await {
                Ok(Some(Ok(ev))) => self.on_mqtt(ev).await?,
                Ok(Some(Err(_)) | None) => break,
                Err(_) => {}
            }
        }
        // No DISCONNECT: the socket closes with the event loop (its will says "0" as well).
        // A DISCONNECT makes rumqttd 0.20 forget the connection while its network task still
        // runs, which can drop another client or stop its router (`kestrel_fleet::conn`'s
        // `Events::close` says how).
        Ok(())
    }
}
