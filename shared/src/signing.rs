//! Ed25519 signatures over artifact manifests. The trainer signs the exact bytes of
//! `manifest.json` into `manifest.sig`; devices accept a manifest only when a trusted public key
//! verifies it. Keys are stored as hex (secret: 32-byte seed; public: 32 bytes).

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
}

/// `manifest.sig`: which key signed, and the signature.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SignatureFile {
    pub key_id: String,
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

/// Signs `manifest` (the exact bytes of manifest.json).
pub fn sign(key: &SigningKey, manifest: &[u8]) -> SignatureFile {
    SignatureFile {
        key_id: key_id(&key.verifying_key()),
        signature: hex::encode(key.sign(manifest).to_bytes()),
    }
}

/// Verifies `manifest` against its signature with one of the `trusted` keys; returns the key id.
pub fn verify(
    trusted: &[VerifyingKey],
    manifest: &[u8],
    sig: &SignatureFile,
) -> Result<String, SignError> {
    let key = trusted
        .iter()
        .find(|k| key_id(k) == sig.key_id)
        .ok_or_else(|| SignError::UnknownKey(sig.key_id.clone()))?;
    let raw = hex::decode(&sig.signature).map_err(|e| SignError::Format(e.to_string()))?;
    let raw: [u8; 64] = raw
        .try_into()
        .map_err(|_| SignError::Format("signature is not 64 bytes".into()))?;
    key.verify(manifest, &Signature::from_bytes(&raw))
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
        let sig = sign(&sk, msg);
        assert_eq!(verify(&[other, pk], msg, &sig), Ok(key_id(&pk)));
        assert_eq!(
            verify(&[other], msg, &sig),
            Err(SignError::UnknownKey(key_id(&pk)))
        );
        let altered = br#"{"name":"m","version":3}"#;
        assert!(matches!(
            verify(&[pk], altered, &sig),
            Err(SignError::BadSignature(_))
        ));
        assert!(matches!(
            public_key("zz", "trusted.pub"),
            Err(SignError::BadKey { .. })
        ));
        assert!(public_key(&pk_hex[..10], "short").is_err());
    }
}
