//! A small blocking MQTT client ([`Conn`]) around rumqttc's sync API: every publish is QoS 1
//! and waits for the broker's acknowledgement before the command reports success.

use std::collections::{BTreeMap, VecDeque};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use kestrel_shared::mqtt::BrokerConfig;
use kestrel_shared::now_unix;
use kestrel_shared::topics::Topics;
use rumqttc::{Client, Event, Packet, QoS};

use crate::FleetError;

/// The events of a connection, polled by a thread of its own (never cut short by a timeout: a
/// cancelled poll can lose an acknowledgement, and rumqttd drops clients whose acknowledgements
/// arrive out of order) until the connection fails (reported, not retried) or is closed.
pub(crate) struct Events {
    rx: Receiver<Result<Event, rumqttc::ConnectionError>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Events {
    pub(crate) fn new(mut conn: rumqttc::Connection) -> Events {
        kestrel_shared::mqtt::no_delay(&mut conn.eventloop);
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                let _ = tx.send(Err(rumqttc::ConnectionError::RequestsDone));
                return;
            };
            rt.block_on(async {
                loop {
                    tokio::select! {
                        biased;
                        _ = &mut stopped => break,
                        ev = conn.eventloop.poll() => {
                            let failed = ev.is_err();
                            if tx.send(ev).is_err() || failed {
                                break;
                            }
                        }
                    }
                }
            });
            // `conn` (and its socket) is dropped here.
        });
        Events {
            rx,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    pub(crate) fn recv_timeout(
        &self,
        timeout: Duration,
    ) -> Result<Result<Event, rumqttc::ConnectionError>, RecvTimeoutError> {
        self.rx.recv_timeout(timeout)
    }

    pub(crate) fn try_iter(
        &self,
    ) -> impl Iterator<Item = Result<Event, rumqttc::ConnectionError>> + '_ {
        self.rx.try_iter()
    }

    /// Closes the socket, with no DISCONNECT packet: every request the callers made has been
    /// acknowledged or written by then (they wait for that), and Kestrel's short connections
    /// carry no will. A DISCONNECT would make rumqttd 0.20 drop the connection in its router
    /// while the connection's network task still runs; that task can then report it (closed,
    /// or ready for more data) after the router has forgotten it: the report either reaches a
    /// new client given the same slot (which is dropped in its place) or panics the router
    /// thread, and the broker answers nobody from then on. A closed socket ends the network task
    /// first, so its last report is the last word on that connection.
    pub(crate) fn close(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        self.close();
    }
}

/// The longest [`Conn::retained`] reads (a fleet of thousands of retained statuses arrives in
/// well under a second on loopback).
pub const RETAINED_MAX_WAIT: Duration = Duration::from_secs(20);

/// The most retained messages the embedded broker (rumqttd, `max_outgoing_packet_count` in
/// fleet/broker) hands one new subscription: a read that gets this many may have been cut short.
pub const EMBEDDED_RETAINED_CAP: usize = 20_000;

/// A connected blocking MQTT client; its connection is driven by [`Events`].
pub struct Conn {
    client: Client,
    events: Events,
    url: String,
    pub topics: Topics,
    /// Publishes received while waiting for something else, with their retain flag.
    backlog: VecDeque<(String, Vec<u8>, bool)>,
}

