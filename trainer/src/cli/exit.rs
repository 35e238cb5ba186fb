//! The exit status of every command, from what failed (the error's chain of causes). Listed in
//! `trainer --help` and docs/cli.md.

use std::process::ExitCode;

use crate::data::DataError;
use crate::data::extract::ExtractError;
use crate::data::source::label::LabelError;
use crate::distributed::CollectiveError;
use crate::export::ExportError;
use crate::track::TrackError;
use kestrel_fleet::FleetError;
use kestrel_shared::mqtt::BrokerError;

/// The list shown under `trainer --help`.
pub const HELP: &str = "Exit status: 0 done; 1 failed (a check, gate or rollout did not pass, a bad \
input); 2 usage (unknown flag or command); 3 a service unreachable (broker, MLflow) or a wait timed \
out; 78 configuration (broker URL, password or CA file, TLS settings, a backbone or engine not \
installed); 130 interrupted (the Python package's Ctrl-C).";

/// A service did not answer, or a wait ran out of time: worth retrying later.
pub const UNAVAILABLE: u8 = 3;
/// The configuration is wrong: retrying cannot help (EX_CONFIG, as systemd units expect).
pub const CONFIG: u8 = 78;

/// What kind of failure an error is, from its chain of causes (the first cause that says wins):
/// what the exit status and the Python package's exception classes tell apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// A bad input: a table, column, image, label, cache or weights file.
    Data,
    /// The configuration is wrong (broker URL, TLS, credentials, a backbone not installed, an
    /// engine not available): retrying cannot help.
    Config,
    /// A service did not answer (broker, MLflow, a peer rank) or a wait ran out of time.
    Unavailable,
    /// A check refused the result: an export gate (runtimes disagree, accuracy drop).
    Gate,
    /// A stop was asked for ([`crate::interrupt`]).
    Interrupted,
    /// Another rank of the job failed first (its error is the job's; this rank only stopped).
    Peer,
    /// Anything else.
    Other,
}

impl Failure {
    /// The exit status for this kind of failure.
    pub fn code(self) -> ExitCode {
        match self {
            Failure::Unavailable => ExitCode::from(UNAVAILABLE),
            Failure::Config => ExitCode::from(CONFIG),
            Failure::Interrupted => ExitCode::from(INTERRUPTED),
            Failure::Data | Failure::Gate | Failure::Peer | Failure::Other => ExitCode::FAILURE,
        }
    }
}

/// Ended by a stop (128 + SIGINT, as shells report Ctrl-C).
pub const INTERRUPTED: u8 = 130;

/// The exit status for a command that failed with `e`.
pub fn code(e: &anyhow::Error) -> ExitCode {
    classify(e).code()
}

/// What kind of failure `e` is.
pub fn classify(e: &anyhow::Error) -> Failure {
    e.chain().find_map(kind_of).unwrap_or(Failure::Other)
}

