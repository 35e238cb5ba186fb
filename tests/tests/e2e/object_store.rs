//! Tables on object storage, read from real servers the test starts: `moto` in server mode for
//! S3 (`s3://`) and Azurite for Azure blobs (`az://`). The same tables as local copies (a Delta
//! table with history, Hive-partitioned Parquet, one Parquet file, CSV manifests with relative
//! paths and with object URLs) load to the same samples, and a fit trains to the same accuracy;
//! `predict --out` writes its Parquet file to the store, and `trainer label` rewrites a capture
//! table there through the Delta kernel.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use kestrel_tests::fleet::Proc;
use kestrel_tests::once::free_port;
use kestrel_tests::{fetched, json, python, read_json, s, stderr};
use serde_json::Value;

/// Azurite's well-known development account (the object_store emulator default, too).
const AZURITE_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// An object-store server on loopback and the environment a client needs to reach it.
struct Server {
    _proc: Proc,
    /// `s3` or `az`: the URL scheme of its tables.
    scheme: &'static str,
    endpoint: String,
    env: Vec<(&'static str, String)>,
}

fn wait_listening(port: u16, p: &mut Proc, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
        assert!(p.is_running(), "{what} exited: {}", p.output());
        assert!(Instant::now() < deadline, "{what} not up: {}", p.output());
        std::thread::sleep(Duration::from_millis(100));
    }
}

impl Server {
    fn moto(dir: &Path) -> Server {
        let port = free_port();
        let mut cmd = Command::new(fetched("venv/bin/moto_server"));
        cmd.args(["-H", "127.0.0.1", "-p", &port.to_string()]);
        let mut p = Proc::spawn(&mut cmd, &dir.join("moto.log"));
        wait_listening(port, &mut p, "moto_server");
        let endpoint = format!("http://127.0.0.1:{port}");
        Server {
            _proc: p,
            scheme: "s3",
            env: vec![
                ("AWS_ENDPOINT_URL", endpoint.clone()),
                ("AWS_ACCESS_KEY_ID", "kestrel".into()),
                ("AWS_SECRET_ACCESS_KEY", "kestrel".into()),
                ("AWS_REGION", "us-east-1".into()),
            ],
            endpoint,
        }
    }

    fn azurite(dir: &Path) -> Server {
        let port = free_port();
        let mut cmd = Command::new(fetched("node/node_modules/.bin/azurite-blob"));
        cmd.args(["--blobHost", "127.0.0.1", "--blobPort", &port.to_string()])
            .arg("--location")
            .arg(dir.join("azurite"))
            .args(["--silent", "--skipApiVersionCheck"]);
        let mut p = Proc::spawn(&mut cmd, &dir.join("azurite.log"));
        wait_listening(port, &mut p, "azurite-blob");
        let endpoint = format!("http://127.0.0.1:{port}");
        Server {
            _proc: p,
            scheme: "az",
            env: vec![
                ("AZURE_STORAGE_USE_EMULATOR", "true".into()),
                ("AZURITE_BLOB_STORAGE_URL", endpoint.clone()),
            ],
            endpoint,
        }
    }

    /// Creates bucket (container) `bucket` and uploads every file under `root` to it, keyed by
    /// its relative path, with the clouds' own Python clients (boto3, azure-storage-blob).
    fn upload(&self, bucket: &str, root: &Path) {
        python(
            "import os, sys\n\
             kind, endpoint, bucket, root, key = sys.argv[1:6]\n\
             files = [(os.path.join(d, f), os.path.relpath(os.path.join(d, f), root))\n\
             \x20        for d, _, fs in os.walk(root) for f in fs]\n\
             if kind == 's3':\n\
             \x20   import boto3\n\
             \x20   c = boto3.client('s3', endpoint_url=endpoint, aws_access_key_id='kestrel',\n\
             \x20                    aws_secret_access_key='kestrel', region_name='us-east-1')\n\
             \x20   c.create_bucket(Bucket=bucket)\n\
             \x20   for p, k in files: c.upload_file(p, bucket, k)\n\
             else:\n\
             \x20   from azure.storage.blob import BlobServiceClient\n\
             \x20   conn = ('DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;'\n\
             \x20           f'AccountKey={key};BlobEndpoint={endpoint}/devstoreaccount1;')\n\
             \x20   c = BlobServiceClient.from_connection_string(conn).create_container(bucket)\n\
             \x20   for p, k in files:\n\
             \x20       with open(p, 'rb') as f: c.upload_blob(k, f)\n",
            &[self.scheme, &self.endpoint, bucket, &s(root), AZURITE_KEY],
        );
    }

