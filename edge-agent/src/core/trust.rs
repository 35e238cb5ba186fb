//! Which publishing keys a device trusts, as sans-IO logic. Without a root key (`trusted_root`
//! unset) they are the configured `trusted_keys`, forever. With one, the configured keys only
//! bootstrap the device: once it has verified a key list signed by the root (retained on
//! `P/keys`), exactly the keys of the newest such list are trusted, so keys are rotated and
//! revoked without touching devices. A list with a lower version than the one held is refused
//! (a rollback of the keys); the same list delivered again is accepted as it was. The IO layer
//! keeps the newest list in the store (`keys.json`) and loads it back with [`Trust::new`].
//!
//! Key lists expire (**freeze**, as desired states do): a list whose `expires` has passed, or
//! that has none, is refused on arrival, and once the list held expires ([`Trust::lapse`]) its
//! publishing keys are no longer trusted. The bootstrap keys do not come back then (a revoked
//! key is most likely one of them): the device trusts no publishing key, only the root, until a
//! newer list arrives; the model it runs keeps serving. The expired list stays held as the
//! version floor, so an older list is still refused as a downgrade.

use ed25519_dalek::VerifyingKey;
use kestrel_shared::manifest::rfc3339;
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

/// The root-signed list held, verified.
#[derive(Debug, Clone)]
struct Held {
    signed: SignedKeyList,
    list: KeyList,
    keys: Vec<VerifyingKey>,
    /// Expired (or without expiry): its keys are no longer trusted.
    lapsed: bool,
}

#[derive(Debug, Clone)]
pub struct Trust {
    root: Option<VerifyingKey>,
    bootstrap: Vec<VerifyingKey>,
    list: Option<Held>,
}

impl Trust {
    /// Trust from the configuration and the saved key list, if any (verified again here: a saved
    /// list the root does not verify is an error naming it). A saved list is held whatever its
    /// expiry: [`Trust::lapse`] decides whether its keys are still trusted.
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
            let (list, keys) = t.open(&s, "saved key list (keys.json)")?;
            t.list = Some(Held {
                signed: s,
                list,
                keys,
                lapsed: false,
            });
        }
        Ok(t)
    }

    /// Whether key lists are followed (a root key is configured).
    pub fn has_root(&self) -> bool {
        self.root.is_some()
    }

    /// The keys whose signatures are accepted now: none once the list held has lapsed.
    pub fn keys(&self) -> &[VerifyingKey] {
        match &self.list {
            Some(h) if h.lapsed => &[],
            Some(h) => &h.keys,
            None => &self.bootstrap,
        }
    }

    /// The version of the key list held, if any (in force or lapsed: the version floor).
    pub fn version(&self) -> Option<u64> {
        self.list.as_ref().map(|h| h.list.version)
    }

    /// The version of the key list in force: none once it has lapsed.
    pub fn in_force(&self) -> Option<u64> {
        self.list
            .as_ref()
            .filter(|h| !h.lapsed)
            .map(|h| h.list.version)
    }

    /// Why no publishing key is trusted, when the list held has lapsed.
    pub fn lapsed(&self) -> Option<String> {
        let h = self.list.as_ref().filter(|h| h.lapsed)?;
        Some(lapse_reason(&h.list))
    }

    /// The key list held, as signed (what the IO layer saves).
    pub fn saved(&self) -> Option<&SignedKeyList> {
        self.list.as_ref().map(|h| &h.signed)
    }

    /// The clock read `now` (Unix seconds): once the list held has expired (or has no expiry),
    /// its keys are no longer trusted. Returns why, once, when that happens.
    pub fn lapse(&mut self, now: u64) -> Option<String> {
        let h = self.list.as_mut().filter(|h| !h.lapsed)?;
        if h.list.expires.is_some_and(|e| now < e) {
            return None;
        }
        h.lapsed = true;
        Some(lapse_reason(&h.list))
    }

    /// A key list arrived on `topic` at `now` (Unix seconds).
    pub fn receive(&mut self, signed: SignedKeyList, topic: &str, now: u64) -> KeysVerdict {
        let (list, keys) = match self.open(&signed, topic) {
            Ok(v) => v,
            Err(reason) => return KeysVerdict::Refused(reason),
        };
        if let Some(verdict) = self.against_held(&signed, &list, topic) {
            return verdict;
        }
        if let Err(why) = fresh(&list, &keys, now) {
            return KeysVerdict::Refused(format!(
                "{topic}: key list v{} refused: {why}",
                list.version
            ));
        }
        let version = list.version;
        self.list = Some(Held {
            signed,
            list,
            keys,
            lapsed: false,
        });
        KeysVerdict::Updated(version)
    }

    /// Checks the root's signature.
    fn open(
        &self,
        signed: &SignedKeyList,
        topic: &str,
    ) -> Result<(KeyList, Vec<VerifyingKey>), String> {
        let Some(root) = &self.root else {
            return Err(format!(
                "{topic}: key list ignored: no trusted_root is configured"
            ));
        };
        signed
            .open(root, topic)
            .map_err(|e| format!("{topic}: key list refused: {e}"))
    }

    /// The version rules against the list held: a lower version is a downgrade, the same
    /// version is the same list again or a conflict. None: a newer list (or none held).
    fn against_held(
        &self,
        signed: &SignedKeyList,
        list: &KeyList,
        topic: &str,
    ) -> Option<KeysVerdict> {
        let held = self.list.as_ref()?;
        let current = held.list.version;
        if list.version < current {
            return Some(KeysVerdict::Refused(format!(
                "{topic}: key list v{} refused: v{current} is already in force (a downgrade)",
                list.version
            )));
        }
        (list.version == current).then(|| {
            if held.signed.body == signed.body {
                KeysVerdict::Same
            } else {
                KeysVerdict::Refused(format!(
                    "{topic}: key list v{} refused: another v{current} is already in force",
                    list.version
                ))
            }
        })
    }
}

