//! An operator's command to a running rollout controller (`trainer console --allow-actions`):
//! published on `P/rollouts/<name>/command` (QoS 1, not retained), signed as a command
//! ([`PayloadType::Command`]) with a key the controller trusts: an operator key
//! (`trainer keygen --operator`, given to `trainer rollout --operator-pub`), which can sign
//! nothing a device accepts, or the controller's own publishing key. The controller honours it
//! only if the signature verifies, it names this rollout, it was issued within [`FRESH_MS`] of the
//! controller's clock (a recorded command replayed later is refused) and its nonce is new (a
//! command replayed within that window is refused too: the controller remembers the nonces of the
//! commands it honoured until they would be stale anyway).

use ed25519_dalek::{SigningKey, VerifyingKey};
use kestrel_shared::signing::{PayloadType, SignatureFile, sign, verify};
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
    /// Unique per command ([`Command::new_nonce`]): a command whose nonce the controller has
    /// seen is a replay.
    #[serde(default)]
    pub nonce: String,
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
    #[error("replayed: nonce {0} was honoured already")]
    Replayed(String),
    #[error("no nonce (a command without one could be replayed)")]
    NoNonce,
}

impl Command {
    /// A nonce no other command of this or another process has: the time in nanoseconds, the
    /// process id and a counter.
    pub fn new_nonce() -> String {
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let nanos = std::time::UNIX_EPOCH.elapsed().map_or(0, |d| d.as_nanos());
        format!("{nanos:x}-{:x}-{n}", std::process::id())
    }

    pub fn sign(&self, key: &SigningKey) -> SignedCommand {
        let body = serde_json::to_string(self).expect("serializable");
        let signature = sign(key, PayloadType::Command, body.as_bytes());
        SignedCommand { body, signature }
    }

    /// The command in `payload`, if one of the `trusted` keys signed it as a command for rollout
    /// `name` within [`FRESH_MS`] of `now_ms`.
    pub fn open(
        payload: &[u8],
        trusted: &[VerifyingKey],
        name: &str,
        now_ms: u64,
    ) -> Result<Self, CommandError> {
        let signed: SignedCommand =
            serde_json::from_slice(payload).map_err(|e| CommandError::Format(e.to_string()))?;
        verify(
            trusted,
            PayloadType::Command,
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
        if c.nonce.is_empty() {
            return Err(CommandError::NoNonce);
        }
        Ok(c)
    }
}

/// The nonces of the commands a controller honoured, each until it would be stale anyway.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Nonces(std::collections::BTreeMap<String, u64>);

impl Nonces {
    /// Takes `c`'s nonce at `now_ms`; refused when it was taken before.
    pub fn take(&mut self, c: &Command, now_ms: u64) -> Result<(), CommandError> {
        self.0
            .retain(|_, issued| issued.abs_diff(now_ms) <= FRESH_MS);
        if self.0.contains_key(&c.nonce) {
            return Err(CommandError::Replayed(c.nonce.clone()));
        }
        self.0.insert(c.nonce.clone(), c.issued);
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
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
            nonce: format!("n-{issued}"),
        }
    }

    #[test]
    fn a_command_is_honoured_once() {
        let now = 1_796_022_428_000;
        let mut seen = Nonces::default();
        let c = cmd("r1", now);
        assert_eq!(seen.take(&c, now), Ok(()));
        assert_eq!(
            seen.take(&c, now + 1_000),
            Err(CommandError::Replayed(c.nonce.clone()))
        );
        // Forgotten once it would be stale: by then `open` refuses it.
        assert_eq!(seen.take(&cmd("r1", now + 1), now + 1), Ok(()));
        assert_eq!(seen.take(&c, now + FRESH_MS + 1), Ok(()));
        assert!(matches!(
            Command::open(
                &serde_json::to_vec(&c.sign(&SigningKey::from_bytes(&[3; 32]))).unwrap(),
                &[SigningKey::from_bytes(&[3; 32]).verifying_key()],
                "r1",
                now + FRESH_MS + 1
            ),
            Err(CommandError::Stale(_))
        ));
        let mut blank = cmd("r1", now);
        blank.nonce.clear();
        let key = SigningKey::from_bytes(&[3; 32]);
        let signed = serde_json::to_vec(&blank.sign(&key)).unwrap();
        assert_eq!(
            Command::open(&signed, &[key.verifying_key()], "r1", now),
            Err(CommandError::NoNonce)
        );
    }

    #[test]
    fn only_a_fresh_command_signed_for_this_rollout_opens() {
        let key = SigningKey::from_bytes(&[3; 32]);
        let rogue = SigningKey::from_bytes(&[4; 32]);
        let pk = [key.verifying_key()];
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
        // A desired state's signature (same key, same bytes) is no command's.
        let c = cmd("r1", now);
        let body = serde_json::to_string(&c).unwrap();
        let as_desired = SignedCommand {
            signature: sign(&key, PayloadType::Desired, body.as_bytes()),
            body,
        };
        assert!(matches!(
            Command::open(&serde_json::to_vec(&as_desired).unwrap(), &pk, "r1", now),
            Err(CommandError::Signature(_))
        ));
    }
}