    /// Downloads object `key` of `bucket` to `to` with the cloud's own Python client.
    fn download(&self, bucket: &str, key: &str, to: &Path) {
        python(
            "import sys\n\
             kind, endpoint, bucket, key, to, account = sys.argv[1:7]\n\
             if kind == 's3':\n\
             \x20   import boto3\n\
             \x20   c = boto3.client('s3', endpoint_url=endpoint, aws_access_key_id='kestrel',\n\
             \x20                    aws_secret_access_key='kestrel', region_name='us-east-1')\n\
             \x20   c.download_file(bucket, key, to)\n\
             else:\n\
             \x20   from azure.storage.blob import BlobServiceClient\n\
             \x20   conn = ('DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;'\n\
             \x20           f'AccountKey={account};BlobEndpoint={endpoint}/devstoreaccount1;')\n\
             \x20   blob = BlobServiceClient.from_connection_string(conn).get_blob_client(bucket, key)\n\
             \x20   open(to, 'wb').write(blob.download_blob().readall())\n",
            &[
                self.scheme,
                &self.endpoint,
                bucket,
                key,
                &s(to),
                AZURITE_KEY,
            ],
        );
    }

    /// `trainer ARGS` with this server's environment.
    fn trainer(&self, args: &[&str]) -> Output {
        Command::new(kestrel_tests::bin("trainer"))
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .output()
            .unwrap()
    }

    fn url(&self, rel: &str) -> String {
        format!("{}://kestrel/{rel}", self.scheme)
    }
}

/// The local tables: a Delta table with history (written, overwritten with 150 rows, 12 of them
/// deleted), a `label`-partitioned Parquet directory, the LFW Parquet file, its images with a
/// manifest of relative paths, and one manifest per store naming the images by object URL.
fn tables(dir: &Path) -> PathBuf {
    let root = dir.join("tables");
    std::fs::create_dir_all(&root).unwrap();
    python(
        "import sys, os, shutil, pyarrow.parquet as pq\n\
         from deltalake import DeltaTable, write_deltalake\n\
         src, images, out = sys.argv[1], sys.argv[2], sys.argv[3]\n\
         t = pq.read_table(src)\n\
         write_deltalake(f'{out}/delta', t)\n\
         write_deltalake(f'{out}/delta', t.slice(0, 150), mode='overwrite')\n\
         gone = sorted(t.slice(0, 150).column('path').to_pylist())[:12]\n\
         DeltaTable(f'{out}/delta').delete('path IN (' + ','.join(repr(p) for p in gone) + ')')\n\
         pq.write_to_dataset(t, f'{out}/hive', partition_cols=['label'])\n\
         shutil.copy(src, f'{out}/lfw.parquet')\n\
         shutil.copytree(images, f'{out}/images')\n\
         rows = [(f'{c}/{f}', c) for c in sorted(os.listdir(images)) for f in sorted(os.listdir(f'{images}/{c}'))]\n\
         with open(f'{out}/manifest.csv', 'w') as m:\n\
         \x20   m.write('path,label\\n' + ''.join(f'images/{p},{c}\\n' for p, c in rows))\n\
         for scheme in ['s3', 'az']:\n\
         \x20   with open(f'{out}/urls-{scheme}.csv', 'w') as m:\n\
         \x20       m.write('path,label\\n' + ''.join(f'{scheme}://kestrel/images/{p},{c}\\n' for p, c in rows))\n",
        &[
            s(&fetched("datasets/lfw/lfw.parquet")),
            kestrel_tests::lfw(),
            s(&root),
        ],
    );
    root
}

fn ok(o: Output, what: &str) -> Output {
    assert!(o.status.success(), "{what}: {}", stderr(&o));
    o
}

