//! `trainer mlflow sync`: replays the MLflow calls a run buffered while the server was down.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::distributed::Job;
use crate::track::{self, PENDING_FILE};
use anyhow::{Context, Result};
use clap::Subcommand;

use super::args::MlflowArgs;

/// MLflow tracking: replay buffered calls.
#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    cmd: MlflowCmd,
}

#[derive(Subcommand)]
enum MlflowCmd {
    /// Replay RUN_DIR/mlflow-pending.jsonl (the calls a fit, tune or export could not deliver) in
    /// order, each to the server it was meant for (or to --mlflow); each delivered call leaves the
    /// file, so running it again never sends one twice.
    Sync(SyncArgs),
}

#[derive(clap::Args)]
struct SyncArgs {
    /// Run (or tune) directory holding mlflow-pending.jsonl.
    #[arg(value_name = "RUN_DIR")]
    dir: PathBuf,
    /// Without it, each call goes to the server it was meant for.
    #[command(flatten)]
    server: MlflowArgs,
}

pub fn run(a: Args, _job: &Job) -> Result<ExitCode> {
    let MlflowCmd::Sync(s) = a.cmd;
    let file = s.dir.join(PENDING_FILE);
    if !file.is_file() {
        outln!("{}: nothing to replay", file.display());
        return Ok(ExitCode::SUCCESS);
    }
    let n = track::sync(&s.dir, s.server.mlflow.as_deref())
        .with_context(|| format!("replaying {}", file.display()))?;
    outln!("replayed {n} MLflow calls from {}", file.display());
    Ok(ExitCode::SUCCESS)
}