/// Whether a newer list may be followed at `now`: it names a key and has not expired.
fn fresh(list: &KeyList, keys: &[VerifyingKey], now: u64) -> Result<(), String> {
    if keys.is_empty() {
        return Err("it names no key".into());
    }
    match list.expires {
        None => Err(
            "it carries no expiry (lists signed by `trainer keys` before key lists \
                     expired; publish a new one)"
                .into(),
        ),
        Some(e) if now >= e => Err(format!("it expired at {}", rfc3339(e))),
        Some(_) => Ok(()),
    }
}

/// Why the publishing keys of `list` are no longer trusted.
fn lapse_reason(list: &KeyList) -> String {
    let why = match list.expires {
        Some(e) => format!("expired at {}", rfc3339(e)),
        None => "carries no expiry (signed before key lists expired)".into(),
    };
    format!(
        "key list v{} {why}: its publishing keys are no longer trusted, only the root is, until \
         a newer list arrives (`trainer keys`)",
        list.version
    )
}

#[cfg(test)]
mod tests {
    use ed25519_dalek::SigningKey;
    use kestrel_shared::signing::key_id;

    use super::*;

    fn key(n: u8) -> SigningKey {
        SigningKey::from_bytes(&[n; 32])
    }

    /// The tests' clock (Unix seconds) and the expiry of their lists.
    const NOW: u64 = 1_800_000_000;
    const EXPIRES: u64 = NOW + 3600;

    fn list(root: &SigningKey, version: u64, keys: &[&SigningKey]) -> SignedKeyList {
        expiring(root, version, keys, Some(EXPIRES))
    }

    fn expiring(
        root: &SigningKey,
        version: u64,
        keys: &[&SigningKey],
        expires: Option<u64>,
    ) -> SignedKeyList {
        SignedKeyList::new(
            root,
            &KeyList {
                version,
                keys: keys
                    .iter()
                    .map(|k| hex::encode(k.verifying_key().as_bytes()))
                    .collect(),
                issued: version,
                expires,
            },
        )
    }

