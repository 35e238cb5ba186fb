//! The edge agent as built for the Raspberry Pi (`scripts/build-edge.sh`: dist/edge-agent-aarch64,
//! dist/edge-agent-armv7 and the two .deb files) run under qemu user-mode emulation against the x86
//! trainer and a real broker. Emulation shows correctness (same answers as x86, every update path);
//! its speed says nothing about a Pi's.
//!
//! Skipped, with the reason printed, only when the ARM binaries (or qemu, or dpkg-deb) are absent:
//! scripts/test.sh runs build-edge.sh first, so they are there in CI.
//!
//! qemu runs the guest with the cross sysroot's dynamic loader (`-L /usr/aarch64-linux-gnu`) *and* its
//! libc (`-E LD_LIBRARY_PATH=/usr/aarch64-linux-gnu/lib`): with `-L` alone the loader searches the
//! host's /lib/aarch64-linux-gnu first, where Debian's multiarch libc6:arm64 (pulled in by
//! libstd-rust-web-dev:arm64) lives, and a loader and libc from two different glibc builds made the
//! first `pthread_create` walk a garbage stack-cache list forever: the "predict never finishes" stall.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kestrel_fleet::{Bundle, Conn};
use kestrel_shared::protocol::sha256_hex;
use kestrel_shared::wire::DeviceState;
use kestrel_tests::fleet::{
    Broker, BrokerKind, Proc, agent_config, desired, fixture, killed_mid_download, publish_ok,
    publish_raw, wait_status,
};
use kestrel_tests::{dist, fetched, run, stderr, stdout};
use serde_json::Value;

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// An ARM edge-agent binary and how to run it under qemu.
struct Arm {
    bin: PathBuf,
    qemu: &'static str,
    cpu: &'static str,
    sysroot: &'static str,
    /// A Raspberry Pi 4's /proc/cpuinfo to show the guest (see [`Arm::with_pi_cpuinfo`]).
    cpuinfo: Option<PathBuf>,
}

impl Arm {
    /// The binary from dist/, or None (with the reason printed) when it or qemu is absent.
    fn find(short: &str) -> Option<Arm> {
        let (qemu, cpu, sysroot) = match short {
            // Raspberry Pi 4 (Cortex-A72); the default `max` CPU has extensions no Pi has.
            s if s.starts_with("aarch64") => (
                "qemu-aarch64-static",
                "cortex-a72",
                "/usr/aarch64-linux-gnu",
            ),
            // Raspberry Pi 2 (Cortex-A7), the oldest 32-bit target.
            _ => ("qemu-arm-static", "cortex-a7", "/usr/arm-linux-gnueabihf"),
        };
        let bin = dist().join(format!("edge-agent-{short}"));
        let skip = |why: String| {
            eprintln!("skipped: {why} (scripts/build-edge.sh builds and installs what is needed)");
            None
        };
        if !bin.exists() {
            return skip(format!("{} is not built", bin.display()));
        }
        if Command::new(qemu).arg("--version").output().is_err() {
            return skip(format!(
                "{qemu} is not installed (Debian: qemu-user-static)"
            ));
        }
        if !Path::new(sysroot).join("lib").exists() {
            return skip(format!(
                "no {sysroot}/lib (Debian: the cross libc6 package)"
            ));
        }
        Some(Arm {
            bin,
            qemu,
            cpu,
            sysroot,
            cpuinfo: None,
        })
    }

    /// Runs the guest in a private mount namespace where /proc/cpuinfo is a Raspberry Pi 4's
    /// (Cortex-A72, one entry per host CPU). qemu-user (Debian 12's 7.2; 8.2 emulates the file)
    /// passes the host's x86 /proc/cpuinfo through, on which ONNX Runtime's CPU detection
    /// (pytorch/cpuinfo) dereferences NULL at start; a Pi's kernel reports its own CPU. Needs
    /// root (CI runs as root); None, with the reason printed, otherwise.
    fn with_pi_cpuinfo(mut self, dir: &Path) -> Option<Arm> {
        let possible = std::fs::read_to_string("/sys/devices/system/cpu/possible").unwrap();
        let last: usize = possible
            .trim()
            .rsplit(['-', ','])
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let mut text = String::new();
        for i in 0..=last {
            text += &format!(
                "processor\t: {i}\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm crc32 cpuid\n\
                 CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x0\n\
                 CPU part\t: 0xd08\nCPU revision\t: 3\n\n"
            );
        }
        text +=
            "Hardware\t: BCM2835\nRevision\t: c03111\nModel\t\t: Raspberry Pi 4 Model B Rev 1.1\n";
        let path = dir.join("cpuinfo-pi4");
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(&path, text).unwrap();
        self.cpuinfo = Some(path);
        let mut o = self.command_for(Command::new("cat").arg("/proc/cpuinfo"));
        match o.output() {
            Ok(o) if o.status.success() && stdout(&o).contains("Raspberry Pi 4") => Some(self),
            Ok(o) => {
                eprintln!(
                    "skipped: cannot show the guest a Pi's /proc/cpuinfo (unshare/mount need root): {}",
                    stderr(&o)
                );
                None
            }
            Err(e) => {
                eprintln!("skipped: unshare: {e}");
                None
            }
        }
    }

