//! The trainer binary's fleet commands: `broker`, `publish`, `status`, `infer`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Subcommand;
use kestrel_shared::mqtt::BrokerConfig;
use kestrel_shared::protocol::{DEFAULT_CHUNK_BYTES, DEFAULT_PREFIX, Target};
use kestrel_trainer::fleet::{self, Bundle, Conn};
use kestrel_trainer::rollout::{Plan, RolloutState, driver};

#[derive(clap::Args, Clone)]
pub struct BrokerArgs {
    /// Broker: mqtt://HOST:PORT, or mqtts://HOST:PORT with --ca-file.
    #[arg(long, env = "KESTREL_BROKER", default_value = "mqtt://127.0.0.1:1883")]
    broker: String,
    /// Topic prefix.
    #[arg(long, default_value = DEFAULT_PREFIX)]
    prefix: String,
    #[arg(long)]
    username: Option<String>,
    /// File holding the broker password (first line).
    #[arg(long, requires = "username")]
    password_file: Option<PathBuf>,
    /// CA certificate(s) (PEM) the broker's TLS certificate must chain to.
    #[arg(long)]
    ca_file: Option<PathBuf>,
}

impl BrokerArgs {
    pub fn config(&self) -> BrokerConfig {
        let mut c = BrokerConfig::new(&self.broker);
        c.prefix = self.prefix.clone();
        c.username = self.username.clone();
        c.password_file = self.password_file.clone();
        c.ca_file = self.ca_file.clone();
        c
    }
}

#[derive(Subcommand)]
pub enum FleetCmd {
    /// Run an MQTT broker in-process (rumqttd; nothing kept on disk): the one-machine default.
    Broker {
        #[arg(long, default_value = "127.0.0.1:1883")]
        listen: std::net::SocketAddr,
        /// Largest message payload accepted (must exceed the publisher's chunk size).
        #[arg(long, default_value_t = 1 << 20)]
        max_payload_bytes: usize,
    },
    /// Publish a signed artifact (retained chunks + offer) and make it the desired model of a
    /// device or group. Versions only go up unless --rollback.
    Publish {
        #[command(flatten)]
        broker: BrokerArgs,
        /// Exported artifact directory.
        #[arg(long)]
        artifact: PathBuf,
        /// Secret key from `trainer keygen`; signs the manifest and the desired state.
        #[arg(long)]
        key: PathBuf,
        /// device/<id> or group/<name>.
        #[arg(long)]
        target: Target,
        /// Allow a version older than the target's current desired one.
        #[arg(long)]
        rollback: bool,
        /// Chunk size of the delivery, in bytes.
        #[arg(long, default_value_t = DEFAULT_CHUNK_BYTES)]
        chunk_bytes: usize,
        #[arg(long)]
        json: bool,
    },
    /// Show devices' retained status, or wait for a device to reach a state.
    Status {
        #[command(flatten)]
        broker: BrokerArgs,
        /// One device [default: all].
        #[arg(long)]
        device: Option<String>,
        /// Wait until --device reports this version active and idle (exit 1 on timeout).
        #[arg(long, requires = "device")]
        wait_active: Option<u64>,
        /// Wait until --device reports this error text in last_error (exit 1 on timeout).
        #[arg(long, requires = "device", conflicts_with = "wait_active")]
        wait_error: Option<String>,
        /// Seconds to wait.
        #[arg(long, default_value_t = 120)]
        timeout: u64,
        #[arg(long)]
        json: bool,
    },
    /// Staged rollout of a signed artifact across the fleet (phases, thresholds, abort and roll
    /// back); `trainer rollout status` shows one. A restarted rollout resumes from the broker.
    #[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
    Rollout {
        #[command(subcommand)]
        status: Option<RolloutCmd>,
        #[command(flatten)]
        broker: BrokerArgs,
        /// Exported artifact directory.
        #[arg(long, required = true)]
        artifact: Option<PathBuf>,
        /// Secret key from `trainer keygen`.
        #[arg(long, required = true)]
        key: Option<PathBuf>,
        /// Rollout plan (TOML): [[phases]] with group or percent, success, failure or
        /// max_failures, timeout_s, soak_s; optional name and devices.
        #[arg(long, required = true)]
        fleet: Option<PathBuf>,
        #[arg(long, default_value_t = DEFAULT_CHUNK_BYTES)]
        chunk_bytes: usize,
        /// Print the final state as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Classify images on a device over MQTT: files, or a whole labelled table (--data) with
    /// accuracy and a confusion matrix.
    Infer {
        #[command(flatten)]
        broker: BrokerArgs,
        #[arg(long)]
        device: String,
        /// Image table (ImageFolder dir, CSV or Parquet); its labels are compared with the replies.
        #[arg(long)]
        data: Option<PathBuf>,
        /// Only the images of --data that a run held out for testing (its split.json).
        #[arg(long, requires = "data")]
        held_out: Option<PathBuf>,
        /// Requests outstanding at once.
        #[arg(long, default_value_t = 8)]
        window: usize,
        /// Seconds without any reply before giving up on the rest.
        #[arg(long, default_value_t = 60)]
        timeout: u64,
        /// One JSON line per reply, then one summary line.
        #[arg(long)]
        json: bool,
        images: Vec<PathBuf>,
    },
}

#[derive(Subcommand)]
pub enum RolloutCmd {
    /// A rollout's state: devices per phase and state (from the broker).
    Status {
        #[command(flatten)]
        broker: BrokerArgs,
        /// Rollout name (fleet.toml's name, default <model>-v<version>).
        #[arg(long)]
        name: String,
        /// Keep printing the table as it changes, until the rollout ends.
        #[arg(long)]
        follow: bool,
        #[arg(long)]
        json: bool,
    },
}

pub fn secret_key(path: &Path) -> Result<ed25519_dalek::SigningKey> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(kestrel_shared::signing::secret_key(
        &text,
        &path.display().to_string(),
    )?)
}

