//! `trainer`: the cloud side of Kestrel. Parses the command line and runs the command; each
//! command lives in its own file under `cli/` (`trainer export` → `cli/export.rs`), over the
//! `kestrel_trainer` library (`trainer/src/export/`).

use std::process::ExitCode;

use clap::Parser;
use kestrel_trainer::cli;

fn main() -> ExitCode {
    keep_freed_memory();
    let cli = cli::Cli::parse();
    cli.verbosity.init();
    match cli::run(cli.cmd) {
        Ok(code) => code,
        Err(e) => {
            tracing::error!("{}", kestrel_shared::Chain(e.as_ref()));
            cli::exit::code(&e)
        }
    }
}

/// glibc returns large freed blocks to the kernel at once (each one its own `mmap`, and the heap
/// top trimmed past 128 KiB), so every training step's activations, a few MB each, came back as
/// fresh zeroed pages: a fifth of fine-tuning's time went to page faults. Blocks up to 32 MiB
/// (glibc's ceiling) now come from the heap and freed memory stays for the next step; the peak RSS
/// is what one step needs, as before.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; it is called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20);
    }
}
