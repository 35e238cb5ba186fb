//! docs/guide.md as a reader runs it: every ```sh block, in order, in one bash (so the guide
//! cannot rot). The blocks are the guide's text; the test only fills in what belongs to its
//! machine:
//! - the block marked `guide: settings` is replaced by this test's values (its photos: the first 20
//!   LFW images of each class; free ports; scratch directories; this build's binaries);
//! - blocks marked `guide: background` run in the background, and the test waits until the port
//!   the marker names accepts connections;
//! - the block marked `guide: on the Pi` runs in a directory standing for the Pi's home, with
//!   `/etc/kestrel` and `/var/lib/kestrel` under a directory standing for its root, and shell
//!   functions in place of `scp` (copies into that home), `sudo` (runs the command), `apt install`
//!   (unpacks the .deb there with dpkg-deb) and `systemctl enable --now kestrel-agent` (starts the
//!   unit's `ExecStart`, the packaged aarch64 agent, under qemu-aarch64 as a Raspberry Pi 4's CPU);
//!   its lines that set a variable of the settings block (`LAN_IP=...`: the Pi's shell does not
//!   have step 1's) get this test's value.
//!
//! It needs the aarch64 package in dist/ and qemu (the test command builds and installs both); it
//! says that it skips, and why, without them.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kestrel_tests::once::free_port;
use kestrel_tests::{bin, dataset, read_jsonl, s, table_subset};
use serde_json::Value;

/// One fenced ```sh block of the guide and how it runs.
#[derive(Debug, PartialEq)]
enum Block {
    Settings,
    Plain(String),
    /// Runs in the background; the test waits for the port in the variable named.
    Background(String, String),
    Pi(String),
}

/// The guide's ```sh blocks with the `<!-- guide: ... -->` marker (if any) on the line before.
fn blocks(guide: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut marker: Option<String> = None;
    let mut lines = guide.lines();
    while let Some(line) = lines.next() {
        if let Some(m) = line
            .trim()
            .strip_prefix("<!-- guide:")
            .and_then(|r| r.strip_suffix("-->"))
        {
            marker = Some(m.trim().to_string());
            continue;
        }
        if line.trim() != "```sh" {
            if !line.trim().is_empty() {
                marker = None;
            }
            continue;
        }
        let mut text = String::new();
        for l in lines.by_ref() {
            if l.trim() == "```" {
                break;
            }
            text.push_str(l);
            text.push('\n');
        }
        out.push(match marker.take().as_deref() {
            None => Block::Plain(text),
            Some(m) if m.starts_with("settings") => Block::Settings,
            Some(m) if m.starts_with("on the Pi") => Block::Pi(text),
            Some(m) if m.starts_with("background") => {
                let var = m
                    .split_once("waits for $")
                    .map(|(_, v)| v.trim_end_matches(|c: char| !c.is_alphanumeric() && c != '_'))
                    .unwrap_or_else(|| panic!("a background block names its port: {m}"));
                Block::Background(text, var.to_string())
            }
            Some(m) => panic!("unknown guide marker `{m}`"),
        });
    }
    out
}

