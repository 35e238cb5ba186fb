//! Fleet test helpers: real brokers (the embedded rumqttd via `trainer broker`, and Mosquitto),
//! real agents (`edge-agent run`) as child processes killed on drop, a signing key, and exported
//! artifacts of a real LFW run, built once per test run.

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kestrel_fleet::{Bundle, Conn};
use kestrel_shared::issued_now;
use kestrel_shared::mqtt::BrokerConfig;
use kestrel_shared::protocol::{Desired, SignedDesired, Status, Target};
use serde_json::Value;

pub use crate::trainer_ok;
use crate::{bin, lfw, run, s, stderr, stdout};
use kestrel_shared::wire::DeviceState;

/// A child process killed (SIGKILL) and reaped on drop; its output goes to `log`.
pub struct Proc {
    pub child: Child,
    pub log: PathBuf,
}

impl Proc {
    pub fn spawn(cmd: &mut Command, log: &Path) -> Self {
        let f = std::fs::File::create(log).unwrap();
        let child = cmd
            .stdout(f.try_clone().unwrap())
            .stderr(f)
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
        Self {
            child,
            log: log.to_path_buf(),
        }
    }

    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGKILL, as a power cut would.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM and wait for a clean exit; returns the exit status.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "{} did not stop on SIGTERM",
                self.log.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub use crate::once::free_port;

fn wait_port(port: u16, p: &mut Proc) {
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
        assert!(p.is_running(), "broker exited: {}", p.output());
        assert!(
            Instant::now() < deadline,
            "broker not listening: {}",
            p.output()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The limit lines (`max_*`, `message_size_limit`) of the shipped Mosquitto configuration
/// (edge-agent/deploy/mosquitto.conf), which every Mosquitto of the tests runs with.
pub fn shipped_limits() -> String {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../edge-agent/deploy/mosquitto.conf"
    );
    let text = std::fs::read_to_string(path).unwrap();
    let limits: String = text
        .lines()
        .filter(|l| l.starts_with("max_") || l.starts_with("message_size_limit"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(limits.contains("max_queued_bytes"), "{path}: {limits}");
    limits
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum BrokerKind {
    Rumqttd,
    Mosquitto,
    /// Mosquitto with passwords and the repo's ACL (edge-agent/deploy/kestrel.acl): each user
    /// of [`Broker::start_with_acl`] has the password `<user>-pw`; a device's username is its id.
    MosquittoAcl,
}

pub struct Broker {
    pub kind: BrokerKind,
    pub port: u16,
    pub proc: Option<Proc>,
    dir: PathBuf,
    /// MosquittoAcl: the users, and lines added to the repo's ACL.
    users: Vec<String>,
    extra_acl: String,
}

impl Broker {
    /// Starts a broker on a free loopback port; Mosquitto with persistence under `dir`.
    pub fn start(kind: BrokerKind, dir: &Path) -> Self {
        Self::start_with_acl(kind, dir, &[], "")
    }

    /// [`Broker::start`]; a [`BrokerKind::MosquittoAcl`] knows `users` and appends `extra_acl`
    /// to the repo's ACL.
    pub fn start_with_acl(kind: BrokerKind, dir: &Path, users: &[&str], extra_acl: &str) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let mut b = Self {
            kind,
            port: free_port(),
            proc: None,
            dir: dir.to_path_buf(),
            users: std::iter::once("kestrel-trainer")
                .chain(users.iter().copied().filter(|u| *u != "kestrel-trainer"))
                .map(String::from)
                .collect(),
            extra_acl: extra_acl.to_string(),
        };
        b.restart();
        b
    }

    /// The Mosquitto configuration: persistence under the broker's directory, the shipped
    /// config's limits ([`shipped_limits`]), and for [`BrokerKind::MosquittoAcl`] passwords and
    /// the ACL.
    fn mosquitto_conf(&self) -> PathBuf {
        let d = self.dir.display();
        let mut conf = format!(
            "listener {} 127.0.0.1\npersistence true\npersistence_location {d}/\n\
             autosave_interval 1\nuser root\n{}",
            self.port,
            shipped_limits()
        );
        if self.kind == BrokerKind::MosquittoAcl {
            let passwd = self.dir.join("passwd");
            let _ = std::fs::remove_file(&passwd);
            for (i, user) in self.users.iter().enumerate() {
                let mut c = Command::new("mosquitto_passwd");
                if i == 0 {
                    c.arg("-c");
                }
                let o = c
                    .arg("-b")
                    .arg(&passwd)
                    .args([user.as_str(), &format!("{user}-pw")])
                    .output()
                    .unwrap();
                assert!(o.status.success(), "mosquitto_passwd: {}", stderr(&o));
                std::fs::write(self.dir.join(format!("{user}.pw")), format!("{user}-pw")).unwrap();
            }
            let repo_acl = concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../edge-agent/deploy/kestrel.acl"
            );
            let acl = std::fs::read_to_string(repo_acl).unwrap() + "\n" + &self.extra_acl + "\n";
            std::fs::write(self.dir.join("acl"), acl).unwrap();
            conf += &format!("allow_anonymous false\npassword_file {d}/passwd\nacl_file {d}/acl\n");
        } else {
            conf += "allow_anonymous true\n";
        }
        let path = self.dir.join("mosquitto.conf");
        std::fs::write(&path, conf).unwrap();
        path
    }

    /// The broker's address with `user`'s credentials ([`BrokerKind::MosquittoAcl`]; other
    /// brokers take anyone, and get the same address).
    pub fn config_as(&self, user: &str) -> BrokerConfig {
        let mut c = BrokerConfig::new(&self.url());
        if self.kind == BrokerKind::MosquittoAcl {
            c.username = Some(user.into());
            c.password_file = Some(self.dir.join(format!("{user}.pw")));
        }
        c
    }

    /// (Re)starts the broker process on the same port (Mosquitto keeps its persisted state).
    pub fn restart(&mut self) {
        if let Some(p) = self.proc.take() {
            p.terminate();
        }
        let log = self.dir.join(format!("{:?}.log", self.kind));
        let mut p = match self.kind {
            // Its retained messages kept in the test's own directory (by default they are kept
            // per port under $KESTREL_HOME, where a later test given the same port would read them).
            BrokerKind::Rumqttd => Proc::spawn(
                Command::new(bin("trainer"))
                    .args(["broker", "--listen", &format!("127.0.0.1:{}", self.port)])
                    .arg("--persist")
                    .arg(self.dir.join("retained")),
                &log,
            ),
            BrokerKind::Mosquitto | BrokerKind::MosquittoAcl => {
                let conf = self.mosquitto_conf();
                let exe = ["/usr/sbin/mosquitto", "/usr/bin/mosquitto"]
                    .into_iter()
                    .find(|p| Path::new(p).exists())
                    .expect("mosquitto is not installed: run scripts/setup.sh");
                Proc::spawn(Command::new(exe).arg("-c").arg(&conf), &log)
            }
        };
        wait_port(self.port, &mut p);
        self.proc = Some(p);
    }

    pub fn url(&self) -> String {
        format!("mqtt://127.0.0.1:{}", self.port)
    }

    /// The broker's address, as the trainer logs in ([`BrokerKind::MosquittoAcl`]: as
    /// `kestrel-trainer`).
    pub fn config(&self) -> BrokerConfig {
        self.config_as("kestrel-trainer")
    }

    /// The trainer's flags for this broker: `--broker URL`, with the trainer's credentials on a
    /// [`BrokerKind::MosquittoAcl`].
    pub fn cli_args(&self) -> Vec<String> {
        let c = self.config();
        let mut a = vec!["--broker".to_string(), self.url()];
        if let (Some(u), Some(p)) = (c.username, c.password_file) {
            a.extend(["--username".into(), u, "--password-file".into(), s(&p)]);
        }
        a
    }
}

/// Signing keys, a run and exported artifacts shared by the fleet tests of one test run
/// ([`crate::once::fixture`]).
pub struct Fixture {
    pub dir: PathBuf,
    /// Trusted key pair (kestrel.key, kestrel.pub).
    pub keys: PathBuf,
    /// A key pair the devices do not trust.
    pub rogue_keys: PathBuf,
    /// LFW int8-weights artifacts: v1 and v2 (two exports of one run).
    pub v1: PathBuf,
    pub v2: PathBuf,
    /// The same run exported as f32 (v6): 13 MB of device files.
    pub f32_v6: PathBuf,
}

pub fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let dir = crate::once::fixture("fleet", build_fixture);
        Fixture {
            v1: dir.join("v1"),
            v2: dir.join("v2"),
            f32_v6: dir.join("f32-v6"),
            keys: dir.join("keys"),
            rogue_keys: dir.join("rogue"),
            dir,
        }
    })
}

