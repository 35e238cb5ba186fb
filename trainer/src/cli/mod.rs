//! The `trainer` command line: one file per command (its `Args`, its `run(args, &Job)` and its
//! output), shared argument groups in [`args`], fleet commands in [`fleet`]. This module only
//! dispatches: it builds the [`Job`] a command asks for and runs the command in it.

use std::process::ExitCode;

use crate::distributed::{Collective, Job, JobError, JobOpts};
use anyhow::Result;
use clap::{Parser, Subcommand};

#[macro_use]
pub mod out;
pub mod args;
mod bench;
mod classify;
mod evaluate;
pub mod exit;
mod export;
pub mod features;
mod fit;
pub mod fleet;
mod import_weights;
mod keygen;
mod label;
mod latency;
mod lower;
mod mlflow;
mod predict;
mod prepare;
mod preprocess;
mod sign;
pub mod spec;
mod tune;

#[derive(Parser)]
#[command(
    name = "trainer",
    version,
    about = "Kestrel trainer: pretrained backbones, head training, export and publishing",
    after_help = exit::HELP
)]
pub struct Cli {
    #[command(flatten)]
    pub verbosity: kestrel_shared::logging::Verbosity,
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Subcommand)]
pub enum Cmd {
    Prepare(prepare::Args),
    Fit(fit::Args),
    Tune(tune::Args),
    Evaluate(evaluate::Args),
    Predict(predict::Args),
    Classify(classify::Args),
    Export(export::Args),
    Keygen(keygen::Args),
    Sign(sign::Args),
    ImportWeights(import_weights::Args),
    Label(label::Args),
    Lower(lower::Args),
    Preprocess(preprocess::Args),
    Latency(latency::Args),
    Bench(bench::Args),
    Mlflow(mlflow::Args),
    #[command(flatten)]
    Fleet(fleet::FleetCmd),
}

/// Runs a command in the job it asks for (an MPI rank under `mpirun` for the distributed ones).
/// Under MPI, a failing rank ends the whole job ([`Job::fail`]).
pub fn run(cmd: Cmd) -> Result<ExitCode> {
    let job = Job::start(job_opts(&cmd)?)?;
    dispatch(cmd, &job).map_err(|e| job.fail(e))
}

/// Runs a command as one rank of a job of processes that `comm` connects (the tasks of a Spark
/// barrier stage, each running the same command line); only the distributed commands can.
pub fn run_as_rank(cmd: Cmd, comm: Box<dyn Collective + Send>) -> Result<ExitCode> {
    let opts = job_opts(&cmd)?;
    if !opts.distributed {
        return Err(JobError::NotDistributed.into());
    }
    // The process may hold other work (a Spark executor's Python worker, whose global pool the
    // first command sized): candle's kernels for this rank run in a pool of its own threads. The
    // command runs on that pool's thread; its output goes where this thread's would.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(opts.threads.max(1))
        .build()?;
    let (r, printed) = pool.install(move || {
        let job = Job::ranked(opts, comm);
        out::capture(|| dispatch(cmd, &job).map_err(|e| job.fail(e)))
    });
    out::text(&printed);
    r
}

fn job_opts(cmd: &Cmd) -> Result<JobOpts> {
    match cmd {
        Cmd::Prepare(a) => prepare::job_opts(a),
        Cmd::Fit(a) => fit::job_opts(a),
        Cmd::Tune(a) => tune::job_opts(a),
        Cmd::Evaluate(a) => evaluate::job_opts(a),
        Cmd::Predict(a) => predict::job_opts(a),
        Cmd::Classify(a) => classify::job_opts(a),
        Cmd::Export(a) => export::job_opts(a),
        Cmd::Latency(a) => latency::job_opts(a),
        Cmd::Bench(a) => bench::job_opts(a),
        _ => Ok(JobOpts::default()),
    }
}

fn dispatch(cmd: Cmd, job: &Job) -> Result<ExitCode> {
    match cmd {
        Cmd::Prepare(a) => prepare::run(a, job),
        Cmd::Fit(a) => fit::run(a, job),
        Cmd::Tune(a) => tune::run(a, job),
        Cmd::Evaluate(a) => evaluate::run(a, job),
        Cmd::Predict(a) => predict::run(a, job),
        Cmd::Classify(a) => classify::run(a, job),
        Cmd::Export(a) => export::run(a, job),
        Cmd::Keygen(a) => keygen::run(a, job),
        Cmd::Sign(a) => sign::run(a, job),
        Cmd::ImportWeights(a) => import_weights::run(a, job),
        Cmd::Label(a) => label::run(a),
        Cmd::Lower(a) => lower::run(a, job),
        Cmd::Preprocess(a) => preprocess::run(a, job),
        Cmd::Latency(a) => latency::run(a, job),
        Cmd::Bench(a) => bench::run(a, job),
        Cmd::Mlflow(a) => mlflow::run(a, job),
        Cmd::Fleet(c) => fleet::run(c),
    }
}
