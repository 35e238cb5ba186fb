//! Device status: the retained statuses of the fleet, or waiting for one device to reach a state.

use std::time::{Duration, Instant};

use kestrel_shared::mqtt::BrokerConfig;
use kestrel_shared::protocol::Status;
use kestrel_shared::quality::DeviceQuality;
use kestrel_shared::topics::{DeviceTopic, FromDevice, Topics, from_device};

use crate::{Conn, FleetError};

/// Retained status of every device (or of one). Each is taken from the topic of the device it
/// names; a malformed one, or one that names another device, is skipped with a warning.
pub fn statuses(cfg: &BrokerConfig, device: Option<&str>) -> Result<Vec<Status>, FleetError> {
    read_retained(cfg, "status", DeviceTopic::Status, |t| match device {
        Some(d) => t.status(d),
        None => t.status_filter(),
    })
}

/// Retained quality report of every device (or of one), by device id; skipped as
/// [`statuses`] are.
pub fn qualities(
    cfg: &BrokerConfig,
    device: Option<&str>,
) -> Result<Vec<DeviceQuality>, FleetError> {
    read_retained(cfg, "quality", DeviceTopic::Quality, |t| match device {
        Some(d) => t.quality(d),
        None => t.quality_filter(),
    })
}

/// The retained messages under the filter `topic` names, on a connection of their own. Tried a
/// second time (on a new connection) when the broker dropped the first: reading twice changes
/// nothing, and a busy broker may close a connection it has just accepted.
fn read_retained<T: FromDevice>(
    cfg: &BrokerConfig,
    role: &str,
    kind: DeviceTopic<'static>,
    topic: impl Fn(&Topics) -> String,
) -> Result<Vec<T>, FleetError> {
    let read = || {
        let mut conn = Conn::connect(cfg, role)?;
        let filter = topic(&conn.topics);
        let out = retained(&mut conn, &filter, kind, Duration::from_millis(400))?;
        conn.disconnect();
        Ok(out)
    };
    read().or_else(|e| match e {
        FleetError::Broker { .. } => read(),
        e => Err(e),
    })
}

/// The retained `kind` messages of devices under `filter` (see [`Conn::retained`]); cleared
/// ones are skipped, and so (with a warning) are malformed ones and those whose payload names
/// another device than their topic.
pub(crate) fn retained<T: FromDevice>(
    conn: &mut Conn,
    filter: &str,
    kind: DeviceTopic<'static>,
    quiet: Duration,
) -> Result<Vec<T>, FleetError> {
    let topics = conn.topics.clone();
    Ok(conn
        .retained(filter, quiet)?
        .iter()
        .filter(|(_, p)| !p.is_empty())
        .filter_map(|(t, p)| {
            from_device(&topics, kind, t, p)
                .map_err(|e| tracing::warn!("skipped: {e}"))
                .ok()
        })
        .collect())
}

/// Waits until `device`'s status satisfies `done` (or `timeout`); returns the last status seen.
pub fn wait_status(
    cfg: &BrokerConfig,
    device: &str,
    timeout: Duration,
    done: impl Fn(&Status) -> bool,
) -> Result<Status, FleetError> {
    let deadline = Instant::now() + timeout;
    let mut last: Option<Status> = None;
    // A dropped connection is re-established: the retained status is delivered again on
    // subscribing.
    let mut first = true;
    while Instant::now() < deadline {
        let mut conn = match Conn::connect(cfg, "wait") {
            Ok(c) => c,
            Err(e) if first => return Err(e),
            Err(_) => {
                std::thread::sleep(Duration::from_millis(200));
                continue;
            }
        };
        first = false;
        let topic = conn.topics.status(device);
        if let Err(e) = conn.subscribe(&topic) {
            tracing::warn!("{}; reconnecting", kestrel_shared::Chain(&e));
            continue;
        }
        loop {
            match conn.recv(deadline.saturating_duration_since(Instant::now())) {
                Ok(Some((t, p))) if t == topic && !p.is_empty() => {
                    match from_device::<Status>(&conn.topics, DeviceTopic::Status, &t, &p) {
                        Ok(s) if done(&s) => {
                            conn.disconnect();
                            return Ok(s);
                        }
                        Ok(s) => last = Some(s),
                        // Not this device's status: what it said next may be.
                        Err(e) => tracing::warn!("skipped: {e}"),
                    }
                }
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(e @ FleetError::Broker { .. }) => {
                    tracing::warn!("{}; reconnecting", kestrel_shared::Chain(&e));
                    break;
                }
                Err(e) => return Err(e),
            }
        }
    }
    Err(FleetError::TimedOut(format!(
        "device {device}: condition not met within {timeout:?}; last status: {}",
        last.map_or("none".into(), |s| serde_json::to_string(&s)
            .unwrap_or_default())
    )))
}
