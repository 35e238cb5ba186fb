//! `kestrel-broker` (run as `trainer broker`): rumqttd in-process, the one-machine default
//! broker. Packet limits are set for the artifact chunks.
//!
//! Two processes: the one started supervises a child, the same binary with `--supervised-by`,
//! that runs rumqttd, and starts a new child when one dies ([`supervise`]): rumqttd 0.20's
//! router thread can panic on a client's DISCONNECT, and nothing is routed after that. The
//! retained messages (artifacts, desired states, key lists, rollout states) are kept in
//! `--persist DIR` ([`persist`]; by default `$KESTREL_HOME/broker/port-<port>`) and published
//! again, retained, before a new child listens. Sessions and their queued messages stay in
//! memory only (Mosquitto with `persistence true` is the production broker).
//!
//! It is a binary of its own, which `trainer broker` executes in place of itself (same PID), so
//! that rumqttd and its dependencies are not part of the trainer's build.

mod persist;
mod signals;
mod supervise;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;

/// The exit status of a child one of whose threads panicked (its router, say) while it served:
/// the supervisor starts another, however often.
const EXIT_SOFTWARE: u8 = 70;
/// The exit status of a child that cannot use its `--persist` directory: the supervisor stops
/// too (another child would fail the same way).
const EXIT_CONFIG: u8 = 78;
/// The exit status of a child that could not start (the port taken, the retained messages not
/// restored) or whose listener stopped: the supervisor tries again, with backoff, and gives up
/// after a few such children in a row that died at once.
const EXIT_TEMPFAIL: u8 = 75;
/// How long a broker waits for its port (and its `--persist` directory) to be free: a broker
/// restarted at once finds the previous one still closing its socket.
const FREE_WAIT: Duration = Duration::from_secs(5);

/// The flags are those of `trainer broker`, which passes them on unchanged.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "kestrel-broker",
    version,
    about = "Run an MQTT broker in-process (rumqttd, restarted when it fails; retained messages \
             kept on disk): the one-machine default"
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
    /// Most clients connected at once; beyond it a connection is refused (rumqttd logs "no
    /// space for new connection"). Measured here: 1,000 simulated devices are served well
    /// (a 1% + 99% rollout of a 3.6 MB artifact in 69 s), 10,000 took 4 minutes to connect,
    /// 3.4 GB, and fleet-wide reads that failed meanwhile: a larger fleet wants Mosquitto
    /// (docs/fleet.md, Fleet size and brokers).
    #[arg(long, value_name = "N", default_value_t = MAX_CONNECTIONS)]
    max_clients: usize,
    /// Directory that keeps the retained messages across restarts (one broker at a time)
    /// [default: $KESTREL_HOME/broker/port-<port of --listen>].
    #[arg(long, value_name = "DIR")]
    persist: Option<PathBuf>,
    /// Keep nothing on disk: retained messages vanish when the broker stops or is restarted.
    #[arg(long, conflicts_with = "persist")]
    no_persist: bool,
    /// Most retained messages kept on disk; beyond it a new topic is not kept (logged).
    #[arg(long, value_name = "N", default_value_t = persist::MAX_MESSAGES,
          value_parser = clap::value_parser!(u32).range(1..=persist::MAX_MESSAGES as i64))]
    persist_max_messages: u32,
    /// Most bytes of retained messages (topics and payloads) kept on disk; beyond it a message
    /// is not kept (logged).
    #[arg(long, value_name = "BYTES", default_value_t = persist::MAX_BYTES)]
    persist_max_bytes: u64,
    /// Internal: run the broker itself, for the supervising process with this PID.
    #[arg(long, hide = true, value_name = "PID")]
    supervised_by: Option<u32>,
}

impl Cli {
    /// Where the retained messages are kept, `None` with `--no-persist`.
    fn persist_dir(&self) -> Option<PathBuf> {
        if self.no_persist {
            return None;
        }
        Some(self.persist.clone().unwrap_or_else(|| {
            kestrel_shared::fsutil::kestrel_home()
                .join("broker")
                .join(format!("port-{}", self.listen.port()))
        }))
    }