    /// `inner` (a program and its arguments), in the cpuinfo namespace when there is one.
    fn command_for(&self, inner: &Command) -> Command {
        let Some(cpuinfo) = &self.cpuinfo else {
            let mut c = Command::new(inner.get_program());
            c.args(inner.get_args());
            return c;
        };
        let mut c = Command::new("unshare");
        c.args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg("mount --bind \"$0\" /proc/cpuinfo && exec \"$@\"")
            .arg(cpuinfo)
            .arg(inner.get_program())
            .args(inner.get_args());
        c
    }

    fn command(&self) -> Command {
        let mut c = Command::new(self.qemu);
        c.args(["-cpu", self.cpu, "-L", self.sysroot, "-E"])
            .arg(format!("LD_LIBRARY_PATH={}/lib", self.sysroot))
            .arg(&self.bin);
        self.command_for(&c)
    }

    fn run(&self, args: &[&str]) -> Output {
        self.command().args(args).output().expect("spawn qemu")
    }

    fn start_agent(&self, config: &Path, env: &[(&str, &str)]) -> Proc {
        let dir = config.parent().unwrap();
        let n = std::fs::read_dir(dir).unwrap().count();
        let mut cmd = self.command();
        cmd.arg("run").arg("--config").arg(config);
        for (k, v) in env {
            // qemu passes its own environment on to the guest.
            cmd.env(k, v);
        }
        Proc::spawn(&mut cmd, &dir.join(format!("agent-{n}.log")))
    }
}

/// The ELF machine of a file: 183 = AArch64, 40 = ARM.
fn elf_machine(p: &Path) -> u16 {
    let b = std::fs::read(p).unwrap();
    assert_eq!(&b[..4], b"\x7fELF", "{} is not an ELF file", p.display());
    u16::from_le_bytes([b[18], b[19]])
}

/// The LFW images the fixture's run held out for testing (split.json), by content hash; the two
/// classes alternate, so the first few hold both.
fn held_out() -> Vec<PathBuf> {
    let f = fixture();
    let recs: Vec<Value> =
        serde_json::from_slice(&std::fs::read(f.dir.join("run/split.json")).unwrap()).unwrap();
    let test: std::collections::HashSet<String> = recs
        .iter()
        .filter(|r| r["split"] == "test")
        .map(|r| r["sha256"].as_str().unwrap().to_string())
        .collect();
    let root = fetched("datasets/lfw/imagefolder");
    let by_class: Vec<Vec<PathBuf>> = ["face", "nonface"]
        .iter()
        .map(|class| {
            let mut files: Vec<PathBuf> = std::fs::read_dir(root.join(class))
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| test.contains(&sha256_hex(&std::fs::read(p).unwrap())))
                .collect();
            files.sort();
            files
        })
        .collect();
    assert!(
        by_class.iter().all(|c| !c.is_empty()),
        "held-out images of both classes: {by_class:?}"
    );
    let longest = by_class.iter().map(Vec::len).max().unwrap_or(0);
    (0..longest)
        .flat_map(|i| by_class.iter().filter_map(move |c| c.get(i).cloned()))
        .collect()
}

