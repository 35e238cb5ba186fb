//! The console as an attacker meets it (issue 35), through `trainer console`, curl and headless
//! Chromium: hostile strings from the broker in every field the page shows stay text and run
//! nothing; requests for another `Host` or state changes from another `Origin` are refused;
//! TLS with a test CA, sessions from a token, no plain HTTP on an open address; half-open
//! connections and streams capped; the console's broker role and operator key cannot release a
//! model.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use kestrel_fleet::Conn;
use kestrel_fleet::rollout::command::Command as RolloutCommand;
use kestrel_fleet::rollout::{Controller, Plan};
use kestrel_shared::protocol::{LatencyStats, Status, Target};
use kestrel_tests::browser::Browser;
use kestrel_tests::fleet::{BrokerKind, fixture, free_port, publish};
use kestrel_tests::tls::test_ca;
use kestrel_tests::{run, s, stderr};
use serde_json::{Value, json};

use super::console::{start_console, start_console_with_actions, workdir_and_broker};
use kestrel_shared::wire::DeviceState;

/// Device ids and rollout names come from topics, where only safe names are taken
/// (`check_name`); a hostile one is skipped before the page ([`HOSTILE_ID`]).
const IDS: [&str; 3] = ["pi-a", "pi-b", "pi-c"];
const HOSTILE_ID: &str = "<img src=x onerror=window.__pwned=1>";

/// Hostile string `i` (five kinds), made unique by its number.
fn hostile(i: usize) -> String {
    let kind = match i % 5 {
        0 => "<script>window.__pwned=1</script>".into(),
        1 => "<img src=x onerror=\"window.__pwned=1\">".into(),
        2 => "'\"><svg/onload=window.__pwned=1>".into(),
        3 => format!("{}<i onmouseover=window.__pwned=1>", "long ".repeat(1000)),
        _ => "ünïcødé ☃ \u{202e}<a href=javascript:window.__pwned=1>x</a>".into(),
    };
    format!("{kind}#{i}")
}

/// The fields (by the end of their JSON path) the page shows; the others (timestamps the page
/// does not print, `refused`, `source`) are poisoned too but need not appear.
const SHOWN: [&str; 10] = [
    "/groups/0",
    "/model",
    "/last_error",
    "/kind",
    "/reason",
    "/bound",
    "/detail",
    "/aborted",
    "/name",
    "/time",
];

