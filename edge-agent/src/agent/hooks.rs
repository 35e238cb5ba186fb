//! Test hooks, compiled in only with the cargo feature `test-hooks` (the test command's build;
//! never a device build): `KESTREL_AGENT_PAUSE=activate` stops an update between its health check
//! and the atomic switch (journaled as `activating`), still connected, so a test can kill the
//! agent at exactly that point. Without the feature nothing reads the variable.

/// Where the agent stops, if anywhere.
#[derive(Debug, Default)]
pub(super) struct Pause {
    #[cfg(feature = "test-hooks")]
    activate: bool,
}

impl Pause {
    pub(super) fn from_env() -> Self {
        Self {
            #[cfg(feature = "test-hooks")]
            activate: std::env::var("KESTREL_AGENT_PAUSE").is_ok_and(|v| v == "activate"),
        }
    }

    /// Whether to stop before activating an update.
    pub(super) fn before_activating(&self) -> bool {
        #[cfg(feature = "test-hooks")]
        return self.activate;
        #[cfg(not(feature = "test-hooks"))]
        false
    }
}