/// `edge-agent predict --json --top-k 2` output lines, by image path.
fn predictions(o: &Output) -> Vec<Value> {
    assert!(o.status.success(), "predict: {}{}", stdout(o), stderr(o));
    stdout(o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// Same top-1, every class's probability within 1e-3 and the logit difference (the log-odds, all
/// the logits a 2-class softmax determines) within 1e-3.
fn assert_same(what: &str, arm: &Value, x86: &Value) {
    let (a, b) = (&arm["top"], &x86["top"]);
    assert_eq!(a[0]["class"], b[0]["class"], "{what}: top-1 {a} vs {b}");
    let score = |t: &Value, class: u64| {
        t.as_array()
            .unwrap()
            .iter()
            .find(|c| c["class"] == class)
            .unwrap_or_else(|| panic!("{what}: class {class} missing from {t}"))["score"]
            .as_f64()
            .unwrap()
    };
    for class in [0, 1] {
        let (pa, pb) = (score(a, class), score(b, class));
        assert!(
            (pa - pb).abs() < 1e-3,
            "{what}: class {class}: {pa} vs {pb}"
        );
    }
    let logodds = |t: &Value| (score(t, 0) / score(t, 1)).ln();
    let (la, lb) = (logodds(a), logodds(b));
    assert!(
        (la - lb).abs() < 1e-3
            || (la.abs() > 10.0 && lb.abs() > 10.0 && la.signum() == lb.signum()),
        "{what}: log-odds {la} vs {lb}"
    );
}

#[test]
fn dist_binaries_and_debian_packages() {
    let dist = dist();
    let mut checked = 0;
    for (short, machine, arch) in [("aarch64", 183u16, "arm64"), ("armv7", 40, "armhf")] {
        let bin = dist.join(format!("edge-agent-{short}"));
        if !bin.exists() {
            eprintln!(
                "skipped {short}: {} is not built (scripts/build-edge.sh)",
                bin.display()
            );
            continue;
        }
        check_binary(&dist, short, machine, &bin);
        let Some(deb) = std::fs::read_dir(&dist)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| {
                let n = p.file_name().unwrap().to_string_lossy().into_owned();
                n.starts_with("kestrel-agent_") && n.ends_with(&format!("_{arch}.deb"))
            })
        else {
            panic!("no kestrel-agent_*_{arch}.deb beside {}", bin.display());
        };
        check_package_metadata(&deb, arch, "kestrel-agent");
        check_package_payload(&deb, &bin);
        lintian(&deb);
        checked += 1;
    }
    // The ONNX Runtime build's package, the `ort` variant.
    let ort_bin = dist.join("edge-agent-aarch64-ort");
    if ort_bin.exists() {
        let deb = std::fs::read_dir(&dist)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| {
                let n = p.file_name().unwrap().to_string_lossy().into_owned();
                n.starts_with("kestrel-agent-ort_") && n.ends_with("_arm64.deb")
            })
            .unwrap_or_else(|| panic!("no kestrel-agent-ort_*_arm64.deb in {}", dist.display()));
        check_package_metadata(&deb, "arm64", "kestrel-agent-ort");
        check_package_payload(&deb, &ort_bin);
        lintian(&deb);
    }
    if checked == 0 {
        eprintln!("skipped: no ARM binaries in {}", dist.display());
    }
}

/// The ELF machine, the size ceiling and the SHA256SUMS line of one dist/ binary.
fn check_binary(dist: &Path, short: &str, machine: u16, bin: &Path) {
    assert_eq!(elf_machine(&bin), machine, "{}", bin.display());
    let size = std::fs::metadata(&bin).unwrap().len();
    if short == "aarch64" {
        // The device budget (scripts/build-edge.sh checks the same): 12 MB stripped.
        assert!(
            size <= 12_000_000,
            "{} is {size} bytes, over the 12 MB budget",
            bin.display()
        );
    }
    let sums = std::fs::read_to_string(dist.join("SHA256SUMS")).unwrap();
    let want = sha256_hex(&std::fs::read(&bin).unwrap());
    assert!(
        sums.lines()
            .any(|l| l == format!("{want}  edge-agent-{short}")),
        "SHA256SUMS does not match edge-agent-{short}:\n{sums}"
    );
}

/// `lintian` (Debian's package checker) finds no error in the package.
fn lintian(deb: &Path) {
    let o = Command::new("lintian")
        .args(["--fail-on", "error"])
        .arg(deb)
        .output()
        .expect("lintian (Debian's package; scripts/setup.sh installs it)");
    assert!(
        o.status.success(),
        "lintian {}: {}{}",
        deb.display(),
        stdout(&o),
        stderr(&o)
    );
}

