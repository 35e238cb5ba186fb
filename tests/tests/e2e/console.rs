//! The fleet console (`trainer console`) in a real browser: headless Chromium driven over
//! WebDriver looks at 200 simulated devices (`edge-agent run --simulate 200`, two groups fed
//! live images), a rollout started from the CLI advancing through its phases without a reload, a
//! device whose model fails its health check, the group filter, and a pause, resume and abort
//! from the page (`--allow-actions`, signed with the operator key) that the rollout's controller
//! honours. The safety rules are `console_security`'s. Screenshots go to
//! `target/tmp/console/screenshots/` (docs/console.png is one).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kestrel_tests::browser::Browser;
use kestrel_tests::fleet::{
    Broker, BrokerKind, Proc, agent_config, fixture, free_port, publish_ok, rollout_command,
    start_agent_with, wait_fleet, write_plan,
};
use kestrel_tests::{bin, lfw, s, trainer_json};
use serde_json::Value;

const DEVICES: usize = 200;
/// An emptied `target/tmp/NAME` (kept after the test for its logs and screenshots), and a broker.
/// The fleet's is Mosquitto: rumqttd gave a subscriber that came after 1,000 devices only 100
/// retained messages per topic filter (`trainer status` listed 100, a console saw 189 devices).
pub(crate) fn workdir_and_broker(name: &str, kind: BrokerKind) -> (PathBuf, Broker) {
    let target = bin("trainer")
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .to_path_buf();
    let dir = target.join("tmp").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let b = Broker::start(kind, &dir.join("broker"));
    (dir, b)
}