/// `prepare --json` of `data` (a path or URL) through `server`'s environment.
fn prepare(server: &Server, data: &str, cache: &Path, extra: &[&str]) -> Value {
    let mut args = vec!["prepare", "--json", "--engine", "ort", "--data", data];
    let cache = s(cache);
    args.extend(["--cache", &cache]);
    args.extend(extra);
    json(&ok(server.trainer(&args), data))
}

/// `fit` of `data`; the run's validation accuracy.
fn fit(server: &Server, data: &str, cache: &Path, out: &Path) -> f64 {
    let (cache, out_s) = (s(cache), s(out));
    let args = ["fit", "--data", data, "--cache", &cache, "--out", &out_s];
    ok(server.trainer(&args), data);
    read_json(&out.join("summary.json"))["val_accuracy"]
        .as_f64()
        .unwrap()
}

fn tables_on(server: &Server, tmp: &Path, root: &Path) {
    server.upload("kestrel", root);
    let cache = tmp.join("cache");
    let local = |rel: &str| s(&root.join(rel));
    let urls_csv = format!("urls-{}.csv", server.scheme);
    let forms = [
        ("delta", 138),
        ("hive", 200),
        ("lfw.parquet", 200),
        ("manifest.csv", 200),
        (urls_csv.as_str(), 200),
    ];
    for (rel, samples) in forms {
        let here = prepare(server, &local(rel), &cache, &[]);
        let there = prepare(server, &server.url(rel), &cache, &[]);
        assert_eq!(there["samples"], samples, "{rel}: {there}");
        assert_eq!(there["samples_cache"], here["samples_cache"], "{rel}");
        assert_eq!(there["labels"], here["labels"], "{rel}");
    }
    // Time travel reads the remote log as the local one.
    let v0 = prepare(
        server,
        &server.url("delta"),
        &cache,
        &["--data-version", "0"],
    );
    let plain = prepare(server, &local("lfw.parquet"), &cache, &[]);
    assert_eq!(v0["samples_cache"], plain["samples_cache"]);

    let a = fit(server, &local("delta"), &cache, &tmp.join("run-local"));
    let b = fit(
        server,
        &server.url("delta"),
        &cache,
        &tmp.join("run-remote"),
    );
    assert_eq!(a, b, "the same rows train to the same accuracy");
    assert!(a >= 0.85, "{a}");

    // Batch inference from the remote table into the store: the object is the Parquet file the
    // same command writes locally, byte for byte, and holds a prediction for every row.
    let (run, art) = (s(&tmp.join("run-remote")), s(&tmp.join("art")));
    let cache_s = s(&cache);
    let export = ["export", "--run", &run, "--out", &art, "--cache", &cache_s];
    ok(server.trainer(&export), "export of a run on a remote table");
    let local_out = tmp.join("predictions.parquet");
    for out in [s(&local_out), server.url("out/predictions.parquet")] {
        let args = [
            "predict",
            "--model",
            &art,
            "--data",
            &server.url("delta"),
            "--out",
            &out,
        ];
        ok(server.trainer(&args), &out);
    }
    let fetched = tmp.join("fetched.parquet");
    server.download("kestrel", "out/predictions.parquet", &fetched);
    let bytes = std::fs::read(&fetched).unwrap();
    assert_eq!(bytes, std::fs::read(&local_out).unwrap());
    let rows = python(
        "import sys, pyarrow.parquet as pq\n\
         t = pq.read_table(sys.argv[1])\n\
         print(t.num_rows, sum(p is not None for p in t.column('prediction').to_pylist()))\n",
        &[s(&fetched)],
    );
    assert_eq!(String::from_utf8_lossy(&rows.stdout).trim(), "138 138");

    // A prefix holding no table, and a bucket that does not exist: refused, naming the URL.
    for (url, says) in [
        (server.url("images/face"), "no Delta table"),
        (
            format!("{}://no-such-bucket/t", server.scheme),
            "no-such-bucket",
        ),
    ] {
        let o = server.trainer(&["prepare", "--data", &url]);
        assert!(!o.status.success(), "{url}");
        let e = stderr(&o);
        assert!(e.contains(&url) || e.contains(says), "{url}: {e}");
        assert!(e.contains(says), "{url}: {e}");
    }
}

