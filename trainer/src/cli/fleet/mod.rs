//! The trainer binary's fleet commands, one file per command: `broker`, `publish`, `keys`,
//! `status`, `rollout`, `infer`, `collect`, `console`. Each has its `Args`, one `run` and its output formatting; the operations
//! themselves are in the `kestrel_fleet` crate (the broker in the `kestrel-broker` binary).

pub mod broker;
pub mod collect;
pub mod console;
pub mod infer;
pub mod keys;
pub mod prune;
pub mod publish;
pub mod rollout;
pub mod status;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::track::{
    self,
    registry::{self, ModelUri},
};
use anyhow::{Context, Result, bail};

use super::args::MlflowArgs;
use clap::Subcommand;
use kestrel_shared::mqtt::BrokerConfig;
use kestrel_shared::topics::DEFAULT_PREFIX;

/// Which artifact to deliver: a directory, or a version in the MLflow model registry.
#[derive(clap::Args, Clone)]
pub struct ArtifactArgs {
    /// Exported artifact directory, or a version in the MLflow model registry (also as --model):
    /// models:/NAME@ALIAS or models:/NAME/VERSION, fetched from the --mlflow server into
    /// $KESTREL_HOME/registry and checked against its manifest; devices then report that version.
    #[arg(
        long,
        alias = "model",
        value_name = "ART_DIR|models:/NAME@ALIAS",
        required = true
    )]
    artifact: Option<String>,
    #[command(flatten)]
    server: MlflowArgs,
}

impl ArtifactArgs {
    /// The artifact directory (a registered version fetched first).
    pub fn dir(&self) -> Result<PathBuf> {
        let a = self.artifact.as_deref().expect("clap requires --artifact");
        if !a.starts_with("models:/") {
            return Ok(PathBuf::from(a));
        }
        let uri: ModelUri = a.parse().map_err(anyhow::Error::msg)?;
        let Some(server) = &self.server.mlflow else {
            bail!("{uri} needs an MLflow server: --mlflow URI or MLFLOW_TRACKING_URI");
        };
        let client = track::Client::new(server)?;
        let cache = kestrel_models::engine::kestrel_home().join("registry");
        let f = registry::fetch(&client, &uri, &cache)
            .with_context(|| format!("fetching {uri} from {server}"))?;
        tracing::info!(
            "{uri}: version {} ({}){}",
            f.version.version,
            f.dir.display(),
            if f.cached { ", cached" } else { "" }
        );
        Ok(f.dir)
    }
}

/// How to reach the broker: the flags every MQTT command shares.
#[derive(clap::Args, Clone)]
pub struct BrokerArgs {
    /// Broker: mqtt://HOST:PORT, or mqtts://HOST:PORT with --ca-file.
    #[arg(long, env = "KESTREL_BROKER", default_value = "mqtt://127.0.0.1:1883")]
    broker: String,
    /// Topic prefix.
    #[arg(long, default_value = DEFAULT_PREFIX)]
    prefix: String,
    /// User name to log in to the broker with (with --password-file).
    #[arg(long)]
    username: Option<String>,
    /// File holding the broker password (first line); needs --username.
    #[arg(long, requires = "username")]
    password_file: Option<PathBuf>,
    /// CA certificate(s) (PEM) the broker's TLS certificate must chain to.
    #[arg(long)]
    ca_file: Option<PathBuf>,
    /// Also trust the system's root certificates (a broker with a public certificate).
    #[arg(long)]
    system_roots: bool,
    /// Client certificate (PEM) for brokers that authenticate clients by certificate.
    #[arg(long, requires = "key_file")]
    cert_file: Option<PathBuf>,
    /// Private key (PEM) of --cert-file.
    #[arg(long, requires = "cert_file")]
    key_file: Option<PathBuf>,
    /// Send --password-file's password over plain mqtt:// to a broker on another machine
    /// (refused without it: anyone on the path reads it; loopback is always allowed). For a
    /// lab you trust; use mqtts:// anywhere else.
    #[arg(long, requires = "password_file")]
    insecure_plain_password: bool,
}

impl BrokerArgs {
    pub fn config(&self) -> BrokerConfig {
        let mut c = BrokerConfig::new(&self.broker);
        c.prefix = self.prefix.clone();
        c.username = self.username.clone();
        c.password_file = self.password_file.clone();
        c.ca_file = self.ca_file.clone();
        c.system_roots = self.system_roots;
        c.cert_file = self.cert_file.clone();
        c.key_file = self.key_file.clone();
        c.insecure_plain_password = self.insecure_plain_password;
        c
    }
}

#[derive(Subcommand)]
pub enum FleetCmd {
    /// Run an MQTT broker in-process (rumqttd; nothing kept on disk): the one-machine default.
    Broker(broker::Args),
    /// Publish a signed artifact (retained chunks + offer) and make it the desired model of a
    /// device or group. Versions only go up unless --rollback.
    Publish(publish::Args),
    /// Publish the list of publishing keys devices accept, signed by the fleet's root key
    /// (rotation and revocation: devices with `trusted_root` follow the newest list).
    Keys(keys::Args),
    /// Show devices' retained status, or wait for a device to reach a state.
    Status(status::Args),
    /// Clear the retained chunks and offers of all but the newest versions of each model,
    /// keeping every version a desired state or a running rollout still needs.
    Prune(prune::PruneArgs),
    /// Clear one published version's retained chunks and offer (refused while a desired state
    /// or a running rollout needs it).
    Unpublish(prune::UnpublishArgs),
    /// Staged rollout of a signed artifact across the fleet (phases, thresholds, abort and roll
    /// back); `trainer rollout status` shows one. A restarted rollout resumes from the broker.
    #[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
    Rollout(rollout::Args),
    /// Classify images on a device over MQTT: files, or a whole labelled table (--data) with
    /// accuracy and a confusion matrix.
    Infer(infer::Args),
    /// Append the inputs devices captured (`[capture]` in agent.toml) to a Delta table, each
    /// once, over a persistent session; label them with `trainer label`.
    Collect(collect::Args),
    /// Serve the fleet console: a live web page and JSON API of devices, rollouts and events
    /// (loopback only unless --token-file; read-only unless --allow-actions).
    Console(console::Args),
}

pub fn run(cmd: FleetCmd) -> Result<ExitCode> {
    match cmd {
        FleetCmd::Broker(args) => broker::run(args),
        FleetCmd::Publish(args) => publish::run(args),
        FleetCmd::Keys(args) => keys::run(args),
        FleetCmd::Status(args) => status::run(args),
        FleetCmd::Prune(args) => prune::prune(args),
        FleetCmd::Unpublish(args) => prune::unpublish(args),
        FleetCmd::Rollout(args) => rollout::run(args),
        FleetCmd::Infer(args) => infer::run(args),
        FleetCmd::Collect(args) => collect::run(args),
        FleetCmd::Console(args) => console::run(args),
    }
}

/// The signing key in a `trainer keygen` secret key file.
pub fn secret_key(path: &Path) -> Result<ed25519_dalek::SigningKey> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(kestrel_shared::signing::secret_key(
        &text,
        &path.display().to_string(),
    )?)
}

/// The public key in a `trainer keygen` public key file.
pub fn public_key(path: &Path) -> Result<ed25519_dalek::VerifyingKey> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(kestrel_shared::signing::public_key(
        &text,
        &path.display().to_string(),
    )?)
}
