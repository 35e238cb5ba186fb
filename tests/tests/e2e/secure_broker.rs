//! Mosquitto as edge-agent/deploy/ configures it: TLS (the broker's CA pinned), passwords and the
//! repo's ACL, with the real binaries: a device installs a model over it, connections without
//! credentials or trust are refused, and the ACL keeps devices apart.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use kestrel_fleet::Conn;
use kestrel_shared::mqtt::BrokerConfig;
use kestrel_shared::protocol::Target;
use kestrel_shared::wire::DeviceState;
use kestrel_tests::fleet::{Proc, fixture, free_port, start_agent_with, wait_status};
use kestrel_tests::tls::{client_cert, test_ca};
use kestrel_tests::{run, s, stderr};

/// A Mosquitto with TLS, passwords and the repo's ACL (edge-agent/deploy/kestrel.acl).
struct SecureBroker {
    proc: Proc,
    port: u16,
    dir: std::path::PathBuf,
}

fn secure_broker(dir: &Path) -> SecureBroker {
    test_ca(dir);
    let passwd = dir.join("passwd");
    for (i, (user, pw)) in [
        ("kestrel-trainer", "t-secret"),
        ("pi-a", "a-secret"),
        ("pi-b", "b-secret"),
    ]
    .iter()
    .enumerate()
    {
        let mut c = Command::new("mosquitto_passwd");
        if i == 0 {
            c.arg("-c");
        }
        let o = c.arg("-b").arg(&passwd).args([user, pw]).output().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        std::fs::write(dir.join(format!("{user}.pw")), pw).unwrap();
    }
    let repo_acl = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../edge-agent/deploy/kestrel.acl"
    );
    let acl = std::fs::read_to_string(repo_acl).unwrap()
        + "\nuser pi-a\ntopic read kestrel/groups/lab/desired\n";
    std::fs::write(dir.join("acl"), acl).unwrap();
    let d = dir.display();
    let conf = format!("allow_anonymous false\npassword_file {d}/passwd\nacl_file {d}/acl\n");
    mosquitto_tls(dir, &conf)
}

