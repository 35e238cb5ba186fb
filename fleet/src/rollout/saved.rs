//! The controller's saved state as retained on `P/rollouts/<name>/state`: the [`Controller`]'s
//! JSON, deflated (`encoding: "deflate"`, base64; a record of each device makes 10,000 devices
//! about 2 MB of JSON, a tenth of that deflated, and a broker limits a message to 2 MiB), and a
//! signature over those bytes by the key the rollout signs its desired states with
//! ([`PayloadType::RolloutState`]); a state without `encoding` is the JSON itself. A restarted controller resumes only a state that its own key
//! signed, for the rollout its topic names, with the plan the operator gave again: anyone who
//! can publish to the broker can plant a state, and one resumed unchecked could finish a
//! rollout that never ran, or have the controller sign rollbacks to any version for any device.
//! Readers that only show the state (`trainer rollout status`, the console) read the body
//! without a key.

use std::io::Read;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use ed25519_dalek::{SigningKey, VerifyingKey};
use kestrel_shared::protocol::{ProtocolError, parse};
use kestrel_shared::signing::{PayloadType, SignatureFile, sign, verify};
use serde::{Deserialize, Serialize};

use super::{Controller, Plan};

/// The retained payload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SignedState {
    /// The signed bytes: the JSON, or with `encoding` its deflated bytes in base64.
    pub body: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encoding: Option<Encoding>,
    pub signature: SignatureFile,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Encoding {
    Deflate,
}

/// The most a saved state may inflate to (a million devices' records).
const MAX_JSON_BYTES: u64 = 256 << 20;

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
         plan, or one that only adds devices to its groups; or give the new plan another \
         rollout name)"
    )]
    OtherPlan { topic: String },
}

/// The payload to retain for `c`, signed with `key`.
pub fn seal(key: &SigningKey, c: &Controller) -> Vec<u8> {
    let mut z = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::fast());
    serde_json::to_writer(&mut z, c).expect("serializable");
    let deflated = z.finish().expect("in memory");
    let signature = sign(key, PayloadType::RolloutState, &deflated);
    serde_json::to_vec(&SignedState {
        body: B64.encode(deflated),
        encoding: Some(Encoding::Deflate),
        signature,
    })
    .expect("serializable")
}

/// The signed bytes of a saved state.
fn signed_bytes(topic: &str, s: &SignedState) -> Result<Vec<u8>, ProtocolError> {
    match s.encoding {
        None => Ok(s.body.as_bytes().to_vec()),
        Some(Encoding::Deflate) => B64.decode(&s.body).map_err(|e| ProtocolError::Payload {
            topic: topic.to_string(),
            reason: format!("body: {e}"),
        }),
    }
}

/// The controller in a saved state's signed bytes.
fn controller(topic: &str, s: &SignedState, signed: &[u8]) -> Result<Controller, ProtocolError> {
    let json = match s.encoding {
        None => signed.to_vec(),
        Some(Encoding::Deflate) => {
            let mut json = Vec::new();
            flate2::read::DeflateDecoder::new(signed)
                .take(MAX_JSON_BYTES + 1)
                .read_to_end(&mut json)
                .map_err(|e| ProtocolError::Payload {
                    topic: topic.to_string(),
                    reason: format!("deflated body: {e}"),
                })?;
            if json.len() as u64 > MAX_JSON_BYTES {
                return Err(ProtocolError::Payload {
                    topic: topic.to_string(),
                    reason: format!("the body inflates past {MAX_JSON_BYTES} bytes"),
                });
            }
            json
        }
    };
    parse(topic, &json)
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
    let bytes = signed_bytes(topic, &signed).map_err(format)?;
    verify(
        &[*key],
        PayloadType::RolloutState,
        &bytes,
        &signed.signature,
    )
    .map_err(|source| StateError::Signature {
        topic: topic.to_string(),
        source,
    })?;
    let c = controller(topic, &signed, &bytes).map_err(format)?;
    if c.name != name {
        return Err(StateError::OtherRollout {
            topic: topic.to_string(),
            found: c.name,
        });
    }
    let mut c = c;
    if &c.plan != plan {
        if !only_grows(&c.plan, plan) {
            return Err(StateError::OtherPlan {
                topic: topic.to_string(),
            });
        }
        // Devices added to the plan's groups: each joins its group's phase when it first
        // reports; the devices the rollout already has keep their phase. A plan made dynamic
        // serves late devices from now on (a completed rollout's controller goes on); one made
        // plain again lets a completed rollout's controller stop.
        c.plan.groups = plan.groups.clone();
        c.plan.dynamic = plan.dynamic;
    }
    Ok(c)
}

/// Whether `new` is `old` with devices added to its groups and, maybe, `dynamic` switched, and
/// nothing else changed.
fn only_grows(old: &Plan, new: &Plan) -> bool {
    let grown = old.groups.iter().all(|(g, members)| {
        new.groups
            .get(g)
            .is_some_and(|now| members.iter().all(|d| now.contains(d)))
    }) && new.groups.keys().all(|g| old.groups.contains_key(g));
    grown
        && Plan {
            groups: new.groups.clone(),
            dynamic: new.dynamic,
            ..old.clone()
        } == *new
}

/// The controller in a saved state, unverified: for showing it, never for acting on it.
pub fn read(topic: &str, payload: &[u8]) -> Result<Controller, ProtocolError> {
    let signed: SignedState = parse(topic, payload)?;
    controller(topic, &signed, &signed_bytes(topic, &signed)?)
}
