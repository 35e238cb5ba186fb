//! The MQTT loop around the rollout [`Controller`]: publishes the artifact, feeds device statuses
//! and clock ticks to the controller, publishes what it asks for (signed desired states), and
//! keeps the controller retained at `P/rollouts/<name>/state` so a restart resumes it.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use ed25519_dalek::{SigningKey, VerifyingKey};
use kestrel_shared::mqtt::BrokerConfig;
use kestrel_shared::protocol::{
    DEFAULT_VALIDITY_S, Desired, ModelRef, SignedDesired, Status, Target, check_name, sha256_hex,
};
use kestrel_shared::quality::DeviceQuality;
use kestrel_shared::topics::{DeviceTopic, Route, from_device};
use kestrel_shared::wire;
use kestrel_shared::{issued_now, now_unix};

use super::command::{Action, Command};
use super::{Controller, DeviceState, Output, Plan, RolloutState, saved};
use crate::{Bundle, Conn, FleetError, Skipped};

pub fn state_topic(conn: &Conn, name: &str) -> String {
    conn.topics.rollout_state(name)
}

/// Where operators' signed commands to rollout `name` arrive ([`super::command`]).
pub fn command_topic(conn: &Conn, name: &str) -> String {
    conn.topics.rollout_command(name)
}

/// The rollout's retained state (topic, payload), if any.
fn retained_state(conn: &mut Conn, name: &str) -> Result<Option<(String, Vec<u8>)>, FleetError> {
    let topic = state_topic(conn, name);
    let mut found = conn.retained(&topic, Duration::from_millis(400))?;
    Ok(found
        .remove(&topic)
        .filter(|p| !p.is_empty())
        .map(|p| (topic, p)))
}

/// The rollout's retained controller, if any, unverified: for showing it
/// ([`saved::read`]).
pub fn load(conn: &mut Conn, name: &str) -> Result<Option<Controller>, FleetError> {
    Ok(match retained_state(conn, name)? {
        Some((topic, p)) => Some(saved::read(&topic, &p)?),
        None => None,
    })
}

/// What a rollout signs with and whom it obeys.
struct Keys<'a> {
    /// Signs the desired states.
    sign: &'a SigningKey,
    /// The registry version desired states for the rolled-out version name, if any.
    source: Option<&'a str>,
    /// Whose commands are honoured: the operator keys and the rollout's own key.
    commands: Vec<VerifyingKey>,
}

/// How often a running rollout's state is saved at most: each save is the whole controller
/// (deflated, about 200 KB at 10,000 devices), and devices change state many times a second.
/// A controller stopped between two saves resumes from the older one: what it did since is
/// in the desired states already published (published before the save that records them), and
/// a device it gave the model then reports it, which the resumed controller counts (a waiting
/// device reporting the model active is active).
const SAVE_EVERY: Duration = Duration::from_secs(1);

/// Publishes what the controller asks for, and saves it.
struct Publisher<'a> {
    keys: Keys<'a>,
    /// A save was asked for and not yet published.
    unsaved: bool,
    saved: Option<Instant>,
}