/// The shell functions that stand for the Pi (see the module's comment).
const PI_SHIMS: &str = r#"
scp() { # scp FILE... HOST:  -> copies into the Pi's home
  local n=$(($# - 1)) dest="${@: -1}"
  [[ "$dest" == *: ]] || { echo "scp (guide test): expects HOST: last, got $dest" >&2; return 1; }
  cp "${@:1:$n}" "$PI_HOME/"
}
sudo() { "$@"; }
apt() {
  [ "$1" = install ] || { echo "apt (guide test): only install" >&2; return 1; }
  shift
  for deb in "$@"; do dpkg-deb -x "$deb" "$PI_ROOT"; done
}
systemctl() {
  [ "$*" = "enable --now kestrel-agent" ] || { echo "systemctl (guide test): only enable --now kestrel-agent" >&2; return 1; }
  local cmd
  cmd=$(sed -n 's/^ExecStart=//p' "$PI_ROOT/usr/lib/systemd/system/kestrel-agent.service")
  # The shipped defaults name the real /var/lib/kestrel and /etc/kestrel: the stand-in Pi's own
  # under $PI_ROOT, in a last drop-in.
  printf 'store = "%s"\ntrusted_keys = ["%s"]\n' "$PI_ROOT/var/lib/kestrel" \
    "$PI_ROOT/etc/kestrel/kestrel.pub" > "$PI_ROOT/etc/kestrel/agent.d/99-test-root.toml"
  cmd=${cmd//\/etc\/kestrel/$PI_ROOT/etc/kestrel}
  cmd=${cmd//\/usr\/bin\//$PI_ROOT/usr/bin/}
  # shellcheck disable=SC2086
  qemu-aarch64-static -cpu cortex-a72 -L /usr/aarch64-linux-gnu $cmd >"$PI_HOME/agent.log" 2>&1 &
}
guide_wait_port() { # waits (up to 60 s) until 127.0.0.1:$1 accepts a connection
  local deadline=$((SECONDS + 60))
  until (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; do
    [ $SECONDS -lt $deadline ] || { echo "nothing listens on port $1" >&2; return 1; }
    sleep 0.1
  done
}
"#;

/// The bash script the guide's blocks make, with this test's `settings`.
fn script(blocks: &[Block], settings: &str) -> String {
    let mut sh = String::from("set -euo pipefail\n");
    sh += PI_SHIMS;
    for (i, b) in blocks.iter().enumerate() {
        sh += &format!("echo '=== docs/guide.md, block {}' >&2\n", i + 1);
        match b {
            Block::Settings => sh += settings,
            Block::Plain(text) => sh += text,
            Block::Background(text, port) => {
                sh += &format!("(\n{text}) >bg-{i}.log 2>&1 &\nguide_wait_port \"${port}\"\n")
            }
            Block::Pi(text) => {
                let ours = |line: &str| {
                    settings.lines().find(|s| {
                        line.split_once('=')
                            .is_some_and(|(var, _)| s.starts_with(&format!("{var}=")))
                    })
                };
                let text: String = text
                    .lines()
                    .map(|l| format!("{}\n", ours(l).unwrap_or(l)))
                    .collect::<String>()
                    .replace("/etc/kestrel", "$PI_ROOT/etc/kestrel")
                    .replace("/var/lib/kestrel", "$PI_ROOT/var/lib/kestrel");
                sh += &format!("cd \"$PI_HOME\"\n{text}cd \"$WORK\"\n");
            }
        }
    }
    sh
}

/// Kills a process group (the guide's background processes) when dropped.
struct Group(i32);
impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: kill(2) on a process group this test created.
        unsafe { libc::kill(-self.0, libc::SIGTERM) };
    }
}

/// The aarch64 kestrel-agent package in `dist` (not its `ort` variant), if built.
fn arm64_deb(dist: &Path) -> Option<PathBuf> {
    std::fs::read_dir(dist)
        .ok()?
        .map(|e| e.unwrap().path())
        .find(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with("kestrel-agent_") && name.ends_with("_arm64.deb")
        })
}

#[test]
fn the_guide_has_its_marked_blocks() {
    let guide = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/guide.md"))
        .expect("docs/guide.md");
    let b = blocks(&guide);
    assert_eq!(b.first(), Some(&Block::Settings), "{b:#?}");
    assert_eq!(b.iter().filter(|b| **b == Block::Settings).count(), 1);
    assert_eq!(b.iter().filter(|b| matches!(b, Block::Pi(_))).count(), 1);
    assert_eq!(
        b.iter()
            .filter(|b| matches!(b, Block::Background(..)))
            .count(),
        2
    );
    assert!(b.len() >= 12, "{} blocks", b.len());
}

#[test]
fn every_block_of_the_guide_runs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dist = kestrel_tests::dist();
    let Some(deb) = arm64_deb(&dist) else {
        eprintln!(
            "skipped: no kestrel-agent_*_arm64.deb in {} (scripts/build-edge.sh)",
            dist.display()
        );
        return;
    };
    if Command::new("qemu-aarch64-static")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("skipped: qemu-aarch64-static is not installed (Debian: qemu-user-static)");
        return;
    }
    let guide = std::fs::read_to_string(root.join("docs/guide.md")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let dir = |name: &str| {
        let d = tmp.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        d
    };
    let (work, photos, pi_home, pi_root) = (dir("work"), dir("photos"), dir("pi"), dir("pi-root"));
    table_subset(Path::new(&dataset("lfw", "imagefolder")), &photos, 20);
    // The guide's scp takes the package from $KESTREL_SRC/dist: a source directory whose dist/
    // is the one built (KESTREL_DIST may point elsewhere).
    let src = dir("src");
    std::os::unix::fs::symlink(root.join("scripts"), src.join("scripts")).unwrap();
    std::fs::create_dir_all(src.join("dist")).unwrap();
    std::fs::copy(&deb, src.join("dist").join(deb.file_name().unwrap())).unwrap();
    let (port, console_port) = (free_port(), free_port());
    let settings = format!(
        "KESTREL_SRC={}\nPHOTOS={}\nWORK={}\nLAN_IP=127.0.0.1\nPORT={port}\n\
         CONSOLE_PORT={console_port}\nPI=pi@raspberrypi.local\nPI_HOME={}\nPI_ROOT={}\n",
        s(&src),
        s(&photos),
        s(&work),
        s(&pi_home),
        s(&pi_root)
    );
    let sh = script(&blocks(&guide), &settings);
    std::fs::write(tmp.path().join("guide.sh"), &sh).unwrap();
    // The binaries under test: scripts/env.sh puts $CARGO_TARGET_DIR/release on the PATH.
    let target = bin("trainer")
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf();
    let mut child = Command::new("bash")
        .arg(tmp.path().join("guide.sh"))
        .current_dir(tmp.path())
        .env("CARGO_TARGET_DIR", &target)
        .process_group(0)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let _group = Group(child.id() as i32);
    let out = std::mem::take(&mut child.stdout).unwrap();
    let err = std::mem::take(&mut child.stderr).unwrap();
    let out = std::thread::spawn(move || std::io::read_to_string(out).unwrap());
    let err = std::thread::spawn(move || std::io::read_to_string(err).unwrap());
    let status = child.wait().unwrap();
    let (out, err) = (out.join().unwrap(), err.join().unwrap());
    let agent_log = std::fs::read_to_string(pi_home.join("agent.log")).unwrap_or_default();
    assert!(
        status.success(),
        "the guide failed:\n{err}\nstdout:\n{out}\nagent on the Pi:\n{agent_log}"
    );

    // Step 7: the device answered every held-out photo, and well (LFW faces and non-faces).
    let answers = read_jsonl(&work.join("answers.jsonl"));
    let summary = answers.last().unwrap();
    let held_out = answers.len() - 1;
    assert!(held_out >= 8, "{held_out} answers: {summary}");
    assert_eq!(summary["errors"], 0, "{summary}");
    assert_eq!(
        summary["evaluation"]["samples"], held_out as u64,
        "{summary}"
    );
    assert!(
        summary["evaluation"]["accuracy"].as_f64().unwrap() >= 0.75,
        "{summary}"
    );
    // Step 8 and 9: the rollout moved the Pi to version 2, as the console shows (it reads the
    // retained statuses once connected: asked until it has them).
    let url = format!("http://127.0.0.1:{console_port}/api/devices");
    let deadline = Instant::now() + Duration::from_secs(60);
    let devices = loop {
        let v: Value = reqwest::blocking::get(&url).unwrap().json().unwrap();
        if v.as_array().is_some_and(|a| !a.is_empty()) || Instant::now() > deadline {
            break v;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let pi = &devices[0];
    assert_eq!(
        (
            pi["id"].as_str(),
            pi["active"].as_u64(),
            pi["previous"].as_u64()
        ),
        (Some("pi-01"), Some(2), Some(1)),
        "{devices}"
    );
    let shown: Value =
        serde_json::from_slice(&std::fs::read(work.join("devices.json")).unwrap()).unwrap();
    assert!(shown.is_array(), "{shown}");
}
