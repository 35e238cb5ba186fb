//! Kestrel's end-to-end tests, one test binary with a module per area (as ripgrep's
//! `tests/tests.rs`): one link per build instead of eleven. They run the real binaries on real
//! weights and photos; run them through `scripts/test.sh`, which fetches and builds what they need.
//! Tests run as threads of this one process: every test uses its own temporary directories and
//! free ports, and sets no process-global state (environment, current directory).

mod arm;
mod backbone;
mod capture;
mod chaos;
mod cli;
mod console;
mod cross;
mod distributed;
mod edge;
mod export;
mod fleet_status;
mod hardening;
mod inputs;
mod learning_loop;
mod mlflow;
// Needs the trainer built with `--features kestrel-trainer/mpi` and Open MPI's `mpirun`.
#[cfg(feature = "mpi")]
mod mpi;
mod mqtt;
mod own_backbone;
mod quality;
mod rollout;
mod secure_broker;
mod tables;
mod training;
mod tune;