    fn refused(v: KeysVerdict, what: &str) -> String {
        match v {
            KeysVerdict::Refused(r) if r.contains(what) => r,
            v => panic!("expected a refusal with `{what}`: {v:?}"),
        }
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
        assert_eq!(
            t.receive(v1.clone(), "k/keys", NOW),
            KeysVerdict::Updated(1)
        );
        assert_eq!(t.keys().len(), 2);
        let v2 = list(&root, 2, &[&b]);
        assert_eq!(
            t.receive(v2.clone(), "k/keys", NOW),
            KeysVerdict::Updated(2)
        );
        assert_eq!(ids(&t), vec![key_id(&b.verifying_key())], "A revoked");
        assert_eq!(t.receive(v2, "k/keys", NOW), KeysVerdict::Same);
        let v = t.receive(v1, "k/keys", NOW);
        assert!(
            matches!(&v, KeysVerdict::Refused(r) if r.contains("downgrade")),
            "{v:?}"
        );
        let other_v2 = list(&root, 2, &[&a]);
        assert!(matches!(
            t.receive(other_v2, "k/keys", NOW),
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
            t.receive(forged.clone(), "k/keys", NOW),
            KeysVerdict::Refused(_)
        ));
        assert!(matches!(
            t.receive(list(&root, 1, &[]), "k/keys", NOW),
            KeysVerdict::Refused(_)
        ));
        assert!(Trust::new(Some(root.verifying_key()), vec![], Some(forged)).is_err());
        let saved = list(&root, 3, &[&a]);
        let t = Trust::new(Some(root.verifying_key()), vec![], Some(saved)).unwrap();
        assert_eq!(t.version(), Some(3));
        // No root configured: lists are ignored and the configured keys stay.
        let mut plain = Trust::new(None, vec![a.verifying_key()], None).unwrap();
        assert!(matches!(
            plain.receive(list(&root, 1, &[&root]), "k/keys", NOW),
            KeysVerdict::Refused(_)
        ));
        assert_eq!(ids(&plain), vec![key_id(&a.verifying_key())]);
    }

    #[test]
    fn a_fresh_list_is_accepted_and_an_expired_or_undated_one_refused() {
        let (root, a, b) = (key(1), key(2), key(3));
        let mut t = Trust::new(Some(root.verifying_key()), vec![a.verifying_key()], None).unwrap();
        let late = expiring(&root, 1, &[&b], Some(NOW));
        let r = refused(t.receive(late, "k/keys", NOW), "expired at");
        assert!(
            r.starts_with("k/keys: key list v1") && r.contains("2027-01-15"),
            "{r}"
        );
        refused(
            t.receive(expiring(&root, 1, &[&b], None), "k/keys", NOW),
            "carries no expiry",
        );
        assert_eq!(ids(&t), vec![key_id(&a.verifying_key())], "bootstrap kept");
        assert_eq!(
            t.receive(list(&root, 1, &[&b]), "k/keys", NOW),
            KeysVerdict::Updated(1)
        );
        assert_eq!((t.in_force(), t.lapse(EXPIRES - 1)), (Some(1), None));
        assert_eq!(ids(&t), vec![key_id(&b.verifying_key())]);
    }

    /// The list held expires: its keys go, the bootstrap keys do not come back, the version stays
    /// the floor, and a newer fresh list is followed again.
    #[test]
    fn an_expiry_reached_after_acceptance_drops_the_listed_keys() {
        let (root, a, b, c) = (key(1), key(2), key(3), key(4));
        let mut t = Trust::new(Some(root.verifying_key()), vec![a.verifying_key()], None).unwrap();
        assert_eq!(
            t.receive(list(&root, 2, &[&b]), "k/keys", NOW),
            KeysVerdict::Updated(2)
        );
        let why = t.lapse(EXPIRES).expect("lapsed at its expiry");
        assert!(
            why.contains("key list v2 expired at") && why.contains("only the root"),
            "{why}"
        );
        assert_eq!(t.lapse(EXPIRES + 1), None, "reported once");
        assert!(
            t.keys().is_empty(),
            "neither the listed nor the bootstrap keys"
        );
        assert_eq!((t.version(), t.in_force()), (Some(2), None));
        assert_eq!(t.lapsed(), Some(why));
        let later = EXPIRES + 10;
        refused(
            t.receive(expiring(&root, 1, &[&a], Some(later + 99)), "k/keys", later),
            "downgrade",
        );
        let v3 = expiring(&root, 3, &[&c], Some(later + 99));
        assert_eq!(t.receive(v3, "k/keys", later), KeysVerdict::Updated(3));
        assert_eq!(
            (ids(&t), t.lapsed()),
            (vec![key_id(&c.verifying_key())], None)
        );
    }