/// Keys, an LFW run (the demo's: ORT, 10 epochs, 20% held out) and its three exports, in `dir`.
fn build_fixture(dir: &Path) {
    trainer_ok(&["keygen", "--out", &s(&dir.join("keys"))]);
    // The console's key (operator.key, operator.pub): commands only.
    trainer_ok(&["keygen", "--operator", "--out", &s(&dir.join("keys"))]);
    trainer_ok(&["keygen", "--out", &s(&dir.join("rogue"))]);
    let run_dir = dir.join("run");
    trainer_ok(&[
        "fit",
        "--data",
        &lfw(),
        "--engine",
        "ort",
        "--optimizer",
        "sgd",
        "--epochs",
        "10",
        "--test-fraction",
        "0.2",
        "--out",
        &s(&run_dir),
    ]);
    for (out, form, version) in [
        ("v1", "int8-weights", "1"),
        ("v2", "int8-weights", "2"),
        ("f32-v6", "none", "6"),
    ] {
        let args = [
            "--quantize",
            form,
            "--model-version",
            version,
            "--model-name",
            "lfw",
        ];
        crate::export_ok(&run_dir, &dir.join(out), &args);
    }
}

/// The secret key in a `trainer keygen` directory.
pub fn signing_key(dir: &Path) -> ed25519_dalek::SigningKey {
    signing_key_file(&dir.join("kestrel.key"))
}

