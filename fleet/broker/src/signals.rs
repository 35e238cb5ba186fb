//! SIGTERM and SIGINT, caught: each is recorded and, in the supervising process, handed on to
//! the child, so that `kill PID` (or Ctrl-C) stops the broker cleanly: the child writes the
//! retained messages it has not written yet and exits, then the supervisor exits, and the port
//! is free once `trainer broker`'s PID is gone.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

static STOP: AtomicBool = AtomicBool::new(false);
/// The running child's PID in the supervisor (0: none).
static CHILD: AtomicI32 = AtomicI32::new(0);

#[cfg(unix)]
extern "C" fn on_signal(sig: libc::c_int) {
    // Only what a signal handler may do: atomics and kill(2).
    STOP.store(true, Ordering::SeqCst);
    let child = CHILD.load(Ordering::SeqCst);
    if child > 0 {
        // SAFETY: kill(2) is async-signal-safe.
        unsafe {
            libc::kill(child, sig);
        }
    }
}

/// Catches SIGTERM and SIGINT from now on.
pub fn catch() {
    #[cfg(unix)]
    {
        let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        // SAFETY: the handler only touches atomics and calls kill(2).
        unsafe {
            libc::signal(libc::SIGTERM, handler);
            libc::signal(libc::SIGINT, handler);
        }
    }
}

/// A SIGTERM or SIGINT came.
pub fn stop_requested() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// The supervisor's child is now `pid` (`None`: it has exited). A stop requested before the
/// child was known is handed on now.
pub fn set_child(pid: Option<u32>) {
    let pid = pid.and_then(|p| i32::try_from(p).ok()).unwrap_or(0);
    CHILD.store(pid, Ordering::SeqCst);
    #[cfg(unix)]
    if pid > 0 && stop_requested() {
        // SAFETY: a plain kill(2) of our own child.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
    }
}