/// A capture table (written by `deltalake`, as `collect` would: 24 LFW images, no labels) on the
/// store: `trainer label` exports its unlabelled rows, writes the labels back through the
/// kernel's transaction API onto the store (a put-if-absent commit there), and the labelled
/// table reads as an image table, twice labelled by path.
fn captures_on(server: &Server, tmp: &Path) {
    let local = tmp.join("captures");
    python(
        "import os, sys, datetime, pyarrow as pa\n\
         from deltalake import write_deltalake\n\
         faces, out = sys.argv[1], sys.argv[2]\n\
         rows = [(c, f) for c in sorted(os.listdir(faces)) for f in sorted(os.listdir(os.path.join(faces, c)))[:12]]\n\
         at = datetime.datetime(2026, 12, 5, tzinfo=datetime.timezone.utc)\n\
         t = pa.table({\n\
         \x20   'content': pa.array([open(os.path.join(faces, c, f), 'rb').read() for c, f in rows], pa.binary()),\n\
         \x20   'path': [f'cam-1/{c}-{f}' for c, f in rows], 'device': ['cam-1'] * len(rows),\n\
         \x20   'model': ['lfw'] * len(rows), 'version': pa.array([1] * len(rows), pa.int64()),\n\
         \x20   'predicted': [c for c, _ in rows], 'score': [0.4] * len(rows), 'reason': ['low-confidence'] * len(rows),\n\
         \x20   'captured_at': pa.array([at] * len(rows), pa.timestamp('us', tz='UTC')),\n\
         \x20   'label': pa.array([None] * len(rows), pa.string())})\n\
         write_deltalake(out, t)\n",
        &[kestrel_tests::lfw(), s(&local)],
    );
    let up = tmp.join("upload");
    std::fs::create_dir_all(&up).unwrap();
    std::fs::rename(&local, up.join("captures")).unwrap();
    server.upload("captures", &up);
    let url = format!("{}://captures/captures", server.scheme);
    let todo = tmp.join("todo.csv");
    let export = ["label", "--table", &url, "--export", &s(&todo)];
    ok(server.trainer(&export), "label --export");
    let text = std::fs::read_to_string(&todo).unwrap();
    let labels: String = text
        .lines()
        .skip(1)
        .map(|l| {
            let path = l.split(',').next().unwrap();
            let class = path.trim_start_matches("cam-1/").split('-').next().unwrap();
            format!("{path},{class}\n")
        })
        .collect();
    assert_eq!(labels.lines().count(), 24, "{text}");
    let csv = tmp.join("labels.csv");
    std::fs::write(&csv, format!("path,label\n{labels}")).unwrap();
    let from = ["label", "--table", &url, "--from", &s(&csv), "--json"];
    let v = json(&ok(server.trainer(&from), "label --from"));
    assert_eq!(
        (v["labelled"].as_u64(), v["unlabelled"].as_u64()),
        (Some(24), Some(0))
    );
    assert_eq!(v["labels_version"], 1, "{v}");
    let cache = tmp.join("cache-captures");
    let p = prepare(server, &url, &cache, &[]);
    assert_eq!(p["samples"], 24, "{p}");
    assert_eq!(p["labels"], serde_json::json!(["face", "nonface"]), "{p}");
    // The labels went to the labels table on the store: the images were not copied (the
    // capture table is still at the version Python wrote).
    let tables = &p["tables"];
    assert_eq!(tables[0]["version"], 0, "{p}");
    assert_eq!(tables[1]["location"], format!("{url}/_labels"), "{p}");
    assert_eq!(tables[1]["version"], 1, "{p}");
}

#[test]
fn s3_tables_on_moto_train_like_their_local_copies() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tables(tmp.path());
    let server = Server::moto(tmp.path());
    tables_on(&server, tmp.path(), &root);
    captures_on(&server, tmp.path());
}

#[test]
fn azure_tables_on_azurite_train_like_their_local_copies() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tables(tmp.path());
    let server = Server::azurite(tmp.path());
    tables_on(&server, tmp.path(), &root);
    captures_on(&server, tmp.path());
}
