//! Kestrel's end-to-end tests, one test binary with a module per area (as ripgrep's
//! `tests/tests.rs`): one link per build instead of eleven. They run the real binaries on real
//! weights and photos; run them through `scripts/test.sh`, which fetches and builds what they need.
//! The test command runs them with nextest, each in a process of its own; every test uses its
//! own temporary directories and free ports, sets no process-global state, and reads what many
//! share (a trained run, its exports) from fixtures built once per run (`kestrel_tests::once`).

mod adversary;
mod arm;
mod backbone;
mod broker_survives;
mod capture;
mod capture_quota;
mod chaos;
mod cli;
mod console;
mod console_security;
mod cross;
mod distributed;
mod docs;
mod edge;
mod expiry_export;
mod export;
mod fleet_scale;
mod fleet_status;
mod guide;
mod hardening;
mod hostile_files;
mod inputs;
mod learning_loop;

mod mlflow;
// Needs the trainer built with `--features kestrel-trainer/mpi` and Open MPI's `mpirun`.
#[cfg(feature = "mpi")]
mod mpi;
mod mqtt;
mod object_store;
mod own_backbone;
mod parts;
mod parts_fleet;
mod prune;
mod quality;
mod rollout;
mod secure_broker;
mod service;
mod shadow;
mod tables;
mod training;
mod trust;
mod tune;
