//! Ed25519 signatures over Kestrel's signed bodies: artifact manifests (`manifest.json`, signed
//! into `manifest.sig`), desired states, key lists, operators' rollout commands and rollout
//! controllers' saved states. Keys are stored as hex (secret: 32-byte seed; public: 32 bytes).
//!
//! Every signature names the type of what it signs ([`PayloadType`]) and covers that type with
//! the body (DSSE's pre-authentication encoding, [`pae`]): a signature made for one kind of body
//! never verifies as another kind (a rollout command's signature is no desired state's), and a
//! verifier says which type it expects.

use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub const SIGNATURE_FILE: &str = "manifest.sig";

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SignError {
    #[error("{what}: not a valid {expected} (hex)")]
    BadKey {
        what: String,
        expected: &'static str,
    },
    #[error("signed by unknown key {0}")]
    UnknownKey(String),
    #[error("bad signature: altered, or not signed by key {0}")]
    BadSignature(String),
    #[error("manifest.sig: {0}")]
    Format(String),
    #[error(
        "signed as {found:?}, not as {expected:?} (a signature is good for one kind of body only)"
    )]
    WrongType {
        expected: &'static str,
        found: String,
    },
}

/// What a signature is for: named inside the signature and covered by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadType {
    /// An artifact's `manifest.json` (publishing key).
    Manifest,
    /// A device's or group's desired state (publishing key).
    Desired,
    /// The list of publishing keys (root key).
    KeyList,
    /// An operator's command to a rollout controller (operator or publishing key).
    Command,
    /// A rollout controller's saved state, retained on `P/rollouts/<name>/state` (the key the
    /// rollout signs its desired states with): what a restarted controller resumes.
    RolloutState,
}

impl PayloadType {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Manifest => "application/vnd.kestrel.manifest+json",
            Self::Desired => "application/vnd.kestrel.desired+json",
            Self::KeyList => "application/vnd.kestrel.keylist+json",
            Self::Command => "application/vnd.kestrel.command+json",
            Self::RolloutState => "application/vnd.kestrel.rollout-state+json",
        }
    }
}

/// DSSE's pre-authentication encoding: `DSSEv1 LEN(type) type LEN(body) body`, the bytes a
/// signature covers (so neither the type nor the body can be changed or moved between them).
pub fn pae(ty: PayloadType, body: &[u8]) -> Vec<u8> {
    let t = ty.as_str();
    let mut out = format!("DSSEv1 {} {t} {} ", t.len(), body.len()).into_bytes();
    out.extend_from_slice(body);
    out
}

/// `manifest.sig` (and the signature beside every signed body): which key signed, for what type
/// of body, and the signature over [`pae`] of both.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SignatureFile {
    pub key_id: String,
    /// [`PayloadType::as_str`]; empty in a signature from before types were named (refused).
    #[serde(default)]
    pub payload_type: String,
    pub signature: String,
}

/// Short identity of a public key: the first 16 hex digits of its sha256.
pub fn key_id(public: &VerifyingKey) -> String {
    hex::encode(Sha256::digest(public.as_bytes()))[..16].to_string()
}

fn bytes32(hex_text: &str, what: &str, expected: &'static str) -> Result<[u8; 32], SignError> {
    let bad = || SignError::BadKey {
        what: what.to_string(),
        expected,
    };
    let v = hex::decode(hex_text.trim()).map_err(|_| bad())?;
    v.try_into().map_err(|_| bad())
}

/// Parses a secret key file's content (hex seed).
pub fn secret_key(hex_text: &str, what: &str) -> Result<SigningKey, SignError> {
    Ok(SigningKey::from_bytes(&bytes32(
        hex_text,
        what,
        "ed25519 secret key",
    )?))
}