/// Every string value of `v` replaced by a hostile one where it still `parses` (an enum's tag
/// stays), except at the paths `keep`; returns those the page shows ([`SHOWN`]).
fn poison(v: &mut Value, keep: &[&str], parses: impl Fn(&Value) -> bool) -> Vec<String> {
    let mut used = Vec::new();
    let mut paths = Vec::new();
    collect_paths(v, String::new(), &mut paths);
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    for path in &paths {
        if keep.contains(&path.as_str()) {
            continue;
        }
        let h = hostile(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        let before = v.clone();
        set_at(v, path, &h);
        if parses(v) {
            if SHOWN.iter().any(|f| path.ends_with(f)) {
                used.push(h);
            }
        } else {
            *v = before;
        }
    }
    used
}

/// JSON-pointer paths of every string value.
fn collect_paths(v: &Value, at: String, out: &mut Vec<String>) {
    match v {
        Value::String(_) => out.push(at),
        Value::Array(a) => a
            .iter()
            .enumerate()
            .for_each(|(i, x)| collect_paths(x, format!("{at}/{i}"), out)),
        Value::Object(o) => o
            .iter()
            .for_each(|(k, x)| collect_paths(x, format!("{at}/{k}"), out)),
        _ => {}
    }
}

fn set_at(v: &mut Value, path: &str, to: &str) {
    *v.pointer_mut(path).unwrap() = Value::String(to.into());
}

fn status(device: &str) -> Status {
    Status {
        device: device.into(),
        groups: vec!["g".into()],
        state: DeviceState::Idle,
        model: Some("m".into()),
        active: Some(1),
        previous: Some(0),
        target: None,
        manifest_sha256: None,
        progress: None,
        last_error: Some("e".into()),
        failed_version: None,
        latency: LatencyStats::default(),
        updated: "2026-12-04T09:00:00Z".into(),
        started: 0,
        seq: 1,
        source: Some("s".into()),
        refused: Some("r".into()),
        keys_version: None,
        shadow: None,
        captures: None,
        counters: Default::default(),
    }
}

/// A rollout state as a controller retains it (signed by a key of the test's; the console shows
/// a state without verifying it).
fn sealed(c: &Controller) -> Vec<u8> {
    kestrel_fleet::rollout::saved::seal(&ed25519_dalek::SigningKey::from_bytes(&[5; 32]), c)
}

/// A rollout's retained state with hostile names, reasons, failures, gates and bounds.
fn hostile_rollout(name: &str, fleet: &[Status], running: bool) -> (Value, Vec<String>) {
    let plan = Plan::parse(
        "[[phases]]\nname = \"one\"\npercent = 50\n[[phases]]\nname = \"two\"\npercent = 100\n",
        "plan",
    )
    .unwrap();
    let mut c = Controller::new(name, "m", 2, plan, fleet).unwrap();
    c.start(1_000);
    if !running {
        c.on_abort("why", "console@test");
    }
    let mut v = serde_json::to_value(&c).unwrap();
    let first = v["devices"]
        .as_object()
        .unwrap()
        .keys()
        .next()
        .unwrap()
        .clone();
    v["devices"][&first]["state"] = json!({"state": "failed", "detail": "detail"});
    v["gates"] = json!([{"phase": 0, "name": "gate", "value": 0.5, "limit": 0.9,
                         "bound": "min", "passed": false}]);
    serde_json::from_value::<Controller>(v.clone()).expect("the edited controller parses");
    let used = poison(&mut v, &["/name"], |v| {
        serde_json::from_value::<Controller>(v.clone()).is_ok()
    });
    (v, used)
}

#[test]
fn hostile_strings_from_the_broker_show_as_text_and_run_nothing() {
    let (dir, b) = workdir_and_broker("console-xss", BrokerKind::Mosquitto);
    let cfg = b.config();
    let mut conn = Conn::connect(&cfg, "attacker").unwrap();
    let topics = conn.topics.clone();
    let mut msgs = Vec::new();
    let mut shown: Vec<String> = Vec::new();
    let mut fleet = Vec::new();
    for id in IDS {
        let mut v = serde_json::to_value(status(id)).unwrap();
        shown.extend(poison(&mut v, &["/device"], |v| {
            serde_json::from_value::<Status>(v.clone()).is_ok()
        }));
        fleet.push(serde_json::from_value::<Status>(v.clone()).unwrap());
        msgs.push((topics.status(id), serde_json::to_vec(&v).unwrap(), true));
        let mut e = json!({"device": id, "kind": "rejected", "version": 3, "reason": "r",
                           "time": "t"});
        shown.extend(poison(&mut e, &["/device"], |v| {
            serde_json::from_value::<kestrel_shared::protocol::DeviceEvent>(v.clone()).is_ok()
        }));
        msgs.push((topics.events(id), serde_json::to_vec(&e).unwrap(), false));
    }
    // A hostile device id in the topic (and the payload): not a device name, skipped.
    msgs.push((
        topics.status(HOSTILE_ID),
        serde_json::to_vec(&status(HOSTILE_ID)).unwrap(),
        true,
    ));
    for (name, running) in [("r-aborted", false), ("r-running", true)] {
        let (v, used) = hostile_rollout(name, &fleet, running);
        shown.extend(used);
        let c: Controller = serde_json::from_value(v).unwrap();
        msgs.push((topics.rollout_state(name), sealed(&c), true));
    }
    // Commands the page might be made to send.
    conn.subscribe(&topics.rollout_command("+")).unwrap();
    let (_console, url) = start_console_with_actions(&dir, &b);
    let browser = Browser::start(&dir.join("chromium"), 1280, 900);
    browser.goto(&url);
    // Connected (and so subscribed: the events below are not retained).
    browser.wait_for(
        "return document.querySelector('#summary').textContent.startsWith('0 devices') && \
         document.querySelector('#link').textContent.includes('broker connected')",
        30,
        "the page, empty and connected",
    );
    conn.publish_all(msgs, None).unwrap();
    browser.wait_for(
        "return document.querySelectorAll('#device-rows tr').length === 3 && \
         document.querySelectorAll('[data-rollout]').length === 2 && \
         document.querySelectorAll('#event-list li').length >= 3",
        60,
        "three devices, two rollouts and their events",
    );
    // Every hostile string is on the page as text.
    let text = browser.eval("return document.body.textContent");
    let text = text.as_str().unwrap();
    let missing: Vec<&String> = shown
        .iter()
        .filter(|h| !text.contains(h.as_str()))
        .collect();
    assert!(missing.is_empty(), "not shown as text: {missing:?}");
    for kind in 0..5 {
        let k = hostile(kind);
        let k = k.rsplit_once('#').unwrap().0;
        assert!(
            shown.iter().any(|s| s.starts_with(k)),
            "no field showed {k:?}"
        );
    }
    let ids = browser.eval(
        "return [...document.querySelectorAll('#device-rows tr')].map(r => r.dataset.device).sort()",
    );
    assert_eq!(ids, json!(IDS), "the hostile id is skipped");
    assert!(!text.contains(HOSTILE_ID));
    // Nothing of it became markup or ran.
    let found = browser.eval(
        "return {pwned: window.__pwned === 1, scripts: document.scripts.length, \
         imgs: document.querySelectorAll('img').length, \
         foreign_svg: document.querySelectorAll('svg:not(.spark)').length, \
         handlers: [...document.querySelectorAll('*')].filter(e => [...e.attributes] \
           .some(a => a.name.startsWith('on'))).length, \
         links: document.querySelectorAll('a[href^=\"javascript\"]').length, \
         italics: document.querySelectorAll('main i, main b').length}",
    );
    assert_eq!(
        found,
        json!({"pwned": false, "scripts": 1, "imgs": 0, "foreign_svg": 0, "handlers": 0,
               "links": 0, "italics": 0}),
        "markup from the broker reached the DOM"
    );
    // The page asked nothing of the console: no command was published.
    assert!(
        conn.recv(Duration::from_secs(1)).unwrap().is_none(),
        "a command was published"
    );
    conn.disconnect();
}

/// `curl ARGS -s -i`: (status, headers in lowercase, body); status 0 when curl got no answer.
fn curl(args: &[&str]) -> (u16, String, String) {
    let o = Command::new("curl")
        .args(["-s", "-i", "--max-time", "20"])
        .args(args)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, head.to_ascii_lowercase(), body.to_string())
}