impl Publisher<'_> {
    /// Publishes what the controller asked for; desired states for the rolled-out version carry
    /// its registry `source`. A save is published at most every [`SAVE_EVERY`] while the rollout
    /// runs ([`Publisher::flush`] publishes one held back).
    fn execute(
        &mut self,
        conn: &mut Conn,
        c: &Controller,
        outputs: Vec<Output>,
        log: &mut dyn FnMut(String),
    ) -> Result<(), FleetError> {
        let Keys {
            sign: key, source, ..
        } = self.keys;
        let mut batch = Vec::new();
        for o in outputs {
            let (device, name, version, rollback, clear, shadow) = match o {
                Output::Desired {
                    device,
                    name,
                    version,
                    rollback,
                    shadow,
                } => (device, name, version, rollback, false, shadow),
                // A signed clear: devices ignore an unsigned (empty) one.
                Output::Clear { device } => {
                    (device, c.model.clone(), c.version, false, true, false)
                }
                Output::Save => {
                    self.unsaved = true;
                    continue;
                }
                Output::Log(line) => {
                    log(line);
                    continue;
                }
            };
            let target = Target::Device(device);
            let d = Desired {
                target: target.clone(),
                name,
                version,
                rollback,
                issued: issued_now(),
                expires: Some(now_unix() + DEFAULT_VALIDITY_S),
                clear,
                rollout: Some(c.name.clone()),
                source: source
                    .filter(|_| version == c.version && !clear)
                    .map(String::from),
                shadow: shadow.then(|| ModelRef {
                    name: c.model.clone(),
                    version: c.version,
                }),
            };
            let payload = serde_json::to_vec(&SignedDesired::new(key, &d)).expect("serializable");
            batch.push((conn.topics.desired(&target), payload, true));
        }
        // After the desired states it follows: a crash in between repeats them on resume.
        conn.publish_all(batch, None)?;
        self.flush(conn, c, c.state != RolloutState::Running)
    }

    /// Publishes a save asked for, if [`SAVE_EVERY`] has passed since the last (or `now`).
    fn flush(&mut self, conn: &mut Conn, c: &Controller, now: bool) -> Result<(), FleetError> {
        if self.unsaved && (now || self.saved.is_none_or(|t| t.elapsed() >= SAVE_EVERY)) {
            let state = (
                state_topic(conn, &c.name),
                saved::seal(self.keys.sign, c),
                true,
            );
            conn.publish_all(vec![state], None)?;
            self.unsaved = false;
            self.saved = Some(Instant::now());
        }
        Ok(())
    }
}

/// Runs (or resumes) the rollout of `bundle` with `plan` until it completes or aborts, obeying
/// operators' commands signed by `key` or one of `operators`.
pub fn run(
    cfg: &BrokerConfig,
    bundle: &Bundle,
    key: &SigningKey,
    operators: &[VerifyingKey],
    plan: Plan,
    log: &mut dyn FnMut(String),
) -> Result<Controller, FleetError> {
    let (model, version) = (bundle.offer.name.clone(), bundle.offer.version);
    let name = plan
        .name
        .clone()
        .unwrap_or_else(|| format!("{model}-v{version}"));
    check_name(&name)?;
    let mut conn = Conn::connect(cfg, "rollout")?;
    let resumed = match retained_state(&mut conn, &name)? {
        Some((topic, p)) => Some(
            saved::open(&topic, &p, &name, &key.verifying_key(), &plan)
                .map_err(|e| FleetError::Refused(kestrel_shared::chain(&e)))?,
        ),
        None => None,
    };
    let mut c = match resumed {
        Some(c) if c.model != model || c.version != version => {
            return Err(FleetError::Refused(format!(
                "rollout {name} exists for {} v{}, not {model} v{version}: choose another name",
                c.model, c.version
            )));
        }
        // A dynamic rollout that completed goes on serving late devices.
        Some(c) if c.state != RolloutState::Running && !going(&c) => {
            log(format!("rollout {name} already finished: {:?}", c.state));
            conn.disconnect();
            return Ok(c);
        }
        Some(c) => {
            log(format!(
                "resuming rollout {name} at phase {} `{}`",
                c.phase, c.plan.phases[c.phase].name
            ));
            c
        }
        None => begin(&mut conn, &name, bundle, plan, log)?,
    };
    let signer = &mut Publisher {
        keys: Keys {
            sign: key,
            source: bundle.manifest.registry.as_deref(),
            commands: operators
                .iter()
                .copied()
                .chain([key.verifying_key()])
                .collect(),
        },
        unsaved: false,
        saved: None,
    };
    let mut seen = Seen::default();
    // A lost broker (a restart, an outage) is waited for: reconnected, the controller goes on as
    // a restarted one would (its phase's desired states again, all idempotent).
    while let Err(e) = follow(cfg, &mut conn, &mut c, signer, &mut seen, log) {
        let FleetError::Broker { .. } = e else {
            return Err(e);
        };
        log(format!(
            "{}; reconnecting (for up to {RECONNECT_S} s)",
            kestrel_shared::chain(&e)
        ));
        conn = reconnect(cfg, e)?;
    }
    if let RolloutState::Aborted(_) = &c.state {
        wait_rolled_back(&mut conn, &mut c, signer, &mut seen, log)?;
    }
    if let Some(line) = seen.skipped.summary() {
        log(line);
    }
    conn.disconnect();
    Ok(c)
}