/// The secret key in a `trainer keygen` key file.
pub fn signing_key_file(p: &Path) -> ed25519_dalek::SigningKey {
    kestrel_shared::signing::secret_key(
        &std::fs::read_to_string(p).unwrap(),
        &p.display().to_string(),
    )
    .unwrap()
}

impl Fixture {
    pub fn key(&self) -> PathBuf {
        self.keys.join("kestrel.key")
    }

    /// The operator's secret key (`trainer keygen --operator`), for `trainer console`.
    pub fn operator_key(&self) -> PathBuf {
        self.keys.join("operator.key")
    }

    pub fn signing(&self) -> ed25519_dalek::SigningKey {
        signing_key(&self.keys)
    }

    /// A copy of `src` as `version` with its manifest edited by `edit` (files untouched), in a
    /// directory of its own (tests running at the same time may make the same version).
    pub fn variant(&self, src: &Path, version: u64, edit: impl Fn(&mut Value)) -> PathBuf {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dst = self
            .dir
            .join(format!("variant-{version}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dst);
        crate::copy_dir(src, &dst);
        let mpath = dst.join("manifest.json");
        let mut m: Value = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
        m["version"] = version.into();
        edit(&mut m);
        std::fs::write(&mpath, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
        dst
    }

    /// v2 as `version`, with golden outputs that its model does not produce: every device
    /// fails its health check.
    pub fn failing(&self, version: u64) -> PathBuf {
        self.variant(&self.v2, version, |m| {
            for g in m["golden"].as_array_mut().unwrap() {
                g["expected_top1"] = (1 - g["expected_top1"].as_u64().unwrap()).into();
            }
        })
    }
}

/// A rollout plan `DIR/NAME.toml` named NAME with `body` (its phases); the path.
pub fn write_plan(dir: &Path, name: &str, body: &str) -> String {
    std::fs::create_dir_all(dir).unwrap();
    let p = dir.join(format!("{name}.toml"));
    std::fs::write(&p, format!("name = \"{name}\"\n{body}")).unwrap();
    s(&p)
}

/// Writes `agent.toml` for `device` under `dir` and returns its path.
pub fn agent_config(
    dir: &Path,
    device: &str,
    broker: &str,
    keys: &Path,
    extra_limits: &str,
) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let p = dir.join("agent.toml");
    std::fs::write(
        &p,
        format!(
            "device_id = \"{device}\"\ngroups = [\"all\"]\nstore = \"store\"\n\
             trusted_keys = [\"{}\"]\n[broker]\nurl = \"{broker}\"\nkeep_alive_s = 5\n\
             [limits]\n{extra_limits}\n",
            keys.join("kestrel.pub").display()
        ),
    )
    .unwrap();
    p
}

/// [`agent_config`] for a device that logs in to `b` as `user` (its own id on a
/// [`BrokerKind::MosquittoAcl`], where the ACL lets it write only its own topics).
pub fn agent_config_on(
    dir: &Path,
    device: &str,
    b: &Broker,
    user: &str,
    extra_limits: &str,
) -> PathBuf {
    let p = agent_config(dir, device, &b.url(), &fixture().keys, extra_limits);
    let c = b.config_as(user);
    if let (Some(u), Some(pw)) = (c.username, c.password_file) {
        let text = std::fs::read_to_string(&p).unwrap().replace(
            "keep_alive_s = 5\n",
            &format!(
                "keep_alive_s = 5\nusername = \"{u}\"\npassword_file = \"{}\"\n",
                pw.display()
            ),
        );
        std::fs::write(&p, text).unwrap();
    }
    p
}

/// Starts `edge-agent run --config CONFIG` with extra environment.
pub fn start_agent(config: &Path, env: &[(&str, &str)]) -> Proc {
    start_agent_with(config, env, &[])
}

/// `edge-agent run --config CONFIG ARGS...` with extra environment.
pub fn start_agent_with(config: &Path, env: &[(&str, &str)], args: &[&str]) -> Proc {
    let dir = config.parent().unwrap();
    let n = std::fs::read_dir(dir).unwrap().count();
    let mut cmd = Command::new(bin("edge-agent"));
    cmd.arg("run").arg("--config").arg(config).args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    Proc::spawn(&mut cmd, &dir.join(format!("agent-{n}.log")))
}

/// Polls the device's retained status until `done` holds (panics after `secs`).
pub fn wait_status(
    broker: &BrokerConfig,
    device: &str,
    secs: u64,
    what: &str,
    done: impl Fn(&Status) -> bool,
) -> Status {
    kestrel_fleet::wait_status(broker, device, Duration::from_secs(secs), done)
        .unwrap_or_else(|e| panic!("waiting for {device}: {what}: {e}"))
}

/// `trainer publish --json` as a user types it.
pub fn publish(b: &Broker, art: &Path, key: &Path, target: &str, extra: &[&str]) -> Output {
    let mut args = vec!["publish".to_string()];
    args.extend(b.cli_args());
    args.extend(
        [
            "--artifact",
            &s(art),
            "--key",
            &s(key),
            "--target",
            target,
            "--json",
        ]
        .into_iter()
        .map(String::from),
    );
    args.extend(extra.iter().map(|a| a.to_string()));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    run("trainer", &refs)
}

/// [`publish`], which must succeed; its JSON.
pub fn publish_ok(b: &Broker, art: &Path, key: &Path, target: &str) -> Value {
    let o = publish(b, art, key, target, &[]);
    assert!(
        o.status.success(),
        "publish {}: {}",
        art.display(),
        stderr(&o)
    );
    serde_json::from_str(stdout(&o).trim()).unwrap()
}

/// Publishes artifact messages (possibly tampered) and a desired state straight to the broker,
/// as a publisher that skips the CLI's checks (or an attacker with broker access) would.
pub fn publish_raw(b: &Broker, msgs: Vec<(String, Vec<u8>, bool)>, d: Desired) {
    let key = fixture().signing();
    let mut c = Conn::connect(&b.config(), "test").unwrap();
    c.publish_all(msgs, None).unwrap();
    let payload = serde_json::to_vec(&SignedDesired::new(&key, &d)).unwrap();
    c.publish_all(vec![(c.topics.desired(&d.target), payload, true)], None)
        .unwrap();
    c.disconnect();
}

/// A desired state for `device`, issued now.
pub fn desired(device: &str, version: u64, rollback: bool) -> Desired {
    Desired {
        target: Target::Device(device.into()),
        name: "lfw".into(),
        version,
        rollback,
        issued: issued_now(),
        expires: None,
        clear: false,
        rollout: None,
        source: None,
        shadow: None,
    }
}

/// Starts an agent (by `start`, given its environment), publishes `art` to it with only its
/// first two chunks on the broker (a publisher still uploading), waits until it has stored them
/// and SIGKILLs it; its journal (`<agent_dir>/store/state.json`) must say it was downloading.
/// Then the other chunks are published, for the restarted agent to resume with. The device id is
/// `agent_dir`'s name.
pub fn killed_mid_download(
    b: &Broker,
    art: &Path,
    agent_dir: &Path,
    secs: u64,
    what: &str,
    start: impl Fn(&[(&str, &str)]) -> Proc,
) {
    let device = agent_dir
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let f = fixture();
    let bundle = Bundle::from_dir(art, &f.signing(), 128 * 1024).unwrap();
    assert!(bundle.chunks.len() > 2, "{} chunks", bundle.chunks.len());
    let mut conn = Conn::connect(&b.config(), "t").unwrap();
    let mut msgs = bundle.messages(&conn.topics);
    let offer = msgs.pop().expect("the offer is last");
    let rest = msgs.split_off(2);
    msgs.push(offer);
    let agent = start(&[]);
    let version = bundle.offer.version;
    publish_raw(b, msgs, desired(&device, version, false));
    let st = wait_status(&b.config(), &device, secs, what, |s| {
        s.state == DeviceState::Downloading && s.progress.is_some_and(|(have, _)| have >= 2)
    });
    assert_eq!(st.active, None);
    agent.kill();
    let journal: Value =
        serde_json::from_slice(&std::fs::read(agent_dir.join("store/state.json")).unwrap())
            .unwrap();
    assert!(
        journal["updater"]["phase"]["Downloading"].is_object(),
        "{journal}"
    );
    conn.publish_all(rest, None).unwrap();
    conn.disconnect();
}

/// `trainer rollout --broker B --artifact ART --key KEY --fleet PLAN`, as a user types it, with
/// the fixture's key.
pub fn rollout_command(b: &Broker, art: &Path, plan: &str) -> Command {
    let mut c = Command::new(bin("trainer"));
    c.arg("rollout")
        .args(b.cli_args())
        .args(["--artifact", &s(art), "--key"])
        .arg(fixture().key())
        .arg("--operator-pub")
        .arg(fixture().keys.join("operator.pub"))
        .args(["--fleet", plan]);
    c
}

/// Waits until `n` devices have reported a status.
pub fn wait_fleet(cfg: &BrokerConfig, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while kestrel_fleet::statuses(cfg, None).unwrap().len() < n {
        assert!(Instant::now() < deadline, "fewer than {n} devices reported");
        std::thread::sleep(Duration::from_millis(300));
    }
}
