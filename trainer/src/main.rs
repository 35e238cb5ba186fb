//! `trainer`: the cloud side of Kestrel. Parses the command line and runs the command; each
//! command lives in its own file under `cli/` (`trainer export` → `cli/export.rs`), over the
//! `kestrel_trainer` library (`trainer/src/export/`).

use std::process::ExitCode;

use clap::Parser;

mod cli;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    match cli::run(cli.cmd) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