impl Conn {
    /// Connects with a clean session; fails with the broker's URL when it cannot be reached.
    pub fn connect(cfg: &BrokerConfig, role: &str) -> Result<Self, FleetError> {
        // Unique per connection: a broker drops the older of two sessions with one client id.
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = format!(
            "kestrel-{role}-{}-{}-{n}",
            std::process::id(),
            now_unix() % 100_000
        );
        let opts = cfg.options(&id, true)?;
        let (client, conn) = Client::new(opts, 512);
        let events = Events::new(conn);
        let c = Self {
            client,
            events,
            url: cfg.url.clone(),
            topics: Topics::new(&cfg.prefix),
            backlog: VecDeque::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match c
                .events
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(Ok(Event::Incoming(Packet::ConnAck(_)))) => return Ok(c),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(c.err(e)),
                Err(_) => return Err(c.err("no answer within 10 s")),
            }
        }
    }

    fn err(&self, e: impl Into<kestrel_shared::error::Cause>) -> FleetError {
        FleetError::broker(&self.url, e)
    }

    /// A request the client could not queue: its event loop has stopped, so name why when the
    /// loop said so (the broker closed the connection, say), not only that it stopped.
    fn client_err(&self, e: rumqttc::ClientError) -> FleetError {
        match self.events.try_iter().find_map(Result::err) {
            Some(lost) => self.err(format!("connection lost: {lost}")),
            None => self.err(e),
        }
    }

    /// Queues one QoS 1 publish (not retained) without waiting for its acknowledgement.
    pub fn send(&self, topic: String, payload: Vec<u8>) -> Result<(), FleetError> {
        self.client
            .publish(topic, QoS::AtLeastOnce, false, payload)
            .map_err(|e| self.client_err(e))
    }

    /// Next event within `timeout` (None on timeout); connection errors end the command.
    fn next(&mut self, timeout: Duration) -> Result<Option<Event>, FleetError> {
        match self.events.recv_timeout(timeout) {
            Ok(Ok(ev)) => {
                // Publishes are kept for `recv`, whatever the caller is waiting for.
                if let Event::Incoming(Packet::Publish(p)) = &ev {
                    self.backlog
                        .push_back((p.topic.clone(), p.payload.to_vec(), p.retain));
                }
                Ok(Some(ev))
            }
            Ok(Err(e)) => Err(self.err(format!("connection lost: {e}"))),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(self.err("client stopped")),
        }
    }

    /// Publishes every message at QoS 1 (up to 32 in flight) and waits for all acknowledgements.
    pub fn publish_all(
        &mut self,
        msgs: Vec<(String, Vec<u8>, bool)>,
        progress: Option<&indicatif::ProgressBar>,
    ) -> Result<(), FleetError> {
        let total = msgs.len();
        let mut queue: VecDeque<_> = msgs.into();
        let (mut in_flight, mut acked) = (0usize, 0usize);
        while acked < total {
            while in_flight < 32
                && let Some((topic, payload, retain)) = queue.pop_front()
            {
                self.client
                    .publish(topic, QoS::AtLeastOnce, retain, payload)
                    .map_err(|e| self.client_err(e))?;
                in_flight += 1;
            }
            match self.next(Duration::from_secs(30))? {
                Some(Event::Incoming(Packet::PubAck(_))) => {
                    in_flight -= 1;
                    acked += 1;
                    if let Some(p) = progress {
                        p.inc(1);
                    }
                }
                Some(_) => {}
                None => {
                    return Err(self.err(format!(
                        "{} of {total} publishes unacknowledged after 30 s",
                        total - acked
                    )));
                }
            }
        }
        Ok(())
    }

    /// Subscribes at QoS 1 and waits for the broker's SubAck.
    pub fn subscribe(&mut self, filter: &str) -> Result<(), FleetError> {
        self.subscribe_qos(filter, QoS::AtLeastOnce)
    }

    /// Subscribes at `qos` and waits for the broker's SubAck. Fleet-wide retained state (statuses,
    /// quality, presence) is read at QoS 0: rumqttd 0.20 sends a new QoS 1 subscription at most
    /// 100 retained messages (its fixed in-flight window), a QoS 0 one up to the broker's
    /// `max_outgoing_packet_count` (`kestrel-broker` sets 20,000).
    pub fn subscribe_qos(&mut self, filter: &str, qos: QoS) -> Result<(), FleetError> {
        self.client
            .subscribe(filter, qos)
            .map_err(|e| self.client_err(e))?;
        // Wait for the SubAck: retained messages follow it.
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(Event::Incoming(Packet::SubAck(_))) =
                self.next(Duration::from_millis(200))?
            {
                return Ok(());
            }
        }
        Err(self.err(format!("no SubAck for {filter}")))
    }

    /// The next publish received within `timeout`.
    pub fn recv(&mut self, timeout: Duration) -> Result<Option<(String, Vec<u8>)>, FleetError> {
        Ok(self.recv_flagged(timeout)?.map(|(t, p, _)| (t, p)))
    }

    /// The next publish received within `timeout`, with its retain flag (set by the broker on
    /// what it sends because of a new subscription, clear on what it forwards live).
    /// Like [`Conn::recv`], without the retained messages a new subscription brings (RETAIN
    /// set): for a caller that read those from a snapshot taken after it subscribed
    /// ([`Conn::retained`] on another connection), so that a stale one never arrives after newer
    /// state was acted on.
    pub fn recv_fresh(
        &mut self,
        timeout: Duration,
    ) -> Result<Option<(String, Vec<u8>)>, FleetError> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.recv_flagged(left)? {
                Some((_, _, true)) if !left.is_zero() => {}
                Some((_, _, true)) | None => return Ok(None),
                Some((t, p, false)) => return Ok(Some((t, p))),
            }
        }
    }

    fn recv_flagged(
        &mut self,
        timeout: Duration,
    ) -> Result<Option<(String, Vec<u8>, bool)>, FleetError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(m) = self.backlog.pop_front() {
                return Ok(Some(m));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            self.next(left.min(Duration::from_millis(200)))?;
        }
    }

    /// Retained messages under `filter` (subscribed at QoS 0, see [`Conn::subscribe_qos`]): those
    /// the broker sends with the retain flag on subscribing, until `quiet` passes without one (live traffic on the same topics, which a
    /// chatty or hostile device can keep up forever, neither counts nor keeps the wait going),
    /// and for at most [`RETAINED_MAX_WAIT`].
    pub fn retained(
        &mut self,
        filter: &str,
        quiet: Duration,
    ) -> Result<BTreeMap<String, Vec<u8>>, FleetError> {
        self.subscribe_qos(filter, QoS::AtMostOnce)?;
        let mut out = BTreeMap::new();
        let end = Instant::now() + RETAINED_MAX_WAIT;
        let mut last = Instant::now();
        while last.elapsed() < quiet && Instant::now() < end {
            let left = quiet.saturating_sub(last.elapsed());
            if let Some((t, p, retained)) = self.recv_flagged(left)?
                && retained
            {
                out.insert(t, p);
                last = Instant::now();
            }
        }
        self.client
            .unsubscribe(filter)
            .map_err(|e| self.client_err(e))?;
        if out.len() >= EMBEDDED_RETAINED_CAP {
            tracing::warn!(
                "{} retained messages under {filter}: the embedded broker hands a subscription at \
                 most {EMBEDDED_RETAINED_CAP}, so there may be more (a fleet this size wants \
                 Mosquitto: docs/fleet.md, Fleet size and brokers)",
                out.len()
            );
        }
        Ok(out)
    }

    /// Closes the connection (see [`Events::close`]).
    pub fn disconnect(mut self) {
        self.events.close();
    }
}