#[test]
fn only_its_own_host_and_origin_are_answered() {
    let (dir, b) = workdir_and_broker("console-origin", BrokerKind::Rumqttd);
    let (_console, url) = start_console_with_actions(&dir, &b);
    let base = url.trim_end_matches('/');
    let own = base.trim_start_matches("http://");
    let (st, head, _) = curl(&[&format!("{base}/")]);
    assert_eq!(st, 200);
    for h in [
        "content-security-policy: default-src 'none'; script-src 'self'",
        "frame-ancestors 'none'",
        "x-content-type-options: nosniff",
        "referrer-policy: no-referrer",
    ] {
        assert!(head.contains(h), "no {h}: {head}");
    }
    // DNS rebinding: a page of attacker.example, its name now pointing at 127.0.0.1.
    for path in ["/", "/api/devices", "/api/stream"] {
        let (st, _, body) = curl(&["-H", "Host: attacker.example", &format!("{base}{path}")]);
        assert_eq!(st, 421, "{path}: {body}");
        assert!(body.contains("attacker.example"), "{body}");
    }
    let (st, _, _) = curl(&[
        "-H",
        &format!("Host: attacker.example:{}", own.rsplit(':').next().unwrap()),
        &format!("{base}/api/info"),
    ]);
    assert_eq!(st, 421);
    let (st, _, _) = curl(&["-H", &format!("Host: {own}"), &format!("{base}/api/info")]);
    assert_eq!(st, 200);
    // A state change from another site's page; from the console's own page; from a script.
    let post = |origin: Option<&str>| {
        let mut a = vec![
            "-X".to_string(),
            "POST".into(),
            "-H".into(),
            "Content-Type: application/json".into(),
            "--data".into(),
            r#"{"confirm":"r1"}"#.into(),
            format!("{base}/api/rollouts/r1/pause"),
        ];
        if let Some(o) = origin {
            a.extend(["-H".into(), format!("Origin: {o}")]);
        }
        curl(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let (st, _, body) = post(Some("http://attacker.example"));
    assert_eq!(st, 403, "{body}");
    assert!(body.contains("Origin"), "{body}");
    assert_eq!(post(Some("null")).0, 403);
    // Past the guard: no rollout r1 on this broker.
    assert_eq!(post(Some(base)).0, 404);
    assert_eq!(post(None).0, 404);
}

#[test]
fn tls_sessions_and_no_clear_text_on_an_open_address() {
    let (dir, b) = workdir_and_broker("console-tls", BrokerKind::Rumqttd);
    let ca = dir.join("ca");
    test_ca(&ca);
    let token = "f3c9a1d27b6e4c05a8d1e2f3b4c5d6e7";
    let token_file = dir.join("token");
    std::fs::write(&token_file, format!("{token}\n")).unwrap();
    let tf = s(&token_file);
    // An open address: no token, then no TLS, are refused at start.
    let open = format!("0.0.0.0:{}", free_port());
    let o = run(
        "trainer",
        &["console", "--broker", &b.url(), "--listen", &open],
    );
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--token-file"), "{}", stderr(&o));
    let o = run(
        "trainer",
        &[
            "console",
            "--broker",
            &b.url(),
            "--listen",
            &open,
            "--token-file",
            &tf,
        ],
    );
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--tls-cert"), "{}", stderr(&o));

    let port = free_port();
    let listen = format!("0.0.0.0:{port}");
    let (_console, url) = start_console(
        &dir,
        &[
            "--broker",
            &b.url(),
            "--listen",
            &listen,
            "--token-file",
            &tf,
            "--tls-cert",
            &s(&ca.join("server.pem")),
            "--tls-key",
            &s(&ca.join("server.key")),
        ],
    );
    assert!(url.starts_with("https://"), "{url}");
    let base = format!("https://127.0.0.1:{port}");
    let cacert = s(&ca.join("ca.pem"));
    let bearer = format!("Authorization: Bearer {token}");
    let (st, head, body) = curl(&[
        "--cacert",
        &cacert,
        "-H",
        &bearer,
        &format!("{base}/api/info"),
    ]);
    assert_eq!(st, 200, "{body}");
    assert!(head.contains("strict-transport-security"), "{head}");
    assert_eq!(
        curl(&["--cacert", &cacert, &format!("{base}/api/devices")]).0,
        401
    );
    // A certificate from a CA the client does not trust, and plain HTTP: no answer.
    let other = s(&ca.join("other.pem"));
    assert_eq!(
        curl(&["--cacert", &other, &format!("{base}/api/info")]).0,
        0
    );
    let (st, _, _) = curl(&["-H", &bearer, &format!("http://127.0.0.1:{port}/api/info")]);
    assert_ne!(st, 200, "plain HTTP answered");
    // ?token= opens a session: a cookie, and the same page without the token.
    let (st, head, _) = curl(&["--cacert", &cacert, &format!("{base}/?token={token}&x=1")]);
    assert_eq!(st, 303, "{head}");
    assert!(head.contains("\r\nlocation: /?x=1\r\n"), "{head}");
    let cookie_line = head
        .lines()
        .find(|l| l.starts_with("set-cookie: kestrel_session="))
        .unwrap_or_else(|| panic!("no session cookie: {head}"));
    for attr in ["httponly", "samesite=strict", "secure", "max-age="] {
        assert!(cookie_line.contains(attr), "{attr}: {cookie_line}");
    }
    assert!(!cookie_line.contains(token), "{cookie_line}");
    let id = cookie_line
        .trim_start_matches("set-cookie: ")
        .split(';')
        .next()
        .unwrap();
    let (st, _, _) = curl(&[
        "--cacert",
        &cacert,
        "-H",
        &format!("Cookie: {id}"),
        &format!("{base}/api/devices"),
    ]);
    assert_eq!(st, 200);
    // The token itself is no cookie, and a guessed session is none.
    for c in [
        format!("kestrel_session={token}"),
        format!("kestrel_console={token}"),
    ] {
        let (st, _, _) = curl(&[
            "--cacert",
            &cacert,
            "-H",
            &format!("Cookie: {c}"),
            &format!("{base}/api/devices"),
        ]);
        assert_eq!(st, 401, "{c}");
    }
}

#[test]
fn sessions_end() {
    let (dir, b) = workdir_and_broker("console-session", BrokerKind::Rumqttd);
    let token_file = dir.join("token");
    let token = "0123456789abcdef0123";
    std::fs::write(&token_file, token).unwrap();
    // A two-second session.
    let (_console, url) = start_console(
        &dir,
        &[
            "--broker",
            &b.url(),
            "--listen",
            "127.0.0.1:0",
            "--token-file",
            &s(&token_file),
            "--session-hours",
            "0.00056",
        ],
    );
    let base = url.trim_end_matches('/');
    let (st, head, _) = curl(&[&format!("{base}/api/info?token={token}")]);
    assert_eq!(st, 303);
    assert!(!head.contains("secure"), "no Secure without TLS: {head}");
    let id = head
        .lines()
        .find_map(|l| l.strip_prefix("set-cookie: "))
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_string();
    let get = || curl(&["-H", &format!("Cookie: {id}"), &format!("{base}/api/info")]).0;
    let started = Instant::now();
    assert_eq!(get(), 200);
    while get() == 200 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the session never ended"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(get(), 401);
}

#[test]
fn half_open_connections_and_streams_are_capped() {
    let (dir, b) = workdir_and_broker("console-limits", BrokerKind::Rumqttd);
    let (console, url) = start_console(
        &dir,
        &[
            "--broker",
            &b.url(),
            "--listen",
            "127.0.0.1:0",
            "--header-timeout-s",
            "3",
            "--max-connections-per-client",
            "64",
            "--max-streams-per-client",
            "4",
        ],
    );
    let base = url.trim_end_matches('/');
    let addr = base.trim_start_matches("http://");
    // 500 connections from 127.0.0.1, each stopping in the middle of its headers.
    let held: Vec<TcpStream> = (0..500)
        .map(|_| {
            let mut c = TcpStream::connect(addr).unwrap();
            let _ = c.write_all(format!("GET / HTTP/1.1\r\nHost: {addr}\r\n").as_bytes());
            c
        })
        .collect();
    // Another client is answered at once.
    let t0 = Instant::now();
    let (st, _, _) = curl(&[
        "--interface",
        "127.0.0.2",
        "--max-time",
        "2",
        &format!("{base}/api/info"),
    ]);
    assert_eq!(
        st, 200,
        "a normal request while 500 half-open connections wait"
    );
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    // Those over the per-client cap were closed at once; the others wait for their headers.
    let open = |held: &[TcpStream]| {
        held.iter()
            .filter(|c| {
                c.set_nonblocking(true).unwrap();
                let mut r: &TcpStream = c;
                matches!(r.read(&mut [0u8; 64]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
            })
            .count()
    };
    let still = open(&held);
    assert!(still <= 64, "{still} connections held, over the cap of 64");
    assert!(still >= 1, "none held: the cap refused them all");
    // The header timeout closes the rest.
    let deadline = Instant::now() + Duration::from_secs(60);
    while open(&held) > 0 {
        assert!(
            Instant::now() < deadline,
            "half-open connections outlived the header timeout"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(held);
    assert!(
        console.output().contains("per-client connection cap"),
        "{}",
        console.output()
    );
    // Streams: four per client, the fifth refused.
    let http = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let streams: Vec<_> = (0..4)
        .map(|_| {
            let r = http.get(format!("{base}/api/stream")).send().unwrap();
            assert_eq!(r.status().as_u16(), 200);
            r
        })
        .collect();
    let r = http.get(format!("{base}/api/stream")).send().unwrap();
    assert_eq!(r.status().as_u16(), 503);
    assert!(r.text().unwrap().contains("--max-streams-per-client"));
    drop(streams);
    // A stream given back is a stream to take again.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = http.get(format!("{base}/api/stream")).send().unwrap();
        if r.status().as_u16() == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "closed streams were not given back"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The console under the shipped ACL's read-only `kestrel-console` role: it shows the fleet and
/// sends operators' commands, signed with the operator key, which the rollout can verify; its
/// attempt to publish a desired state is refused by Mosquitto.
#[test]
fn the_console_role_reads_and_commands_but_cannot_release() {
    let f = fixture();
    let (dir, _) = workdir_and_broker("console-role", BrokerKind::Rumqttd);
    let b = kestrel_tests::fleet::Broker::start_with_acl(
        BrokerKind::MosquittoAcl,
        &dir.join("acl-broker"),
        &["kestrel-console"],
        "",
    );
    let trainer = b.config();
    let console_cfg = b.config_as("kestrel-console");
    let mut conn = Conn::connect(&trainer, "test").unwrap();
    let topics = conn.topics.clone();
    let fleet = vec![status("pi-z")];
    let plan = Plan::parse("[[phases]]\nname = \"all\"\npercent = 100\n", "plan").unwrap();
    let mut c = Controller::new("r1", "m", 2, plan, &fleet).unwrap();
    c.start(1_000);
    conn.publish_all(
        vec![
            (
                topics.status("pi-z"),
                serde_json::to_vec(&fleet[0]).unwrap(),
                true,
            ),
            (topics.rollout_state("r1"), sealed(&c), true),
        ],
        None,
    )
    .unwrap();
    conn.subscribe(&topics.rollout_command("r1")).unwrap();
    let (_console, url) = start_console(
        &dir,
        &[
            "--broker",
            &b.url(),
            "--username",
            "kestrel-console",
            "--password-file",
            &s(console_cfg.password_file.as_ref().unwrap()),
            "--listen",
            "127.0.0.1:0",
            "--allow-actions",
            "--operator-key",
            &s(&f.operator_key()),
        ],
    );
    let base = url.trim_end_matches('/');
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, _, body) = curl(&[&format!("{base}/api/rollouts/r1")]);
        if body.contains("\"name\":\"r1\"") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the console never saw rollout r1: {body}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let (_, _, devices) = curl(&[&format!("{base}/api/devices")]);
    assert!(devices.contains("pi-z"), "{devices}");
    let (st, _, body) = curl(&[
        "-X",
        "POST",
        "-H",
        "Content-Type: application/json",
        "--data",
        r#"{"confirm":"r1","reason":"from the role test"}"#,
        &format!("{base}/api/rollouts/r1/pause"),
    ]);
    assert_eq!(st, 202, "{body}");
    let (_, payload) = conn
        .recv(Duration::from_secs(20))
        .unwrap()
        .expect("the console's command reached the broker");
    let operator = kestrel_shared::signing::public_key(
        &std::fs::read_to_string(f.keys.join("operator.pub")).unwrap(),
        "operator.pub",
    )
    .unwrap();
    let now = kestrel_shared::issued_now();
    let cmd = RolloutCommand::open(&payload, &[operator], "r1", now).unwrap();
    assert_eq!(cmd.reason, "from the role test");
    // Not a key the rollout signs with: the publishing key alone does not verify it.
    assert!(RolloutCommand::open(&payload, &[f.signing().verifying_key()], "r1", now).is_err());

    // The console's account publishing a desired state: Mosquitto drops it.
    let mut args = vec![
        "publish".to_string(),
        "--broker".into(),
        b.url(),
        "--username".into(),
        "kestrel-console".into(),
        "--password-file".into(),
        s(console_cfg.password_file.as_ref().unwrap()),
    ];
    args.extend(["--artifact".into(), s(&f.v1), "--key".into(), s(&f.key())]);
    args.extend(["--target".into(), "device/pi-z".into()]);
    let _ = run(
        "trainer",
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let desired = topics.desired(&Target::Device("pi-z".into()));
    let held = conn.retained(&desired, Duration::from_secs(2)).unwrap();
    assert!(
        held.get(&desired).is_none_or(|p| p.is_empty()),
        "the console's account published a desired state"
    );
    // The trainer's account may (the same command, as it): the check above can fail.
    let o = publish(&b, &f.v1, &f.key(), "device/pi-z", &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let held = conn.retained(&desired, Duration::from_secs(5)).unwrap();
    assert!(held.get(&desired).is_some_and(|p| !p.is_empty()));
    conn.disconnect();
}
