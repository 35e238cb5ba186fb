//! Where the commands print their results: stdout, or a buffer that the caller collects
//! ([`capture`]: the Python package returns a command's `--json` output as an object).

use std::cell::RefCell;

thread_local! {
    static CAPTURE: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// `print!` of the commands: to the capture buffer of this thread, if one is open, else stdout.
pub fn text(s: &str) {
    CAPTURE.with(|c| match &mut *c.borrow_mut() {
        Some(buf) => buf.push_str(s),
        None => {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            // A closed stdout (`trainer ... | head`) ends the output, not the command.
            let _ = out.write_all(s.as_bytes()).and_then(|_| out.flush());
        }
    })
}

/// Runs `f` with this thread's output going to a buffer, and returns the buffer with its value.
pub fn capture<T>(f: impl FnOnce() -> T) -> (T, String) {
    let outer = CAPTURE.with(|c| c.borrow_mut().replace(String::new()));
    let v = f();
    let text = CAPTURE.with(|c| std::mem::replace(&mut *c.borrow_mut(), outer));
    (v, text.unwrap_or_default())
}

/// `println!` to the command output ([`text`]).
macro_rules! outln {
    () => { $crate::cli::out::text("\n") };
    ($($t:tt)*) => { $crate::cli::out::text(&format!("{}\n", format_args!($($t)*))) };
}

/// `print!` to the command output ([`text`]).
macro_rules! out {
    ($($t:tt)*) => { $crate::cli::out::text(&format!($($t)*)) };
}
