//! Kestrel edge agent as a library: the sans-IO update state machine ([`update`]), the model
//! store with atomic activation ([`store`]), the durable outbox ([`outbox`]), the configuration
//! ([`config`]) and the MQTT event loop that drives them ([`agent`]).

pub mod agent;
pub mod config;
pub mod outbox;
pub mod serve;
pub mod store;
pub mod update;
