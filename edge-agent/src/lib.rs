//! Kestrel edge agent as a library: the sans-IO update state machine (the MQTT and store IO
//! around it live in the binary).

pub mod update;
