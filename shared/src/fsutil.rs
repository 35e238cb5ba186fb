//! Crash-safe file writes, shared by every writer in trainer and edge.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Writes `bytes` to `path` so that a crash leaves either the old file or the new one: a unique
/// temporary file in the same directory, fsync, rename, then a best-effort fsync of the directory.
/// The temporary file is removed when anything fails.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut f = AtomicFile::create(path)?;
    f.write_all(bytes)?;
    f.commit()
}

/// A file written piece by piece that appears at its path only when [`AtomicFile::commit`] is
/// called (the crash-safety of [`write_atomic`] for files too large to hold in memory): until then
/// it is a unique temporary file beside it, removed when the writer is dropped uncommitted.
pub struct AtomicFile {
    path: PathBuf,
    tmp: PathBuf,
    file: Option<io::BufWriter<File>>,
}

impl AtomicFile {
    pub fn create(path: &Path) -> io::Result<AtomicFile> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let name = path
            .file_name()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?
            .to_string_lossy();
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = parent(path).join(format!(".{name}.tmp.{}.{n}", std::process::id()));
        let file = io::BufWriter::new(File::create_new(&tmp)?);
        Ok(AtomicFile {
            path: path.to_path_buf(),
            tmp,
            file: Some(file),
        })
    }

    /// Flushes, fsyncs and renames the file into place, then fsyncs the directory (best effort).
    pub fn commit(mut self) -> io::Result<()> {
        let file = self.file.take().expect("not yet committed");
        let result = (|| {
            let f = file.into_inner().map_err(io::IntoInnerError::into_error)?;
            f.sync_all()?;
            drop(f);
            fs::rename(&self.tmp, &self.path)
        })();
        if result.is_ok() {
            if let Ok(d) = File::open(parent(&self.path)) {
                let _ = d.sync_all();
            }
        }
        result
    }
}

impl Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.file.as_mut().expect("not yet committed").write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.as_mut().expect("not yet committed").flush()
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        // Committed (renamed) or not: a temporary file left at `tmp` is never wanted.
        let _ = fs::remove_file(&self.tmp);
    }
}

fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// Removes what [`write_atomic`] leaves in `dir` when its process is killed mid-write
/// (`.<name>.tmp.<pid>.<n>`); returns how many. Call it on directories one process owns, at start.
pub fn remove_temp_files(dir: &Path) -> io::Result<usize> {
    let mut n = 0;
    for e in fs::read_dir(dir)? {
        let e = e?;
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') && name.contains(".tmp.") && e.file_type()?.is_file() {
            fs::remove_file(e.path())?;
            n += 1;
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    #[test]
    fn replaces_and_leaves_no_temp_files() {
        let dir = std::env::temp_dir().join(format!("kestrel-fsutil-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.bin");
        super::write_atomic(&p, b"one").unwrap();
        super::write_atomic(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        assert!(super::write_atomic(&dir.join("missing/x"), b"").is_err());
        std::fs::write(dir.join(".a.bin.tmp.1.0"), b"torn").unwrap();
        std::fs::write(dir.join(".keep"), b"").unwrap();
        assert_eq!(super::remove_temp_files(&dir).unwrap(), 1);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2);
        std::fs::remove_dir_all(dir).unwrap();
    }
}

/// Kestrel's directory for fetched weights, data, libraries and caches: `$KESTREL_HOME`, else
/// `~/.cache/kestrel` (as in scripts/env.sh), else `./.cache/kestrel` without a home directory.
pub fn kestrel_home() -> PathBuf {
    if let Some(p) = std::env::var_os("KESTREL_HOME") {
        return PathBuf::from(p);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("kestrel")
}
