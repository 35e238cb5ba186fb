//! A stop asked for from outside a command: the Python package's Ctrl-C ("interrupt kernel" in
//! a notebook) while a command runs in that process. The long loops — each training batch (so
//! each tuning trial) and each batch of backbone features — check it and end with
//! [`Interrupted`]; every file a command writes is written crash-safe, so an interrupted command
//! leaves only whole files. The flag is the process's: it stops every command running in it.
//! The `trainer` binary does not use it (Ctrl-C ends the process).

use std::sync::atomic::{AtomicBool, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);

/// The command stopped because a stop was asked for.
#[derive(Debug, thiserror::Error)]
#[error("interrupted")]
pub struct Interrupted;

/// Asks every running command to stop at its next check.
pub fn request() {
    REQUESTED.store(true, Ordering::SeqCst);
}

/// Withdraws the request (once the interrupted command has ended).
pub fn clear() {
    REQUESTED.store(false, Ordering::SeqCst);
}

/// `Err(Interrupted)` once a stop was asked for.
pub fn check() -> Result<(), Interrupted> {
    if REQUESTED.load(Ordering::Relaxed) {
        Err(Interrupted)
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_request_is_seen_until_cleared() {
        super::clear();
        assert!(super::check().is_ok());
        super::request();
        assert!(super::check().is_err());
        super::clear();
        assert!(super::check().is_ok());
    }
}
