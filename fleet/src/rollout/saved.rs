//! The controller's saved state as retained on `P/rollouts/<name>/state`: the [`Controller`]'s
//! exact JSON and a signature over it by the key the rollout signs its desired states with
//! ([`PayloadType::RolloutState`]). A restarted controller resumes only a state that its own key
//! signed, for the rollout its topic names, with the plan the operator gave again: anyone who
//! can publish to the broker can plant a state, and one resumed unchecked could finish a
//! rollout that never ran, or have the controller sign rollbacks to any version for any device.
//! Readers that only show the state (`trainer rollout status`, the console) read the body
//! without a key.

use ed25519_dalek::{SigningKey, VerifyingKey};
use kestrel_shared::protocol::{ProtocolError, parse};
use kestrel_shared::signing::{PayloadType, SignatureFile, sign, verify};
use serde::{Deserialize, Serialize};

use super::{Controller, Plan};

/// The retained payload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SignedState {
    pub body: String,
    pub signature: SignatureFile,
}

/// Why a saved state is not resumed.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("{topic}: not a signed rollout state (refusing to resume it)")]
    Format {
        topic: String,
        #[source]
        source: ProtocolError,
    },
    #[error(
        "{topic}: the saved state does not verify with this rollout's key (refusing to resume \
         it; planted, or saved by another key: give the rollout another name, or delete the \
         retained state)"
    )]
    Signature {
        topic: String,
        #[source]
        source: kestrel_shared::signing::SignError,
    },
    #[error("{topic}: the saved state is of rollout `{found}`, not of this topic's")]
    OtherRollout { topic: String, found: String },
    #[error(
        "{topic}: the saved rollout's plan differs from the plan given (resume with the same \
         plan, or give the new plan another rollout name)"
    )]
    OtherPlan { topic: String },
}

/// The payload to retain for `c`, signed with `key`.
pub fn seal(key: &SigningKey, c: &Controller) -> Vec<u8> {
    let body = serde_json::to_string(c).expect("serializable");
    let signature = sign(key, PayloadType::RolloutState, body.as_bytes());
    serde_json::to_vec(&SignedState { body, signature }).expect("serializable")
}

/// The controller saved on `topic` for rollout `name`, if `key` signed it and its plan is
/// `plan`.
pub fn open(
    topic: &str,
    payload: &[u8],
    name: &str,
    key: &VerifyingKey,
    plan: &Plan,
) -> Result<Controller, StateError> {
    let format = |source| StateError::Format {
        topic: topic.to_string(),
        source,
    };
    let signed: SignedState = parse(topic, payload).map_err(format)?;
    verify(
        &[*key],
        PayloadType::RolloutState,
        signed.body.as_bytes(),
        &signed.signature,
    )
    .map_err(|source| StateError::Signature {
        topic: topic.to_string(),
        source,
    })?;
    let c: Controller = parse(topic, signed.body.as_bytes()).map_err(format)?;
    if c.name != name {
        return Err(StateError::OtherRollout {
            topic: topic.to_string(),
            found: c.name,
        });
    }
    if &c.plan != plan {
        return Err(StateError::OtherPlan {
            topic: topic.to_string(),
        });
    }
    Ok(c)
}

/// The controller in a saved state, unverified: for showing it, never for acting on it.
pub fn read(topic: &str, payload: &[u8]) -> Result<Controller, ProtocolError> {
    let signed: SignedState = parse(topic, payload)?;
    parse(topic, signed.body.as_bytes())
}
