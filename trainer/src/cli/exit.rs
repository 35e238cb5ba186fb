//! The exit status of every command, from what failed (the error's chain of causes). Listed in
//! `trainer --help` and docs/cli.md.

use std::process::ExitCode;

use crate::track::TrackError;
use kestrel_fleet::FleetError;
use kestrel_shared::mqtt::BrokerError;

/// The list shown under `trainer --help`.
pub const HELP: &str = "Exit status: 0 done; 1 failed (a check, gate or rollout did not pass, a bad \
input); 2 usage (unknown flag or command); 3 a service unreachable (broker, MLflow) or a wait timed \
out; 78 configuration (broker URL, password or CA file, TLS settings).";

/// A service did not answer, or a wait ran out of time: worth retrying later.
pub const UNAVAILABLE: u8 = 3;
/// The configuration is wrong: retrying cannot help (EX_CONFIG, as systemd units expect).
pub const CONFIG: u8 = 78;

/// The exit status for a command that failed with `e`.
pub fn code(e: &anyhow::Error) -> ExitCode {
    for cause in e.chain() {
        if let Some(f) = cause.downcast_ref::<FleetError>() {
            match f {
                FleetError::Broker { .. } | FleetError::TimedOut(_) => {
                    return ExitCode::from(UNAVAILABLE);
                }
                FleetError::Config(_) => return ExitCode::from(CONFIG),
                _ => {}
            }
        }
        if cause.is::<BrokerError>() {
            return ExitCode::from(CONFIG);
        }
        if let Some(TrackError::Unreachable { .. }) = cause.downcast_ref::<TrackError>() {
            return ExitCode::from(UNAVAILABLE);
        }
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind::*;
            if matches!(
                io.kind(),
                ConnectionRefused
                    | ConnectionReset
                    | ConnectionAborted
                    | TimedOut
                    | HostUnreachable
                    | NetworkUnreachable
            ) {
                return ExitCode::from(UNAVAILABLE);
            }
        }
    }
    ExitCode::FAILURE
}