/// Whether the controller goes on: while the rollout runs, and after a dynamic one completed.
fn going(c: &Controller) -> bool {
    match c.state {
        RolloutState::Running => true,
        RolloutState::Completed => c.plan.dynamic,
        RolloutState::Aborted(_) => false,
    }
}

/// How long a rollout waits for a lost broker to come back.
const RECONNECT_S: u64 = 120;

/// The fleet's retained statuses, quality reports and online flags fed to the controller, its
/// current phase published again, then what devices send and the clock fed to it until the
/// rollout ends (a `dynamic` rollout's, once completed, until the process is stopped).
fn follow(
    cfg: &BrokerConfig,
    conn: &mut Conn,
    c: &mut Controller,
    signer: &mut Publisher,
    seen: &mut Seen,
    log: &mut dyn FnMut(String),
) -> Result<(), FleetError> {
    let live = [
        conn.topics.online_filter(),
        conn.topics.status_filter(),
        conn.topics.quality_filter(),
    ];
    for f in &live {
        conn.subscribe(f)?;
    }
    conn.subscribe(&conn.topics.rollout_command(&c.name))?;
    // The subscriptions above bring live changes; every device's retained state comes from a
    // snapshot of its own (a QoS 1 subscription may bring only some of it: see
    // `Conn::subscribe_qos`). A status older than one already seen is ignored (`on_message`).
    let mut snapshot = Conn::connect(cfg, "rollout-snapshot")?;
    for f in &live {
        for (t, p) in snapshot.retained(f, Duration::from_millis(400))? {
            if !p.is_empty() {
                let outputs = on_message(conn, c, &signer.keys.commands, seen, (&t, &p), log);
                signer.execute(conn, c, outputs, log)?;
            }
        }
    }
    snapshot.disconnect();
    let outputs = c.start(now_unix());
    signer.execute(conn, c, outputs, log)?;
    let (mut last_tick, mut renewed) = (Instant::now(), Instant::now());
    while going(c) {
        // Desired states expire (DEFAULT_VALIDITY_S): a long rollout signs its own again.
        if renewed.elapsed() >= Duration::from_secs(DEFAULT_VALIDITY_S / 2) {
            renewed = Instant::now();
            let outputs = c.renew();
            signer.execute(conn, c, outputs, log)?;
        }
        // The retained messages the subscriptions bring were read from the snapshot, before the
        // phase started: one delivered now (a quality report of an earlier shadow of this
        // version, say) would come after the state it precedes.
        if let Some((t, p)) = conn.recv_fresh(Duration::from_millis(250))?
            && !p.is_empty()
        {
            let outputs = on_message(conn, c, &signer.keys.commands, seen, (&t, &p), log);
            signer.execute(conn, c, outputs, log)?;
        }
        if last_tick.elapsed() >= Duration::from_secs(1) {
            last_tick = Instant::now();
            let outputs = c.on_tick(now_unix());
            signer.execute(conn, c, outputs, log)?;
        }
        signer.flush(conn, c, false)?;
    }
    signer.flush(conn, c, true)
}

/// What the rollout has seen of the fleet: each device's latest status (after an abort, a device
/// that never left its previous model sends nothing new, and a broker need not resend retained
/// messages to a subscription that exists already (rumqttd does not), so the wait for the roll
/// back starts from these), and the messages it skipped.
#[derive(Default)]
struct Seen {
    latest: BTreeMap<String, Status>,
    /// Each device's latest `online` flag: a device the rollout does not know yet is told
    /// offline when it joins (its status may be older than its last will).
    online: BTreeMap<String, bool>,
    skipped: Skipped,
}

