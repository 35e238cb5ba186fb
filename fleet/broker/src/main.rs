//! `kestrel-broker` (run as `trainer broker`): rumqttd in-process, the one-machine default
//! broker. Packet limits are set for the artifact chunks. It keeps nothing on disk: retained
//! models and sessions vanish when it stops (Mosquitto with `persistence true` is the production
//! broker).
//!
//! It is a binary of its own, which `trainer broker` executes in place of itself (same PID), so
//! that rumqttd and its dependencies are not part of the trainer's build.

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::Parser;

/// The flags are those of `trainer broker`, which passes them on unchanged.
#[derive(Parser)]
#[command(
    name = "kestrel-broker",
    version,
    about = "Run an MQTT broker in-process (rumqttd; nothing kept on disk): the one-machine default"
)]
struct Cli {
    #[command(flatten)]
    verbosity: kestrel_shared::logging::Verbosity,
    /// Address to listen on (MQTT 3.1.1, plain TCP).
    #[arg(long, default_value = "127.0.0.1:1883")]
    listen: SocketAddr,
    /// Largest message payload accepted (must exceed the publisher's chunk size; the clients'
    /// packet limit, kestrel_shared::mqtt::MAX_PAYLOAD_BYTES by default, must exceed it).
    #[arg(long, default_value_t = 2 << 20)]
    max_payload_bytes: usize,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    cli.verbosity.init();
    exit_when_the_router_dies();
    tracing::info!(
        "kestrel broker (rumqttd) listening on mqtt://{}, payloads up to {} bytes",
        cli.listen,
        cli.max_payload_bytes
    );
    if !cli.listen.ip().is_loopback() {
        tracing::warn!(
            "listening beyond this machine ({}) with plain MQTT, no passwords and no \
             ACL: anyone who reaches it can read every message and publish to every topic (devices \
             still install only what a trusted key signed). On a network you do not trust, run \
             Mosquitto with edge-agent/deploy/mosquitto.conf (TLS, passwords, per-device ACL)",
            cli.listen
        );
    }
    match run(cli.listen, cli.max_payload_bytes) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{}", kestrel_shared::Chain(&e));
            ExitCode::FAILURE
        }
    }
}

/// rumqttd routes every message through one thread; when it panics, the listener still accepts
/// connections that nothing will ever answer. Ending the process instead lets a supervisor
/// (systemd's `Restart=`) or the operator start a working broker.
fn exit_when_the_router_dies() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        if std::thread::current()
            .name()
            .is_some_and(|n| n.starts_with("router-"))
        {
            tracing::error!("rumqttd's router thread stopped: exiting (nothing routes messages)");
            std::process::exit(70);
        }
    }));
}

#[derive(Debug, thiserror::Error)]
enum BrokerError {
    #[error("embedded broker: {0}")]
    Config(String),
    #[error("embedded broker on {listen}")]
    Start {
        listen: SocketAddr,
        #[source]
        source: kestrel_shared::error::Cause,
    },
}

/// The rumqttd configuration: one MQTT 3.1.1 listener, payloads up to `max_payload` bytes.
///
/// `max_outgoing_packet_count` is how many retained messages rumqttd 0.20 sends a new QoS 0
/// subscription (and how many messages a QoS 0 subscriber is sent per read): 20,000, so a late
/// console or `trainer status` sees every device of a fleet of thousands. A QoS 1 subscription
/// gets at most 100 (rumqttd's fixed in-flight window, not configurable); Kestrel's fleet-wide
/// reads of retained state subscribe at QoS 0 for that reason.
fn config(listen: SocketAddr, max_payload: usize) -> Result<rumqttd::Config, BrokerError> {
    let toml = format!(
        r#"
id = 0
[router]
id = 0
max_connections = 10010
max_outgoing_packet_count = 20000
max_segment_size = 104857600
max_segment_count = 10

[v4.1]
name = "v4-1"
listen = "{listen}"
next_connection_delay_ms = 1
  [v4.1.connections]
  connection_timeout_ms = 60000
  max_payload_size = {max_payload}
  max_inflight_count = 200
  dynamic_filters = true
"#
    );
    toml::from_str(&toml).map_err(|e| BrokerError::Config(e.to_string()))
}

/// Runs the broker until the process ends. The listener is bound before this returns an error
/// for a busy port, so callers see a clear message.
fn run(listen: SocketAddr, max_payload: usize) -> Result<(), BrokerError> {
    // rumqttd logs a bind failure and keeps running; check the port first.
    std::net::TcpListener::bind(listen).map_err(|e| BrokerError::Start {
        listen,
        source: e.into(),
    })?;
    let mut broker = rumqttd::Broker::new(config(listen, max_payload)?);
    broker.start().map_err(|e| BrokerError::Start {
        listen,
        source: e.into(),
    })
}
