//! MLflow tracking and registry against a real `mlflow server` (SQLite backend, proxied
//! artifacts) from the project's venv: what `fit`, `tune` and `export --register` log, read back
//! with MLflow's own Python client; `publish --model models:/NAME@ALIAS` to a real agent; a server
//! stopped mid-fit and `trainer mlflow sync`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kestrel_shared::wire::DeviceState;
use kestrel_tests::fleet::{
    Broker, BrokerKind, Proc, agent_config, fixture, free_port, start_agent, wait_status,
};
use kestrel_tests::{
    Scratch, fetched, lfw, python, read_json, read_jsonl, run, run_ok, s, stderr, stdout,
};
use serde_json::Value;

/// An `mlflow server` on a free port, its state under `dir` (kept across restarts).
struct Mlflow {
    dir: PathBuf,
    port: u16,
    proc: Option<Proc>,
    /// The admin password of MLflow's basic-auth app (`--app-name basic-auth`), when it runs.
    admin_password: Option<&'static str>,
}

impl Mlflow {
    fn start(dir: &Path) -> Mlflow {
        Mlflow::start_with(dir, None)
    }

    fn start_with(dir: &Path, admin_password: Option<&'static str>) -> Mlflow {
        std::fs::create_dir_all(dir).unwrap();
        let mut m = Mlflow {
            dir: dir.to_path_buf(),
            port: free_port(),
            proc: None,
            admin_password,
        };
        m.restart();
        m
    }

