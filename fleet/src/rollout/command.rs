//! An operator's command to a running rollout controller (`trainer console --allow-actions`):
//! published on `P/rollouts/<name>/command` (QoS 1, not retained), signed with a key the
//! controller trusts (the key it signs desired states with). The controller honours it only if
//! the signature verifies, it names this rollout and it was issued within [`FRESH_MS`] of the
//! controller's clock (a recorded command replayed later is refused).

use ed25519_dalek::{SigningKey, VerifyingKey};
use kestrel_shared::signing::{SignatureFile, sign, verify};
use serde::{Deserialize, Serialize};

/// How far a command's `issued` may be from the controller's clock.
pub const FRESH_MS: u64 = 120_000;

/// What the operator asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Action {
    /// Stop the rollout and send every device already moved back to its previous model.
    Abort,
    /// Hold the rollout in its current phase (its devices go on; the next phase does not start).
    Pause,
    /// Let a paused rollout go on.
    Resume,
}

/// The command itself (the signed `body`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Command {
    pub rollout: String,
    pub action: Action,
    /// Why, in the operator's words (it becomes the abort reason).
    pub reason: String,
    /// Who asked, as the console names it (`console@HOST:PORT`).
    pub by: String,
    /// Milliseconds since the Unix epoch.
    pub issued: u64,
}

/// A command as published: the exact JSON of [`Command`] and its signature.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SignedCommand {
    pub body: String,
    pub signature: SignatureFile,
}

/// Why a command was not honoured.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum CommandError {
    #[error("not a signed command: {0}")]
    Format(String),
    #[error("signature: {0}")]
    Signature(String),
    #[error("names rollout {0}, not this one")]
    OtherRollout(String),
    #[error("issued {0} ms away from this controller's clock (at most {FRESH_MS} ms)")]
    Stale(u64),
}

impl Command {
    pub fn sign(&self, key: &SigningKey) -> SignedCommand {
        let body = serde_json::to_string(self).expect("serializable");
        let signature = sign(key, body.as_bytes());
        SignedCommand { body, signature }
    }

    /// The command in `payload`, if `trusted` signed it for rollout `name` within [`FRESH_MS`]
    /// of `now_ms`.
    pub fn open(
        payload: &[u8],
        trusted: &VerifyingKey,
        name: &str,
        now_ms: u64,
    ) -> Result<Self, CommandError> {
        let signed: SignedCommand =
            serde_json::from_slice(payload).map_err(|e| CommandError::Format(e.to_string()))?;
        verify(
            std::slice::from_ref(trusted),
            signed.body.as_bytes(),
            &signed.signature,
        )
        .map_err(|e| CommandError::Signature(e.to_string()))?;
        let c: Command =
            serde_json::from_str(&signed.body).map_err(|e| CommandError::Format(e.to_string()))?;
        if c.rollout != name {
            return Err(CommandError::OtherRollout(c.rollout));
        }
        if c.issued.abs_diff(now_ms) > FRESH_MS {
            return Err(CommandError::Stale(c.issued.abs_diff(now_ms)));
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cmd(rollout: &str, issued: u64) -> Command {
        Command {
            rollout: rollout.into(),
            action: Action::Abort,
            reason: "drift on the canary".into(),
            by: "console@127.0.0.1:8080".into(),
            issued,
        }
    }

    #[test]
    fn only_a_fresh_command_signed_for_this_rollout_opens() {
        let key = SigningKey::from_bytes(&[3; 32]);
        let rogue = SigningKey::from_bytes(&[4; 32]);
        let pk = key.verifying_key();
        let now = 1_796_022_428_000;
        let good = serde_json::to_vec(&cmd("r1", now - 5_000).sign(&key)).unwrap();
        assert_eq!(
            Command::open(&good, &pk, "r1", now).unwrap(),
            cmd("r1", now - 5_000)
        );
        let other = serde_json::to_vec(&cmd("r2", now).sign(&key)).unwrap();
        assert_eq!(
            Command::open(&other, &pk, "r1", now),
            Err(CommandError::OtherRollout("r2".into()))
        );
        let old = serde_json::to_vec(&cmd("r1", now - FRESH_MS - 1).sign(&key)).unwrap();
        assert!(matches!(
            Command::open(&old, &pk, "r1", now),
            Err(CommandError::Stale(_))
        ));
        let forged = serde_json::to_vec(&cmd("r1", now).sign(&rogue)).unwrap();
        assert!(matches!(
            Command::open(&forged, &pk, "r1", now),
            Err(CommandError::Signature(_))
        ));
        // A body edited after signing.
        let mut s = cmd("r1", now).sign(&key);
        s.body = s.body.replace("drift", "other");
        let edited = serde_json::to_vec(&s).unwrap();
        assert!(matches!(
            Command::open(&edited, &pk, "r1", now),
            Err(CommandError::Signature(_))
        ));
        assert!(matches!(
            Command::open(b"{}", &pk, "r1", now),
            Err(CommandError::Format(_))
        ));
    }
}
