//! Receiving captures (`trainer collect`): a persistent MQTT session subscribed at QoS 1 to
//! `P/devices/+/captures/+`, with manual acknowledgements, so the broker keeps every capture
//! until the caller has stored it and acknowledged it ([`CaptureFeed::ack`]): a collector that
//! dies loses nothing, and what it stored but had not acknowledged comes again (the caller
//! de-duplicates by capture path). Once a capture is stored durably, the device is told on
//! `P/devices/<id>/capture-ack` ([`CaptureFeed::acknowledge`]): it keeps each capture until then.
//! [`gate`]: what is stored (each capture once, within each device's hourly quota).

use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};

use kestrel_shared::capture::{Capture, CaptureAck, MAX_ACK_IDS};
use kestrel_shared::mqtt::BrokerConfig;
use kestrel_shared::topics::{DeviceTopic, Route, Topics};
use rumqttc::{Client, Event, Outgoing, Packet, Publish, QoS};

use crate::FleetError;
use crate::conn::Events;

mod gate;
pub use gate::{Gate, Quota, Seen, Verdict};

/// One message from the capture topics: a capture and its image bytes, or why it is not one.
pub struct Received {
    pub topic: String,
    pub capture: Result<(Capture, Vec<u8>), String>,
    publish: Publish,
    size: usize,
}

impl Received {
    /// The message's payload size in bytes (before [`Received::take_content`]).
    pub fn size(&self) -> usize {
        self.size
    }

    /// Takes the image bytes out and frees the payload: what waits for its acknowledgement
    /// holds no image.
    pub fn take_content(&mut self) -> Vec<u8> {
        self.publish.payload = Default::default();
        match &mut self.capture {
            Ok((_, bytes)) => std::mem::take(bytes),
            Err(_) => Vec::new(),
        }
    }
}

pub struct CaptureFeed {
    client: Client,
    events: Events,
    url: String,
    topics: Topics,
    /// Client id, named in the acknowledgements to devices.
    client_id: String,
    /// Acknowledgements queued and not yet written to the socket.
    unwritten: usize,
    /// Acknowledgements to devices published and not yet acknowledged by the broker.
    unconfirmed: usize,
    /// Whether the broker had this client id's session (captures queued while away).
    pub resumed: bool,
}

impl CaptureFeed {
    /// Connects as `client_id` with a persistent session and subscribes to every device's captures.
    pub fn connect(cfg: &BrokerConfig, client_id: &str) -> Result<Self, FleetError> {
        let mut opts = cfg.options(client_id, false)?;
        opts.set_manual_acks(true);
        let (client, conn) = Client::new(opts, 256);
        let events = Events::new(conn);
        let deadline = Instant::now() + Duration::from_secs(10);
        let resumed = loop {
            match events.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(Ok(Event::Incoming(Packet::ConnAck(a)))) => break a.session_present,
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(FleetError::broker(&cfg.url, e)),
                Err(_) => return Err(FleetError::broker(&cfg.url, "no answer within 10 s")),
            }
        };
        let topics = Topics::new(&cfg.prefix);
        client
            .subscribe(topics.captures_filter(), QoS::AtLeastOnce)
            .map_err(|e| FleetError::broker(&cfg.url, e))?;
        Ok(Self {
            client,
            events,
            url: cfg.url.clone(),
            topics,
            resumed,
            client_id: client_id.to_string(),
            unwritten: 0,
            unconfirmed: 0,
        })
    }

    fn err(&self, e: impl Into<kestrel_shared::error::Cause>) -> FleetError {
        FleetError::broker(&self.url, e)
    }

    /// The next capture message within `timeout` (None on timeout).
    pub fn next(&mut self, timeout: Duration) -> Result<Option<Received>, FleetError> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left) {
                Ok(Ok(Event::Incoming(Packet::Publish(p)))) => {
                    let capture = self.capture(&p.topic, &p.payload);
                    return Ok(Some(Received {
                        topic: p.topic.clone(),
                        capture,
                        size: p.payload.len(),
                        publish: p,
                    }));
                }
                Ok(Ok(ev)) => self.count(&ev),
                Ok(Err(e)) => return Err(self.err(format!("connection lost: {e}"))),
                Err(RecvTimeoutError::Timeout) => return Ok(None),
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(self.err("client stopped"));
                }
            }
        }
    }

    /// The capture on `topic`: the device and capture id are the topic's (the device wrote its
    /// own topic, as the broker's ACL allows), and a payload that names another device or id is
    /// refused, as is one that does not parse.
    fn capture(&self, topic: &str, payload: &[u8]) -> Result<(Capture, Vec<u8>), String> {
        let Some(Route::Device {
            device,
            kind: DeviceTopic::Capture { id },
        }) = self.topics.parse(topic)
        else {
            return Err(format!("{topic}: not a capture topic"));
        };
        let (c, bytes) = Capture::parse(payload)
            .map_err(|e| format!("{topic}: {}", kestrel_shared::Chain(&e)))?;
        if c.device != device || c.id != id {
            return Err(format!(
                "{topic}: the payload says it is capture `{}` of device `{}`; refused (a device \
                 speaks only for itself)",
                c.id.chars().take(80).collect::<String>(),
                c.device.chars().take(80).collect::<String>()
            ));
        }
        Ok((c, bytes))
    }

    /// Counts the acknowledgements written and those the broker confirmed.
    fn count(&mut self, ev: &Event) {
        match ev {
            Event::Outgoing(Outgoing::PubAck(_)) => {
                self.unwritten = self.unwritten.saturating_sub(1)
            }
            Event::Incoming(Packet::PubAck(_)) => {
                self.unconfirmed = self.unconfirmed.saturating_sub(1)
            }
            _ => {}
        }
    }

    /// Tells `device` that its captures `ids` are stored durably (QoS 1, not retained, at most
    /// [`MAX_ACK_IDS`] ids a message): it may delete them.
    pub fn acknowledge(&mut self, device: &str, ids: &[String]) -> Result<(), FleetError> {
        let topic = self.topics.capture_ack(device);
        for part in ids.chunks(MAX_ACK_IDS) {
            let ack = CaptureAck {
                ids: part.to_vec(),
                collector: self.client_id.clone(),
            };
            let payload = serde_json::to_vec(&ack).expect("serializable");
            self.client
                .publish(topic.clone(), QoS::AtLeastOnce, false, payload)
                .map_err(|e| self.err(e))?;
            self.unconfirmed += 1;
        }
        Ok(())
    }

    /// Acknowledges a message once it is stored (or refused for good).
    pub fn ack(&mut self, r: &Received) -> Result<(), FleetError> {
        self.client.ack(&r.publish).map_err(|e| self.err(e))?;
        self.unwritten += 1;
        Ok(())
    }

    /// Closes the connection (the session stays) once every queued acknowledgement is written
    /// and every acknowledgement to a device confirmed (waiting up to 5 s; a message not
    /// acknowledged comes again, and the caller de-duplicates; a device not told sends again).
    pub fn close(mut self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.unwritten > 0 || self.unconfirmed > 0 {
            match self
                .events
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(Ok(ev)) => self.count(&ev),
                Ok(Err(_)) | Err(_) => break,
            }
        }
        self.events.close();
    }
}
