//! `trainer sign`: an artifact's manifest signature.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::distributed::Job;
use anyhow::{Context, Result};
use kestrel_shared::{fsutil, manifest, signing};

use super::fleet::ArtifactArgs;

/// Sign an artifact's manifest.json into manifest.sig (devices only accept signed manifests).
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    artifact: ArtifactArgs,
    /// Secret key file written by `trainer keygen` (signs manifests, desired states and rollout
    /// commands).
    #[arg(long)]
    key: PathBuf,
}

pub fn run(a: Args, _: &Job) -> Result<ExitCode> {
    let sk = super::fleet::secret_key(&a.key)?;
    let dir = a.artifact.dir()?;
    let mpath = dir.join(manifest::MANIFEST_FILE);
    let bytes = std::fs::read(&mpath).with_context(|| format!("reading {}", mpath.display()))?;
    let sig = signing::sign(&sk, signing::PayloadType::Manifest, &bytes);
    let spath = dir.join(signing::SIGNATURE_FILE);
    fsutil::write_atomic(&spath, serde_json::to_string_pretty(&sig)?.as_bytes())
        .with_context(|| format!("writing {}", spath.display()))?;
    outln!("signed {} with key {}", mpath.display(), sig.key_id);
    Ok(ExitCode::SUCCESS)
}
