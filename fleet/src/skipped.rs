//! Messages a long-running consumer (the rollout controller, the console, the collector) did not
//! take: malformed, or from a device that speaks for another. Each is one bad record: skipped,
//! counted, and logged the first time its source (the device of its topic, else the topic) sends
//! one, so a device that repeats a forgery every second cannot flood the log.

use std::collections::BTreeMap;

use kestrel_shared::topics::{Route, Topics};

#[derive(Debug, Default, Clone, PartialEq)]
pub struct Skipped {
    /// Messages skipped, by source.
    pub by_source: BTreeMap<String, u64>,
}

impl Skipped {
    /// Records a skipped message on `topic` and why; logs it when its source is new.
    pub fn note(
        &mut self,
        topics: &Topics,
        topic: &str,
        why: &dyn std::fmt::Display,
        log: &mut dyn FnMut(String),
    ) {
        let source = match topics.parse(topic) {
            Some(Route::Device { device, .. }) => format!("device {device}"),
            _ => topic.chars().take(200).collect(),
        };
        let n = self.by_source.entry(source.clone()).or_default();
        *n += 1;
        if *n == 1 {
            log(format!(
                "skipped a message from {source} (later ones from it are counted, not logged): {why}"
            ));
        }
    }

    pub fn total(&self) -> u64 {
        self.by_source.values().sum()
    }

    /// One line: how many were skipped, from how many sources; None when none were.
    pub fn summary(&self) -> Option<String> {
        (self.total() > 0).then(|| {
            format!(
                "{} messages skipped from {} sources ({})",
                self.total(),
                self.by_source.len(),
                self.by_source
                    .iter()
                    .take(5)
                    .map(|(s, n)| format!("{s}: {n}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
    }
}