/// `dpkg-deb --field/--info/--contents`: package, architecture, dependencies, scripts, files and modes.
fn check_package_metadata(deb: &Path, arch: &str, package: &str) {
    let dpkg = |args: &[&str]| {
        let o = Command::new("dpkg-deb").args(args).arg(&deb).output();
        match o {
            Ok(o) if o.status.success() => stdout(&o),
            Ok(o) => panic!("dpkg-deb {args:?} {}: {}", deb.display(), stderr(&o)),
            Err(e) => panic!("dpkg-deb is needed to check the packages: {e}"),
        }
    };
    let field = |f: &str| {
        dpkg(&["--field"])
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{f}: ")).map(str::to_string))
    };
    assert_eq!(field("Package").as_deref(), Some(package));
    assert_eq!(
        field("Architecture").as_deref(),
        Some(arch),
        "{}",
        deb.display()
    );
    let depends = field("Depends").unwrap_or_default();
    assert!(
        depends.contains("libc6 (>= 2.") && depends.contains("systemd"),
        "{depends}"
    );
    if package != "kestrel-agent" {
        assert_eq!(field("Provides").as_deref(), Some("kestrel-agent"));
        assert_eq!(field("Conflicts").as_deref(), Some("kestrel-agent"));
    }
    let info = dpkg(&["--info"]);
    for script in ["postinst", "prerm", "postrm", "conffiles", "md5sums"] {
        assert!(
            info.contains(script),
            "{}: no {script}:\n{info}",
            deb.display()
        );
    }
    // Files and modes.
    let contents = dpkg(&["--contents"]);
    let entry = |path: &str| {
        contents
            .lines()
            .find(|l| l.ends_with(&format!(" .{path}")))
            .unwrap_or_else(|| panic!("{}: no {path}:\n{contents}", deb.display()))
            .to_string()
    };
    let doc = format!("/usr/share/doc/{package}");
    let sysusers = format!("/usr/lib/sysusers.d/{package}.conf");
    for (path, mode) in [
        ("/usr/bin/edge-agent", "-rwxr-xr-x root/root"),
        ("/etc/kestrel/agent.toml", "-rw-r--r-- root/root"),
        (UNIT, "-rw-r--r-- root/root"),
        (&sysusers, "-rw-r--r-- root/root"),
        (&format!("{doc}/copyright"), "-rw-r--r-- root/root"),
        (
            &format!("{doc}/changelog.Debian.gz"),
            "-rw-r--r-- root/root",
        ),
        (
            "/usr/share/man/man1/edge-agent.1.gz",
            "-rw-r--r-- root/root",
        ),
        (
            "/usr/share/man/man1/edge-agent-run.1.gz",
            "-rw-r--r-- root/root",
        ),
        (
            "/usr/share/bash-completion/completions/edge-agent",
            "-rw-r--r-- root/root",
        ),
        (
            "/usr/share/zsh/vendor-completions/_edge-agent",
            "-rw-r--r-- root/root",
        ),
        (
            "/usr/share/fish/vendor_completions.d/edge-agent.fish",
            "-rw-r--r-- root/root",
        ),
    ] {
        let e = entry(path);
        assert!(e.starts_with(mode), "{path}: {e}");
    }
}

/// Where the package installs the unit.
const UNIT: &str = "/usr/lib/systemd/system/kestrel-agent.service";