type Cause<'a> = &'a (dyn std::error::Error + 'static);

/// The error inside a `#[error(transparent)]` variant of the trainer's wrapping errors: such a
/// wrapper shows and chains as its inner error, so the chain of causes never holds the inner
/// error itself and only this unwrapping finds its type.
fn transparent(cause: Cause<'_>) -> Option<Cause<'_>> {
    use crate::data::cache::CacheError as C;
    use crate::track::{TrackedFitError as F, TrackedTuneError as T};
    use crate::train::TrainError as R;
    use crate::tune::TuneError as U;
    use ExportError as X;
    if let Some(e) = cause.downcast_ref::<R>() {
        return match e {
            R::Interrupted(x) => Some(x),
            R::Data(x) => Some(x),
            R::Cache(x) => Some(x),
            R::Backbone(x) => Some(x),
            R::Engine(x) => Some(x),
            R::Preprocess(x) => Some(x),
            R::Collective(x) => Some(x),
            _ => None,
        };
    }
    if let Some(e) = cause.downcast_ref::<C>() {
        return match e {
            C::Interrupted(x) => Some(x),
            C::Data(x) => Some(x),
            C::Backbone(x) => Some(x),
            C::Engine(x) => Some(x),
            C::Collective(x) => Some(x),
            _ => None,
        };
    }
    if let Some(e) = cause.downcast_ref::<X>() {
        return match e {
            X::Train(x) => Some(x),
            X::Cache(x) => Some(x),
            X::Data(x) => Some(x),
            X::Engine(x) => Some(x),
            X::Preprocess(x) => Some(x),
            _ => None,
        };
    }
    if let Some(e) = cause.downcast_ref::<U>() {
        return match e {
            U::Train(x) => Some(x),
            U::Collective(x) => Some(x),
            _ => None,
        };
    }
    if let Some(F::Fit(x)) = cause.downcast_ref::<F>() {
        return Some(x);
    }
    if let Some(T::Tune(x)) = cause.downcast_ref::<T>() {
        return Some(x);
    }
    None
}

/// The kind one cause says, if it says one.
fn kind_of(cause: Cause<'_>) -> Option<Failure> {
    use kestrel_models::backbone::BackboneError;
    if let Some(inner) = transparent(cause) {
        return kind_of(inner);
    }
    if cause.is::<crate::interrupt::Interrupted>() {
        return Some(Failure::Interrupted);
    }
    if let Some(CollectiveError::PeerFailed { .. }) = cause.downcast_ref::<CollectiveError>() {
        return Some(Failure::Peer);
    }
    if let Some(f) = cause.downcast_ref::<FleetError>() {
        match f {
            FleetError::Broker { .. } | FleetError::TimedOut(_) => {
                return Some(Failure::Unavailable);
            }
            FleetError::Config(_) => return Some(Failure::Config),
            _ => {}
        }
    }
    if cause.is::<BrokerError>() {
        return Some(Failure::Config);
    }
    if let Some(TrackError::Unreachable { .. }) = cause.downcast_ref::<TrackError>() {
        return Some(Failure::Unavailable);
    }
    if let Some(b) = cause.downcast_ref::<BackboneError>() {
        return match b {
            BackboneError::NotFetched { .. }
            | BackboneError::NoPretrained(_)
            | BackboneError::Unknown(_)
            | BackboneError::NeedArch
            | BackboneError::NeedPreprocess(_)
            | BackboneError::OnnxOnly(_)
            | BackboneError::OnnxOnCandle => Some(Failure::Config),
            _ => None,
        };
    }
    if let Some(e) = cause.downcast_ref::<kestrel_models::EngineError>() {
        use kestrel_models::EngineError::*;
        if matches!(e, NotCompiled(_) | Unknown(_)) {
            return Some(Failure::Config);
        }
    }
    if let Some(e) = cause.downcast_ref::<ExportError>() {
        use ExportError::*;
        if matches!(
            e,
            Disagrees { .. } | AccuracyDrop { .. } | GoldenMismatch { .. }
        ) {
            return Some(Failure::Gate);
        }
    }
    if let Some(c) = cause.downcast_ref::<crate::data::cache::CacheError>() {
        use crate::data::cache::CacheError::*;
        if matches!(
            c,
            Invalid(_) | Meta { .. } | Shard { .. } | TooFewSamples { .. } | Empty(_)
        ) {
            return Some(Failure::Data);
        }
    }
    if cause.is::<DataError>()
        || cause.is::<LabelError>()
        || cause.is::<ExtractError>()
        || cause.is::<kestrel_shared::PreprocessError>()
    {
        return Some(Failure::Data);
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
            return Some(Failure::Unavailable);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::TrainError;
    use std::path::PathBuf;

    fn bad_table() -> DataError {
        DataError::UnsupportedSource {
            path: PathBuf::from("table.xlsx"),
        }
    }

    #[test]
    fn a_cause_inside_transparent_wrappers_says_what_failed() {
        let e = anyhow::Error::from(TrainError::from(bad_table())).context("fitting `run`");
        assert_eq!(classify(&e), Failure::Data);
        let stopped = anyhow::Error::from(crate::tune::TuneError::from(TrainError::from(
            crate::interrupt::Interrupted,
        )));
        assert_eq!(classify(&stopped), Failure::Interrupted);
        assert_eq!(
            u8_of(Failure::Interrupted.code()),
            u8_of(ExitCode::from(130))
        );
        let undecodable = crate::data::cache::CacheError::Invalid(
            kestrel_shared::PreprocessError::UnknownFormat {
                source_name: "x.png".into(),
                magic: "00".into(),
            },
        );
        let e = anyhow::Error::from(TrainError::from(undecodable));
        assert_eq!(classify(&e), Failure::Data);
        let plain = anyhow::anyhow!("something else");
        assert_eq!(classify(&plain), Failure::Other);
        assert_eq!(u8_of(code(&plain)), u8_of(ExitCode::FAILURE));
    }

    fn u8_of(c: ExitCode) -> String {
        format!("{c:?}")
    }
}
