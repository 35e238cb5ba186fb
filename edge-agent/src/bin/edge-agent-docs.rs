//! `edge-agent-docs DIR`: the man pages (`DIR/man/edge-agent.1`, one page per subcommand) and the
//! bash, zsh and fish completions (`DIR/completions/`) of `edge-agent`, from its clap definition,
//! for the Debian package (`edge-agent/deploy/build-deb.sh`). A host tool: built with the
//! `docs` feature, never for the device.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::CommandFactory;
use clap_complete::Shell;
use edge_agent::cli::Cli;

fn main() -> Result<()> {
    let out: PathBuf = std::env::args_os()
        .nth(1)
        .context("usage: edge-agent-docs DIR")?
        .into();
    let man = out.join("man");
    let completions = out.join("completions");
    for d in [&man, &completions] {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    let cmd = Cli::command();
    clap_mangen::generate_to(cmd.clone(), &man)
        .with_context(|| format!("writing man pages to {}", man.display()))?;
    for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
        clap_complete::generate_to(shell, &mut cmd.clone(), "edge-agent", &completions)
            .with_context(|| format!("writing {shell} completions to {}", completions.display()))?;
    }
    Ok(())
}