/// The unpacked package: the dist/ binary, agent.toml as a conffile, the hardened unit, postinst.
fn check_package_payload(deb: &Path, bin: &Path) {
    // The packaged binary is the dist/ one; agent.toml is a conffile; the unit is hardened.
    let tmp = tempfile::tempdir().unwrap();
    let o = Command::new("dpkg-deb")
        .arg("-R")
        .arg(&deb)
        .arg(tmp.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let x = tmp.path();
    let sha = |p: &Path| sha256_hex(&std::fs::read(p).unwrap());
    assert_eq!(
        sha(&x.join("usr/bin/edge-agent")),
        sha(bin),
        "{} does not hold {}",
        deb.display(),
        bin.display()
    );
    assert_eq!(
        std::fs::read_to_string(x.join("DEBIAN/conffiles"))
            .unwrap()
            .trim(),
        "/etc/kestrel/agent.toml"
    );
    let unit = std::fs::read_to_string(x.join(&UNIT[1..])).unwrap();
    for line in [
        "ExecStart=/usr/bin/edge-agent run --config /etc/kestrel/agent.toml",
        "User=kestrel",
        "Type=notify",
        "WatchdogSec=30",
        "After=network-online.target time-sync.target",
        "Restart=always",
        "RestartPreventExitStatus=78",
        "LoadCredential=broker-password:/etc/kestrel/broker-password",
        "StateDirectory=kestrel",
        "ProtectSystem=strict",
        "ReadWritePaths=/var/lib/kestrel",
        "NoNewPrivileges=true",
    ] {
        assert!(
            unit.lines().any(|l| l == line),
            "unit lacks {line}:\n{unit}"
        );
    }
    // systemd's own review of the sandbox: "1.4 OK" (3.2 before the system call filter,
    // ProtectProc and PrivateUsers); --threshold fails the command above 2.0.
    let unit_path = x.join(&UNIT[1..]);
    match std::process::Command::new("systemd-analyze")
        .args(["security", "--offline=true", "--threshold=20"])
        .arg(&unit_path)
        .output()
    {
        Ok(o) => assert!(
            o.status.success(),
            "systemd-analyze security: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => eprintln!("SKIPPED the unit's security review: systemd-analyze: {e}"),
    }
    // The user from systemd-sysusers, the unit through deb-systemd-helper (debhelper's snippets).
    let postinst = std::fs::read_to_string(x.join("DEBIAN/postinst")).unwrap();
    for s in [
        "systemd-sysusers",
        "deb-systemd-helper",
        "/etc/kestrel/agent.d",
    ] {
        assert!(postinst.contains(s), "postinst lacks {s}:\n{postinst}");
    }
    let sysusers = std::fs::read_dir(x.join("usr/lib/sysusers.d"))
        .unwrap()
        .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap())
        .collect::<String>();
    assert!(sysusers.contains("u kestrel - "), "{sysusers}");
    let toml = std::fs::read_to_string(x.join("etc/kestrel/agent.toml")).unwrap();
    assert!(toml.contains("store = \"/var/lib/kestrel\""), "{toml}");
    // md5sums name every installed file, with its sum.
    let sums = std::fs::read_to_string(x.join("DEBIAN/md5sums")).unwrap();
    let line = format!("{}  usr/bin/edge-agent", md5(&std::fs::read(bin).unwrap()));
    assert!(
        sums.lines().any(|l| l == line),
        "{line} not in md5sums:\n{sums}"
    );
    assert!(sums.contains("  etc/kestrel/agent.toml") && sums.contains("  usr/share/man/man1/"));
    // The copyright names the linked crates (DEP-5 paragraphs) and their licences' texts.
    let doc = std::fs::read_dir(x.join("usr/share/doc"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let copyright = std::fs::read_to_string(doc.join("copyright")).unwrap();
    for s in [
        "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/",
        "Files: crates.io/tract-core-",
        "Files: crates.io/rustls-",
        "License: MIT\n",
    ] {
        assert!(copyright.contains(s), "copyright lacks {s}");
    }
}

/// MD5 of `bytes` through `md5sum` (what dpkg checks the md5sums with).
fn md5(bytes: &[u8]) -> String {
    use std::io::Write;
    let mut c = Command::new("md5sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all(bytes).unwrap();
    let o = c.wait_with_output().unwrap();
    stdout(&o).split_whitespace().next().unwrap().to_string()
}

/// The aarch64 package installed as on a Pi: into a Debian bookworm arm64 system
/// (scripts/debian-chroot.sh: mmdebstrap, programs run by qemu through binfmt_misc) with dpkg, its
/// maintainer scripts run there; then systemd's own check of the unit, dpkg's of the files, the
/// agent itself, and a purge.
#[test]
fn aarch64_deb_installs_into_a_debian_arm64_chroot() {
    let dist = dist();
    let Some(deb) = std::fs::read_dir(&dist).ok().and_then(|d| {
        d.map(|e| e.unwrap().path()).find(|p| {
            let n = p.file_name().unwrap().to_string_lossy().into_owned();
            n.starts_with("kestrel-agent_") && n.ends_with("_arm64.deb")
        })
    }) else {
        eprintln!(
            "skipped: no kestrel-agent_*_arm64.deb in {}",
            dist.display()
        );
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("pi");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/debian-chroot.sh");
    let o = Command::new(script)
        .arg("arm64")
        .arg(&root)
        .output()
        .unwrap();
    if o.status.code() == Some(3) {
        eprintln!("skipped: {}", stderr(&o).trim());
        return;
    }
    assert!(o.status.success(), "debian-chroot.sh: {}", stderr(&o));
    std::fs::copy(&deb, root.join("tmp/agent.deb")).unwrap();
    let chroot = |args: &[&str]| -> Output {
        Command::new("chroot")
            .arg(&root)
            .args(args)
            .output()
            .unwrap()
    };
    let ok = |args: &[&str]| -> String {
        let o = chroot(args);
        assert!(o.status.success(), "{args:?}: {}{}", stdout(&o), stderr(&o));
        format!("{}{}", stdout(&o), stderr(&o))
    };
    let said = ok(&["dpkg", "-i", "/tmp/agent.deb"]);
    assert!(said.contains("Setting up kestrel-agent"), "{said}");
    // The user from sysusers.d, the drop-in directory and the credential file from postinst.
    let user = ok(&["getent", "passwd", "kestrel"]);
    assert!(
        user.contains(":/var/lib/kestrel:/usr/sbin/nologin"),
        "{user}"
    );
    for (path, mode) in [
        ("/etc/kestrel/agent.toml", "640 root:kestrel"),
        ("/etc/kestrel/agent.d", "755 root:root"),
        ("/etc/kestrel/broker-password", "600 root:root"),
    ] {
        assert_eq!(ok(&["stat", "-c", "%a %U:%G", path]).trim(), mode, "{path}");
    }
    // systemd's check of the unit finds nothing to say; dpkg's of the files (md5sums) neither.
    let verify = ok(&["systemd-analyze", "verify", UNIT]);
    assert!(verify.trim().is_empty(), "systemd-analyze verify: {verify}");
    let files = ok(&["dpkg", "--verify", "kestrel-agent"]);
    assert!(files.trim().is_empty(), "dpkg --verify: {files}");
    let version = ok(&["/usr/bin/edge-agent", "--version"]);
    assert!(version.starts_with("edge-agent "), "{version}");
    assert!(root.join("usr/share/man/man1/edge-agent.1.gz").is_file());
    ok(&["dpkg", "--purge", "kestrel-agent"]);
    assert!(!root.join("usr/bin/edge-agent").exists());
    assert!(!root.join("etc/kestrel/broker-password").exists());
}

#[test]
fn aarch64_agent_under_qemu_installs_serves_rejects_rolls_back_and_resumes() {
    let Some(arm) = Arm::find("aarch64") else {
        return;
    };
    let f = fixture();
    let dir = f.dir.join("arm64");
    let b = Broker::start(BrokerKind::Rumqttd, &dir.join("broker"));
    let cfg = b.config();
    let conf = agent_config(&dir.join("pi-a"), "pi-a", &b.url(), &f.keys, "");

    // v1 over MQTT, the agent killed (SIGKILL) mid-download, then resuming to v1 active.
    killed_mid_download(
        &b,
        &f.v1,
        &dir.join("pi-a"),
        300,
        "downloading under qemu",
        |env| arm.start_agent(&conf, env),
    );
    let mut agent = arm.start_agent(&conf, &[]);
    let st = wait_status(&cfg, "pi-a", 300, "v1 active after resume", |s| {
        s.active == Some(1) && s.state == DeviceState::Idle
    });
    assert_eq!(st.last_error, None, "{}", agent.output());

    // Inference over MQTT on the held-out images: the x86 answers.
    let paths = infer_matches_x86(&b.url(), "pi-a", &f.v1, &agent, 6);
    let url = b.url();

    // A chunk altered in the broker is dropped and asked for again (never a failure), and v1
    // keeps serving.
    let topics = Conn::connect(&cfg, "t").unwrap().topics.clone();
    let v4 = Bundle::from_dir(&f.variant(&f.v2, 4, |_| {}), &f.signing(), 128 * 1024)
        .unwrap()
        .without_pieces(); // whole-bundle chunks: v4 shares every piece with v2
    let mut msgs = v4.messages(&topics);
    msgs.push((topics.chunk("lfw", 4, 3), b"tampered".to_vec(), true));
    publish_raw(&b, msgs, desired("pi-a", 4, false));
    let st = wait_status(&cfg, "pi-a", 300, "tampered chunk dropped", |s| {
        s.last_error
            .as_deref()
            .is_some_and(|e| e.contains("chunk 3 of v4 failed its sha256 check"))
    });
    assert_eq!((st.active, st.state.as_str()), (Some(1), "downloading"));
    assert_ne!(st.failed_version, Some(4));

    // A model whose golden samples fail its health check is rolled back; v1 stays.
    let v8 = f.variant(&f.v2, 8, |m| {
        for g in m["golden"].as_array_mut().unwrap() {
            let top = g["expected_top1"].as_u64().unwrap();
            g["expected_top1"] = (1 - top).into();
        }
    });
    publish_ok(&b, &v8, &f.key(), "device/pi-a");
    let st = wait_status(&cfg, "pi-a", 300, "health check failed, rolled back", |s| {
        s.last_error
            .as_deref()
            .is_some_and(|e| e.contains("health check failed"))
            && s.state == DeviceState::Idle
    });
    assert_eq!(st.active, Some(1));
    let store = dir.join("pi-a/store");
    assert!(
        !store.join("versions/8").exists(),
        "the failed model is discarded"
    );
    assert_eq!(
        std::fs::read_link(store.join("active")).unwrap(),
        Path::new("versions/1")
    );
    let o = run(
        "trainer",
        &[
            "infer", "--broker", &url, "--device", "pi-a", "--json", &paths[0],
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let line: Value = serde_json::from_str(stdout(&o).lines().next().unwrap()).unwrap();
    assert_eq!(line["prediction"]["version"], 1);
    assert!(agent.is_running(), "{}", agent.output());
    assert!(agent.terminate().success());
}

/// Sends the first `n` held-out images (both classes) to `device` over MQTT and checks every
/// reply against x86 `edge-agent predict` on `model`; returns the image paths. A few images
/// prove it (each reply must equal the x86 answer: top-1, scores within 1e-3): under qemu each costs
/// one to two seconds, and all 40 held-out ones took ~60 s of the two tests that call this.
fn infer_matches_x86(url: &str, device: &str, model: &Path, agent: &Proc, n: usize) -> Vec<String> {
    let images: Vec<PathBuf> = held_out().into_iter().take(n).collect();
    let paths: Vec<String> = images.iter().map(|p| s(p)).collect();
    let mut args = vec![
        "infer",
        "--broker",
        url,
        "--device",
        device,
        "--json",
        "--timeout",
        "300",
    ];
    args.extend(paths.iter().map(String::as_str));
    let o = run("trainer", &args);
    assert!(o.status.success(), "{}{}", stderr(&o), agent.output());
    let mut remote: Vec<Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let summary = remote.pop().unwrap();
    assert_eq!(summary["errors"].as_u64(), Some(0), "{summary}");
    let mut x86_args = vec!["predict", "--model", &s(model), "--json", "--top-k", "2"]
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>();
    x86_args.extend(paths.iter().cloned());
    let refs: Vec<&str> = x86_args.iter().map(String::as_str).collect();
    let local = predictions(&run("edge-agent", &refs));
    assert_eq!((remote.len(), local.len()), (images.len(), images.len()));
    for l in &local {
        let r = remote
            .iter()
            .find(|r| r["image"] == l["image"])
            .unwrap_or_else(|| panic!("no reply for {}", l["image"]));
        assert_eq!(r["prediction"]["version"], 1);
        // The agent answers with its configured top_k (3): both classes.
        assert_same(l["image"].as_str().unwrap(), &r["prediction"], l);
    }

    paths
}

#[test]
fn armv7_agent_under_qemu_checks_and_predicts() {
    let Some(arm) = Arm::find("armv7") else {
        return;
    };
    let f = fixture();
    let key = f.keys.join("kestrel.pub");
    // Signed copies (the fixture's artifacts are signed when published, maybe not yet).
    let tmp = tempfile::tempdir().unwrap();
    let signed: Vec<PathBuf> = [&f.v1, &f.f32_v6]
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let c = tmp.path().join(i.to_string());
            kestrel_tests::copy_dir(m, &c);
            let k = s(&f.keys.join("kestrel.key"));
            let o = run("trainer", &["sign", "--artifact", &s(&c), "--key", &k]);
            assert!(o.status.success(), "{}", stderr(&o));
            c
        })
        .collect();
    for model in &signed {
        let o = arm.run(&["check", "--model", &s(model), "--trusted-key", &s(&key)]);
        assert!(
            o.status.success(),
            "check {}: {}{}",
            model.display(),
            stdout(&o),
            stderr(&o)
        );
        assert!(stdout(&o).contains("golden samples pass"), "{}", stdout(&o));
    }
    let images: Vec<String> = held_out().iter().take(6).map(|p| s(p)).collect();
    let mut args = vec!["predict", "--model", &s(&f.v1), "--json", "--top-k", "2"]
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>();
    args.extend(images.iter().cloned());
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let armv7 = predictions(&arm.run(&refs));
    let x86 = predictions(&run("edge-agent", &refs));
    assert_eq!(armv7.len(), images.len());
    for (a, x) in armv7.iter().zip(&x86) {
        assert_same(a["image"].as_str().unwrap(), a, x);
    }
}

#[test]
fn aarch64_predict_matches_x86_on_the_f32_artifact() {
    let Some(arm) = Arm::find("aarch64") else {
        return;
    };
    let f = fixture();
    let images: Vec<String> = held_out().iter().take(4).map(|p| s(p)).collect();
    let mut args = vec![
        "predict",
        "--model",
        &s(&f.f32_v6),
        "--json",
        "--top-k",
        "2",
    ]
    .into_iter()
    .map(String::from)
    .collect::<Vec<_>>();
    args.extend(images.iter().cloned());
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let a = predictions(&arm.run(&refs));
    let x = predictions(&run("edge-agent", &refs));
    assert_eq!(a.len(), images.len());
    for (a, x) in a.iter().zip(&x) {
        assert_same(a["image"].as_str().unwrap(), a, x);
    }
}

/// The ONNX Runtime build of the aarch64 agent (`build-edge.sh --ort`) with the library from
/// ONNX Runtime's aarch64 wheel: the health check and inference run on ONNX Runtime and give the
/// x86 tract answers; the agent installs over MQTT with `[inference] engine = "ort"`. A missing
/// library, and `--engine ort` on the pure-Rust build, are clear errors.
#[test]
fn aarch64_ort_engine_under_qemu_checks_predicts_and_serves() {
    let Some(arm) = Arm::find("aarch64-ort") else {
        return;
    };
    let libdir = dist().join("onnxruntime-aarch64");
    let Some(lib) = std::fs::read_dir(&libdir)
        .into_iter()
        .flatten()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains("libonnxruntime.so"))
    else {
        eprintln!("skipped: no ONNX Runtime library in {}", libdir.display());
        return;
    };
    let f = fixture();
    let Some(arm) = arm.with_pi_cpuinfo(&f.dir.join("arm64-ort")) else {
        return;
    };
    let model = s(&f.v1);
    let run_ort = |args: &[&str], lib: &Path| {
        arm.command()
            .env("ORT_DYLIB_PATH", lib)
            .args(args)
            .output()
            .expect("spawn qemu")
    };

    let o = run_ort(&["--engine", "ort", "check", "--model", &model], &lib);
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert!(
        stdout(&o).contains("golden samples pass on ort"),
        "{}",
        stdout(&o)
    );
    let o = run_ort(
        &["--engine", "ort", "check", "--model", &model],
        Path::new("/nonexistent/libonnxruntime.so"),
    );
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("library not found at /nonexistent/libonnxruntime.so"),
        "{}",
        stderr(&o)
    );
    if let Some(pure) = Arm::find("aarch64") {
        let o = pure.run(&["--engine", "ort", "check", "--model", &model]);
        assert!(!o.status.success());
        assert!(stderr(&o).contains("cargo feature `ort`"), "{}", stderr(&o));
    }

    let images: Vec<String> = held_out().iter().take(4).map(|p| s(p)).collect();
    let mut args = vec!["predict", "--model", &model, "--json", "--top-k", "2"];
    args.extend(images.iter().map(String::as_str));
    let x86 = predictions(&run("edge-agent", &args));
    let mut ort_args = vec!["--engine", "ort"];
    ort_args.extend(&args);
    let ort = predictions(&run_ort(&ort_args, &lib));
    assert_eq!(ort.len(), images.len());
    for (a, x) in ort.iter().zip(&x86) {
        assert_same(a["image"].as_str().unwrap(), a, x);
    }

    // The agent, configured for ONNX Runtime, installs v1 over MQTT and serves it.
    let dir = f.dir.join("arm64-ort");
    let b = Broker::start(BrokerKind::Rumqttd, &dir.join("broker"));
    let engine = format!(
        "[inference]\nengine = \"ort\"\nort_library = \"{}\"",
        lib.display()
    );
    let conf = agent_config(&dir.join("pi-o"), "pi-o", &b.url(), &f.keys, &engine);
    let agent = arm.start_agent(&conf, &[]);
    publish_ok(&b, &f.v1, &f.key(), "device/pi-o");
    let st = wait_status(&b.config(), "pi-o", 300, "v1 active on ort", |s| {
        s.active == Some(1) && s.state == DeviceState::Idle
    });
    assert_eq!(st.last_error, None, "{}", agent.output());
    infer_matches_x86(&b.url(), "pi-o", &f.v1, &agent, 6);
    assert!(agent.terminate().success());
}