    /// A list saved by the store is held whatever its expiry; an expired one, or one saved before
    /// lists expired, lapses at the first reading of the clock.
    #[test]
    fn a_saved_list_lapses_when_expired_or_undated() {
        let (root, a) = (key(1), key(2));
        for expires in [Some(NOW), None] {
            let saved = expiring(&root, 4, &[&a], expires);
            let mut t = Trust::new(
                Some(root.verifying_key()),
                vec![a.verifying_key()],
                Some(saved),
            )
            .unwrap();
            assert!(t.lapse(NOW).is_some() && t.keys().is_empty(), "{expires:?}");
            assert_eq!(t.version(), Some(4));
        }
    }

    #[test]
    fn a_saved_list_is_the_version_floor_after_a_restart() {
        let (root, a, b) = (key(1), key(2), key(3));
        let saved = list(&root, 3, &[&b]);
        let mut t = Trust::new(
            Some(root.verifying_key()),
            vec![a.verifying_key()],
            Some(saved),
        )
        .unwrap();
        assert_eq!(
            ids(&t),
            vec![key_id(&b.verifying_key())],
            "the saved list, not the bootstrap keys"
        );
        let v = t.receive(list(&root, 2, &[&a]), "k/keys", NOW);
        assert!(
            matches!(&v, KeysVerdict::Refused(r) if r.contains("v3 is already in force (a downgrade)")),
            "{v:?}"
        );
        assert_eq!(
            (t.version(), ids(&t)),
            (Some(3), vec![key_id(&b.verifying_key())])
        );
    }

    #[test]
    fn a_list_signed_by_a_trusted_publishing_key_instead_of_the_root_is_refused() {
        let (root, b) = (key(1), key(3));
        let mut t = Trust::new(Some(root.verifying_key()), vec![], None).unwrap();
        assert_eq!(
            t.receive(list(&root, 1, &[&b]), "k/keys", NOW),
            KeysVerdict::Updated(1)
        );
        // b is trusted to sign desired states and offers, never key lists.
        let v = t.receive(list(&b, 2, &[&b]), "k/keys", NOW);
        assert!(
            matches!(&v, KeysVerdict::Refused(r) if r.starts_with("k/keys: key list refused")),
            "{v:?}"
        );
        assert_eq!(
            (t.version(), ids(&t)),
            (Some(1), vec![key_id(&b.verifying_key())])
        );
    }

    #[test]
    fn a_newer_list_refused_as_expired_leaves_the_held_keys_in_force() {
        let (root, a, b, c) = (key(1), key(2), key(3), key(4));
        let mut t = Trust::new(Some(root.verifying_key()), vec![a.verifying_key()], None).unwrap();
        assert_eq!(
            t.receive(list(&root, 1, &[&b]), "k/keys", NOW),
            KeysVerdict::Updated(1)
        );
        let v = t.receive(expiring(&root, 2, &[&c], Some(NOW)), "k/keys", NOW);
        assert!(
            matches!(&v, KeysVerdict::Refused(r) if r.contains("key list v2 refused: it expired at")),
            "{v:?}"
        );
        assert_eq!(
            (t.in_force(), ids(&t)),
            (Some(1), vec![key_id(&b.verifying_key())])
        );
    }

    #[test]
    fn the_lapsed_list_delivered_again_stays_lapsed() {
        let (root, a, b) = (key(1), key(2), key(3));
        let mut t = Trust::new(Some(root.verifying_key()), vec![a.verifying_key()], None).unwrap();
        let v2 = list(&root, 2, &[&b]);
        assert_eq!(
            t.receive(v2.clone(), "k/keys", NOW),
            KeysVerdict::Updated(2)
        );
        assert!(t.lapse(EXPIRES).is_some());
        // The retained list again (a reconnect): the same list, not a revival of its keys.
        assert_eq!(t.receive(v2, "k/keys", EXPIRES), KeysVerdict::Same);
        assert!(t.keys().is_empty());
        assert_eq!(t.in_force(), None);
        assert!(t.lapsed().is_some());
    }

    #[test]
    fn without_a_root_the_configured_keys_never_lapse() {
        let a = key(2);
        let mut t = Trust::new(None, vec![a.verifying_key()], None).unwrap();
        assert!(!t.has_root());
        assert_eq!(t.lapse(u64::MAX), None);
        assert_eq!((t.version(), t.in_force(), t.lapsed()), (None, None, None));
        assert_eq!(ids(&t), vec![key_id(&a.verifying_key())]);
    }
}
