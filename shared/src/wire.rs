//! The wire's vocabulary: every closed set of values a message carries (a device's state, a shadow
//! model's state, an event's kind, a capture's reason, an artifact's quantization form), and the
//! small value types all messages share ([`Class`], [`sha256_hex`]).
//!
//! Each set is an enum whose JSON is today's string (`"health-check"`, `"rolled-back"`,
//! `"int8-weights"`). A value this build does not know (sent by a newer peer, or by a device that
//! lies) becomes `Unknown(text)`: never a parse failure that drops the whole message, never a silent
//! default, and shown as sent. Code compares the enums, never the strings (`scripts/layers.py`
//! fails on a wire value compared as a string outside this crate); docs/protocol.md's
//! "Wire vocabulary" table is [`vocabulary_table`], checked by a test.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest, Sha256};

/// One closed set of wire values: the enum, its `Unknown(String)`, and the string conversions.
macro_rules! wire_enum {
    (
        $(#[$meta:meta])*
        $name:ident ($field:literal) {
            $( $(#[$vmeta:meta])* $variant:ident = $text:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )+
            /// A value this build does not know, kept as it was sent.
            Unknown(String),
        }

        impl $name {
            /// The values this build knows, in their wire form.
            pub const KNOWN: &'static [&'static str] = &[$($text),+];
            /// The message field that carries it (for docs and errors).
            pub const FIELD: &'static str = $field;

            /// The wire form (an unknown value as it was sent).
            pub fn as_str(&self) -> &str {
                match self {
                    $( Self::$variant => $text, )+
                    Self::Unknown(s) => s,
                }
            }

            /// Reads a wire value; one this build does not know is [`Self::Unknown`].
            pub fn parse(s: &str) -> Self {
                match s {
                    $( $text => Self::$variant, )+
                    other => Self::Unknown(other.to_string()),
                }
            }

            pub fn is_known(&self) -> bool {
                !matches!(self, Self::Unknown(_))
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.pad(self.as_str())
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = std::borrow::Cow::<'de, str>::deserialize(d)?;
                Ok(Self::parse(&s))
            }
        }
    };
}

wire_enum! {
    /// What a device's update machine is doing (`Status.state`).
    DeviceState ("Status.state") {
        Idle = "idle",
        Downloading = "downloading",
        Verifying = "verifying",
        Staged = "staged",
        HealthCheck = "health-check",
        Activating = "activating",
    }
}

wire_enum! {
    /// How far a device got with the shadow model its desired state names (`ShadowStatus.state`).
    ShadowState ("ShadowStatus.state") {
        Downloading = "downloading",
        /// Checking it, or a restarted agent loading it again.
        Verifying = "verifying",
        /// Loaded, and compared on live requests.
        Running = "running",
        Failed = "failed",
    }
}

wire_enum! {
    /// A device's transition (`DeviceEvent.kind`).
    EventKind ("DeviceEvent.kind") {
        Downloading = "downloading",
        Rejected = "rejected",
        RolledBack = "rolled-back",
        Active = "active",
        /// A desired state refused by the replay, expiry and clear rules.
        Refused = "refused",
    }
}

wire_enum! {
    /// Why a device captured an input (`Capture.reason`).
    CaptureReason ("Capture.reason") {
        LowConfidence = "low-confidence",
        Random = "random",
        Drift = "drift",
    }
}

wire_enum! {
    /// How an artifact's weights and activations are stored (`Quantization.form` of a manifest).
    QuantForm ("Quantization.form") {
        /// f32 weights (or f16 with `--precision f16`).
        None = "none",
        /// int8 weights per output channel, dequantized to f32 before each layer.
        Int8Weights = "int8-weights",
        /// int8 weights and activations (static, calibrated).
        Int8 = "int8",
    }
}

impl EventKind {
    /// A kind that says something went wrong (logged as a warning).
    pub fn is_failure(&self) -> bool {
        matches!(self, Self::Rejected | Self::RolledBack | Self::Refused)
    }
}

/// One class of a prediction: its index, its label and its score.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Class {
    pub class: usize,
    pub label: String,
    pub score: f32,
}

/// A sha256 digest as the wire writes it: 64 lowercase hex digits.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// The Markdown table of every closed set (docs/protocol.md carries it verbatim).
pub fn vocabulary_table() -> String {
    let rows: [(&str, &[&str]); 5] = [
        (DeviceState::FIELD, DeviceState::KNOWN),
        (ShadowState::FIELD, ShadowState::KNOWN),
        (EventKind::FIELD, EventKind::KNOWN),
        (CaptureReason::FIELD, CaptureReason::KNOWN),
        (QuantForm::FIELD, QuantForm::KNOWN),
    ];
    let mut out = String::from("| field | values |\n|---|---|\n");
    for (field, values) in rows {
        let values: Vec<String> = values.iter().map(|v| format!("`{v}`")).collect();
        out.push_str(&format!("| `{field}` | {} |\n", values.join(", ")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values_keep_their_json_and_unknown_ones_are_kept_as_sent() {
        for v in DeviceState::KNOWN {
            let s = DeviceState::parse(v);
            assert!(s.is_known(), "{v}");
            assert_eq!(serde_json::to_string(&s).unwrap(), format!("\"{v}\""));
        }
        assert_eq!(
            serde_json::from_str::<DeviceState>("\"health-check\"").unwrap(),
            DeviceState::HealthCheck
        );
        assert_eq!(
            serde_json::from_str::<EventKind>("\"rolled-back\"").unwrap(),
            EventKind::RolledBack
        );
        let newer: ShadowState = serde_json::from_str("\"warming-up\"").unwrap();
        assert_eq!(newer, ShadowState::Unknown("warming-up".into()));
        assert_eq!(serde_json::to_string(&newer).unwrap(), "\"warming-up\"");
        assert_eq!(format!("[{:<8}]", QuantForm::Int8), "[int8    ]");
        // Not a string at all is still a parse error (the message is malformed, not newer).
        assert!(serde_json::from_str::<QuantForm>("3").is_err());
    }

    #[test]
    fn every_set_is_named_once_and_failures_are_the_failing_kinds() {
        let failing: Vec<&str> = EventKind::KNOWN
            .iter()
            .filter(|k| EventKind::parse(k).is_failure())
            .copied()
            .collect();
        assert_eq!(failing, ["rejected", "rolled-back", "refused"]);
        assert!(!EventKind::Unknown("x".into()).is_failure());
        let table = vocabulary_table();
        assert_eq!(table.lines().count(), 2 + 5);
        assert!(table.contains("| `Status.state` | `idle`, `downloading`, `verifying`, `staged`"));
    }

    #[test]
    fn docs_protocol_carries_the_vocabulary_table() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/protocol.md");
        let doc = std::fs::read_to_string(path).unwrap();
        assert!(
            doc.contains(&vocabulary_table()),
            "docs/protocol.md's \"Wire vocabulary\" table is not wire::vocabulary_table(); put this there:\n{}",
            vocabulary_table()
        );
    }
}
