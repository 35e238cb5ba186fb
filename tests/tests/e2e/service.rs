//! The agent as a systemd service, through the interfaces systemd gives it (no systemd runs
//! here): levelled logs (under systemd stderr is the journal's stream, named by
//! `JOURNAL_STREAM`, and every line carries its syslog priority, so `journalctl -p warning` keeps
//! warnings and errors; elsewhere lines read `error: …`, `warning: …`; `-q` keeps errors only),
//! `sd_notify` readiness, watchdog pings and stopping on `NOTIFY_SOCKET`, and exit status 78 for
//! a configuration error (`RestartPreventExitStatus=78`). `RUST_LOG` surfacing a library's
//! diagnostics is checked on a Delta table in `tables`.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use kestrel_tests::fleet::{Broker, BrokerKind, Proc, agent_config, free_port, wait_status};
use kestrel_tests::{bin, run_ok, s, stderr};

/// Creates `path` and returns the `JOURNAL_STREAM` value systemd would set for it as stderr.
fn journal_stream(path: &Path) -> String {
    File::create(path).unwrap();
    let m = std::fs::metadata(path).unwrap();
    format!("{}:{}", m.dev(), m.ino())
}

/// Whether every line of `text` starts with a syslog priority `<N>`.
fn all_prefixed(text: &str) -> bool {
    text.lines().all(|l| {
        l.len() > 3
            && l.as_bytes()[0] == b'<'
            && l.as_bytes()[1].is_ascii_digit()
            && l.as_bytes()[2] == b'>'
    })
}

#[test]
fn agent_lines_carry_journald_priorities_under_systemd() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-such-artifact");

    // A failing command: its error at priority 3 on the journal's stream.
    let log = tmp.path().join("check.log");
    let stream = journal_stream(&log);
    let status = Command::new(bin("edge-agent"))
        .args(["check", "--model", &s(&missing)])
        .env("JOURNAL_STREAM", &stream)
        .stderr(OpenOptions::new().append(true).open(&log).unwrap())
        .status()
        .unwrap();
    assert!(!status.success());
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.starts_with("<3>") && text.contains("no-such-artifact") && all_prefixed(&text),
        "{text}"
    );
    // The same error where stderr is not the journal (a pipe; JOURNAL_STREAM inherited from a
    // unit whose stream this is not): the plain form.
    let o = Command::new(bin("edge-agent"))
        .args(["check", "--model", &s(&missing)])
        .env("JOURNAL_STREAM", &stream)
        .output()
        .unwrap();
    let plain = stderr(&o);
    assert!(plain.starts_with("error: model "), "{plain}");

    // The agent running with its broker unreachable: a warning at priority 4; on SIGTERM the
    // information that it stops, at 6.
    let keys = tmp.path().join("keys");
    run_ok("trainer", &["keygen", "--out", &s(&keys)]);
    let nowhere = format!("mqtt://127.0.0.1:{}", free_port());
    let config = agent_config(&tmp.path().join("a"), "pi-journal", &nowhere, &keys, "");
    let log = tmp.path().join("run.log");
    let mut cmd = Command::new(bin("edge-agent"));
    cmd.args(["run", "--config", &s(&config)])
        .env("JOURNAL_STREAM", journal_stream(&log))
        .env_remove("RUST_LOG");
    let agent = Proc::spawn(&mut cmd, &log);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !agent.output().contains("retrying") {
        assert!(
            Instant::now() < deadline,
            "no broker warning: {}",
            agent.output()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(agent.terminate().success());
    let text = std::fs::read_to_string(&log).unwrap();
    let warning = text.lines().find(|l| l.contains("retrying")).unwrap();
    assert!(
        warning.starts_with("<4>pi-journal: broker mqtt://127.0.0.1:"),
        "{text}"
    );
    assert!(
        text.lines().any(|l| l == "<6>pi-journal: stopping"),
        "{text}"
    );
    assert!(all_prefixed(&text), "{text}");

    // -q: errors only. An agent that connects, reports and stops cleanly writes nothing.
    let b = Broker::start(BrokerKind::Rumqttd, &tmp.path().join("broker"));
    let config = agent_config(&tmp.path().join("q"), "pi-quiet", &b.url(), &keys, "");
    let mut cmd = Command::new(bin("edge-agent"));
    cmd.args(["-q", "run", "--config", &s(&config)])
        .env_remove("RUST_LOG");
    let agent = Proc::spawn(&mut cmd, &tmp.path().join("quiet.log"));
    wait_status(&b.config(), "pi-quiet", 60, "first status", |_| true);
    let log = agent.log.clone();
    assert!(agent.terminate().success());
    assert_eq!(
        std::fs::read_to_string(log).unwrap(),
        "",
        "-q writes errors only"
    );
}

#[test]
fn agent_tells_systemd_ready_alive_stopping_and_exits_78_on_a_bad_config() {
    use std::os::unix::net::UnixDatagram;
    let tmp = tempfile::tempdir().unwrap();
    let keys = tmp.path().join("keys");
    run_ok("trainer", &["keygen", "--out", &s(&keys)]);
    let nowhere = format!("mqtt://127.0.0.1:{}", free_port());
    let config = agent_config(&tmp.path().join("a"), "pi-notify", &nowhere, &keys, "");
    let socket = tmp.path().join("notify.sock");
    let systemd = UnixDatagram::bind(&socket).unwrap();
    systemd
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    // systemd names the watchdog's process (WATCHDOG_PID): the shell's own pid, which `exec`
    // hands to the agent.
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg("export WATCHDOG_PID=$$; exec \"$0\" run --config \"$1\"")
        .arg(bin("edge-agent"))
        .arg(&config)
        .env("NOTIFY_SOCKET", &socket)
        .env("WATCHDOG_USEC", "3000000");
    let agent = Proc::spawn(&mut cmd, &tmp.path().join("agent.log"));
    let next = || {
        let mut buf = [0u8; 256];
        let n = systemd
            .recv(&mut buf)
            .unwrap_or_else(|e| panic!("no notification: {e}: {}", agent.output()));
        String::from_utf8_lossy(&buf[..n]).trim().to_string()
    };
    assert_eq!(next(), "READY=1");
    // Pings from the event loop's tick, every second, well inside the 3 s watchdog.
    assert_eq!(next(), "WATCHDOG=1");
    assert_eq!(next(), "WATCHDOG=1");
    let pid = agent.child.id().to_string();
    Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    let mut said = next();
    while said == "WATCHDOG=1" {
        said = next();
    }
    assert_eq!(said, "STOPPING=1");
    assert!(agent.terminate().success());

    // A configuration error: 78 (EX_CONFIG), which the unit does not restart into; anything
    // else that fails: 1.
    let bad = tmp.path().join("bad.toml");
    std::fs::write(&bad, "device_id = 7\n").unwrap();
    for (config, code) in [(s(&bad), 78), (s(&tmp.path().join("none.toml")), 78)] {
        let o = kestrel_tests::run("edge-agent", &["run", "--config", &config]);
        assert_eq!(o.status.code(), Some(code), "{config}: {}", stderr(&o));
        assert!(stderr(&o).starts_with("error: "), "{}", stderr(&o));
    }
    let o = kestrel_tests::run("edge-agent", &["check", "--model", &s(tmp.path())]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
}
