//! The supervising process: it runs the broker as a child process and starts a new one when the
//! child dies.
//!
//! Why: rumqttd 0.20 cannot be made to survive its clients by configuration. When a client sends
//! DISCONNECT (or the router drops a client for a bad packet), the router forgets the connection
//! at once while the connection's network task still runs; that task can then send the router a
//! `Ready` event (after writing a full outgoing buffer, as a subscriber to more than 199 retained
//! messages gets) for a connection id that no longer exists, and the router thread panics on an
//! `unwrap` (rumqttd-0.20.0 `src/router/routing.rs` `Event::Ready` -> `src/router/scheduler.rs`
//! `reschedule`). And two CONNECTs with a client id rumqttd refuses (`a/b`) panic a task on the
//! listener's thread while it holds a mutex every later connection takes (`src/server/broker.rs`
//! line 544): no client connects again. No setting avoids either, and the router cannot be
//! restarted in-process: the listener thread holds the dead router's channel and its bound socket
//! until the process ends. So the child exits when any of its threads panics
//! (`exit_when_the_router_dies`), and this process starts another, which publishes the retained
//! messages again from the `--persist` directory before it listens.

use std::collections::VecDeque;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use crate::{Cli, EXIT_CONFIG, EXIT_SOFTWARE};

/// A child that dies sooner than this after its start, other than by its router dying, failed
/// to start.
const QUICK: Duration = Duration::from_secs(2);
/// Failed starts in a row after which the supervisor gives up (a broken installation or a port
/// taken by another program, not a client).
const MAX_FAILED_STARTS: u32 = 5;
/// Restarts are counted over this window to space them out.
const WINDOW: Duration = Duration::from_secs(60);
/// The longest wait before a restart.
const MAX_DELAY: Duration = Duration::from_secs(5);

pub fn run(cli: &Cli) -> ExitCode {
    crate::signals::catch();
    let dir = cli.persist_dir();
    let kept = match &dir {
        Some(d) => format!("retained messages kept in {}", d.display()),
        None => "nothing kept on disk (--no-persist)".to_string(),
    };
    tracing::info!(
        "kestrel broker (rumqttd) listening on mqtt://{}, payloads up to {} bytes, {kept}",
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
    // Errors a user can fix are reported here, before any child starts.
    if let Err(e) = crate::wait_for_port(cli.listen) {
        tracing::error!("{}", kestrel_shared::Chain(&e));
        return ExitCode::FAILURE;
    }
    if let Some(d) = &dir
        && let Err(e) = std::fs::create_dir_all(d)
    {
        tracing::error!(
            "the retained-message store {} (--persist): {e}",
            d.display()
        );
        return ExitCode::from(EXIT_CONFIG);
    }
    let exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            tracing::error!("locating the kestrel-broker executable: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut restarts: VecDeque<Instant> = VecDeque::new();
    let mut failed_starts = 0;
    loop {
        if crate::signals::stop_requested() {
            return ExitCode::SUCCESS;
        }
        let started = Instant::now();
        let status = match child_command(cli, &exe).spawn() {
            Ok(mut child) => {
                crate::signals::set_child(Some(child.id()));
                let status = child.wait();
                crate::signals::set_child(None);
                status
            }
            Err(e) => Err(e),
        };
        let status = match status {
            Ok(s) => s,
            Err(e) => {
                tracing::error!("running {}: {e}", exe.display());
                return ExitCode::FAILURE;
            }
        };
        let ran = started.elapsed();
        // Asked to stop (SIGTERM, SIGINT): the child has written what it had to and exited.
        if crate::signals::stop_requested() || status.success() {
            tracing::info!("kestrel broker stopped");
            return ExitCode::SUCCESS;
        }
        if status.code() == Some(EXIT_CONFIG.into()) {
            // The child said why; another would fail the same way.
            return ExitCode::from(EXIT_CONFIG);
        }
        // A child whose router died was serving (a client killed it): never a failed start, or
        // a client could make the supervisor give up.
        let crashed = status.code() == Some(EXIT_SOFTWARE.into());
        failed_starts = if ran < QUICK && !crashed {
            failed_starts + 1
        } else {
            0
        };
        if failed_starts >= MAX_FAILED_STARTS {
            tracing::error!(
                "the broker stopped {failed_starts} times in a row within {QUICK:?} of its \
                 start ({status}): giving up"
            );
            return ExitCode::from(EXIT_SOFTWARE);
        }
        let now = Instant::now();
        while restarts.front().is_some_and(|t| now - *t > WINDOW) {
            restarts.pop_front();
        }
        let delay = delay(restarts.len());
        restarts.push_back(now);
        let retained = match &dir {
            Some(d) => format!("retained messages come back from {}", d.display()),
            None => "retained messages are lost (--no-persist)".to_string(),
        };
        tracing::error!(
            "the broker stopped ({status}) after {:.1} s: starting it again in {:.1} s; {retained}",
            ran.as_secs_f64(),
            delay.as_secs_f64()
        );
        let until = Instant::now() + delay;
        while Instant::now() < until && !crate::signals::stop_requested() {
            std::thread::sleep(Duration::from_millis(50).min(until - Instant::now()));
        }
    }
}

/// The wait before a restart, given how many restarts the last [`WINDOW`] saw: none for the
/// first, then 0.1 s doubling to [`MAX_DELAY`], so that a client that kills the router over and
/// over costs at most a restart every few seconds.
fn delay(recent: usize) -> Duration {
    if recent == 0 {
        return Duration::ZERO;
    }
    let exp = (recent - 1).min(16) as u32;
    (Duration::from_millis(100) * 2u32.pow(exp)).min(MAX_DELAY)
}

/// The child: this executable with the same settings and `--supervised-by` this process.
fn child_command(cli: &Cli, exe: &std::path::Path) -> Command {
    let mut cmd = Command::new(exe);
    cmd.arg("--listen")
        .arg(cli.listen.to_string())
        .arg("--max-payload-bytes")
        .arg(cli.max_payload_bytes.to_string())
        .arg("--max-clients")
        .arg(cli.max_clients.to_string());
    match cli.persist_dir() {
        Some(d) => {
            cmd.arg("--persist").arg(d);
        }
        None => {
            cmd.arg("--no-persist");
        }
    }
    cmd.arg("--persist-max-messages")
        .arg(cli.persist_max_messages.to_string())
        .arg("--persist-max-bytes")
        .arg(cli.persist_max_bytes.to_string())
        .arg("--supervised-by")
        .arg(std::process::id().to_string())
        .stdin(Stdio::null());
    if let Some(d) = kestrel_shared::logging::directives() {
        cmd.env("RUST_LOG", d); // the child logs as this process does
    }
    cmd
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    #[test]
    fn restarts_are_spaced_out() {
        assert_eq!(super::delay(0), Duration::ZERO);
        assert_eq!(super::delay(1), Duration::from_millis(100));
        assert_eq!(super::delay(3), Duration::from_millis(400));
        assert_eq!(super::delay(10), super::MAX_DELAY);
        assert_eq!(super::delay(usize::MAX), super::MAX_DELAY);
    }
}
