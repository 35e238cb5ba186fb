//! Kestrel edge agent as a library: the sans-IO update state machine ([`update`]) and desired-state
//! rules (replay, expiry, signed clears: [`desired`]), the trusted keys (root-signed key lists:
//! [`trust`]), the model
//! store with atomic activation ([`store`]), the durable outbox ([`outbox`]), the configuration
//! ([`config`]), the agent's decisions as a pure core ([`core`]), the MQTT shell that carries
//! them out ([`agent`]) and the command line ([`cli`]).

pub mod agent;
pub mod capture;
pub mod cli;
pub mod config;
pub mod core;
pub mod desired;
pub mod models;
pub mod outbox;
pub mod replies;
pub mod store;
pub mod trust;
pub mod update;
