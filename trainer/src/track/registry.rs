//! Models from the MLflow model registry: `models:/NAME@ALIAS` or `models:/NAME/VERSION` resolved
//! to a version, its artifact directory downloaded into a local cache and verified against its
//! manifest before anything uses it.

use std::path::{Path, PathBuf};

use kestrel_models::artifact::{read_manifest, verify_files};

use super::{Client, ModelVersion, TrackError};

/// A `models:/` URI.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelUri {
    pub name: String,
    pub pick: Pick,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Pick {
    Alias(String),
    Version(u64),
}

impl std::str::FromStr for ModelUri {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{s:?}: expected models:/NAME@ALIAS or models:/NAME/VERSION");
        let rest = s.strip_prefix("models:/").ok_or_else(bad)?;
        let (name, pick) = if let Some((n, a)) = rest.split_once('@') {
            (n, Pick::Alias(a.to_string()))
        } else if let Some((n, v)) = rest.rsplit_once('/') {
            (n, Pick::Version(v.parse().map_err(|_| bad())?))
        } else {
            return Err(bad());
        };
        if name.is_empty() || matches!(&pick, Pick::Alias(a) if a.is_empty()) {
            return Err(bad());
        }
        Ok(ModelUri {
            name: name.to_string(),
            pick,
        })
    }
}

impl std::fmt::Display for ModelUri {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.pick {
            Pick::Alias(a) => write!(f, "models:/{}@{a}", self.name),
            Pick::Version(v) => write!(f, "models:/{}/{v}", self.name),
        }
    }
}

/// The canonical reference of one registered version: `models:/NAME/VERSION`.
pub fn version_uri(name: &str, version: u64) -> String {
    format!("models:/{name}/{version}")
}

/// A registered version fetched into the local cache.
#[derive(Debug, Clone)]
pub struct Fetched {
    pub version: ModelVersion,
    pub dir: PathBuf,
    /// Whether the cache already held it.
    pub cached: bool,
}

/// Resolves `uri` and downloads its artifact into `cache/NAME/VERSION` (kept: a version's files
/// never change), checking every file against the manifest and the manifest's registry reference
/// against the version.
pub fn fetch(client: &Client, uri: &ModelUri, cache: &Path) -> Result<Fetched, TrackError> {
    let version = match &uri.pick {
        Pick::Alias(a) => client.version_by_alias(&uri.name, a)?,
        Pick::Version(v) => client.model_version(&uri.name, *v)?,
    };
    let dir = cache.join(&uri.name).join(version.version.to_string());
    if dir.is_dir() && check(&dir, &version).is_ok() {
        return Ok(Fetched {
            version,
            dir,
            cached: true,
        });
    }
    let tmp = cache.join(&uri.name).join(format!(
        ".{}.{}.partial",
        version.version,
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| TrackError::io(&tmp, e))?;
    let got = client
        .download_dir(&version.source, &tmp)
        .and_then(|_| check(&tmp, &version));
    if let Err(e) = got {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&tmp, &dir).map_err(|e| TrackError::io(&dir, e))?;
    Ok(Fetched {
        version,
        dir,
        cached: false,
    })
}

/// The artifact in `dir` is whole (every file matches the manifest) and is the one registered as
/// `v` (when its manifest names a registry version).
fn check(dir: &Path, v: &ModelVersion) -> Result<(), TrackError> {
    let bad = |e: &dyn std::fmt::Display| {
        TrackError::Unsupported(format!(
            "{} (from {}): {e}",
            version_uri(&v.name, v.version),
            v.source
        ))
    };
    let m = read_manifest(dir).map_err(|e| bad(&kestrel_shared::Chain(&e)))?;
    verify_files(dir, &m, u64::MAX).map_err(|e| bad(&kestrel_shared::Chain(&e)))?;
    let want = version_uri(&v.name, v.version);
    match &m.registry {
        Some(r) if *r != want => Err(bad(&format!("its manifest says it was registered as {r}"))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_uris() {
        let u: ModelUri = "models:/lfw@staging".parse().unwrap();
        assert_eq!(u.pick, Pick::Alias("staging".into()));
        assert_eq!(u.to_string(), "models:/lfw@staging");
        let u: ModelUri = "models:/team/lfw/3".parse().unwrap();
        assert_eq!((u.name.as_str(), u.pick), ("team/lfw", Pick::Version(3)));
        for bad in [
            "lfw@staging",
            "models:/lfw",
            "models:/lfw/x",
            "models:/@a",
            "models:/lfw@",
        ] {
            assert!(bad.parse::<ModelUri>().is_err(), "{bad}");
        }
    }
}