    fn restart(&mut self) {
        let log = self.dir.join(format!(
            "server-{}.log",
            Instant::now().elapsed().as_nanos()
        ));
        let mut cmd = Command::new(fetched("venv/bin/mlflow"));
        // Its own process group: the server runs uvicorn as a child, and stopping it must stop
        // both. No background job runner (six more processes, unused here).
        cmd.process_group(0)
            .env("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
            .args([
                "server",
                "--host",
                "127.0.0.1",
                "--workers",
                "1",
                "--serve-artifacts",
            ])
            .arg("--port")
            .arg(self.port.to_string())
            .arg("--backend-store-uri")
            .arg(format!("sqlite:///{}/mlflow.db", self.dir.display()))
            .arg("--artifacts-destination")
            .arg(self.dir.join("artifacts"));
        if let Some(password) = self.admin_password {
            // The auth app's own user store beside the tracking store; no one may read without
            // logging in (default_permission = NO_PERMISSIONS).
            let ini = self.dir.join("auth.ini");
            std::fs::write(
                &ini,
                format!(
                    "[mlflow]\ndefault_permission = NO_PERMISSIONS\n\
                     database_uri = sqlite:///{}/auth.db\nadmin_username = admin\n\
                     authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n",
                    self.dir.display()
                ),
            )
            .unwrap();
            cmd.args(["--app-name", "basic-auth"])
                .env("MLFLOW_AUTH_CONFIG_PATH", &ini)
                .env("MLFLOW_AUTH_ADMIN_PASSWORD", password)
                .env("MLFLOW_FLASK_SERVER_SECRET_KEY", "kestrel-test-csrf-secret");
        }
        let mut p = Proc::spawn(&mut cmd, &log);
        let addr: SocketAddr = format!("127.0.0.1:{}", self.port).parse().unwrap();
        let deadline = Instant::now() + Duration::from_secs(120);
        while !healthy(&addr) {
            assert!(p.is_running(), "mlflow server exited: {}", p.output());
            assert!(
                Instant::now() < deadline,
                "mlflow server not up: {}",
                p.output()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        self.proc = Some(p);
    }

    /// SIGKILL to the server and its workers, as a crash would look to the client.
    fn stop(&mut self) {
        if let Some(p) = self.proc.take() {
            let group = format!("-{}", p.child.id());
            Command::new("kill")
                .args(["-KILL", "--", &group])
                .status()
                .unwrap();
            p.kill();
        }
    }
}

impl Mlflow {
    fn uri(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for Mlflow {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `GET /health` answers 200 (the port opens before the app has started).
fn healthy(addr: &SocketAddr) -> bool {
    let Ok(mut c) = TcpStream::connect_timeout(addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
    let mut answer = String::new();
    c.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .is_ok()
        && c.read_to_string(&mut answer).is_ok()
        && answer.starts_with("HTTP/1.1 200")
}

/// What MLflow's own Python client says about a run: status, params, tags, every metric's
/// history as (step, value), artifact paths (recursive) and child runs.
fn mlflow_run(uri: &str, run_id: &str) -> Value {
    let o = python(
        "import sys, json\n\
         from mlflow.tracking import MlflowClient\n\
         c = MlflowClient(sys.argv[1]); rid = sys.argv[2]\n\
         r = c.get_run(rid)\n\
         def files(p=None):\n\
         \x20   out = []\n\
         \x20   for f in c.list_artifacts(rid, p):\n\
         \x20       out += files(f.path) if f.is_dir else [f.path]\n\
         \x20   return out\n\
         kids = c.search_runs([r.info.experiment_id], f\"tags.`mlflow.parentRunId` = '{rid}'\")\n\
         print(json.dumps({\n\
         \x20   'experiment': c.get_experiment(r.info.experiment_id).name,\n\
         \x20   'status': r.info.status, 'params': r.data.params, 'tags': r.data.tags,\n\
         \x20   'metrics': {k: [[m.step, m.value] for m in c.get_metric_history(rid, k)] for k in r.data.metrics},\n\
         \x20   'artifacts': files(),\n\
         \x20   'children': [{'params': k.data.params, 'status': k.info.status, 'metrics': k.data.metrics, 'ms': k.info.end_time - k.info.start_time} for k in kids],\n\
         }))\n",
        &[uri, run_id],
    );
    serde_json::from_str(stdout(&o).trim()).unwrap()
}

/// `metrics.jsonl`'s `key` per epoch, as MLflow's (step, value) history.
fn history(run_dir: &Path, key: &str) -> Vec<(i64, f64)> {
    read_jsonl(&run_dir.join("metrics.jsonl"))
        .iter()
        .map(|m| (m["epoch"].as_i64().unwrap(), m[key].as_f64().unwrap()))
        .collect()
}

fn mlflow_history(v: &Value, key: &str) -> Vec<(i64, f64)> {
    let mut h: Vec<(i64, f64)> = v["metrics"][key]
        .as_array()
        .unwrap_or_else(|| panic!("no metric {key}: {v}"))
        .iter()
        .map(|p| (p[0].as_i64().unwrap(), p[1].as_f64().unwrap()))
        .collect();
    h.sort_by_key(|p| p.0);
    h
}

fn run_id(dir: &Path) -> String {
    read_json(&dir.join("mlflow.json"))["run_id"]
        .as_str()
        .unwrap()
        .to_string()
}

/// fit, tune (8 trials, 2 at a time) and export --register --alias, read back with MLflow's
/// Python client; then `publish --model models:/lfw@staging` delivers that version to an agent,
/// whose status names it.
#[test]
fn fit_tune_export_are_tracked_and_the_registry_deploys() {
    let w = Scratch::new();
    let ml = Mlflow::start(&w.join("mlflow"));
    let uri = ml.uri();
    // The LFW images as a Delta table (what a Databricks user trains on): the run's dataset
    // input names its version.
    let data = w.join("lfw");
    python(
        "import sys, pyarrow.parquet as pq\n\
         from deltalake import write_deltalake\n\
         write_deltalake(sys.argv[2], pq.read_table(sys.argv[1]))\n",
        &[
            s(&kestrel_tests::fetched("datasets/lfw/lfw.parquet")),
            s(&data),
        ],
    );
    let (data, cache) = (s(&data), w.cache_arg());
    let common = ["--data", &data, "--engine", "ort", "--cache", &cache];
    let track = ["--mlflow", &uri, "--experiment", "kestrel-lfw"];
    let (run_dir, fit_id) = tracked_fit(&w, &uri, &[&common[..], &track[..]].concat());
    tracked_tune(&w, &uri, &[&common[..], &track[..]].concat());
    registered_export(&w, &uri, &run_dir, &fit_id, &cache);
    loaded_as_mlflow_model(&w, &uri);
    fit_into_an_existing_run(&w, &uri, &common);
    published_from_registry(&w, &uri);
}

/// The registered version as MLflow's own loaders take it: `mlflow.pyfunc.load_model` and
/// `mlflow.onnx.load_model` on `models:/lfw@staging`, run on the golden images preprocessed
/// by `trainer preprocess` with the manifest's spec, give the manifest's golden logits.
fn loaded_as_mlflow_model(w: &Scratch, uri: &str) {
    let art = w.join("art");
    let m = read_json(&art.join("manifest.json"));
    let spec = w.join("preprocess.json");
    std::fs::write(&spec, m["preprocess"].to_string()).unwrap();
    let tensors = w.join("tensors");
    let golden = m["golden"].as_array().unwrap();
    assert!(golden.len() >= 2, "{m}");
    let mut args = vec!["preprocess".to_string(), "--spec".into(), s(&spec)];
    args.extend(["--out".into(), s(&tensors)]);
    args.extend(
        golden
            .iter()
            .map(|g| s(&art.join(g["file"].as_str().unwrap()))),
    );
    run_ok("trainer", &args);
    let o = python(
        "import sys, json, os, numpy as np, mlflow, mlflow.onnx, mlflow.pyfunc, onnxruntime as ort\n\
         uri, tensors, manifest = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])\n\
         mlflow.set_tracking_uri(uri)\n\
         h, w = manifest['preprocess']['input_size']\n\
         x = np.stack([np.fromfile(os.path.join(tensors, os.path.basename(g['file']) + '.f32'), '<f4').reshape(3, h, w)\n\
         \x20             for g in manifest['golden']])\n\
         want = np.array([g.get('runtime_logits', {}).get('ort', g['logits']) for g in manifest['golden']])\n\
         py = mlflow.pyfunc.load_model('models:/lfw@staging')\n\
         out = py.predict({manifest['input']['name']: x})[manifest['output']['name']]\n\
         proto = mlflow.onnx.load_model('models:/lfw@staging')\n\
         s = ort.InferenceSession(proto.SerializeToString(), providers=['CPUExecutionProvider'])\n\
         direct = s.run(None, {manifest['input']['name']: x})[0]\n\
         meta = py.metadata\n\
         print(json.dumps({'pyfunc': float(np.abs(out - want).max()), 'onnx': float(np.abs(direct - want).max()),\n\
         \x20   'argmax': [int(i) for i in out.argmax(1)], 'expected': [g['expected_top1'] for g in manifest['golden']],\n\
         \x20   'inputs': meta.get_input_schema().to_dict(), 'kestrel': meta.flavors['kestrel']['labels']}))\n",
        &[uri, &s(&tensors), &m.to_string()],
    );
    let v: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    for k in ["pyfunc", "onnx"] {
        assert!(v[k].as_f64().unwrap() < 1e-3, "{k}: {v}");
    }
    assert_eq!(v["argmax"], v["expected"], "{v}");
    assert_eq!(v["kestrel"], m["labels"]);
    assert_eq!(v["inputs"][0]["name"], m["input"]["name"], "{v}");
}

/// `MLFLOW_RUN_ID`: a fit logs into a run a notebook already started, not a new one.
fn fit_into_an_existing_run(w: &Scratch, uri: &str, common: &[&str]) {
    let o = python(
        "import sys\nfrom mlflow.tracking import MlflowClient\n\
         c = MlflowClient(sys.argv[1])\n\
         print(c.create_run(c.get_experiment_by_name('kestrel-lfw').experiment_id).info.run_id)\n",
        &[uri],
    );
    let id = stdout(&o).trim().to_string();
    let dir = w.join("run-in-notebook");
    let mut fit = Command::new(kestrel_tests::bin("trainer"));
    fit.args(["fit", "--out", &s(&dir)])
        .args(common)
        .env("MLFLOW_TRACKING_URI", uri)
        .env("MLFLOW_RUN_ID", &id);
    let o = fit.output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(run_id(&dir), id);
    let v = mlflow_run(uri, &id);
    assert_eq!(v["status"], "FINISHED");
    assert!(v["metrics"]["best_val_accuracy"].is_array(), "{v}");
}

/// `fit`: the run's params, every epoch's metrics, tags and artifacts.
fn tracked_fit(w: &Scratch, uri: &str, flags: &[&str]) -> (PathBuf, String) {
    let run_dir = w.join("run");
    let mut args = vec![
        "fit",
        "--optimizer",
        "sgd",
        "--epochs",
        "6",
        "--out",
        run_dir.to_str().unwrap(),
    ];
    args.extend(flags);
    run_ok("trainer", &args);
    let fit_id = run_id(&run_dir);
    let v = mlflow_run(uri, &fit_id);
    assert_eq!(v["experiment"], "kestrel-lfw");
    assert_eq!(v["status"], "FINISHED");
    let params: Value = read_json(&run_dir.join("params.json"));
    assert_eq!(v["params"]["epochs"], "6");
    assert_eq!(v["params"]["lr"], params["lr"].to_string());
    assert_eq!(v["params"]["source.label_column"], "label");
    assert_eq!(v["params"]["optimizer"], params["optimizer"]);
    for key in ["train_loss", "val_loss", "val_accuracy"] {
        assert_eq!(mlflow_history(&v, key), history(&run_dir, key), "{key}");
    }
    let summary = read_json(&run_dir.join("summary.json"));
    assert_eq!(
        v["metrics"]["best_val_accuracy"][0][1],
        summary["val_accuracy"]
    );
    assert!(
        v["tags"]["kestrel.data.source"]
            .as_str()
            .unwrap()
            .contains("lfw"),
        "{}",
        v["tags"]
    );
    assert_eq!(v["tags"]["kestrel.data.samples"], "200");
    // The table as the run's dataset input: named, digested by the sample cache, versioned.
    let o = python(
        "import sys, json\nfrom mlflow.tracking import MlflowClient\n\
         r = MlflowClient(sys.argv[1]).get_run(sys.argv[2])\n\
         print(json.dumps([{'name': d.dataset.name, 'digest': d.dataset.digest, 'type': d.dataset.source_type,\n\
         \x20   'source': json.loads(d.dataset.source), 'context': {t.key: t.value for t in d.tags}}\n\
         \x20   for d in r.inputs.dataset_inputs]))\n",
        &[uri, &fit_id],
    );
    let inputs: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    let key = v["tags"]["kestrel.cache.samples"].as_str().unwrap();
    assert_eq!(inputs.as_array().map(Vec::len), Some(1), "{inputs}");
    let d = &inputs[0];
    assert_eq!(d["name"], "lfw", "{d}");
    assert_eq!(d["type"], "delta_table", "{d}");
    assert_eq!(d["source"]["delta_table_version"], 0, "{d}");
    assert!(key.starts_with(d["digest"].as_str().unwrap()), "{d} {key}");
    assert_eq!(d["context"]["mlflow.data.context"], "training");
    assert_eq!(v["tags"]["mlflow.source.name"], "trainer fit");
    for f in [
        "summary.json",
        "metrics.jsonl",
        "confusion_matrix.json",
        "loss.png",
        "best.safetensors",
    ] {
        assert!(
            v["artifacts"].as_array().unwrap().iter().any(|a| a == f),
            "{f}: {}",
            v["artifacts"]
        );
    }

    (run_dir, fit_id)
}

/// `tune`: a parent run with one child run per trial, the best trial's params on the parent.
fn tracked_tune(w: &Scratch, uri: &str, flags: &[&str]) {
    let tune_dir = w.join("tune");
    let mut args = vec![
        "tune",
        "--trials",
        "8",
        "--parallel",
        "2",
        "--seed",
        "5",
        "--out",
        tune_dir.to_str().unwrap(),
    ];
    args.extend(flags);
    run_ok("trainer", &args);
    let t = mlflow_run(uri, &run_id(&tune_dir));
    let kids = t["children"].as_array().unwrap();
    assert_eq!(kids.len(), 8, "{t}");
    let trials = read_jsonl(&tune_dir.join("trials.jsonl"));
    for tr in &trials {
        let lr = tr["params"]["lr"].to_string();
        let kid = kids
            .iter()
            .find(|k| k["params"]["lr"] == lr.as_str() && k["status"] == "FINISHED")
            .unwrap_or_else(|| panic!("trial {} (lr {lr}) has no child run", tr["trial"]));
        // The child run lasts as long as the trial did (it was once logged with zero duration).
        let ms = kid["ms"].as_f64().unwrap();
        let want = tr["seconds"].as_f64().unwrap() * 1000.0;
        assert!(
            want > 0.0 && (ms - want).abs() <= 1.0,
            "trial {}: {ms} ms in MLflow, {want} ms",
            tr["trial"]
        );
    }
    let best = read_json(&tune_dir.join("best.json"));
    assert_eq!(t["params"]["best.lr"], best["params"]["lr"].to_string());
    assert_eq!(t["params"]["best.trial"], best["trial"].to_string());
}

/// `export --register --alias`: the model version points at the fit's run and its files.
fn registered_export(w: &Scratch, uri: &str, run_dir: &Path, fit_id: &str, cache: &str) {
    let art = w.join("art");
    let o = run_ok(
        "trainer",
        &[
            "export",
            "--run",
            run_dir.to_str().unwrap(),
            "--out",
            art.to_str().unwrap(),
            "--quantize",
            "int8-weights",
            "--model-name",
            "lfw",
            "--cache",
            cache,
            "--mlflow",
            uri,
            "--register",
            "lfw",
            "--alias",
            "staging",
        ],
    );
    assert!(
        stdout(&o).contains("registered models:/lfw/1 (alias staging)"),
        "{}",
        stdout(&o)
    );
    let m = read_json(&art.join("manifest.json"));
    assert_eq!(m["registry"], "models:/lfw/1");
    assert_eq!(m["version"], 1);
    // MLflow 3: the version is registered from a LoggedModel of the fit's run, ready, holding
    // the artifact and its MLmodel, and listed as the run's output.
    let o = python(
        "import sys, json, mlflow\n\
         from mlflow.tracking import MlflowClient\n\
         c = MlflowClient(sys.argv[1])\n\
         v = c.get_model_version_by_alias('lfw', 'staging')\n\
         lm = c.get_logged_model(v.source.removeprefix('models:/'))\n\
         files = sorted(f.path.rsplit('/', 1)[-1] for f in mlflow.artifacts.list_artifacts(artifact_uri=lm.artifact_location, tracking_uri=sys.argv[1]))\n\
         outs = [o.model_id for o in c.get_run(v.run_id).outputs.model_outputs]\n\
         print(json.dumps({'version': v.version, 'run_id': v.run_id, 'source': v.source, 'model_id': lm.model_id,\n\
         \x20   'lm_run': lm.source_run_id, 'lm_status': str(lm.status), 'lm_uri': lm.artifact_location,\n\
         \x20   'files': files, 'outputs': outs}))\n",
        &[uri],
    );
    let reg: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(reg["version"], "1");
    assert_eq!(reg["run_id"], fit_id);
    assert_eq!(reg["lm_run"], fit_id, "{reg}");
    assert!(
        reg["lm_status"].as_str().unwrap().contains("READY"),
        "{reg}"
    );
    assert_eq!(
        reg["source"],
        format!("models:/{}", reg["model_id"].as_str().unwrap())
    );
    assert_eq!(
        reg["outputs"],
        serde_json::json!([reg["model_id"]]),
        "{reg}"
    );
    for f in ["MLmodel", "manifest.json", "model.onnx"] {
        let files = reg["files"].as_array().unwrap();
        assert!(files.iter().any(|a| a == f), "{f}: {reg}");
    }
    let v = mlflow_run(uri, &fit_id);
    for f in ["model/manifest.json", "model/model.onnx", "model/MLmodel"] {
        assert!(
            v["artifacts"].as_array().unwrap().iter().any(|a| a == f),
            "{f}: {}",
            v["artifacts"]
        );
    }
}

/// `publish --model models:/lfw@staging`: fetched, verified, delivered; the device reports it.
fn published_from_registry(w: &Scratch, uri: &str) {
    let broker = Broker::start(BrokerKind::Rumqttd, &w.join("broker"));
    let cfg = agent_config(&w.join("pi"), "pi-ml", &broker.url(), &fixture().keys, "");
    let _agent = start_agent(&cfg, &[("KESTREL_HOME", w.join("home").to_str().unwrap())]);
    let key = s(&fixture().key());
    let o = run_ok(
        "trainer",
        &[
            "publish",
            "--broker",
            &broker.url(),
            "--model",
            "models:/lfw@staging",
            "--mlflow",
            uri,
            "--key",
            &key,
            "--target",
            "device/pi-ml",
            "--json",
        ],
    );
    let p: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(
        (p["name"].as_str(), p["version"].as_u64()),
        (Some("lfw"), Some(1))
    );
    let st = wait_status(
        &broker.config(),
        "pi-ml",
        60,
        "registry version active",
        |s| s.active == Some(1) && s.state == DeviceState::Idle,
    );
    assert_eq!(st.source.as_deref(), Some("models:/lfw/1"));
    let table = kestrel_tests::trainer_ok(&["status", "--broker", &broker.url()]);
    let row = table
        .lines()
        .find(|l| l.starts_with("pi-ml"))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(row.contains("models:/lfw/1"), "{table}");

    // A name the registry does not know: a clear error naming it.
    let o = run(
        "trainer",
        &[
            "publish",
            "--broker",
            &broker.url(),
            "--model",
            "models:/nope@staging",
            "--mlflow",
            uri,
            "--key",
            &key,
            "--target",
            "device/pi-ml",
        ],
    );
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("models:/nope@staging"),
        "{}",
        stderr(&o)
    );
}

/// A server that is down at start stops the fit before any work; one that dies mid-fit leaves a
/// complete run directory and a pending file, which `trainer mlflow sync` replays once it is back:
/// MLflow then holds every epoch of metrics.jsonl.
#[test]
fn a_server_outage_buffers_and_sync_replays() {
    let w = Scratch::new();
    let (data, cache) = (lfw(), w.cache_arg());
    let down = format!("http://127.0.0.1:{}", free_port());
    let early = w.join("early");
    let o = run(
        "trainer",
        &[
            "fit",
            "--data",
            &data,
            "--cache",
            &cache,
            "--out",
            early.to_str().unwrap(),
            "--mlflow",
            &down,
        ],
    );
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("unreachable") && stderr(&o).contains(&down),
        "{}",
        stderr(&o)
    );
    assert!(
        !early.join("metrics.jsonl").exists(),
        "work began although tracking was down"
    );

    let mut ml = Mlflow::start(&w.join("mlflow"));
    let uri = ml.uri();
    let run_dir = w.join("run");
    // Fine-tuning the last block: epochs of seconds, so the server can die between them.
    let mut fit = Command::new(kestrel_tests::bin("trainer"));
    fit.args(["fit", "--data", &data, "--cache", &cache, "--engine", "ort"])
        .args(["--unfreeze-last", "1", "--epochs", "5", "--mlflow", &uri])
        .arg("--out")
        .arg(&run_dir);
    let log = w.join("fit.log");
    let mut child = Proc::spawn(&mut fit, &log);
    let deadline = Instant::now() + Duration::from_secs(600);
    while !run_dir.join("metrics.jsonl").exists() {
        assert!(child.is_running(), "fit ended early: {}", child.output());
        assert!(Instant::now() < deadline, "no epoch after 600 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    ml.stop();
    let status = child.child.wait().unwrap();
    let out = std::fs::read_to_string(&log).unwrap();
    assert!(status.success(), "fit failed with the server down: {out}");
    assert!(out.contains("trainer mlflow sync"), "{out}");
    let epochs = read_jsonl(&run_dir.join("metrics.jsonl")).len();
    assert_eq!(epochs, 5);
    assert!(run_dir.join("summary.json").is_file());
    let pending = run_dir.join("mlflow-pending.jsonl");
    assert!(std::fs::read_to_string(&pending).unwrap().lines().count() >= 3);

    // Still down: sync fails and keeps every line.
    let o = run("trainer", &["mlflow", "sync", run_dir.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(pending.is_file());

    ml.restart();
    let o = run_ok("trainer", &["mlflow", "sync", run_dir.to_str().unwrap()]);
    assert!(stdout(&o).contains("replayed"), "{}", stdout(&o));
    assert!(!pending.exists());
    let v = mlflow_run(&uri, &run_id(&run_dir));
    assert_eq!(v["status"], "FINISHED");
    for key in ["train_loss", "val_loss", "val_accuracy"] {
        assert_eq!(mlflow_history(&v, key), history(&run_dir, key), "{key}");
    }
    assert!(
        v["artifacts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a == "summary.json"),
        "{v}"
    );
    // Nothing left: a second sync sends nothing.
    let o = run_ok("trainer", &["mlflow", "sync", run_dir.to_str().unwrap()]);
    assert!(stdout(&o).contains("nothing to replay"), "{}", stdout(&o));
}

/// A server behind MLflow's basic-auth app: without credentials `fit` stops before any work with
/// an error naming MLflow's credential variables, a wrong password is refused the same way, and
/// with `MLFLOW_TRACKING_USERNAME` / `MLFLOW_TRACKING_PASSWORD` the run is tracked (read back with
/// MLflow's Python client logged in the same way).
#[test]
fn credentials_from_mlflow_variables_reach_an_authenticated_server() {
    const PASSWORD: &str = "Kestrel-admin-2026";
    let w = Scratch::new();
    let ml = Mlflow::start_with(&w.join("mlflow"), Some(PASSWORD));
    let uri = ml.uri();
    let (data, cache) = (lfw(), w.cache_arg());
    let fit = |out: &Path, user: Option<(&str, &str)>| {
        let mut c = Command::new(kestrel_tests::bin("trainer"));
        c.args(["fit", "--data", &data, "--cache", &cache, "--engine", "ort"])
            .args(["--mlflow", &uri, "--experiment", "kestrel-auth", "--out"])
            .arg(out)
            .env_remove("MLFLOW_TRACKING_TOKEN")
            .env_remove("MLFLOW_TRACKING_USERNAME")
            .env_remove("MLFLOW_TRACKING_PASSWORD");
        if let Some((u, p)) = user {
            c.env("MLFLOW_TRACKING_USERNAME", u)
                .env("MLFLOW_TRACKING_PASSWORD", p);
        }
        c.output().unwrap()
    };
    for (name, user) in [("anonymous", None), ("wrong", Some(("admin", "not-it")))] {
        let out = w.join(name);
        let o = fit(&out, user);
        assert!(!o.status.success(), "{name}: {}", stdout(&o));
        let err = stderr(&o);
        assert!(
            err.contains("HTTP 401") && err.contains("MLFLOW_TRACKING_USERNAME"),
            "{name}: {err}"
        );
        assert!(
            !out.join("metrics.jsonl").exists(),
            "{name}: work began although the server refused the credentials"
        );
    }
    let run_dir = w.join("run");
    let o = fit(&run_dir, Some(("admin", PASSWORD)));
    assert!(o.status.success(), "{}", stderr(&o));
    let code = "import sys, json\n\
                from mlflow.tracking import MlflowClient\n\
                r = MlflowClient(sys.argv[1]).get_run(sys.argv[2])\n\
                print(json.dumps({'status': r.info.status, 'metrics': r.data.metrics}))\n";
    let o = Command::new(fetched("venv/bin/python"))
        .args(["-c", code, &uri, &run_id(&run_dir)])
        .env("MLFLOW_TRACKING_USERNAME", "admin")
        .env("MLFLOW_TRACKING_PASSWORD", PASSWORD)
        .output()
        .unwrap();
    assert!(o.status.success(), "python: {}", stderr(&o));
    let v: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(v["status"], "FINISHED", "{v}");
    let summary = read_json(&run_dir.join("summary.json"));
    assert_eq!(v["metrics"]["best_val_accuracy"], summary["val_accuracy"]);
}
