//! Logging for the binaries: `tracing` events with levels, filtered by `RUST_LOG` or by
//! `-v`/`-q`, written to stderr one line per event.
//!
//! On a terminal or in a file a line reads as before: `error: …`, `warning: …`, plain text for
//! information, `debug: target: …` below that, and a library's events name their target. Under
//! systemd, when stderr is the journal's stream (`JOURNAL_STREAM` names stderr's device and
//! inode, the sd-daemon contract), each line starts with its syslog priority instead (`<3>` error,
//! `<4>` warning, `<6>` info, `<7>` debug), so `journalctl -p warning` shows warnings and errors.
//! Diagnostics of libraries that use `log` rather than `tracing` (reqwest, rustls) arrive too.

use std::fmt::Write as _;
use std::io::IsTerminal;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::{FormatEvent, FormatFields, Writer};
use tracing_subscriber::fmt::{FmtContext, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

/// Kestrel's own crates (their `tracing` targets): logged one level more verbosely than the
/// libraries beneath them.
const OURS: [&str; 7] = [
    "trainer",
    "kestrel_trainer",
    "edge_agent",
    "kestrel_fleet",
    "kestrel_shared",
    "kestrel_models",
    "kestrel_broker",
];

/// `-v`/`-q` for a binary's command line (flattened into its top-level `Parser`, global).
#[derive(clap::Args, Debug, Clone, Copy, Default)]
pub struct Verbosity {
    /// More log detail: -v debug from Kestrel and information from libraries, -vv debug from
    /// everything, -vvv trace. RUST_LOG, when set, takes precedence (e.g. RUST_LOG=delta_kernel=debug)
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Less: errors only
    #[arg(short, long, global = true, action = clap::ArgAction::Count, conflicts_with = "verbose")]
    pub quiet: u8,
}

impl Verbosity {
    /// Installs the subscriber at this verbosity (see [`init`]).
    pub fn init(self) {
        init(self.verbose.min(10) as i8 - self.quiet.min(10) as i8);
    }
}

/// The filter used when `RUST_LOG` is not set, for a verbosity of (number of `-v`) minus
/// (number of `-q`): by default information from Kestrel and warnings from libraries (errors
/// from ONNX Runtime); `-q`
/// errors only; `-v` debug from Kestrel and information from libraries; `-vv` debug from
/// everything; `-vvv` trace.
pub fn default_directives(verbosity: i8) -> String {
    let (ours, libraries) = match verbosity {
        i8::MIN..=-1 => ("error", "error"),
        0 => ("info", "warn"),
        1 => ("debug", "info"),
        2 => ("debug", "debug"),
        _ => ("trace", "trace"),
    };
    let mut d = libraries.to_string();
    if verbosity == 0 {
        // ONNX Runtime reports its graph optimisations (removed initializers, unused inputs) as
        // warnings on every session; they are shown from -v on.
        d.push_str(",ort=error");
    }
    for t in OURS {
        let _ = write!(d, ",{t}={ours}");
    }
    d
}

/// Whether stderr is the journal's stream: systemd sets `JOURNAL_STREAM=<device>:<inode>` of
/// the stream it connected; a child whose stderr was redirected elsewhere does not match.
fn stderr_is_journal() -> bool {
    use std::os::fd::AsFd;
    use std::os::unix::fs::MetadataExt;
    let Some(want) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Ok(fd) = std::io::stderr().as_fd().try_clone_to_owned() else {
        return false;
    };
    let Ok(meta) = std::fs::File::from(fd).metadata() else {
        return false;
    };
    want.to_str() == Some(format!("{}:{}", meta.dev(), meta.ino()).as_str())
}

/// Installs the subscriber (once per process; a second call changes nothing). `RUST_LOG`, when
/// set, wins over `verbosity`; a malformed one is reported and the default used.
pub fn init(verbosity: i8) {
    let directives = match std::env::var("RUST_LOG") {
        Ok(s) if !s.trim().is_empty() => match EnvFilter::try_new(&s) {
            Ok(_) => s,
            Err(e) => {
                eprintln!("warning: RUST_LOG={s:?}: {e}; using the default levels");
                default_directives(verbosity)
            }
        },
        _ => default_directives(verbosity),
    };
    let filter = EnvFilter::new(&directives);
    let _ = DIRECTIVES.set(directives);
    let format = LineFormat {
        journal: stderr_is_journal(),
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .event_format(format)
        .try_init();
}

static DIRECTIVES: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// The filter this process logs with (after [`init`]), as `RUST_LOG` directives: for a child
/// process that should log at the same levels.
pub fn directives() -> Option<&'static str> {
    DIRECTIVES.get().map(String::as_str)
}

/// One line per event (a message with line breaks gives one line each, every one prefixed).
struct LineFormat {
    journal: bool,
}

impl LineFormat {
    fn prefix(&self, level: Level, target: &str) -> String {
        let ours = OURS
            .iter()
            .any(|o| target == *o || target.starts_with(*o) && target[o.len()..].starts_with("::"));
        if self.journal {
            let p = match level {
                Level::ERROR => 3,
                Level::WARN => 4,
                Level::INFO => 6,
                Level::DEBUG | Level::TRACE => 7,
            };
            return if ours {
                format!("<{p}>")
            } else {
                format!("<{p}>{target}: ")
            };
        }
        let word = match level {
            Level::ERROR => "error: ",
            Level::WARN => "warning: ",
            Level::INFO => "",
            Level::DEBUG => "debug: ",
            Level::TRACE => "trace: ",
        };
        if ours && level <= Level::INFO {
            word.to_string()
        } else {
            format!("{word}{target}: ")
        }
    }
}

impl<S, N> FormatEvent<S, N> for LineFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        let meta = event.metadata();
        let mut text = String::new();
        ctx.field_format()
            .format_fields(Writer::new(&mut text), event)?;
        // Fields of the enclosing spans (a device's id in a simulated fleet), outermost first.
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                if let Some(f) = span.extensions().get::<FormattedFields<N>>()
                    && !f.fields.is_empty()
                {
                    write!(text, " {}", f.fields)?;
                }
            }
        }
        let prefix = self.prefix(*meta.level(), meta.target());
        for line in text.lines() {
            writeln!(writer, "{prefix}{line}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verbosity_moves_both_levels() {
        assert!(default_directives(0).starts_with("warn,ort=error,trainer=info,"));
        assert!(default_directives(-1).starts_with("error,"));
        assert!(default_directives(1).contains("edge_agent=debug"));
        assert!(default_directives(3).starts_with("trace,"));
        for v in -2..4 {
            EnvFilter::try_new(default_directives(v)).unwrap();
        }
    }

    #[test]
    fn prefixes_read_as_before_and_as_journald_wants() {
        let plain = LineFormat { journal: false };
        assert_eq!(plain.prefix(Level::ERROR, "edge_agent::agent"), "error: ");
        assert_eq!(plain.prefix(Level::INFO, "trainer"), "");
        assert_eq!(
            plain.prefix(Level::WARN, "delta_kernel::log_segment"),
            "warning: delta_kernel::log_segment: "
        );
        assert_eq!(
            plain.prefix(Level::DEBUG, "kestrel_trainer::data"),
            "debug: kestrel_trainer::data: "
        );
        // A crate whose name only starts like ours is a library.
        assert_eq!(plain.prefix(Level::INFO, "trainers"), "trainers: ");
        let journal = LineFormat { journal: true };
        assert_eq!(journal.prefix(Level::ERROR, "edge_agent"), "<3>");
        assert_eq!(journal.prefix(Level::WARN, "edge_agent::agent"), "<4>");
        assert_eq!(
            journal.prefix(Level::INFO, "rumqttc::state"),
            "<6>rumqttc::state: "
        );
        assert_eq!(journal.prefix(Level::TRACE, "trainer"), "<7>");
    }
}