/// One message from the broker, by its topic: a device's status or quality report (the device
/// is the one its topic names; a payload that names another, or does not parse, is skipped and
/// counted), or an operator's command to this rollout.
fn on_message(
    conn: &Conn,
    c: &mut Controller,
    commanders: &[VerifyingKey],
    seen: &mut Seen,
    (topic, payload): (&str, &[u8]),
    log: &mut dyn FnMut(String),
) -> Vec<Output> {
    let topics = &conn.topics;
    match topics.parse(topic) {
        Some(Route::Device {
            kind: DeviceTopic::Status,
            ..
        }) => match from_device::<Status>(topics, DeviceTopic::Status, topic, payload) {
            Ok(s)
                if seen
                    .latest
                    .get(&s.device)
                    .is_some_and(|l| (s.started, s.seq) < (l.started, l.seq)) =>
            {
                vec![] // older than what this controller already saw
            }
            Ok(s) => {
                let mut outputs = c.on_status(&s, now_unix());
                if seen.online.get(&s.device) == Some(&false) {
                    outputs.extend(c.on_online(&s.device, false, now_unix()));
                }
                seen.latest.insert(s.device.clone(), s);
                outputs
            }
            Err(e) => {
                seen.skipped.note(topics, topic, &e, log);
                vec![]
            }
        },
        Some(Route::Device {
            kind: DeviceTopic::Quality,
            ..
        }) => match from_device::<DeviceQuality>(topics, DeviceTopic::Quality, topic, payload) {
            Ok(q) => c.on_quality(&q, now_unix()),
            Err(e) => {
                seen.skipped.note(topics, topic, &e, log);
                vec![]
            }
        },
        // The device is the one the topic names; anything but `1` or `0` is skipped.
        Some(Route::Device {
            device,
            kind: DeviceTopic::Online,
        }) => match payload {
            b"1" | b"0" => {
                seen.online.insert(device.to_string(), payload == b"1");
                c.on_online(device, payload == b"1", now_unix())
            }
            _ => {
                seen.skipped
                    .note(topics, topic, &"an online flag is `1` or `0`", log);
                vec![]
            }
        },
        Some(Route::RolloutCommand { name }) if name == c.name => {
            command(c, payload, commanders, log)
        }
        _ => vec![],
    }
}

/// An operator's command: honoured when signed as a command by one of `commanders`, for this
/// rollout, fresh and not seen before; else refused with a log line.
fn command(
    c: &mut Controller,
    payload: &[u8],
    commanders: &[VerifyingKey],
    log: &mut dyn FnMut(String),
) -> Vec<Output> {
    let now_ms = kestrel_shared::issued_now();
    let opened = Command::open(payload, commanders, &c.name, now_ms)
        .and_then(|cmd| c.commands.take(&cmd, now_ms).map(|()| cmd));
    match opened {
        Ok(cmd) => {
            log(format!(
                "{:?} requested by {}: {}",
                cmd.action, cmd.by, cmd.reason
            ));
            match cmd.action {
                Action::Abort => c.on_abort(&cmd.reason, &cmd.by),
                Action::Pause => c.on_pause(true, &cmd.by, now_unix()),
                Action::Resume => c.on_pause(false, &cmd.by, now_unix()),
            }
        }
        Err(e) => {
            log(format!("command refused: {e}"));
            vec![]
        }
    }
}

/// A new connection to the broker, tried every 2 s for [`RECONNECT_S`]; else `lost` and the
/// last failure.
fn reconnect(cfg: &BrokerConfig, lost: FleetError) -> Result<Conn, FleetError> {
    let deadline = Instant::now() + Duration::from_secs(RECONNECT_S);
    loop {
        std::thread::sleep(Duration::from_secs(2));
        match Conn::connect(cfg, "rollout") {
            Ok(c) => return Ok(c),
            Err(e) if Instant::now() >= deadline => {
                return Err(FleetError::broker(
                    &cfg.url,
                    format!(
                        "{}; not back within {RECONNECT_S} s: {}",
                        kestrel_shared::chain(&lost),
                        kestrel_shared::chain(&e)
                    ),
                ));
            }
            Err(_) => {}
        }
    }
}