    fn limits(&self) -> persist::Limits {
        persist::Limits {
            max_messages: self.persist_max_messages as usize,
            max_bytes: self.persist_max_bytes,
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    cli.verbosity.init();
    match cli.supervised_by {
        Some(parent) => child(&cli, parent),
        None => supervise::run(&cli),
    }
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
/// reads of retained state subscribe at QoS 0 for that reason. The retained-message store reads
/// them the same way, so it keeps at most as many ([`persist::MAX_MESSAGES`]).
///
/// `connection_timeout_ms`: a connection that has not sent a whole CONNECT packet in 10 s is
/// closed (each one held open costs a task and a file descriptor).
/// The embedded broker's ceiling: a fleet of about 1,000 devices and its tools.
const MAX_CONNECTIONS: usize = 2000;

fn config(
    listen: SocketAddr,
    max_payload: usize,
    max_clients: usize,
) -> Result<rumqttd::Config, BrokerError> {
    let toml = format!(
        r#"
id = 0
[router]
id = 0
max_connections = {max_clients}
max_outgoing_packet_count = {max_outgoing}
max_segment_size = 104857600
max_segment_count = 10

[v4.1]
name = "v4-1"
listen = "{listen}"
next_connection_delay_ms = 1
  [v4.1.connections]
  connection_timeout_ms = 10000
  max_payload_size = {max_payload}
  max_inflight_count = 200
  dynamic_filters = true
"#,
        max_outgoing = persist::MAX_MESSAGES,
    );
    toml::from_str(&toml).map_err(|e| BrokerError::Config(e.to_string()))
}

/// Waits up to [`FREE_WAIT`] for `listen` to be free (a broker stopped a moment ago may still
/// hold it); the error is the last bind's.
fn wait_for_port(listen: SocketAddr) -> Result<(), BrokerError> {
    let deadline = Instant::now() + FREE_WAIT;
    loop {
        // rumqttd logs a bind failure and keeps running; check the port first.
        match std::net::TcpListener::bind(listen) {
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => {
                return Err(BrokerError::Start {
                    listen,
                    source: e.into(),
                });
            }
        }
    }
}

/// The supervised child: rumqttd, with its retained messages restored from and written to the
/// `--persist` directory. Runs until one of its threads panics (exit status [`EXIT_SOFTWARE`]),
/// its listener stops, or the supervisor is gone.
fn child(cli: &Cli, parent: u32) -> ExitCode {
    signals::catch();
    let stopping = Arc::new(AtomicBool::new(false));
    let persisting = Arc::new(AtomicBool::new(false));
    watch_parent(parent, stopping.clone(), persisting.clone());
    exit_when_the_router_dies();
    if let Err(e) = wait_for_port(cli.listen) {
        tracing::error!("{}", kestrel_shared::Chain(&e));
        return ExitCode::from(EXIT_TEMPFAIL);
    }
    let store = match cli.persist_dir() {
        Some(dir) => match persist::Store::open(&dir, cli.limits()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::error!("{}", kestrel_shared::Chain(&e));
                return ExitCode::from(EXIT_CONFIG);
            }
        },
        None => None,
    };
    tracing::info!(
        "at most {} clients at once (--max-clients): a fleet beyond about 1,000 devices \
         wants Mosquitto (docs/fleet.md, Fleet size and brokers)",
        cli.max_clients
    );
    let config = match config(cli.listen, cli.max_payload_bytes, cli.max_clients) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("{}", kestrel_shared::Chain(&e));
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let mut broker = rumqttd::Broker::new(config);
    if let Some(store) = store {
        // Before the listener: clients find the retained messages there from their first
        // connection on.
        let started = persist::Persister::start(&broker, store, stopping).and_then(|p| {
            std::thread::Builder::new()
                .name(persist::THREAD.into())
                .spawn(move || p.run())
                .map_err(persist::PersistError::Thread)
        });
        if let Err(e) = started {
            tracing::error!("{}", kestrel_shared::Chain(&e));
            return ExitCode::from(EXIT_TEMPFAIL);
        }
        persisting.store(true, Ordering::SeqCst);
    }
    let outcome = broker.start();
    // `start` returns only when its listener thread has ended (a panic or an I/O error).
    let why = match outcome {
        Ok(()) => "rumqttd's listener stopped".to_string(),
        Err(e) => format!("rumqttd's listener failed: {e}"),
    };
    tracing::error!("{why}: exiting, to be started again");
    ExitCode::from(EXIT_TEMPFAIL)
}

/// The child stops on SIGTERM or SIGINT (the supervisor hands them on, then waits for it), and
/// when its supervisor is gone (a SIGKILL to `trainer broker`'s PID): it notices within 100 ms,
/// writes what it has not written of the retained messages yet (a last round, at most 3 s), and
/// exits with status 0, freeing the port.
fn watch_parent(parent: u32, stopping: Arc<AtomicBool>, persisting: Arc<AtomicBool>) {
    let spawned = std::thread::Builder::new()
        .name("kestrel-watch".into())
        .spawn(move || {
            while !signals::stop_requested() && parent_is(parent) {
                std::thread::sleep(Duration::from_millis(100));
            }
            stopping.store(true, Ordering::SeqCst);
            if persisting.load(Ordering::SeqCst) {
                // The persister exits the process once its last round is written.
                std::thread::sleep(Duration::from_secs(3));
                tracing::warn!("the retained messages were not all written in 3 s: exiting");
            }
            std::process::exit(0);
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot watch the supervising process: {e}");
    }
}

/// Whether this process's parent is still `pid` (a parent that dies leaves its children to
/// another).
fn parent_is(pid: u32) -> bool {
    #[cfg(unix)]
    return std::os::unix::process::parent_id() == pid;
    #[cfg(not(unix))]
    {
        let _ = pid;
        true
    }
}

/// A panic in any thread of the broker but the main one ends the process, and the supervisor
/// starts a working broker (with the retained messages kept on disk). rumqttd routes every
/// message through one thread: when it panics (a client's DISCONNECT can make it), the listener
/// still accepts connections that nothing will ever answer. A connection task that panics on the
/// listener's thread may have poisoned a mutex that every later connection takes (two CONNECTs
/// with a client id that rumqttd refuses, `a/b`, do: `src/server/broker.rs` line 544, then 538):
/// no client could connect again. And a store that silently stopped writing would lose messages.
fn exit_when_the_router_dies() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        let thread = std::thread::current();
        let Some(name) = thread.name().filter(|n| *n != "main") else {
            return;
        };
        let what = if name.starts_with("router-") {
            "rumqttd's router thread stopped (nothing routes messages)"
        } else if name == persist::THREAD {
            "the retained-message store stopped"
        } else {
            "a thread of rumqttd panicked (it may take every connection with it)"
        };
        tracing::error!("{what}: exiting, to be started again");
        std::process::exit(EXIT_SOFTWARE.into());
    }));
}
