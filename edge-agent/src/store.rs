//! The on-device model store: downloads assemble in `staging/<v>`, verified models live in
//! `versions/<v>`, and `active` / `previous` are symlinks swapped atomically (new link under a
//! temporary name, rename over the old one, fsync the directory). Only the active and previous
//! versions are kept. A crash at any point leaves `active` naming a complete model.
//!
//! Artifacts delivered in pieces ([`kestrel_shared::protocol::Piece`]) keep every piece once in
//! the part store, `parts/<sha256>`, shared by both lanes' stores and every version: a version
//! directory then holds the signed manifest and links to its golden samples, and its model is
//! composed from the parts at load ([`kestrel_runtime::artifact::device_model`]). A part stays
//! while a kept version, a staged one or a download's offer lists it ([`Store::prune_parts`]).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use kestrel_runtime::artifact;
use kestrel_shared::fsutil::{remove_temp_files, write_atomic};
use kestrel_shared::manifest::{MANIFEST_FILE, Manifest};
use kestrel_shared::protocol::{ArtifactOffer, device_files, pieces, sha256_hex};
use kestrel_shared::signing::SIGNATURE_FILE;

#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
    /// The part store (shared with the other lane's store).
    parts: PathBuf,
    /// A simulated fleet's one copy of each part ([`Store::sharing_part_files`]).
    shared_parts: Option<PathBuf>,
}

/// [`write_atomic`], creating the parent directory first (a download's directories are made
/// as its files come; a full disk may have refused them before).
fn write_creating(path: &Path, bytes: &[u8]) -> io::Result<()> {
    fs::create_dir_all(path.parent().expect("a store path"))?;
    write_atomic(path, bytes)
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    fs::File::open(dir)?.sync_all()
}

/// Renames every file under `from` to the same place under `to` (replacing what is there).
fn move_files(from: &Path, to: &Path) -> io::Result<()> {
    for e in fs::read_dir(from)? {
        let e = e?;
        let target = to.join(e.file_name());
        if e.file_type()?.is_dir() {
            fs::create_dir_all(&target)?;
            move_files(&e.path(), &target)?;
        } else {
            fs::rename(e.path(), &target)?;
        }
    }
    sync_dir(to)
}

impl Store {
    /// Opens (creating) the store and removes the temporary files of writes a crash cut short
    /// (the journal's, the keys', the chunks'), so that a crash loop leaves nothing growing.
    pub fn open(root: &Path, parts: &Path) -> io::Result<Self> {
        for d in ["downloads", "staging", "versions"] {
            fs::create_dir_all(root.join(d))?;
        }
        fs::create_dir_all(parts)?;
        remove_temp_files(parts)?;
        remove_temp_files(root)?;
        for e in fs::read_dir(root.join("downloads"))? {
            let dir = e?.path();
            for d in [dir.clone(), dir.join("chunks")] {
                if d.is_dir() {
                    remove_temp_files(&d)?;
                }
            }
        }
        Ok(Self {
            root: root.to_path_buf(),
            parts: parts.to_path_buf(),
            shared_parts: None,
        })
    }

    /// A simulated fleet's stores (`edge-agent run --simulate N --share-part-files`): a checked
    /// piece goes into `dir` once and is hard-linked into each device's part store, so that
    /// thousands of devices holding the same backbone keep one copy on disk. Only for devices
    /// of one process, which trust each other's checks: a shared file damaged on disk is
    /// damaged for every device that links it.
    pub fn sharing_part_files(mut self, dir: Option<PathBuf>) -> Self {
        self.shared_parts = dir;
        self
    }

    /// A checked piece into the part store (through the shared copy, when there is one).
    fn put_part(&self, path: &Path, sha256: &str, bytes: &[u8]) -> io::Result<()> {
        let Some(shared) = &self.shared_parts else {
            return write_atomic(path, bytes);
        };
        let one = shared.join(sha256);
        if !one.exists() {
            write_creating(&one, bytes)?;
        }
        // A temporary name `Store::open` removes (`remove_temp_files`) if a crash leaves it.
        let link = self.parts.join(format!(".{sha256}.tmp.link"));
        let _ = fs::remove_file(&link);
        fs::hard_link(&one, &link)?;
        fs::rename(&link, path)
    }