pub fn run(cmd: FleetCmd) -> Result<ExitCode> {
    match cmd {
        FleetCmd::Broker {
            listen,
            max_payload_bytes,
        } => {
            eprintln!(
                "kestrel broker (rumqttd) listening on mqtt://{listen}, payloads up to {max_payload_bytes} bytes"
            );
            kestrel_trainer::broker::run(listen, max_payload_bytes)?;
        }
        FleetCmd::Publish {
            broker,
            artifact,
            key,
            target,
            rollback,
            chunk_bytes,
            json,
        } => {
            let sk = secret_key(&key)?;
            let bundle = Bundle::from_dir(&artifact, &sk, chunk_bytes)
                .with_context(|| format!("artifact {}", artifact.display()))?;
            let p = fleet::publish(&broker.config(), &bundle, &sk, &target, rollback, None)?;
            if json {
                println!("{}", serde_json::to_string(&p)?);
            } else {
                println!(
                    "published {} v{} to {} ({} chunks, {:.1} MB{}) in {:.1} s",
                    p.name,
                    p.version,
                    p.target,
                    p.chunks,
                    p.bytes as f64 / 1e6,
                    p.replaced
                        .map(|v| format!(", was v{v}"))
                        .unwrap_or_default(),
                    p.seconds
                );
            }
        }
        FleetCmd::Status {
            broker,
            device,
            wait_active,
            wait_error,
            timeout,
            json,
        } => {
            let cfg = broker.config();
            let list = match (&device, wait_active, &wait_error) {
                (Some(d), Some(v), _) => vec![fleet::wait_status(
                    &cfg,
                    d,
                    Duration::from_secs(timeout),
                    |s| s.active == Some(v) && s.state == "idle",
                )?],
                (Some(d), None, Some(text)) => vec![fleet::wait_status(
                    &cfg,
                    d,
                    Duration::from_secs(timeout),
                    |s| {
                        s.last_error
                            .as_deref()
                            .is_some_and(|e| e.contains(text.as_str()))
                    },
                )?],
                _ => fleet::statuses(&cfg, device.as_deref())?,
            };
            if json {
                for s in &list {
                    println!("{}", serde_json::to_string(s)?);
                }
            } else {
                println!(
                    "{:<20} {:<13} {:<24} {:>7} {:>8} {:>9}  last error",
                    "device", "state", "model", "active", "previous", "p50 ms"
                );
                for s in &list {
                    let v = |x: Option<u64>| x.map_or("-".into(), |v| format!("v{v}"));
                    println!(
                        "{:<20} {:<13} {:<24} {:>7} {:>8} {:>9.1}  {}",
                        s.device,
                        s.state,
                        s.model.as_deref().unwrap_or("-"),
                        v(s.active),
                        v(s.previous),
                        s.latency.p50_ms,
                        s.last_error.as_deref().unwrap_or("")
                    );
                }
            }
        }
        FleetCmd::Rollout {
            status:
                Some(RolloutCmd::Status {
                    broker,
                    name,
                    follow,
                    json,
                }),
            ..
        } => return rollout_status(&broker.config(), &name, follow, json),
        FleetCmd::Rollout {
            status: None,
            broker,
            artifact,
            key,
            fleet: plan_path,
            chunk_bytes,
            json,
        } => {
            let (artifact, key, plan_path) = (
                artifact.expect("required"),
                key.expect("required"),
                plan_path.expect("required"),
            );
            let text = std::fs::read_to_string(&plan_path)
                .with_context(|| format!("reading {}", plan_path.display()))?;
            let plan = Plan::parse(&text, &plan_path.display().to_string())?;
            let sk = secret_key(&key)?;
            let bundle = Bundle::from_dir(&artifact, &sk, chunk_bytes)
                .with_context(|| format!("artifact {}", artifact.display()))?;
            let start = std::time::Instant::now();
            let c = driver::run(&broker.config(), &bundle, &sk, plan, &mut |l| {
                eprintln!("{l}")
            })?;
            if json {
                println!("{}", serde_json::to_string(&c)?);
            } else {
                print!("{}", driver::table(&c));
            }
            eprintln!(
                "rollout {} ended after {:.1} s",
                c.name,
                start.elapsed().as_secs_f64()
            );
            if c.state != RolloutState::Completed {
                return Ok(ExitCode::FAILURE);
            }
        }
        FleetCmd::Infer {
            broker,
            device,
            data,
            held_out,
            window,
            timeout,
            json,
            images,
        } => {
            let mut inputs = Vec::new();
            if let Some(path) = &data {
                inputs = table_images(path, held_out.as_deref())?;
            }
            for p in &images {
                let bytes = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?;
                inputs.push((p.display().to_string(), bytes, None));
            }
            return infer(&broker.config(), &device, inputs, window, timeout, json);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// (name, bytes, true label) of a table's images, or of those a run held out for testing.
fn table_images(
    path: &Path,
    held_out: Option<&Path>,
) -> Result<Vec<(String, Vec<u8>, Option<String>)>> {
    let ds = kestrel_trainer::data::load(path, &Default::default())?;
    let keep: Option<std::collections::HashSet<String>> = match held_out {
        None => None,
        Some(run) => {
            let p = run.join(kestrel_trainer::train::SPLIT_FILE);
            let text =
                std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
            let recs: Vec<kestrel_trainer::train::SplitRecord> =
                serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))?;
            Some(
                recs.into_iter()
                    .filter(|r| r.split == kestrel_trainer::data::Split::Test)
                    .map(|r| r.sha256)
                    .collect(),
            )
        }
    };
    let out: Vec<_> = ds
        .samples
        .into_iter()
        .filter(|s| {
            keep.as_ref()
                .is_none_or(|k| k.contains(&kestrel_shared::protocol::sha256_hex(&s.bytes)))
        })
        .map(|s| (s.id, s.bytes, Some(ds.labels[s.label].clone())))
        .collect();
    if out.is_empty() {
        bail!(
            "{}: no images{}",
            path.display(),
            if held_out.is_some() {
                " held out by that run"
            } else {
                ""
            }
        );
    }
    Ok(out)
}

fn infer(
    cfg: &BrokerConfig,
    device: &str,
    inputs: Vec<(String, Vec<u8>, Option<String>)>,
    window: usize,
    timeout: u64,
    json: bool,
) -> Result<ExitCode> {
    if inputs.is_empty() {
        bail!("no images: pass image files or --data TABLE");
    }
    let truth: Vec<String> = inputs.iter().filter_map(|i| i.2.clone()).collect();
    let inputs: Vec<(String, Vec<u8>)> = inputs.into_iter().map(|(n, b, _)| (n, b)).collect();
    let start = std::time::Instant::now();
    let replies = fleet::infer(cfg, device, &inputs, window, Duration::from_secs(timeout))?;
    let seconds = start.elapsed().as_secs_f64();
    let mut errors = 0;
    let mut latencies = Vec::new();
    for ((name, _), r) in inputs.iter().zip(&replies) {
        match (&r.prediction, &r.error) {
            (Some(p), _) => {
                latencies.push(p.latency_ms);
                if json {
                    println!(
                        "{}",
                        serde_json::json!({"image": name, "request": r.request, "prediction": p})
                    );
                } else {
                    let top = p
                        .top
                        .first()
                        .map_or("-".into(), |c| format!("{} ({:.3})", c.label, c.score));
                    println!("{name}: {top}  [v{} {:.1} ms]", p.version, p.latency_ms);
                }
            }
            (None, e) => {
                errors += 1;
                let e = e.clone().unwrap_or_default();
                if json {
                    println!(
                        "{}",
                        serde_json::json!({"image": name, "request": r.request, "error": e})
                    );
                } else {
                    eprintln!("error: {name}: {e}");
                }
            }
        }
    }
    latencies.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        latencies
            .get(((latencies.len().max(1) - 1) as f64 * p).round() as usize)
            .copied()
            .unwrap_or(0.0)
    };
    let mut summary = serde_json::json!({
        "device": device,
        "requests": inputs.len(),
        "errors": errors,
        "seconds": seconds,
        "device_latency_p50_ms": pct(0.5),
        "device_latency_p95_ms": pct(0.95),
    });
    if !truth.is_empty() && truth.len() == inputs.len() {
        // Labels by name: the model's label order need not match the table's.
        let labels: Vec<String> = {
            let mut l: Vec<String> = truth.clone();
            l.sort();
            l.dedup();
            l
        };
        let idx = |s: &str| labels.iter().position(|l| l == s);
        let (mut pred, mut gold) = (Vec::new(), Vec::new());
        for (r, t) in replies.iter().zip(&truth) {
            if let Some(p) = r.prediction.as_ref().and_then(|p| p.top.first()) {
                pred.push(idx(&p.label).unwrap_or(labels.len()));
                gold.push(idx(t).expect("label from the table"));
            }
        }
        let e = kestrel_trainer::report::evaluate(&pred, &gold, &labels, None);
        if !json {
            println!("{}", e.to_table());
        }
        summary["evaluation"] = serde_json::to_value(&e)?;
    }
    if json {
        println!("{summary}");
    } else {
        println!(
            "{} requests to {device} in {seconds:.1} s: {errors} errors, device latency p50 {:.1} ms, p95 {:.1} ms",
            inputs.len(),
            pct(0.5),
            pct(0.95)
        );
    }
    Ok(if errors > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

fn rollout_status(cfg: &BrokerConfig, name: &str, follow: bool, json: bool) -> Result<ExitCode> {
    let mut conn = Conn::connect(cfg, "rollout-status")?;
    let Some(mut c) = driver::load(&mut conn, name)? else {
        bail!("no rollout named {name} on {}", cfg.url);
    };
    let show = |c: &kestrel_trainer::rollout::Controller| -> Result<()> {
        if json {
            println!("{}", serde_json::to_string(c)?);
        } else {
            println!("{}", driver::table(c));
        }
        Ok(())
    };
    show(&c)?;
    if follow {
        let topic = driver::state_topic(&conn, name);
        conn.subscribe(&topic)?;
        while c.state == RolloutState::Running {
            if let Some((t, p)) = conn.recv(Duration::from_secs(1))?
                && t == topic
                && !p.is_empty()
            {
                let next: kestrel_trainer::rollout::Controller = serde_json::from_slice(&p)?;
                if next != c {
                    c = next;
                    show(&c)?;
                }
            }
        }
    }
    conn.disconnect();
    Ok(ExitCode::SUCCESS)
}
