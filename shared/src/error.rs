//! An error as one line of text: its message, then each cause's (`Error::source`), joined by
//! `": "` — what `anyhow`'s `{:#}` prints. Kestrel's errors keep their causes as sources (not as
//! strings); [`chain`] is where one becomes text: a log line, an MQTT reply, a Python exception,
//! a CLI's last words.
//!
//! Some libraries both print their cause and return it as the source (the `image` crate's
//! decoding errors); a cause whose text already ends the line is not printed twice.

use std::error::Error;
use std::fmt;

/// A cause kept as an error's `#[source]` where it can be one of several types, or a sentence
/// (`"no graph".into()`).
pub type Cause = Box<dyn Error + Send + Sync>;

/// `e` and its causes, `"outer: inner: innermost"`.
pub fn chain(e: &dyn Error) -> String {
    Chain(e).to_string()
}

/// [`chain`] as a `Display`, for `format!` arguments and `tracing` messages.
pub struct Chain<'a>(pub &'a dyn Error);

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut last = self.0.to_string();
        f.write_str(&last)?;
        let mut cause = self.0.source();
        while let Some(c) = cause {
            let text = c.to_string();
            if !text.is_empty() && !last.ends_with(&text) {
                write!(f, ": {text}")?;
            }
            last = text;
            cause = c.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("reading {path}")]
    struct Outer {
        path: &'static str,
        #[source]
        source: std::io::Error,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("decoding: {0}")]
    struct Repeats(#[source] std::io::Error);

    #[test]
    fn prints_each_cause_once() {
        let e = Outer {
            path: "a.json",
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "gone"),
        };
        assert_eq!(chain(&e), "reading a.json: gone");
        let r = Repeats(std::io::Error::other("bad header"));
        assert_eq!(chain(&r), "decoding: bad header");
        let nested = anyhow::Error::new(e).context("loading the model");
        assert_eq!(
            chain(nested.as_ref()),
            "loading the model: reading a.json: gone"
        );
    }
}
