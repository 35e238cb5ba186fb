//! `trainer broker`: the embedded MQTT broker.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, ExitCode};

use anyhow::{Context, Result, bail};

/// The executable that runs the broker, in the trainer executable's directory.
pub const BROKER_EXE: &str = "kestrel-broker";

#[derive(clap::Args)]
pub struct Args {
    /// Address to listen on (MQTT 3.1.1, plain TCP).
    #[arg(long, default_value = "127.0.0.1:1883")]
    listen: SocketAddr,
    /// Largest message payload accepted (must exceed the publisher's chunk size; by default the
    /// clients' packet limit leaves room for it, so no device is disconnected by a message).
    #[arg(long, default_value_t = kestrel_shared::mqtt::MAX_PAYLOAD_BYTES)]
    max_payload_bytes: usize,
    /// Most clients connected at once; beyond it a connection is refused [default: 2000: a fleet
    /// of about 1,000 devices; a larger one wants Mosquitto].
    #[arg(long, value_name = "N")]
    max_clients: Option<usize>,
    /// Directory that keeps the retained messages (artifacts, desired states, key lists, rollout
    /// states) across restarts, one broker at a time [default: $KESTREL_HOME/broker/port-<port>].
    #[arg(long, value_name = "DIR")]
    persist: Option<PathBuf>,
    /// Keep nothing on disk: retained messages vanish when the broker stops or is restarted.
    #[arg(long, conflicts_with = "persist")]
    no_persist: bool,
    /// Most retained messages kept on disk; beyond it a new topic is not kept (logged)
    /// [default: 20000].
    #[arg(long, value_name = "N")]
    persist_max_messages: Option<u32>,
    /// Most bytes of retained messages (topics and payloads) kept on disk [default: 1073741824].
    #[arg(long, value_name = "BYTES")]
    persist_max_bytes: Option<u64>,
}

/// Runs the `kestrel-broker` binary found next to this executable, with the same flags.
///
/// The broker (rumqttd) is a binary of its own so that rumqttd and its dependencies stay out of
/// the trainer's build; the workspace build (`cargo build --release --workspace --bins`) puts both
/// in one directory. On Unix it replaces this process (exec), so the PID stays the broker's:
/// scripts and tests that start `trainer broker` and later kill that PID stop the broker (its
/// supervising process, whose child running rumqttd follows it within a fraction of a second).
pub fn run(args: Args) -> Result<ExitCode> {
    let exe = broker_exe()?;
    let mut cmd = Command::new(&exe);
    cmd.arg("--listen")
        .arg(args.listen.to_string())
        .arg("--max-payload-bytes")
        .arg(args.max_payload_bytes.to_string());
    if let Some(dir) = &args.persist {
        cmd.arg("--persist").arg(dir);
    }
    if args.no_persist {
        cmd.arg("--no-persist");
    }
    if let Some(n) = args.max_clients {
        cmd.arg("--max-clients").arg(n.to_string());
    }
    if let Some(n) = args.persist_max_messages {
        cmd.arg("--persist-max-messages").arg(n.to_string());
    }
    if let Some(n) = args.persist_max_bytes {
        cmd.arg("--persist-max-bytes").arg(n.to_string());
    }
    if let Some(d) = kestrel_shared::logging::directives() {
        cmd.env("RUST_LOG", d); // `trainer -v broker` logs as `kestrel-broker -v` would
    }
    exec(cmd).with_context(|| format!("running {}", exe.display()))
}

fn broker_exe() -> Result<PathBuf> {
    let me = std::env::current_exe().context("locating the trainer executable")?;
    let exe = me
        .parent()
        .context("the trainer executable has no directory")?
        .join(format!("{BROKER_EXE}{}", std::env::consts::EXE_SUFFIX));
    if !exe.is_file() {
        bail!(
            "the embedded broker is the separate binary {BROKER_EXE}, expected at {} (beside the \
             trainer): build it with `cargo build --release --workspace --bins` (or `-p kestrel-broker`)",
            exe.display()
        );
    }
    Ok(exe)
}

#[cfg(unix)]
fn exec(mut cmd: Command) -> Result<ExitCode> {
    use std::os::unix::process::CommandExt;
    // Only returns on failure.
    Err(cmd.exec().into())
}

#[cfg(not(unix))]
fn exec(mut cmd: Command) -> Result<ExitCode> {
    let status = cmd.status()?;
    Ok(if status.success() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
