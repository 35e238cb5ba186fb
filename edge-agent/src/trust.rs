//! Which publishing keys a device trusts, as sans-IO logic. Without a root key (`trusted_root`
//! unset) they are the configured `trusted_keys`, forever. With one, the configured keys only
//! bootstrap the device: once it has verified a key list signed by the root (retained on
//! `P/keys`), exactly the keys of the newest such list are trusted, so keys are rotated and
//! revoked without touching devices. A list with a lower version than the one held is refused
//! (a rollback of the keys); the same list delivered again is accepted as it was. The IO layer
//! keeps the newest list in the store (`keys.json`) and loads it back with [`Trust::new`].

use ed25519_dalek::VerifyingKey;
use kestrel_shared::protocol::{KeyList, SignedKeyList};

/// What became of a key list that arrived.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeysVerdict {
    /// A newer list: these keys are trusted from now on (save it).
    Updated(u64),
    /// The list already held, delivered again.
    Same,
    Refused(String),
}

#[derive(Debug, Clone)]
pub struct Trust {
    root: Option<VerifyingKey>,
    bootstrap: Vec<VerifyingKey>,
    list: Option<(SignedKeyList, KeyList, Vec<VerifyingKey>)>,
}

impl Trust {
    /// Trust from the configuration and the saved key list, if any (verified again here: a saved
    /// list the root does not verify is an error naming it).
    pub fn new(
        root: Option<VerifyingKey>,
        bootstrap: Vec<VerifyingKey>,
        saved: Option<SignedKeyList>,
    ) -> Result<Trust, String> {
        let mut t = Trust {
            root,
            bootstrap,
            list: None,
        };
        if let Some(s) = saved {
            match t.receive(s, "saved key list (keys.json)") {
                KeysVerdict::Refused(reason) => return Err(reason),
                KeysVerdict::Updated(_) | KeysVerdict::Same => {}
            }
        }
        Ok(t)
    }

    /// Whether key lists are followed (a root key is configured).
    pub fn has_root(&self) -> bool {
        self.root.is_some()
    }

    /// The keys whose signatures are accepted now.
    pub fn keys(&self) -> &[VerifyingKey] {
        match &self.list {
            Some((_, _, keys)) => keys,
            None => &self.bootstrap,
        }
    }

    /// The version of the key list held, if any.
    pub fn version(&self) -> Option<u64> {
        self.list.as_ref().map(|(_, l, _)| l.version)
    }

    /// The key list held, as signed (what the IO layer saves).
    pub fn saved(&self) -> Option<&SignedKeyList> {
        self.list.as_ref().map(|(s, _, _)| s)
    }

    /// A key list arrived on `topic`.
    pub fn receive(&mut self, signed: SignedKeyList, topic: &str) -> KeysVerdict {
        let Some(root) = &self.root else {
            return KeysVerdict::Refused(format!(
                "{topic}: key list ignored: no trusted_root is configured"
            ));
        };
        let (list, keys) = match signed.open(root, topic) {
            Ok(v) => v,
            Err(e) => return KeysVerdict::Refused(format!("{topic}: key list refused: {e}")),
        };
        if let Some((held, current, _)) = &self.list {
            if list.version < current.version {
                return KeysVerdict::Refused(format!(
                    "{topic}: key list v{} refused: v{} is already in force (a downgrade)",
                    list.version, current.version
                ));
            }
            if list.version == current.version {
                return if held.body == signed.body {
                    KeysVerdict::Same
                } else {
                    KeysVerdict::Refused(format!(
                        "{topic}: key list v{} refused: another v{} is already in force",
                        list.version, current.version
                    ))
                };
            }
        }
        if keys.is_empty() {
            return KeysVerdict::Refused(format!(
                "{topic}: key list v{} refused: it names no key",
                list.version
            ));
        }
        let version = list.version;
        self.list = Some((signed, list, keys));
        KeysVerdict::Updated(version)
    }
}

#[cfg(test)]
mod tests {
    use ed25519_dalek::SigningKey;
    use kestrel_shared::signing::key_id;

    use super::*;

    fn key(n: u8) -> SigningKey {
        SigningKey::from_bytes(&[n; 32])
    }

    fn list(root: &SigningKey, version: u64, keys: &[&SigningKey]) -> SignedKeyList {
        SignedKeyList::new(
            root,
            &KeyList {
                version,
                keys: keys
                    .iter()
                    .map(|k| hex::encode(k.verifying_key().as_bytes()))
                    .collect(),
                issued: version,
            },
        )
    }

    fn ids(t: &Trust) -> Vec<String> {
        t.keys().iter().map(key_id).collect()
    }

    #[test]
    fn rotation_replaces_the_bootstrap_keys_and_downgrades_are_refused() {
        let (root, a, b) = (key(1), key(2), key(3));
        let mut t = Trust::new(Some(root.verifying_key()), vec![a.verifying_key()], None).unwrap();
        assert_eq!(ids(&t), vec![key_id(&a.verifying_key())]);
        let v1 = list(&root, 1, &[&a, &b]);
        assert_eq!(t.receive(v1.clone(), "k/keys"), KeysVerdict::Updated(1));
        assert_eq!(t.keys().len(), 2);
        let v2 = list(&root, 2, &[&b]);
        assert_eq!(t.receive(v2.clone(), "k/keys"), KeysVerdict::Updated(2));
        assert_eq!(ids(&t), vec![key_id(&b.verifying_key())], "A revoked");
        assert_eq!(t.receive(v2, "k/keys"), KeysVerdict::Same);
        let v = t.receive(v1, "k/keys");
        assert!(
            matches!(&v, KeysVerdict::Refused(r) if r.contains("downgrade")),
            "{v:?}"
        );
        let other_v2 = list(&root, 2, &[&a]);
        assert!(matches!(
            t.receive(other_v2, "k/keys"),
            KeysVerdict::Refused(_)
        ));
        assert_eq!(t.version(), Some(2));
    }

    #[test]
    fn only_the_root_signs_lists_and_a_saved_list_is_checked_again() {
        let (root, a, rogue) = (key(1), key(2), key(9));
        let mut t = Trust::new(Some(root.verifying_key()), vec![a.verifying_key()], None).unwrap();
        let forged = list(&rogue, 5, &[&rogue]);
        assert!(matches!(
            t.receive(forged.clone(), "k/keys"),
            KeysVerdict::Refused(_)
        ));
        assert!(matches!(
            t.receive(list(&root, 1, &[]), "k/keys"),
            KeysVerdict::Refused(_)
        ));
        assert!(Trust::new(Some(root.verifying_key()), vec![], Some(forged)).is_err());
        let saved = list(&root, 3, &[&a]);
        let t = Trust::new(Some(root.verifying_key()), vec![], Some(saved)).unwrap();
        assert_eq!(t.version(), Some(3));
        // No root configured: lists are ignored and the configured keys stay.
        let mut plain = Trust::new(None, vec![a.verifying_key()], None).unwrap();
        assert!(matches!(
            plain.receive(list(&root, 1, &[&root]), "k/keys"),
            KeysVerdict::Refused(_)
        ));
        assert_eq!(ids(&plain), vec![key_id(&a.verifying_key())]);
    }
}
