//! Kestrel edge agent as a library: every decision in a pure core ([`core`]: the update machine,
//! the desired-state rules, the trusted keys, the capture policy, and the settings they decide
//! with, as plain values), and the shell that carries them out: the model store with atomic
//! activation ([`store`]), the durable outbox ([`outbox`]), reading the configuration files
//! ([`config`]), the MQTT event loop ([`agent`]) and the command line ([`cli`]).

pub mod agent;
pub mod cli;
pub mod config;
pub mod core;
pub mod models;
pub mod outbox;
pub mod replies;
pub mod store;
