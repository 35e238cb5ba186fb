//! `trainer console`: the fleet console, a web page and JSON API over what the broker holds
//! (the server and its state are `kestrel_fleet::console`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kestrel_fleet::console::{Limits, Options, TlsFiles};

use super::{BrokerArgs, secret_key};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    broker: BrokerArgs,
    /// Address to serve the page and the API on. Anything but a loopback address needs
    /// --token-file and TLS (--tls-cert, --tls-key) or --insecure-http.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// File holding the access token (first line, 16 characters or more): every request must
    /// carry it (Authorization: Bearer TOKEN), or a session a browser opens with /?token=TOKEN
    /// once (it is then sent to the same page without the token).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Serve HTTPS with this certificate chain (PEM, leaf first).
    #[arg(long, requires = "tls_key", value_name = "PEM")]
    tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, requires = "tls_cert", value_name = "PEM")]
    tls_key: Option<PathBuf>,
    /// Plain HTTP on a non-loopback --listen: only behind a proxy that terminates TLS (give
    /// --public-url too).
    #[arg(long, conflicts_with = "tls_cert")]
    insecure_http: bool,
    /// The URL users open (https://NAME[:PORT]/, as a proxy publishes the console): its host is
    /// answered besides the listening address, its origin may send actions.
    #[arg(long, value_name = "URL")]
    public_url: Option<String>,
    /// Allow actions: pausing, resuming and aborting a rollout (after typing its name), as
    /// commands signed with --operator-key that the rollout's controller checks. Read-only
    /// without it.
    #[arg(long, requires = "operator_key")]
    allow_actions: bool,
    /// An operator's secret key (`trainer keygen --operator`: operator.key). It signs rollout
    /// commands only; start rollouts with `--operator-pub operator.pub` to obey them. Never give
    /// the console the publishing key (kestrel.key): that one can release models.
    #[arg(long, requires = "allow_actions", value_name = "KEY")]
    operator_key: Option<PathBuf>,
    /// A request's headers (and a TLS handshake) must arrive within this many seconds.
    #[arg(long, default_value_t = 10)]
    header_timeout_s: u64,
    /// A connection nothing crossed for this many seconds is closed.
    #[arg(long, default_value_t = 120)]
    idle_timeout_s: u64,
    /// Open connections, at most.
    #[arg(long, default_value_t = 256)]
    max_connections: usize,
    /// Open connections from one client address, at most.
    #[arg(long, default_value_t = 64)]
    max_connections_per_client: usize,
    /// Live streams (open pages), at most.
    #[arg(long, default_value_t = 64)]
    max_streams: usize,
    /// Live streams from one client address, at most.
    #[arg(long, default_value_t = 8)]
    max_streams_per_client: usize,
    /// A browser session ends this many hours after the token opened it.
    #[arg(long, default_value_t = 12.0)]
    session_hours: f64,
    /// `/metrics` has per-device series (about 30 a device) while the fleet has at most this
    /// many devices; beyond, only the fleet's aggregates (kestrel_fleet_*).
    #[arg(long, value_name = "N", default_value_t = kestrel_fleet::console::PER_DEVICE_METRICS_MAX)]
    per_device_metrics_max: usize,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let token = match &args.token_file {
        Some(p) => Some(
            std::fs::read_to_string(p)
                .with_context(|| format!("reading {}", p.display()))?
                .lines()
                .next()
                .unwrap_or_default()
                .trim()
                .to_string(),
        ),
        None => None,
    };
    let actions = match &args.operator_key {
        Some(k) => Some(secret_key(k)?),
        None => None,
    };
    let tls = args
        .tls_cert
        .zip(args.tls_key)
        .map(|(cert, key)| TlsFiles { cert, key });
    if !(args.session_hours > 0.0 && args.session_hours.is_finite()) {
        bail!("--session-hours must be above 0");
    }
    let limits = Limits {
        header_timeout: Duration::from_secs(args.header_timeout_s.max(1)),
        idle_timeout: Duration::from_secs(args.idle_timeout_s.max(1)),
        max_connections: args.max_connections.max(1),
        max_connections_per_client: args.max_connections_per_client.max(1),
        max_streams: args.max_streams,
        max_streams_per_client: args.max_streams_per_client,
        session_ttl: Duration::from_secs_f64(args.session_hours * 3600.0),
    };
    let opts = Options {
        broker: args.broker.config(),
        listen: args.listen,
        token,
        actions,
        tls,
        insecure_http: args.insecure_http,
        public_url: args.public_url,
        limits,
        per_device_metrics_max: args.per_device_metrics_max,
    };
    let mode = if opts.actions.is_some() {
        "actions allowed"
    } else {
        "read-only"
    };
    let broker = opts.broker.url.clone();
    let served = kestrel_fleet::console::serve(opts, |url| {
        // One line on stdout, for scripts: where the console listens.
        outln!("console: {url} ({mode}) following {broker}");
    });
    served?;
    Ok(ExitCode::SUCCESS)
}