/// Parses a public key file's content (hex).
pub fn public_key(hex_text: &str, what: &str) -> Result<VerifyingKey, SignError> {
    let b = bytes32(hex_text, what, "ed25519 public key")?;
    VerifyingKey::from_bytes(&b).map_err(|_| SignError::BadKey {
        what: what.to_string(),
        expected: "ed25519 public key",
    })
}

/// A key pair from 32 random bytes: (secret hex, public hex).
pub fn keypair_hex(seed: [u8; 32]) -> (String, String) {
    let sk = SigningKey::from_bytes(&seed);
    (
        hex::encode(seed),
        hex::encode(sk.verifying_key().as_bytes()),
    )
}

/// Signs `body` (its exact bytes) as a `ty`.
pub fn sign(key: &SigningKey, ty: PayloadType, body: &[u8]) -> SignatureFile {
    SignatureFile {
        key_id: key_id(&key.verifying_key()),
        payload_type: ty.as_str().to_string(),
        signature: hex::encode(key.sign(&pae(ty, body)).to_bytes()),
    }
}

/// Verifies that one of the `trusted` keys signed `body` as a `ty`; returns the key id.
pub fn verify(
    trusted: &[VerifyingKey],
    ty: PayloadType,
    body: &[u8],
    sig: &SignatureFile,
) -> Result<String, SignError> {
    if sig.payload_type != ty.as_str() {
        return Err(SignError::WrongType {
            expected: ty.as_str(),
            found: sig.payload_type.clone(),
        });
    }
    let key = trusted
        .iter()
        .find(|k| key_id(k) == sig.key_id)
        .ok_or_else(|| SignError::UnknownKey(sig.key_id.clone()))?;
    let raw = hex::decode(&sig.signature).map_err(|e| SignError::Format(e.to_string()))?;
    let raw: [u8; 64] = raw
        .try_into()
        .map_err(|_| SignError::Format("signature is not 64 bytes".into()))?;
    key.verify(&pae(ty, body), &Signature::from_bytes(&raw))
        .map_err(|_| SignError::BadSignature(sig.key_id.clone()))?;
    Ok(sig.key_id.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_verify_and_rejections() {
        let (sk_hex, pk_hex) = keypair_hex([7; 32]);
        let (_, other_hex) = keypair_hex([8; 32]);
        let sk = secret_key(&sk_hex, "k").unwrap();
        let pk = public_key(&pk_hex, "p").unwrap();
        let other = public_key(&other_hex, "o").unwrap();
        let msg = br#"{"name":"m","version":2}"#;
        let m = PayloadType::Manifest;
        let sig = sign(&sk, m, msg);
        assert_eq!(verify(&[other, pk], m, msg, &sig), Ok(key_id(&pk)));
        assert_eq!(
            verify(&[other], m, msg, &sig),
            Err(SignError::UnknownKey(key_id(&pk)))
        );
        let altered = br#"{"name":"m","version":3}"#;
        assert!(matches!(
            verify(&[pk], m, altered, &sig),
            Err(SignError::BadSignature(_))
        ));
        // A signature is good for its own type only: claimed as another, or relabelled.
        assert!(matches!(
            verify(&[pk], PayloadType::Desired, msg, &sig),
            Err(SignError::WrongType { .. })
        ));
        let relabelled = SignatureFile {
            payload_type: PayloadType::Desired.as_str().into(),
            ..sig.clone()
        };
        assert!(matches!(
            verify(&[pk], PayloadType::Desired, msg, &relabelled),
            Err(SignError::BadSignature(_))
        ));
        // A signature over the bare body (as before types were named) does not verify.
        let untyped = SignatureFile {
            signature: hex::encode(sk.sign(msg).to_bytes()),
            ..sig.clone()
        };
        assert!(matches!(
            verify(&[pk], m, msg, &untyped),
            Err(SignError::BadSignature(_))
        ));
        assert!(matches!(
            public_key("zz", "trusted.pub"),
            Err(SignError::BadKey { .. })
        ));
        assert!(public_key(&pk_hex[..10], "short").is_err());
    }
}