/// Mosquitto with TLS (`ca.pem`, `server.pem` of `dir`) on a free loopback port, with `conf`'s
/// authentication settings.
fn mosquitto_tls(dir: &Path, conf: &str) -> SecureBroker {
    let port = free_port();
    let d = dir.display();
    std::fs::write(
        dir.join("mosquitto.conf"),
        format!(
            "per_listener_settings false\nlistener {port} 127.0.0.1\ncafile {d}/ca.pem\ncertfile {d}/server.pem\n\
             keyfile {d}/server.key\ntls_version tlsv1.2\n{conf}user root\npersistence false\n"
        ),
    )
    .unwrap();
    let exe = if Path::new("/usr/sbin/mosquitto").exists() {
        "/usr/sbin/mosquitto"
    } else {
        "mosquitto"
    };
    let mut proc = Proc::spawn(
        Command::new(exe).arg("-c").arg(dir.join("mosquitto.conf")),
        &dir.join("mosquitto.log"),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            proc.is_running() && Instant::now() < deadline,
            "{}",
            proc.output()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    SecureBroker {
        proc,
        port,
        dir: dir.to_path_buf(),
    }
}

impl SecureBroker {
    fn config(&self, user: Option<&str>, ca: &str) -> BrokerConfig {
        let mut c = BrokerConfig::new(&format!("mqtts://127.0.0.1:{}", self.port));
        c.ca_file = Some(self.dir.join(ca));
        if let Some(u) = user {
            c.username = Some(u.into());
            c.password_file = Some(self.dir.join(format!("{u}.pw")));
        }
        c
    }
}

#[test]
fn tls_credentials_and_acl_on_mosquitto() {
    let f = fixture();
    let dir = f.dir.join("secure");
    let sb = secure_broker(&dir.join("broker"));
    let trainer = sb.config(Some("kestrel-trainer"), "ca.pem");
    let _agent = a_device_with_tls_and_credentials_installs_a_model(&sb, &trainer, &dir);
    connections_without_credentials_or_trust_are_refused(&sb);
    the_acl_keeps_devices_apart(&sb, &trainer);
    drop(sb.proc);
}

/// A device with TLS (CA pinned) and its credentials installs a model; returns its agent.
fn a_device_with_tls_and_credentials_installs_a_model(
    sb: &SecureBroker,
    trainer: &BrokerConfig,
    dir: &Path,
) -> Proc {
    let f = fixture();
    let conf = dir.join("pi-a/agent.toml");
    std::fs::create_dir_all(conf.parent().unwrap()).unwrap();
    std::fs::write(
        &conf,
        format!(
            "device_id = \"pi-a\"\ngroups = [\"lab\"]\nstore = \"store\"\ntrusted_keys = [\"{}\"]\n[broker]\n\
             url = \"mqtts://127.0.0.1:{}\"\nca_file = \"{}\"\nusername = \"pi-a\"\npassword_file = \"{}\"\n",
            f.keys.join("kestrel.pub").display(),
            sb.port,
            sb.dir.join("ca.pem").display(),
            sb.dir.join("pi-a.pw").display()
        ),
    )
    .unwrap();
    let agent = start_agent_with(&conf, &[], &[]);
    let o = run(
        "trainer",
        &[
            "publish",
            "--broker",
            &trainer.url,
            "--ca-file",
            &s(&sb.dir.join("ca.pem")),
            "--username",
            "kestrel-trainer",
            "--password-file",
            &s(&sb.dir.join("kestrel-trainer.pw")),
            "--artifact",
            &s(&f.v1),
            "--key",
            &s(&f.key()),
            "--target",
            "device/pi-a",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    wait_status(trainer, "pi-a", 120, "v1 active over TLS", |s| {
        s.active == Some(1) && s.state == DeviceState::Idle
    });
    assert!(
        agent.output().contains("connected to mqtts://"),
        "{}",
        agent.output()
    );
    agent
}

/// Refused: no credentials, a wrong password, a CA the broker's certificate does not chain to,
/// and plain MQTT on the TLS port.
fn connections_without_credentials_or_trust_are_refused(sb: &SecureBroker) {
    let refused = |c: &BrokerConfig, what: &str| {
        let e = match Conn::connect(c, "probe") {
            Ok(_) => panic!("{what}: connected"),
            Err(e) => kestrel_shared::chain(&e),
        };
        assert!(e.contains(&c.url), "{what}: {e}");
        e
    };
    let e = refused(&sb.config(None, "ca.pem"), "no credentials");
    assert!(
        e.to_lowercase().contains("refused")
            || e.contains("NotAuthorized")
            || e.contains("BadUserName"),
        "{e}"
    );
    let mut wrong = sb.config(Some("pi-b"), "ca.pem");
    wrong.password_file = Some(sb.dir.join("pi-a.pw"));
    refused(&wrong, "wrong password");
    let e = refused(&sb.config(Some("pi-a"), "other.pem"), "untrusted CA");
    assert!(
        e.to_lowercase().contains("certificate") || e.contains("Tls"),
        "{e}"
    );
    let mut plain = sb.config(Some("pi-a"), "ca.pem");
    plain.url = format!("mqtt://127.0.0.1:{}", sb.port);
    refused(&plain, "plain MQTT on the TLS port");
}

/// ACL: pi-a reads its own desired state but not pi-b's, and cannot write pi-b's status.
fn the_acl_keeps_devices_apart(sb: &SecureBroker, trainer: &BrokerConfig) {
    let mut t = Conn::connect(trainer, "acl").unwrap();
    let key = fixture().signing();
    let signed = |dev: &str| {
        let d = kestrel_tests::fleet::desired(dev, 1, false);
        serde_json::to_vec(&kestrel_shared::protocol::SignedDesired::new(&key, &d)).unwrap()
    };
    t.publish_all(
        vec![(
            t.topics.desired(&Target::Device("pi-b".into())),
            signed("pi-b"),
            true,
        )],
        None,
    )
    .unwrap();
    let mut a = Conn::connect(&sb.config(Some("pi-a"), "ca.pem"), "acl-a").unwrap();
    let own = a
        .retained("kestrel/devices/pi-a/desired", Duration::from_millis(700))
        .unwrap();
    assert_eq!(own.len(), 1, "pi-a reads its own desired state");
    let other = a
        .retained("kestrel/devices/pi-b/#", Duration::from_millis(700))
        .unwrap();
    assert!(
        other.is_empty(),
        "pi-a must not read pi-b's topics: {:?}",
        other.keys()
    );
    let forged = br#"{"device":"pi-b","forged":true}"#.to_vec();
    a.publish_all(
        vec![("kestrel/devices/pi-b/status".into(), forged, true)],
        None,
    )
    .unwrap();
    let st = t
        .retained("kestrel/devices/pi-b/status", Duration::from_millis(700))
        .unwrap();
    assert!(st.is_empty(), "pi-a wrote pi-b's status: {st:?}");
}

/// Devices authenticated by client certificate, as the shipped Mosquitto configuration offers
/// (`require_certificate` + `use_identity_as_username`: the certificate's CN is the user name
/// the ACL knows): the trainer and a device with their certificates, and no password, install a
/// model; without a certificate, or with one from a CA the broker does not trust, the
/// connection is refused.
#[test]
fn client_certificates_on_mosquitto() {
    let f = fixture();
    let dir = f.dir.join("client-certs");
    let bdir = dir.join("broker");
    test_ca(&bdir);
    for cn in ["kestrel-trainer", "pi-c"] {
        client_cert(&bdir, cn);
    }
    // A client certificate from a CA the broker does not trust.
    let rogue = dir.join("rogue");
    test_ca(&rogue);
    client_cert(&rogue, "pi-c");
    let repo_acl = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../edge-agent/deploy/kestrel.acl"
    );
    std::fs::copy(repo_acl, bdir.join("acl")).unwrap();
    let d = bdir.display();
    let sb = mosquitto_tls(
        &bdir,
        &format!(
            "require_certificate true\nuse_identity_as_username true\nallow_anonymous false\nacl_file {d}/acl\n"
        ),
    );
    let with_cert = |dir: &Path, cn: &str| {
        let mut c = sb.config(None, "ca.pem");
        c.cert_file = Some(dir.join(format!("{cn}.pem")));
        c.key_file = Some(dir.join(format!("{cn}.key")));
        c
    };
    let trainer = with_cert(&bdir, "kestrel-trainer");
    let conf = dir.join("pi-c/agent.toml");
    std::fs::create_dir_all(conf.parent().unwrap()).unwrap();
    std::fs::write(
        &conf,
        format!(
            "device_id = \"pi-c\"\nstore = \"store\"\ntrusted_keys = [\"{}\"]\n[broker]\n\
             url = \"{}\"\nca_file = \"{d}/ca.pem\"\ncert_file = \"{d}/pi-c.pem\"\nkey_file = \"{d}/pi-c.key\"\n",
            f.keys.join("kestrel.pub").display(),
            trainer.url,
        ),
    )
    .unwrap();
    let agent = start_agent_with(&conf, &[], &[]);
    let o = run(
        "trainer",
        &[
            "publish",
            "--broker",
            &trainer.url,
            "--ca-file",
            &s(&bdir.join("ca.pem")),
            "--cert-file",
            &s(&bdir.join("kestrel-trainer.pem")),
            "--key-file",
            &s(&bdir.join("kestrel-trainer.key")),
            "--artifact",
            &s(&f.v1),
            "--key",
            &s(&f.key()),
            "--target",
            "device/pi-c",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    wait_status(
        &trainer,
        "pi-c",
        120,
        "v1 active with a client certificate",
        |s| s.active == Some(1) && s.state == DeviceState::Idle,
    );
    assert!(
        agent.output().contains("connected to mqtts://"),
        "{}",
        agent.output()
    );
    drop(agent);
    // The same device without its certificate: the broker ends the handshake, the agent says so
    // and retries.
    let without = dir.join("pi-c/without.toml");
    let text = std::fs::read_to_string(&conf).unwrap();
    let text = text
        .split("cert_file")
        .next()
        .unwrap()
        .replace("\"store\"", "\"store2\"");
    std::fs::write(&without, text).unwrap();
    let mut refused = start_agent_with(&without, &[], &[]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !refused.output().contains("retrying") {
        assert!(
            refused.is_running() && Instant::now() < deadline,
            "an agent without its certificate: {}",
            refused.output()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let said = refused.output();
    assert!(
        said.contains(&format!("pi-c: broker {}", trainer.url)) && !said.contains("connected to"),
        "{said}"
    );
    drop(refused);
    let rogue_cert = with_cert(&rogue, "pi-c");
    match Conn::connect(&rogue_cert, "probe") {
        Ok(_) => panic!("a certificate from a CA the broker does not trust: connected"),
        Err(e) => assert!(e.to_string().contains(&rogue_cert.url), "{e}"),
    }
    drop(sb.proc);
}
