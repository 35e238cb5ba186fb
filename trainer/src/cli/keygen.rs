//! `trainer keygen`: an ed25519 signing key pair.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::process::ExitCode;

use crate::distributed::Job;
use anyhow::{Context, Result, bail};
use kestrel_shared::{fsutil, signing};

/// Generate an ed25519 signing key pair: DIR/kestrel.key (secret, mode 0600) and DIR/kestrel.pub,
/// or with --root the fleet's root key pair DIR/root.key and DIR/root.pub, or with --operator an
/// operator's key pair DIR/operator.key and DIR/operator.pub.
#[derive(clap::Args)]
pub struct Args {
    /// Directory for the key pair.
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// The fleet's root key (root.key, root.pub): it signs only the key lists that name the
    /// publishing keys (`trainer keys`). Keep root.key offline.
    #[arg(long, conflicts_with = "operator")]
    root: bool,
    /// An operator's key (operator.key, operator.pub) for `trainer console --allow-actions`: it
    /// signs rollout commands only (pause, resume, abort), which a rollout obeys when started
    /// with `--operator-pub operator.pub`. Devices never trust it: a console that holds it
    /// cannot release a model.
    #[arg(long)]
    operator: bool,
}

pub fn run(a: Args, _: &Job) -> Result<ExitCode> {
    let stem = match (a.root, a.operator) {
        (true, _) => "root",
        (_, true) => "operator",
        _ => "kestrel",
    };
    let (secret, public) = (
        a.out.join(format!("{stem}.key")),
        a.out.join(format!("{stem}.pub")),
    );
    if secret.exists() {
        bail!(
            "{} exists: refusing to overwrite a signing key",
            secret.display()
        );
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let mut seed = [0u8; 32];
    rand::Rng::fill(&mut rand::rng(), &mut seed);
    let (sk, pk) = signing::keypair_hex(seed);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&secret)
        .with_context(|| format!("creating {}", secret.display()))?;
    writeln!(f, "{sk}")?;
    f.sync_all()?;
    fsutil::write_atomic(&public, format!("{pk}\n").as_bytes())
        .with_context(|| format!("writing {}", public.display()))?;
    let id = signing::key_id(&signing::public_key(&pk, "new key")?);
    outln!(
        "key {id}: {} (secret), {} (public)",
        secret.display(),
        public.display()
    );
    Ok(ExitCode::SUCCESS)
}
