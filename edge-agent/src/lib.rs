//! Kestrel edge agent as a library: the sans-IO update state machine ([`update`]) and the model
//! store with atomic activation ([`store`]). The MQTT event loop around them lives in the binary.

pub mod store;
pub mod update;
