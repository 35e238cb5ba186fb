#!/usr/bin/env python3
"""Bench (issue 57): a new head on the same backbone to 1, 100 and 1,000 simulated devices, in
parts (what `trainer publish` offers) and as the whole artifact (`publish --whole`, what every
device fetched before parts), on Mosquitto and on the embedded broker, side by side.

Per row: the bytes each device fetched (its own `bytes_fetched` counter), their total, and the
seconds from publish until every device reports the version active. The devices run in one
`edge-agent run --simulate N` process with a connection each, holding v1 of the same backbone.

Env: KESTREL_BIN, KESTREL_HOME (scripts/env.sh); BENCH_PARTS_DEVICES (default 1,100,1000);
BENCH_PARTS_TIMEOUT (seconds one update may take, default 600)."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

BIN = os.environ["KESTREL_BIN"]
TRAINER = f"{BIN}/trainer"
HOME = os.environ["KESTREL_HOME"]
SIZES = [int(n) for n in os.environ.get("BENCH_PARTS_DEVICES", "1,100,1000").split(",")]
TIMEOUT = float(os.environ.get("BENCH_PARTS_TIMEOUT", "600"))


def run(*args):
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port):
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"nothing listens on {port}")


def artifacts(work):
    """v1 (run seed 1), v2 and v3 (run seed 2): int8 weights on the shared backbone."""
    lfw = f"{HOME}/datasets/lfw/imagefolder"
    for seed in (1, 2):
        run(TRAINER, "fit", "--data", lfw, "--engine", "tract", "--no-mlflow", "--seed", str(seed),
            "--cache", f"{work}/cache", "--out", f"{work}/run{seed}")
    for version, seed in ((1, 1), (2, 2), (3, 2)):
        run(TRAINER, "export", "--run", f"{work}/run{seed}", "--out", f"{work}/v{version}",
            "--model-version", str(version), "--model-name", "lfw", "--quantize", "int8-weights",
            "--shared-backbone", "--no-mlflow")
    run(TRAINER, "keygen", "--out", f"{work}/keys")


def start_broker(kind, work):
    port = free_port()
    if kind == "mosquitto":
        conf = f"{work}/mosquitto.conf"
        with open(conf, "w") as f:
            f.write(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
                    "user root\nmax_queued_messages 100000\n")
        exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        p = subprocess.Popen([exe, "-c", conf], stderr=subprocess.DEVNULL)
    else:
        p = subprocess.Popen([TRAINER, "broker", "--listen", f"127.0.0.1:{port}", "--no-persist"],
                             stderr=subprocess.DEVNULL)
    wait_port(port)
    return p, f"mqtt://127.0.0.1:{port}"


def statuses(broker):
    out = run(TRAINER, "status", "--broker", broker, "--json")
    return {s["device"]: s for s in map(json.loads, out.splitlines())}


def wait_active(broker, n, version):
    deadline = time.time() + TIMEOUT
    while time.time() < deadline:
        s = statuses(broker)
        if len(s) >= n and all(d["active"] == version and d["state"] == "idle" for d in s.values()):
            return s
        time.sleep(0.5)
    return None


def publish(work, broker, version, whole):
    args = [TRAINER, "publish", "--broker", broker, "--artifact", f"{work}/v{version}",
            "--key", f"{work}/keys/kestrel.key", "--target", "group/all", "--json"]
    return json.loads(run(*args, *(["--whole"] if whole else [])))


def update(work, broker, n, version, whole):
    """Publishes `version`; (seconds until all active, bytes fetched per device) or None."""
    before = {d: s["counters"]["bytes_fetched"] for d, s in statuses(broker).items()}
    start = time.time()
    publish(work, broker, version, whole)
    after = wait_active(broker, n, version)
    if after is None:
        return None
    seconds = time.time() - start
    fetched = [s["counters"]["bytes_fetched"] - before.get(d, 0) for d, s in after.items()]
    return seconds, fetched


def fleet(work, kind, n):
    """One broker and N devices holding v1: the parts update (v2), then the whole one (v3)."""
    d = tempfile.mkdtemp(dir=work)
    broker_proc, broker = start_broker(kind, d)
    with open(f"{d}/agent.toml", "w") as f:
        f.write(f'device_id = "b"\ngroups = ["all"]\nstore = "store"\n'
                f'trusted_keys = ["{work}/keys/kestrel.pub"]\n[broker]\nurl = "{broker}"\n')
    agent = subprocess.Popen([f"{BIN}/edge-agent", "run", "--config", f"{d}/agent.toml",
                              "--simulate", str(n)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while len(statuses(broker)) < n:
            if time.time() > deadline:
                return [None, None]
            time.sleep(0.5)
        publish(work, broker, 1, False)
        if wait_active(broker, n, 1) is None:
            return [None, None]
        return [update(work, broker, n, 2, False), update(work, broker, n, 3, True)]
    finally:
        agent.kill()
        broker_proc.kill()
        agent.wait()
        broker_proc.wait()
        shutil.rmtree(d, ignore_errors=True)


def human(n):
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def main():
    work = tempfile.mkdtemp()
    try:
        artifacts(work)
        print(f"{'broker':<11}{'devices':>8}  {'form':<7}{'per device':>12}{'in all':>11}"
              f"{'seconds':>9}{'bytes':>9}{'time':>8}")
        for kind in ("mosquitto", "rumqttd"):
            for n in SIZES:
                parts, whole = fleet(work, kind, n)
                rows = [("parts", parts), ("whole", whole)]
                for form, r in rows:
                    if r is None:
                        print(f"{kind:<11}{n:>8}  {form:<7}{'not done in ' + str(TIMEOUT) + ' s':>41}")
                        continue
                    secs, fetched = r
                    ratio = ("", "")
                    if form == "whole" and parts is not None:
                        ratio = (f"{sum(fetched) / max(1, sum(parts[1])):>8.0f}x",
                                 f"{secs / parts[0]:>7.1f}x")
                    print(f"{kind:<11}{n:>8}  {form:<7}{human(max(fetched)):>12}"
                          f"{human(sum(fetched)):>11}{secs:>9.1f}{ratio[0]:>9}{ratio[1]:>8}",
                          flush=True)
        print("(whole/parts ratios on the whole rows; goal: a head-only update <= 50 KB per device, "
              "1,000 devices in <= 60 s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
