//! A real browser for the tests: Debian's headless Chromium driven through chromedriver over
//! the W3C WebDriver protocol (JSON over HTTP: the few endpoints below are all the console
//! test needs). scripts/setup.sh installs `chromium` and `chromium-driver`.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use base64::Engine;
use serde_json::{Value, json};

use crate::fleet::{Proc, free_port};

pub const CHROMIUM: &str = "/usr/bin/chromium";
pub const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
/// The key under which WebDriver returns an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// Chromium's flags here: headless, no sandbox (root in a container), nothing fetched from the
/// network, a fresh profile.
fn chromium_args(profile: &Path, width: u32, height: u32) -> Vec<String> {
    [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([
        format!("--user-data-dir={}", profile.display()),
        format!("--window-size={width},{height}"),
    ])
    .collect()
}

/// A Chromium session; the browser and its driver end on drop.
pub struct Browser {
    _driver: Proc,
    http: reqwest::blocking::Client,
    /// `http://127.0.0.1:PORT/session/ID`
    session: String,
}

impl Browser {
    /// Starts chromedriver and a headless Chromium (profile and logs under `dir`).
    pub fn start(dir: &Path, width: u32, height: u32) -> Self {
        for exe in [CHROMIUM, CHROMEDRIVER] {
            assert!(
                Path::new(exe).exists(),
                "{exe} is missing: run scripts/setup.sh (Debian packages chromium, chromium-driver)"
            );
        }
        std::fs::create_dir_all(dir).unwrap();
        let port = free_port();
        let mut driver = Proc::spawn(
            Command::new(CHROMEDRIVER).arg(format!("--port={port}")),
            &dir.join("chromedriver.log"),
        );
        let http = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap();
        let base = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(20);
        while http.get(format!("{base}/status")).send().is_err() {
            assert!(driver.is_running(), "chromedriver: {}", driver.output());
            assert!(Instant::now() < deadline, "chromedriver not up");
            std::thread::sleep(Duration::from_millis(100));
        }
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": CHROMIUM,
                "args": chromium_args(&dir.join("profile"), width, height),
            },
        }}});
        let v = call(
            &http,
            reqwest::Method::POST,
            &format!("{base}/session"),
            Some(caps),
        );
        let id = v["sessionId"].as_str().expect("sessionId").to_string();
        Self {
            _driver: driver,
            http,
            session: format!("{base}/session/{id}"),
        }
    }

    fn post(&self, path: &str, body: Value) -> Value {
        let url = format!("{}/{path}", self.session);
        call(&self.http, reqwest::Method::POST, &url, Some(body))
    }

    pub fn goto(&self, url: &str) {
        self.post("url", json!({ "url": url }));
    }

    /// Runs `script` (a function body: `return ...`) in the page; returns its value.
    pub fn eval(&self, script: &str) -> Value {
        self.post("execute/sync", json!({ "script": script, "args": [] }))
    }

    /// Polls `script` until it returns something other than null or false; returns that.
    pub fn wait_for(&self, script: &str, secs: u64, what: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let v = self.eval(script);
            if !v.is_null() && v != Value::Bool(false) {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not within {secs} s; page says: {}",
                self.eval("return document.body.innerText.slice(0, 2000)")
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// The element matching a CSS selector (panics when there is none).
    pub fn find(&self, css: &str) -> String {
        let v = self.post("element", json!({ "using": "css selector", "value": css }));
        v[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("no element {css}: {v}"))
            .to_string()
    }

    /// Clicks the element; found again if the page replaced it in between (a live page
    /// re-renders).
    pub fn click(&self, css: &str) {
        for _ in 0..5 {
            let e = self.find(css);
            let url = format!("{}/element/{e}/click", self.session);
            match try_call(&self.http, reqwest::Method::POST, &url, Some(json!({}))) {
                Ok(_) => return,
                Err(e) if e.contains("stale element") => {}
                Err(e) => panic!("{e}"),
            }
        }
        panic!("{css}: replaced five times while clicking it");
    }

    /// Types `text` into the element, as a keyboard would.
    pub fn type_into(&self, css: &str, text: &str) {
        let e = self.find(css);
        self.post(&format!("element/{e}/value"), json!({ "text": text }));
    }

    /// Presses keys (WebDriver key codes, e.g. "\u{E004}" for Tab) on whatever has the focus.
    pub fn press(&self, keys: &str) {
        let actions: Vec<Value> = keys
            .chars()
            .flat_map(|c| {
                let k = c.to_string();
                [
                    json!({"type": "keyDown", "value": k}),
                    json!({"type": "keyUp", "value": k}),
                ]
            })
            .collect();
        self.post(
            "actions",
            json!({"actions": [{"type": "key", "id": "kb", "actions": actions}]}),
        );
    }

    pub fn resize(&self, width: u32, height: u32) {
        self.post("window/rect", json!({ "width": width, "height": height }));
    }

    /// A PNG of the viewport, written to `path`; returns its size in bytes.
    pub fn screenshot(&self, path: &Path) -> usize {
        let url = format!("{}/screenshot", self.session);
        let v = call(&self.http, reqwest::Method::GET, &url, None);
        let png = base64::engine::general_purpose::STANDARD
            .decode(v.as_str().expect("base64 PNG"))
            .unwrap();
        std::fs::write(path, &png).unwrap();
        png.len()
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.http.delete(&self.session).send();
    }
}

/// One WebDriver call: its `value`, or a panic with the driver's error.
fn call(
    http: &reqwest::blocking::Client,
    method: reqwest::Method,
    url: &str,
    body: Option<Value>,
) -> Value {
    try_call(http, method, url, body).unwrap_or_else(|e| panic!("{e}"))
}

/// One WebDriver call: its `value`, or the driver's error.
fn try_call(
    http: &reqwest::blocking::Client,
    method: reqwest::Method,
    url: &str,
    body: Option<Value>,
) -> Result<Value, String> {
    let mut req = http.request(method, url);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let r = req.send().map_err(|e| format!("WebDriver {url}: {e}"))?;
    let ok = r.status().is_success();
    let v: Value = r.json().map_err(|e| format!("WebDriver {url}: {e}"))?;
    if !ok {
        return Err(format!("WebDriver {url}: {}", v["value"]));
    }
    Ok(v["value"].clone())
}