/// `trainer console ARGS...` started, and its URL once it listens.
pub(crate) fn start_console(dir: &Path, args: &[&str]) -> (Proc, String) {
    let log = dir.join(format!("console-{}.log", free_port()));
    let mut p = Proc::spawn(Command::new(bin("trainer")).arg("console").args(args), &log);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = p.output();
        if let Some(url) = out
            .lines()
            .find_map(|l| l.strip_prefix("console: "))
            .and_then(|l| l.split_whitespace().next())
        {
            return (p, url.to_string());
        }
        assert!(p.is_running(), "trainer console exited: {out}");
        assert!(Instant::now() < deadline, "console not listening: {out}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `trainer console` on a free loopback port with actions allowed, signed with the fixture's
/// operator key (commands only).
pub(crate) fn start_console_with_actions(dir: &Path, b: &Broker) -> (Proc, String) {
    let key = s(&fixture().operator_key());
    let args = [
        "--broker",
        &b.url(),
        "--listen",
        "127.0.0.1:0",
        "--allow-actions",
    ];
    start_console(dir, &[&args[..], &["--operator-key", &key]].concat())
}

fn http() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

fn get_json(url: &str) -> Value {
    let r = http().get(url).send().unwrap();
    assert!(r.status().is_success(), "GET {url}: {}", r.status());
    r.json().unwrap()
}

/// Images of one LFW class, flat in `dir` (a feed).
fn feed_dir(dir: &Path, class: &str, n: usize) -> String {
    std::fs::create_dir_all(dir).unwrap();
    let mut files: Vec<PathBuf> = std::fs::read_dir(Path::new(&lfw()).join(class))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    for f in &files[..n] {
        std::fs::copy(f, dir.join(f.file_name().unwrap())).unwrap();
    }
    s(dir)
}

/// `trainer rollout` from the CLI, in the background.
fn start_rollout(dir: &Path, b: &Broker, art: &Path, plan: &str, name: &str) -> Proc {
    let log = dir.join(format!("rollout-{name}.log"));
    Proc::spawn(&mut rollout_command(b, art, plan), &log)
}

/// Waits for a background rollout to end; returns whether it succeeded.
fn rollout_ended(mut p: Proc, secs: u64) -> bool {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(st) = p.child.try_wait().unwrap() {
            return st.success();
        }
        assert!(
            Instant::now() < deadline,
            "rollout still running: {}",
            p.output()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

const THREE_PHASES: &str = r#"
[[phases]]
name = "canary"
percent = 5
soak_s = 2
[[phases]]
name = "half"
percent = 50
soak_s = 2
[[phases]]
name = "all"
percent = 100
"#;

/// The rollout card's current phase and state, as the page shows them.
const ROLLOUT_PROGRESS: &str = "const r = document.querySelector('[data-rollout=\"console-v1\"]'); \
     if (!r) return null; const cur = r.querySelector('tr[data-progress=\"current\"]'); \
     return [r.dataset.state, cur ? Number(cur.dataset.phase) : -1];";

#[test]
fn console_in_chromium_shows_the_fleet_a_rollout_an_error_and_filters() {
    let f = fixture();
    let (dir, b) = workdir_and_broker("console", BrokerKind::Mosquitto);
    let conf = agent_config(&dir.join("sim"), "cs", &b.url(), &f.keys, "");
    let mut text = std::fs::read_to_string(&conf).unwrap();
    text.push_str("[quality]\nwindow = 4\nperiod_s = 2\n");
    std::fs::write(&conf, text).unwrap();
    let east = format!("east={}", feed_dir(&dir.join("east"), "face", 8));
    let west = format!("west={}", feed_dir(&dir.join("west"), "nonface", 8));
    let n = DEVICES.to_string();
    let args = ["--simulate", &n, "--feed", &east, "--feed", &west];
    let mut fleet = start_agent_with(&conf, &[], &[&args[..], &["--feed-rate", "0.1"]].concat());
    wait_fleet(&b.config(), DEVICES);
    // The console holds only the operator key: it can pause and abort, never release a model.
    let (_console, url) = start_console_with_actions(&dir, &b);
    let t0 = Instant::now();
    let stage = |what: &str| {
        eprintln!(
            "console test: {what} at {:.1} s",
            t0.elapsed().as_secs_f64()
        )
    };
    let shots = dir.join("screenshots");
    std::fs::create_dir_all(&shots).unwrap();
    let browser = Browser::start(&dir.join("chromium"), 1280, 900);
    browser.goto(&url);
    let rows = format!("return document.querySelectorAll('#device-rows tr').length === {DEVICES}");
    browser.wait_for(&rows, 30, "200 device rows");
    let first = browser.eval("return document.documentElement.dataset.firstRenderMs");
    eprintln!("console: first render with {DEVICES} devices after {first} ms");
    rollout_advances_in_the_page(&browser, &dir, &b, &shots);
    stage("rollout completed in the page");

    health_check_error_shows(&browser, &b);
    stage("health check error shown");
    // Confidence with its sparkline (the feeds' windows since v1 became active).
    browser.wait_for(
        "return document.querySelectorAll('#device-rows svg.spark').length > 0",
        60,
        "a confidence sparkline",
    );
    browser.screenshot(&shots.join("fleet.png"));

    // Filtering by group.
    browser.click("#f-group option[value=\"east\"]");
    browser.wait_for(
        "const rows = [...document.querySelectorAll('#device-rows tr')]; \
         return rows.length === 100 && rows.every(r => r.children[1].textContent.includes('east'))",
        10,
        "100 east devices",
    );
    browser.screenshot(&shots.join("filtered.png"));
    browser.click("#filters button[type=reset]");
    browser.wait_for(&rows, 10, "every device again");

    stage("filtered");
    abort_from_the_page(&browser, &dir, &b, &url);
    stage("aborted from the page");
    api_reads_the_same(&url);
    phone_and_keyboard(&browser, &shots, &url);
    assert!(fleet.is_running(), "{}", fleet.output());
}

/// A rollout started from the CLI: the page shows its phases advancing, without a reload.
fn rollout_advances_in_the_page(browser: &Browser, dir: &Path, b: &Broker, shots: &Path) {
    let f = fixture();
    // A marker that a reload would lose.
    browser.eval("window.kestrelNoReload = 1; return 1");
    let plan = write_plan(dir, "console-v1", THREE_PHASES);
    let rollout = start_rollout(dir, b, &f.v1, &plan, "v1");
    let mut seen: Vec<Value> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(150);
    loop {
        let v = browser.eval(ROLLOUT_PROGRESS);
        if !v.is_null() && seen.last() != Some(&v) {
            if v[0] == "running" && v[1] == 1 {
                browser.screenshot(&shots.join("rollout.png"));
            }
            seen.push(v.clone());
        }
        if v[0] == "completed" {
            break;
        }
        assert!(Instant::now() < deadline, "rollout in the page: {seen:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(rollout_ended(rollout, 30), "the rollout completed");
    let phases: Vec<i64> = seen.iter().filter_map(|v| v[1].as_i64()).collect();
    assert!(
        phases.contains(&0) && phases.iter().any(|p| *p >= 1),
        "phases seen advancing: {seen:?}"
    );
    assert_eq!(
        browser.eval("return window.kestrelNoReload"),
        1,
        "no reload"
    );
    let active = format!(
        "return [...document.querySelectorAll('#device-rows td[data-col=\"active\"]')]\
         .filter(td => td.textContent === 'lfw v1').length === {DEVICES}"
    );
    browser.wait_for(&active, 60, "every device shows lfw v1 active");
}

/// A device whose new model fails its health check shows the error the device reports.
fn health_check_error_shows(browser: &Browser, b: &Broker) {
    let f = fixture();
    let bad = f.failing(9);
    publish_ok(b, &bad, &f.key(), "device/cs-007");
    let err = browser.wait_for(
        "const td = document.querySelector('tr[data-device=\"cs-007\"] td[data-col=\"error\"]'); \
         return td && td.textContent.includes('health check failed') ? td.textContent : null",
        90,
        "cs-007's health check error",
    );
    eprintln!("cs-007 in the page: {err}");
    let status = trainer_json(&[
        "status",
        "--broker",
        &b.url(),
        "--device",
        "cs-007",
        "--json",
    ]);
    assert!(
        err.as_str()
            .unwrap()
            .contains(status["last_error"].as_str().unwrap()),
        "{err} vs {status}"
    );
}

/// The button of `action` on rollout console-v2's card, once shown.
const V2_BUTTON: &str =
    "[data-rollout=\"console-v2\"] .actions:not([hidden]) [data-action=\"{}\"]:not([hidden])";

/// Clicks `action` on console-v2, types its name in the confirmation and confirms.
fn confirm_action(browser: &Browser, action: &str) {
    let css = V2_BUTTON.replace("{}", action);
    browser.wait_for(
        &format!("return document.querySelector('{css}')"),
        60,
        &format!("console-v2's {action} button"),
    );
    browser.click(&css);
    browser.type_into("#confirm-input", "console-v2");
    browser.click("#confirm-ok");
}

/// Whether console-v2's card shows it paused (`paused`) or not, within 60 s.
fn wait_paused(browser: &Browser, url: &str, paused: bool) {
    browser.wait_for(
        &format!(
            "const r = document.querySelector('[data-rollout=\"console-v2\"] .badge'); \
             return r && r.textContent.includes('paused') === {paused}"
        ),
        60,
        &format!("console-v2 paused: {paused}"),
    );
    let v = get_json(&format!("{url}api/rollouts/console-v2"));
    assert_eq!(v["paused"], paused, "{v}");
}

/// A running rollout paused, resumed and aborted from the page, each confirmed by typing its
/// name; its controller honours each, and rolls back on the abort.
fn abort_from_the_page(browser: &Browser, dir: &Path, b: &Broker, url: &str) {
    let f = fixture();
    // A canary that would soak for ten minutes: still running when the operator aborts it.
    let plan = write_plan(
        dir,
        "console-v2",
        "[[phases]]\nname = \"canary\"\npercent = 50\nsoak_s = 600\n\
         [[phases]]\nname = \"all\"\npercent = 100\n",
    );
    let rollout = start_rollout(dir, b, &f.v2, &plan, "v2");
    confirm_action(browser, "pause");
    wait_paused(browser, url, true);
    confirm_action(browser, "resume");
    wait_paused(browser, url, false);
    // Without the name typed, nothing is sent.
    let abort = V2_BUTTON.replace("{}", "abort");
    browser.click(&abort);
    browser.type_into("#confirm-input", "console-v1");
    browser.click("#confirm-ok");
    browser.wait_for(
        "return document.getElementById('confirm-error').textContent.includes('console-v2')",
        10,
        "the wrong name refused",
    );
    browser.eval("document.getElementById('confirm-input').value = ''; return 1");
    browser.type_into("#confirm-input", "console-v2");
    browser.click("#confirm-ok");
    let reason = browser.wait_for(
        "const r = document.querySelector('[data-rollout=\"console-v2\"]'); \
         return r && r.dataset.state === 'aborted' ? r.querySelector('.reason').textContent : null",
        60,
        "console-v2 aborted",
    );
    let by = format!(
        "aborted by console@{}",
        url.trim_start_matches("http://").trim_end_matches('/')
    );
    assert!(reason.as_str().unwrap().contains(&by), "{reason}");
    assert!(
        !rollout_ended(rollout, 90),
        "an aborted rollout exits non-zero"
    );
    // Its canary is back on v1.
    let v = get_json(&format!("{url}api/rollouts/console-v2"));
    assert_eq!(
        v["phases"][0]["rolled_back"].as_u64(),
        Some(DEVICES as u64 / 2),
        "{v}"
    );
}

/// The JSON API and /metrics say what the page says.
fn api_reads_the_same(url: &str) {
    let all = get_json(&format!("{url}api/devices"));
    assert_eq!(all.as_array().unwrap().len(), DEVICES);
    let east = get_json(&format!("{url}api/devices?group=east"));
    assert_eq!(east.as_array().unwrap().len(), DEVICES / 2);
    let v1 = get_json(&format!("{url}api/devices?version=v1"));
    assert!(!v1.as_array().unwrap().is_empty());
    let rollouts = get_json(&format!("{url}api/rollouts"));
    assert_eq!(rollouts.as_array().unwrap().len(), 2, "{rollouts}");
    let events = get_json(&format!("{url}api/events"));
    let kinds: Vec<&str> = events
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["kind"].as_str())
        .collect();
    assert!(
        kinds.contains(&"rejected") || kinds.contains(&"rolled-back"),
        "{kinds:?}"
    );
    assert!(
        ["completed", "paused", "resumed", "aborted"]
            .iter()
            .all(|k| kinds.contains(k)),
        "{kinds:?}"
    );
    let metrics = http()
        .get(format!("{url}metrics"))
        .send()
        .unwrap()
        .text()
        .unwrap();
    assert!(
        metrics.contains(&format!("\nkestrel_devices {DEVICES}\n")),
        "{metrics}"
    );
    assert!(metrics.contains("kestrel_device_online{device=\"cs-000\"} 1"));
    metrics_follow_the_naming_guide(&metrics);
}

/// `promtool check metrics` (Prometheus' own linter) finds nothing in the live page, and each
/// device's latency histogram counts the requests its counter says it answered.
fn metrics_follow_the_naming_guide(metrics: &str) {
    use std::io::Write;
    let mut promtool = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool (Debian's prometheus package; scripts/setup.sh installs it)");
    promtool
        .stdin
        .take()
        .unwrap()
        .write_all(metrics.as_bytes())
        .unwrap();
    let out = promtool.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool: {said}"
    );
    let value = |prefix: &str| -> Option<f64> {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .map(|v| v.trim().parse().unwrap())
    };
    let mut answered = 0.0;
    for i in 0..DEVICES {
        let d = format!("cs-{i:03}");
        let count = value(&format!(
            "kestrel_device_inference_duration_seconds_count{{device=\"{d}\"}} "
        ));
        let n = value(&format!(
            "kestrel_device_requests_total{{device=\"{d}\",outcome=\"answered\"}} "
        ));
        if let Some(count) = count {
            assert_eq!(
                Some(count),
                n,
                "{d}: histogram count against answered requests"
            );
        }
        answered += n.unwrap_or(0.0);
    }
    assert!(answered > 0.0, "the feeds' requests are counted: {metrics}");
}

/// A phone's width: nothing but the tables scrolls sideways; the keyboard reaches the page.
fn phone_and_keyboard(browser: &Browser, shots: &Path, url: &str) {
    browser.resize(390, 844);
    browser.wait_for(
        "return document.documentElement.scrollWidth <= window.innerWidth + 1",
        10,
        "no sideways scrolling of the page on a phone",
    );
    browser.screenshot(&shots.join("phone.png"));
    browser.resize(1280, 900);
    // A fresh load: Tab starts from the top of the page.
    browser.goto(url);
    browser.wait_for(
        "return document.querySelectorAll('#device-rows tr').length > 0",
        20,
        "rows",
    );
    browser.press("\u{E004}");
    assert_eq!(
        browser.eval("return document.activeElement.className"),
        "skip",
        "Tab reaches the skip link first"
    );
}