/// A new rollout `name`: the fleet (the plan's devices, else every device with a retained
/// status) split into phases, and the artifact published.
fn begin(
    conn: &mut Conn,
    name: &str,
    bundle: &Bundle,
    plan: Plan,
    log: &mut dyn FnMut(String),
) -> Result<Controller, FleetError> {
    let (model, version) = (&bundle.offer.name, bundle.offer.version);
    let filter = conn.topics.status_filter();
    let mut fleet: Vec<Status> = crate::status::retained(
        conn,
        &filter,
        DeviceTopic::Status,
        Duration::from_millis(500),
    )?;
    if let Some(list) = &plan.devices {
        if let Some(missing) = list.iter().find(|d| !fleet.iter().any(|s| &s.device == *d)) {
            return Err(FleetError::Refused(format!(
                "device {missing} of the plan has never reported a status"
            )));
        }
        fleet.retain(|s| list.contains(&s.device));
    }
    let mut c = Controller::new(name, model, version, plan, &fleet)
        .map_err(|e| FleetError::Refused(e.to_string()))?;
    c.manifest_sha256 = Some(sha256_hex(bundle.offer.manifest.as_bytes()));
    c.artifact_bytes = bundle.offer.total_bytes;
    log(format!(
        "rollout {name}: {model} v{version} to {} devices in {} phases",
        fleet.len(),
        c.plan.phases.len()
    ));
    conn.publish_all(bundle.messages(&conn.topics), None)?;
    Ok(c)
}

/// After an abort: waits (up to a minute) until every device sent back reports its previous
/// model, starting from the latest status of each device seen during the rollout.
fn wait_rolled_back(
    conn: &mut Conn,
    c: &mut Controller,
    signer: &mut Publisher,
    seen: &mut Seen,
    log: &mut dyn FnMut(String),
) -> Result<(), FleetError> {
    let mut left: BTreeMap<String, (String, u64)> = c
        .devices
        .values()
        .filter(|d| d.state != DeviceState::Waiting)
        .filter_map(|d| d.previous.clone().map(|p| (d.id.clone(), p)))
        .collect();
    let back = |left: &mut BTreeMap<String, (String, u64)>, s: &Status| {
        if let Some((name, v)) = left.get(s.device.as_str())
            && s.active == Some(*v)
            && s.model.as_deref() == Some(name.as_str())
            && s.state == wire::DeviceState::Idle
        {
            left.remove(s.device.as_str());
        }
    };
    for s in seen.latest.values() {
        back(&mut left, s);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while !left.is_empty() && Instant::now() < deadline {
        if let Some((t, p)) = conn.recv(Duration::from_millis(250))?
            && !p.is_empty()
        {
            // A failure reported now (a device that was installing when the abort came) is
            // recorded in the saved controller.
            let outputs = on_message(conn, c, &signer.keys.commands, seen, (&t, &p), log);
            signer.execute(conn, c, outputs, log)?;
            if let Some(s) = seen.latest.get(
                conn.topics
                    .device_of(&t, DeviceTopic::Status)
                    .unwrap_or_default(),
            ) {
                back(&mut left, s);
            }
        }
    }
    match left.keys().next() {
        None => {
            log("every device sent back reports its previous model".into());
            Ok(())
        }
        Some(d) => Err(FleetError::Refused(format!(
            "{} devices (first: {d}) did not report their previous model within 60 s",
            left.len()
        ))),
    }
}

/// `trainer rollout status`: the retained controller of rollout `name` is shown once, and with
/// `follow` again on every change until the rollout ends. `None` when there is no such rollout.
pub fn watch(
    cfg: &BrokerConfig,
    name: &str,
    follow: bool,
    show: &mut dyn FnMut(&Controller),
) -> Result<Option<Controller>, FleetError> {
    let mut conn = Conn::connect(cfg, "rollout-status")?;
    let Some(mut c) = load(&mut conn, name)? else {
        conn.disconnect();
        return Ok(None);
    };
    show(&c);
    if follow {
        let topic = state_topic(&conn, name);
        conn.subscribe(&topic)?;
        while c.state == RolloutState::Running {
            if let Some((t, p)) = conn.recv(Duration::from_secs(1))?
                && t == topic
                && !p.is_empty()
            {
                let next = saved::read(&t, &p)?;
                if next != c {
                    c = next;
                    show(&c);
                }
            }
        }
    }
    conn.disconnect();
    Ok(Some(c))
}
