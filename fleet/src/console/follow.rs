//! The console's MQTT side: a thread that subscribes to the fleet's topics and feeds every
//! message to the [`FleetView`], telling the HTTP side that something changed. A lost broker is
//! reconnected every 2 s, for as long as the console runs (the retained state comes again).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kestrel_shared::mqtt::BrokerConfig;
use kestrel_shared::now_rfc3339;
use tokio::sync::watch;

use super::view::{FleetView, filters};
use crate::{Conn, FleetError};

/// What the follower shares with the server.
pub struct ConsoleState {
    pub view: Mutex<FleetView>,
    /// Whether the broker is connected now.
    pub connected: AtomicBool,
    /// The view's sequence number after the last change.
    pub changed: watch::Sender<u64>,
}

/// Starts the follower thread.
pub fn start(cfg: BrokerConfig, shared: Arc<ConsoleState>) {
    std::thread::spawn(move || {
        loop {
            if let Err(e) = follow(&cfg, &shared) {
                tracing::warn!(
                    "console: {}; reconnecting in 2 s",
                    kestrel_shared::Chain(&e)
                );
            }
            shared.connected.store(false, Ordering::Relaxed);
            shared.changed.send_modify(|_| {});
            std::thread::sleep(Duration::from_secs(2));
        }
    });
}

/// One connection: subscribe, then apply messages until it fails.
fn follow(cfg: &BrokerConfig, shared: &ConsoleState) -> Result<(), FleetError> {
    let mut conn = Conn::connect(cfg, "console")?;
    // QoS 0: a late console gets every retained status, not rumqttd's first 100 (see
    // `Conn::subscribe_qos`); each message is a device's latest state, which the next replaces.
    for f in filters(&conn.topics) {
        conn.subscribe_qos(&f, rumqttc::QoS::AtMostOnce)?;
    }
    shared.connected.store(true, Ordering::Relaxed);
    // The pages learn it now, not with the next message.
    shared.changed.send_modify(|_| {});
    tracing::info!("console: following {}", cfg.url);
    loop {
        let Some((topic, payload)) = conn.recv(Duration::from_secs(1))? else {
            continue;
        };
        let mut view = shared.view.lock().unwrap_or_else(|e| e.into_inner());
        match view.apply(&topic, &payload, &now_rfc3339()) {
            Ok(true) => {
                let seq = view.seq();
                drop(view);
                shared.changed.send_replace(seq);
            }
            Ok(false) => {}
            Err(e) => tracing::warn!("console: skipped {e}"),
        }
    }
}
