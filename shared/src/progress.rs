//! Progress bars of long work (decoding, features, evaluation, publishing), in one style. They
//! draw on stderr when it is a terminal; a host that shows output elsewhere (the Python package:
//! a notebook cell) installs a [`Sink`], and every bar made after that hands it its lines.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle, TermLike};

/// Where bars go instead of stderr: `show(bar, line)` on each redraw (at most `REDRAW_HZ` a
/// second), `line` empty once the bar is cleared.
pub trait Sink: Send + Sync {
    fn show(&self, bar: u64, line: &str);
}

static SINK: OnceLock<Box<dyn Sink>> = OnceLock::new();
static NEXT_BAR: AtomicU64 = AtomicU64::new(1);
/// Redraws a second handed to a sink.
const REDRAW_HZ: u8 = 4;

/// Sends the bars made from now on to `sink` (once per process; `false` if one was installed).
pub fn set_sink(sink: Box<dyn Sink>) -> bool {
    SINK.set(sink).is_ok()
}

/// A bar of `len` steps labelled `what`.
pub fn bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    if SINK.get().is_some() {
        let term = SinkTerm {
            bar: NEXT_BAR.fetch_add(1, Ordering::Relaxed),
            line: Mutex::new(String::new()),
        };
        pb.set_draw_target(ProgressDrawTarget::term_like_with_hz(
            Box::new(term),
            REDRAW_HZ,
        ));
    }
    pb.set_style(
        ProgressStyle::with_template("{msg:>12} [{bar:30}] {pos}/{len} {per_sec} eta {eta}")
            .expect("template")
            .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

/// A terminal of one line whose every flush goes to the [`Sink`].
struct SinkTerm {
    bar: u64,
    line: Mutex<String>,
}

impl fmt::Debug for SinkTerm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SinkTerm({})", self.bar)
    }
}

impl SinkTerm {
    fn with_line(&self, f: impl FnOnce(&mut String)) -> std::io::Result<()> {
        f(&mut self.line.lock().unwrap_or_else(|p| p.into_inner()));
        Ok(())
    }
}

impl TermLike for SinkTerm {
    fn width(&self) -> u16 {
        100
    }
    fn move_cursor_up(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_down(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn write_line(&self, s: &str) -> std::io::Result<()> {
        self.with_line(|l| {
            l.clear();
            l.push_str(s);
        })
    }
    fn write_str(&self, s: &str) -> std::io::Result<()> {
        self.with_line(|l| l.push_str(s))
    }
    fn clear_line(&self) -> std::io::Result<()> {
        self.with_line(String::clear)
    }
    fn flush(&self) -> std::io::Result<()> {
        let line = self.line.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(sink) = SINK.get() {
            sink.show(self.bar, line.trim_end());
        }
        Ok(())
    }
}