    /// The part store: content-addressed pieces, `<sha256>` each.
    pub fn parts_dir(&self) -> &Path {
        &self.parts
    }

    fn part_path(&self, sha256: &str) -> PathBuf {
        self.parts.join(sha256)
    }

    /// Which of the pieces `sha256s` the part store holds, each read and checked against its
    /// hash first: one that does not match is deleted (it is fetched again, never trusted).
    pub fn held_parts(&self, sha256s: &[String]) -> Vec<String> {
        let mut held = Vec::new();
        for sha in sha256s {
            if held.contains(sha) || !kestrel_shared::protocol::is_sha256(sha) {
                continue;
            }
            let path = self.part_path(sha);
            match fs::read(&path) {
                Ok(bytes) if sha256_hex(&bytes) == *sha => held.push(sha.clone()),
                Ok(_) => {
                    tracing::warn!("{}: does not match its sha256: deleted", path.display());
                    let _ = fs::remove_file(&path);
                }
                Err(_) => {}
            }
        }
        held
    }

    /// Removes every part that no version, staging slot or download of `stores` lists.
    pub fn prune_parts(stores: &[&Store]) -> io::Result<()> {
        let Some(first) = stores.first() else {
            return Ok(());
        };
        let mut keep = std::collections::HashSet::new();
        for s in stores {
            keep.extend(s.listed_parts()?);
        }
        for e in fs::read_dir(&first.parts)? {
            let e = e?;
            let name = e.file_name();
            let Some(name) = name
                .to_str()
                .filter(|n| kestrel_shared::protocol::is_sha256(n))
            else {
                continue; // a write in progress (its temporary file), or not the store's
            };
            if !keep.contains(name) {
                fs::remove_file(e.path())?;
            }
        }
        Ok(())
    }

