//! The Rust code's log events as Python `logging` records, so that a notebook shows them in the
//! cell and `logging` configures them: the subscriber queues each event (bounded: the oldest go
//! first, counted) and the thread that holds the GIL forwards the queue to `logging` — while it
//! waits on a command ([`crate::interruptible`], every 100 ms) and when the command returns. No
//! Rust thread ever waits for the GIL to log. [`init`] may be called again: it swaps the level
//! filter of the installed subscriber. Progress bars take the same way: the latest line of each
//! bar waits here, and `kestrel._progress.show` draws it (a notebook cell's display).

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use pyo3::prelude::*;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::{EnvFilter, Layer, Registry, reload};

/// Records waiting for the GIL; beyond this many the oldest are dropped (and counted).
const MAX_QUEUED: usize = 10_000;

struct Record {
    level: u8,
    logger: String,
    message: String,
}

static QUEUE: Mutex<VecDeque<Record>> = Mutex::new(VecDeque::new());
static DROPPED: AtomicU64 = AtomicU64::new(0);
static FILTER: OnceLock<reload::Handle<EnvFilter, Registry>> = OnceLock::new();
/// The latest line of each progress bar redrawn since the last [`forward`].
static BARS: Mutex<BTreeMap<u64, String>> = Mutex::new(BTreeMap::new());

/// The bars' sink: keeps each bar's latest line for [`forward`].
struct Bars;

impl kestrel_shared::progress::Sink for Bars {
    fn show(&self, bar: u64, line: &str) {
        let mut bars = BARS.lock().unwrap_or_else(|p| p.into_inner());
        bars.insert(bar, line.to_string());
    }
}

/// Logs at `verbosity` (0 information from Kestrel and warnings from libraries, 1 debug, -1
/// errors only); `RUST_LOG`, when set, wins. Installs the subscriber the first time, swaps its
/// filter after that.
pub fn init(verbosity: i8) {
    let directives = match std::env::var("RUST_LOG") {
        Ok(s) if EnvFilter::try_new(&s).is_ok() && !s.trim().is_empty() => s,
        _ => kestrel_shared::logging::default_directives(verbosity),
    };
    let filter = EnvFilter::new(directives);
    if let Some(h) = FILTER.get() {
        let _ = h.reload(filter);
        return;
    }
    kestrel_shared::progress::set_sink(Box::new(Bars));
    let (layer, handle) = reload::Layer::new(filter);
    let subscriber = Registry::default().with(layer).with(Queue);
    if tracing::subscriber::set_global_default(subscriber).is_ok() {
        let _ = FILTER.set(handle);
    }
}

/// Hands the queued records to Python's `logging` (logger `kestrel.<crate>.<module>`), and the
/// bars' latest lines to `kestrel._progress.show(bar, line)`.
pub fn forward(py: Python<'_>) -> PyResult<()> {
    let bars = std::mem::take(&mut *BARS.lock().unwrap_or_else(|p| p.into_inner()));
    if !bars.is_empty() {
        let show = py.import("kestrel._progress")?.getattr("show")?;
        for (bar, line) in bars {
            show.call1((bar, line))?;
        }
    }
    let records: Vec<Record> = {
        let mut q = QUEUE.lock().unwrap_or_else(|p| p.into_inner());
        q.drain(..).collect()
    };
    let dropped = DROPPED.swap(0, Ordering::Relaxed);
    if records.is_empty() && dropped == 0 {
        return Ok(());
    }
    let logging = py.import("logging")?;
    if dropped > 0 {
        logging
            .getattr("getLogger")?
            .call1(("kestrel",))?
            .call_method1(
                "warning",
                (format!(
                    "{dropped} log records dropped (more than {MAX_QUEUED} waited for Python)"
                ),),
            )?;
    }
    for r in records {
        let logger = logging.getattr("getLogger")?.call1((r.logger,))?;
        logger.call_method1("log", (r.level, r.message))?;
    }
    Ok(())
}

/// The layer that queues events.
struct Queue;

impl<S: Subscriber> Layer<S> for Queue {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let meta = event.metadata();
        let mut text = Text::default();
        event.record(&mut text);
        let record = Record {
            level: python_level(*meta.level()),
            logger: logger_name(meta.target()),
            message: text.0,
        };
        let mut q = QUEUE.lock().unwrap_or_else(|p| p.into_inner());
        if q.len() >= MAX_QUEUED {
            q.pop_front();
            DROPPED.fetch_add(1, Ordering::Relaxed);
        }
        q.push_back(record);
    }
}

/// `logging`'s numeric levels.
fn python_level(l: Level) -> u8 {
    match l {
        Level::ERROR => 40,
        Level::WARN => 30,
        Level::INFO => 20,
        Level::DEBUG | Level::TRACE => 10,
    }
}

/// `kestrel_trainer::train::fit` → `kestrel.trainer.train.fit`; a library's target under
/// `kestrel.lib`.
fn logger_name(target: &str) -> String {
    let dotted = target.replace("::", ".");
    match dotted.strip_prefix("kestrel_") {
        Some(ours) => format!("kestrel.{ours}"),
        None if dotted == "trainer" || dotted.starts_with("trainer.") => {
            format!("kestrel.{dotted}")
        }
        None => format!("kestrel.lib.{dotted}"),
    }
}

/// An event's message, then its other fields as `name=value`.
#[derive(Default)]
struct Text(String);

impl Visit for Text {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let rest = std::mem::take(&mut self.0);
            self.0 = format!("{value:?}");
            if !rest.is_empty() {
                self.0.push(' ');
                self.0.push_str(&rest);
            }
        } else {
            let sep = if self.0.is_empty() { "" } else { " " };
            let _ = write!(self.0, "{sep}{}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.record_debug(field, &format_args!("{value}"));
        } else {
            let sep = if self.0.is_empty() { "" } else { " " };
            let _ = write!(self.0, "{sep}{}={value}", field.name());
        }
    }
}