    /// The pieces this store's versions, staging slots and downloads list. A file that cannot
    /// be read or parsed (but is there) fails it: a prune must never take what it could not
    /// see listed.
    fn listed_parts(&self) -> io::Result<Vec<String>> {
        fn read<T: serde::de::DeserializeOwned>(path: &Path) -> io::Result<Option<T>> {
            match fs::read(path) {
                Ok(text) => serde_json::from_slice(&text).map(Some).map_err(|e| {
                    io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("{}: {e}", path.display()),
                    )
                }),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(e),
            }
        }
        let mut out = Vec::new();
        for d in ["versions", "staging"] {
            for e in fs::read_dir(self.root.join(d))? {
                if let Some(m) = read::<Manifest>(&e?.path().join(MANIFEST_FILE))? {
                    out.extend(pieces(&m).into_iter().map(|(sha, _)| sha));
                }
            }
        }
        for e in fs::read_dir(self.root.join("downloads"))? {
            if let Some(o) = read::<ArtifactOffer>(&e?.path().join("offer.json"))? {
                out.extend(o.pieces.into_iter().map(|p| p.sha256));
            }
        }
        Ok(out)
    }

    /// The store's directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where the chunks of `version` and its offer are journaled while downloading.
    pub fn download_dir(&self, version: u64) -> PathBuf {
        self.root.join("downloads").join(version.to_string())
    }

    /// The accepted offer of a download, journaled beside its chunks.
    pub fn offer_path(&self, version: u64) -> PathBuf {
        self.download_dir(version).join("offer.json")
    }

    /// Where chunk `index` of a download is journaled.
    pub fn chunk_path(&self, version: u64, index: u32) -> PathBuf {
        self.download_dir(version)
            .join("chunks")
            .join(index.to_string())
    }

    /// Journals the accepted offer (its raw bytes) of a download.
    pub fn write_offer(&self, version: u64, offer: &[u8]) -> io::Result<()> {
        write_creating(&self.offer_path(version), offer)
    }

    /// Journals one verified chunk of a download.
    pub fn write_chunk(&self, version: u64, index: u32, bytes: &[u8]) -> io::Result<()> {
        write_creating(&self.chunk_path(version, index), bytes)
    }

    /// Where the files of `version` are assembled from its chunks.
    pub fn staging_dir(&self, version: u64) -> PathBuf {
        self.root.join("staging").join(version.to_string())
    }

    pub fn version_dir(&self, version: u64) -> PathBuf {
        self.root.join("versions").join(version.to_string())
    }

    /// The active model's directory (through the `active` link).
    pub fn active_dir(&self) -> PathBuf {
        self.root.join("active")
    }

    fn link_version(&self, name: &str) -> Option<u64> {
        let target = fs::read_link(self.root.join(name)).ok()?;
        target.file_name()?.to_str()?.parse().ok()
    }

    pub fn active(&self) -> Option<u64> {
        self.link_version("active")
    }

    pub fn previous(&self) -> Option<u64> {
        self.link_version("previous")
    }

    /// Moves a verified staging directory into `versions/` (atomic rename). The download stays
    /// until the version is active: a restart during the health check verifies it again from
    /// the journaled chunks.
    pub fn stage(&self, version: u64) -> io::Result<PathBuf> {
        let dst = self.version_dir(version);
        if dst.exists() && Some(version) != self.active() && Some(version) != self.previous() {
            fs::remove_dir_all(&dst)?;
        }
        if dst.exists() {
            // Kept as active or previous (installed again after it was damaged): each verified
            // file replaces its copy atomically, so the directory is whole at every moment. A
            // whole model.onnx left from a delivery before parts goes once the version is
            // composed from parts (its parts are in the part store by now).
            let staging = self.staging_dir(version);
            let whole = staging.join("model.onnx").exists();
            move_files(&staging, &dst)?;
            fs::remove_dir_all(&staging)?;
            let text = fs::read(dst.join(MANIFEST_FILE))?;
            let composed = serde_json::from_slice::<Manifest>(&text)
                .is_ok_and(|m| m.composition.is_some_and(|c| c.file == "model.onnx"));
            if composed && !whole {
                match fs::remove_file(dst.join("model.onnx")) {
                    Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                    _ => {}
                }
            }
        } else {
            fs::rename(self.staging_dir(version), &dst)?;
            sync_dir(&self.root.join("versions"))?;
        }
        Ok(dst)
    }

    fn swap_link(&self, name: &str, version: u64) -> io::Result<()> {
        let tmp = self.root.join(format!(".{name}.tmp"));
        let _ = fs::remove_file(&tmp); // left by a crash
        std::os::unix::fs::symlink(Path::new("versions").join(version.to_string()), &tmp)?;
        fs::rename(&tmp, self.root.join(name))
    }

    /// Makes `version` (already staged) active; the old active becomes previous; drops its
    /// download. Idempotent.
    pub fn activate(&self, version: u64) -> io::Result<()> {
        if !self.version_dir(version).is_dir() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("version {version} is not staged"),
            ));
        }
        let old = self.active();
        if old != Some(version) {
            if let Some(o) = old {
                self.swap_link("previous", o)?;
            }
            self.swap_link("active", version)?;
            sync_dir(&self.root)?;
        }
        let _ = fs::remove_dir_all(self.download_dir(version));
        self.prune()
    }

    /// Removes every version except the active and previous ones, and abandoned staging dirs.
    pub fn prune(&self) -> io::Result<()> {
        let keep = [self.active(), self.previous()];
        for e in fs::read_dir(self.root.join("versions"))? {
            let e = e?;
            let v = e.file_name().to_str().and_then(|s| s.parse::<u64>().ok());
            if !keep.contains(&v) || v.is_none() {
                fs::remove_dir_all(e.path())?;
            }
        }
        Ok(())
    }

    /// Splits the downloaded chunks into the device files under `staging/<v>` with the signed
    /// manifest and its signature; returns that directory. An offer in pieces puts each piece
    /// in the part store ([`Self::assemble_pieces`]).
    pub fn assemble(&self, o: &ArtifactOffer, m: &Manifest) -> Result<PathBuf, String> {
        if !o.pieces.is_empty() {
            return self.assemble_pieces(o, m);
        }
        let mut bundle = Vec::with_capacity(o.total_bytes as usize);
        for i in 0..o.chunks.len() {
            let p = self.chunk_path(o.version, i as u32);
            let bytes = std::fs::read(&p).map_err(|e| format!("{}: {e}", p.display()))?;
            if sha256_hex(&bytes) != o.chunks[i] {
                return Err(format!("chunk {i}: sha256 mismatch on disk"));
            }
            bundle.extend_from_slice(&bytes);
        }
        if bundle.len() as u64 != o.total_bytes {
            return Err(format!(
                "{} bytes assembled, the offer says {}",
                bundle.len(),
                o.total_bytes
            ));
        }
        let dir = self.staging_dir(o.version);
        let _ = std::fs::remove_dir_all(&dir);
        let mut at = 0usize;
        for f in device_files(m) {
            let rel = artifact::safe_relative(&f.path).map_err(|e| kestrel_shared::chain(&e))?;
            let end = at + f.size as usize;
            let bytes = bundle
                .get(at..end)
                .ok_or("bundle shorter than the manifest's files")?;
            let path = dir.join(rel);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent)
                    .map_err(|e| format!("{}: {e}", parent.display()))?;
            }
            write_atomic(&path, bytes).map_err(|e| format!("{}: {e}", path.display()))?;
            at = end;
        }
        Self::write_signed(&dir, o)?;
        Ok(dir)
    }

    /// The offer's signed manifest and signature into `dir`.
    fn write_signed(dir: &Path, o: &ArtifactOffer) -> Result<(), String> {
        fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        write_atomic(&dir.join(MANIFEST_FILE), o.manifest.as_bytes()).map_err(|e| e.to_string())?;
        let sig = serde_json::to_vec(&o.signature).map_err(|e| e.to_string())?;
        write_atomic(&dir.join(SIGNATURE_FILE), &sig).map_err(|e| e.to_string())
    }

    /// [`Self::assemble`] of an offer in pieces: every downloaded piece, checked against its
    /// sha256, into the part store (the others are there: the device held them); then
    /// `staging/<v>` gets the device files that are whole pieces (linked to the part store) but
    /// not the composed model, which is made from its parts at load.
    fn assemble_pieces(&self, o: &ArtifactOffer, m: &Manifest) -> Result<PathBuf, String> {
        for (p, range) in o.pieces.iter().zip(o.piece_ranges()) {
            let path = self.part_path(&p.sha256);
            if p.size == 0 && p.sha256 == sha256_hex(b"") {
                write_atomic(&path, b"").map_err(|e| format!("{}: {e}", path.display()))?;
                continue; // nothing to fetch
            }
            if range.is_empty()
                || !range
                    .clone()
                    .all(|i| self.chunk_path(o.version, i).exists())
            {
                if path.exists() {
                    continue; // held
                }
                return Err(format!("piece {}: neither downloaded nor held", p.sha256));
            }
            let mut bytes = Vec::with_capacity(p.size as usize);
            for (i, want) in range.zip(&p.chunks) {
                let c = self.chunk_path(o.version, i);
                let chunk = fs::read(&c).map_err(|e| format!("{}: {e}", c.display()))?;
                if sha256_hex(&chunk) != *want {
                    return Err(format!("chunk {i}: sha256 mismatch on disk"));
                }
                bytes.extend_from_slice(&chunk);
            }
            if sha256_hex(&bytes) != p.sha256 {
                return Err(format!(
                    "piece {}: its chunks make another sha256",
                    p.sha256
                ));
            }
            self.put_part(&path, &p.sha256, &bytes)
                .map_err(|e| format!("{}: {e}", path.display()))?;
        }
        let dir = self.staging_dir(o.version);
        let _ = fs::remove_dir_all(&dir);
        for f in device_files(m) {
            if m.composition.as_ref().is_some_and(|c| c.file == f.path) {
                continue;
            }
            let rel = artifact::safe_relative(&f.path).map_err(|e| kestrel_shared::chain(&e))?;
            let path = dir.join(rel);
            if let Some(parent) = path.parent() {
                fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
            }
            let from = self.part_path(&f.sha256);
            fs::hard_link(&from, &path)
                .or_else(|_| fs::copy(&from, &path).map(drop))
                .map_err(|e| format!("{} from {}: {e}", path.display(), from.display()))?;
        }
        Self::write_signed(&dir, o)?;
        Ok(dir)
    }

    /// Deletes whatever was downloaded or staged for `version`, never the active or previous model.
    pub fn discard(&self, version: u64) -> io::Result<()> {
        let _ = fs::remove_dir_all(self.download_dir(version));
        let _ = fs::remove_dir_all(self.staging_dir(version));
        if Some(version) != self.active() && Some(version) != self.previous() {
            let _ = fs::remove_dir_all(self.version_dir(version));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(store: &Store, v: u64) {
        let d = store.staging_dir(v);
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join("model.onnx"), format!("model {v}")).unwrap();
        store.stage(v).unwrap();
    }

    #[test]
    fn activation_swaps_links_and_keeps_two_versions() {
        let tmp = tempfile::tempdir().unwrap();
        let s = Store::open(tmp.path(), &tmp.path().join("parts")).unwrap();
        assert_eq!(s.active(), None);
        put(&s, 1);
        s.activate(1).unwrap();
        assert_eq!((s.active(), s.previous()), (Some(1), None));
        put(&s, 2);
        s.activate(2).unwrap();
        s.activate(2).unwrap(); // idempotent: previous stays 1
        assert_eq!((s.active(), s.previous()), (Some(2), Some(1)));
        assert_eq!(
            fs::read_to_string(s.active_dir().join("model.onnx")).unwrap(),
            "model 2"
        );
        put(&s, 3);
        s.activate(3).unwrap();
        assert_eq!((s.active(), s.previous()), (Some(3), Some(2)));
        assert!(
            !s.version_dir(1).exists(),
            "only active and previous are kept"
        );
        // Rolling back is activating the previous version.
        s.activate(2).unwrap();
        assert_eq!((s.active(), s.previous()), (Some(2), Some(3)));
    }

    #[test]
    fn discard_never_touches_active_and_crash_leftovers_are_replaced() {
        let tmp = tempfile::tempdir().unwrap();
        let s = Store::open(tmp.path(), &tmp.path().join("parts")).unwrap();
        put(&s, 1);
        s.activate(1).unwrap();
        s.discard(1).unwrap();
        assert!(s.version_dir(1).exists());
        fs::create_dir_all(s.staging_dir(2)).unwrap();
        s.discard(2).unwrap();
        assert!(!s.staging_dir(2).exists());
        assert!(s.activate(9).is_err());
        // A crash between creating the temporary link and the rename.
        std::os::unix::fs::symlink("versions/1", tmp.path().join(".active.tmp")).unwrap();
        put(&s, 2);
        s.activate(2).unwrap();
        assert_eq!(s.active(), Some(2));
    }

    #[test]
    fn a_download_stays_until_its_version_is_active() {
        // A restart during the health check verifies the staged version again from its
        // journaled chunks and offer, so staging must not drop them (a random-kill chaos run
        // found the agent refusing its own update after a kill at that moment).
        let tmp = tempfile::tempdir().unwrap();
        let s = Store::open(tmp.path(), &tmp.path().join("parts")).unwrap();
        s.write_offer(1, b"{}").unwrap();
        s.write_chunk(1, 0, b"chunk").unwrap();
        put(&s, 1);
        assert!(s.offer_path(1).exists() && s.chunk_path(1, 0).exists());
        s.activate(1).unwrap();
        assert!(!s.download_dir(1).exists());
    }
}
