#!/usr/bin/env python3
"""Bench (issue 58): staged rollouts to 1,000 and 10,000 simulated devices on 2 cores.

Per fleet size and broker: one `edge-agent run --simulate N --share-part-files` process (a
connection, store and update machine per device; one copy on disk of each part), then
`trainer rollout` of v1 to devices that hold nothing (the whole int8-weights artifact) and of v2
(a new head on the same backbone: parts) with the plan below (a 1% canary, then everyone at the
defaults: at most 100 devices in progress, no rate limit). Printed per rollout: seconds from
the first publish to every device active, devices a minute, what the devices fetched (their own
counters), the controller's CPU seconds and peak RSS, the broker's CPU seconds and peak RSS
over the rollout; per fleet: seconds until every device reported, the simulator's peak RSS,
`trainer status --json` seconds at that size, the retained rollout state's size and
`trainer rollout status` seconds (what a resumed controller reads). Then v3 (the same head as v2,
another version: parts) with its controller killed (SIGKILL) once half the fleet has it active and
started again: seconds from the restart to "resuming rollout" (the signed state read and checked)
and to every device active. And the console (`trainer console`) on that fleet: seconds until its
view holds every device, then the latency and size of a page of 250 rows, of a search, and of the
live stream's first (full) event, and its peak RSS.

Env: KESTREL_BIN, KESTREL_HOME (scripts/env.sh); BENCH_FLEET_DEVICES (default 1000,10000);
BENCH_FLEET_BROKERS (default mosquitto,rumqttd; the embedded broker is tried at up to 1,000
devices: docs/fleet.md says why); BENCH_FLEET_TIMEOUT (seconds a rollout may take, 1800);
BENCH_FLEET_FORMS (default whole,parts: the first two rollouts; v3's resume runs always)."""

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_parts import TRAINER, BIN, artifacts, free_port, human, start_broker, wait_port  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
LIMITS = ("max_connections", "message_size_limit", "max_packet_size", "max_inflight_messages", "max_queued_messages",
          "max_queued_bytes")

SIZES = [int(n) for n in os.environ.get("BENCH_FLEET_DEVICES", "1000,10000").split(",")]
BROKERS = os.environ.get("BENCH_FLEET_BROKERS", "mosquitto,rumqttd").split(",")
TIMEOUT = float(os.environ.get("BENCH_FLEET_TIMEOUT", "1800"))
EMBEDDED_MAX = 1000

PLAN = """name = "{name}"
[[phases]]
name = "canary"
percent = 1
timeout_s = 600
[[phases]]
name = "everyone"
percent = 100
timeout_s = 600
"""


def proc_stat(pid):
    """(CPU seconds, peak RSS in MB) of a running process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        with open(f"/proc/{pid}/status") as f:
            hwm = next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
        return cpu, hwm / 1024
    except (OSError, StopIteration):
        return 0.0, 0.0


def statuses(broker):
    start = time.time()
    out = subprocess.run([TRAINER, "status", "--broker", broker, "--json"], capture_output=True,
                         text=True, check=True).stdout
    return {s["device"]: s for s in map(json.loads, out.splitlines())}, time.time() - start


def broker_process(kind, d):
    """(the process to stop, the broker's own pid, url): Mosquitto with the shipped limits
    (edge-agent/deploy/mosquitto.conf), or the embedded broker (its supervised child)."""
    if kind != "mosquitto":
        p, url = start_broker(kind, d)
        for _ in range(100):
            try:
                with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
                    child = f.read().split()
                if child:
                    return p, int(child[0]), url
            except OSError:
                pass
            time.sleep(0.1)
        return p, p.pid, url
    port = free_port()
    with open(f"{HERE}/../edge-agent/deploy/mosquitto.conf") as f:
        shipped = [l for l in f if l.split(" ")[0] in LIMITS]
    with open(f"{d}/mosquitto.conf", "w") as f:
        f.write(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\nuser root\n")
        f.writelines(shipped)
    exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    p = subprocess.Popen([exe, "-c", f"{d}/mosquitto.conf"], stderr=subprocess.DEVNULL)
    wait_port(port)
    return p, p.pid, f"mqtt://127.0.0.1:{port}"


def fleet(work, kind, n):
    d = tempfile.mkdtemp(dir=work)
    broker_proc, broker_pid, broker = broker_process(kind, d)
    with open(f"{d}/agent.toml", "w") as f:
        f.write(f'device_id = "b"\ngroups = ["all"]\nstore = "store"\n'
                f'trusted_keys = ["{work}/keys/kestrel.pub"]\n[broker]\nurl = "{broker}"\n')
    start = time.time()
    agent = subprocess.Popen([f"{BIN}/edge-agent", "run", "--config", f"{d}/agent.toml",
                              "--simulate", str(n), "--share-part-files"],
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 600
        while len(statuses(broker)[0]) < n:
            if time.time() > deadline or agent.poll() is not None:
                print(f"{kind:<11}{n:>8}  the fleet did not come up", flush=True)
                return
            time.sleep(1)
        up = time.time() - start
        print(f"{kind:<11}{n:>8}  fleet up in {up:.0f} s, simulator peak RSS "
              f"{proc_stat(agent.pid)[1]:.0f} MB", flush=True)
        forms = ((1, "whole"), (2, "parts"))
        if os.environ.get("BENCH_FLEET_FORMS"):
            forms = [f for f in forms if f[1] in os.environ["BENCH_FLEET_FORMS"].split(",")]
        for version, form in forms:
            before = {k: s["counters"]["bytes_fetched"] for k, s in statuses(broker)[0].items()}
            r = run_rollout(work, d, broker, version, broker_pid)
            if r is None:
                print(f"{kind:<11}{n:>8}  {form:<6} not done in {TIMEOUT:.0f} s", flush=True)
                return
            seconds, ctl, brk, c = r
            after, _ = statuses(broker)
            fetched = sum(s["counters"]["bytes_fetched"] - before.get(k, 0) for k, s in after.items())
            active = sum(1 for s in after.values() if s["active"] == version)
            state = (c or {}).get("state", {}).get("state")
            print(f"{kind:<11}{n:>8}  {form:<6}{state:<10}{active:>7}{seconds:>9.1f}"
                  f"{n / seconds * 60:>9.0f}{human(fetched // max(n, 1)):>11}{human(fetched):>10}"
                  f"{ctl[0]:>9.1f}{ctl[1]:>9.0f}{brk[0]:>9.1f}{brk[1]:>9.0f}", flush=True)
        resumed = run_rollout(work, d, broker, 3, broker_pid, kill_at=n // 2)
        if resumed is None:
            print(f"{kind:<11}{n:>8}  resume: not done in {TIMEOUT:.0f} s", flush=True)
        else:
            seconds, _, _, c, (read_s, rest_s) = resumed
            state = (c or {}).get("state", {}).get("state")
            print(f"{kind:<11}{n:>8}  v3 killed at {n // 2} active and resumed: {state}; the state "
                  f"read and checked {read_s:.1f} s after the restart, every device active "
                  f"{rest_s:.1f} s after it ({seconds:.1f} s in all)", flush=True)
        console(broker, n, kind)
        _, took = statuses(broker)
        st = time.time()
        o = subprocess.run([TRAINER, "rollout", "status", "--broker", broker, "--name", "bench-v2",
                            "--json"], capture_output=True, text=True)
        read = time.time() - st
        size = len(subprocess.run([TRAINER, "rollout", "status", "--broker", broker, "--name",
                                   "bench-v2", "--json"], capture_output=True).stdout)
        print(f"{kind:<11}{n:>8}  trainer status {took:.1f} s; rollout state {human(size)} of JSON "
              f"(retained deflated), read in {read:.1f} s{'' if o.returncode == 0 else ' FAILED'}; "
              f"simulator peak RSS {proc_stat(agent.pid)[1]:.0f} MB", flush=True)
    finally:
        agent.kill()
        broker_proc.kill()
        agent.wait()
        broker_proc.wait()
        shutil.rmtree(d, ignore_errors=True)


def run_rollout(work, d, broker, version, broker_pid, kill_at=None):
    """`trainer rollout` of `version`: (seconds, controller (CPU s, peak RSS MB) from its
    rusage, broker (CPU s over the rollout, peak RSS MB), the final state) or None. With
    `kill_at`: the controller is killed once that many devices are active by its log, and
    started again; a fifth item, (seconds from the restart to "resuming rollout", to the end)."""
    name = f"bench-v{version}"
    with open(f"{d}/{name}.toml", "w") as f:
        f.write(PLAN.format(name=name))
    cpu0, _ = proc_stat(broker_pid)
    start = time.time()
    deadline = start + TIMEOUT
    cmd = [TRAINER, "rollout", "--broker", broker, "--artifact", f"{work}/v{version}", "--key",
           f"{work}/keys/kestrel.key", "--fleet", f"{d}/{name}.toml", "--json"]
    log = f"{d}/{name}.log"
    resume = None
    if kill_at is not None:
        with open(log, "w") as err:
            p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
            while lines(log, ": Active") < kill_at:
                if time.time() > deadline or p.poll() is not None:
                    p.kill()
                    p.wait()
                    return None
                time.sleep(0.2)
            p.send_signal(signal.SIGKILL)
            p.wait()
        restarted = time.time()
    with open(f"{d}/{name}.json", "w") as out, open(log, "w") as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err)
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if kill_at is not None and resume is None and lines(log, "resuming rollout"):
                resume = time.time() - restarted
            if time.time() > deadline:
                p.kill()
                p.wait()
                return None
            time.sleep(0.2)
    seconds = time.time() - start
    cpu1, rss = proc_stat(broker_pid)
    with open(f"{d}/{name}.json") as f:
        text = f.read().strip()
    c = json.loads(text) if text else None
    r = seconds, (usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024), (cpu1 - cpu0, rss), c
    if kill_at is not None:
        r += ((resume if resume is not None else float("nan"), time.time() - restarted),)
    return r


def lines(path, text):
    """How many lines of the file hold `text`."""
    with open(path, errors="replace") as f:
        return sum(text in line for line in f)


def get(url, stream=False):
    """(seconds, bytes, body or None, headers) of a GET; a stream's first event only."""
    start = time.time()
    with urllib.request.urlopen(url, timeout=60) as r:
        if stream:
            body = b""
            while not body.endswith(b"\n\n"):
                body += r.readline()
        else:
            body = r.read()
        return time.time() - start, len(body), body, r.headers


def console(broker, n, kind):
    """The console on the fleet: seconds until its view holds every device, then a page, a
    search and the live stream's first event, each (seconds, bytes), and its peak RSS."""
    port = free_port()
    p = subprocess.Popen([TRAINER, "console", "--broker", broker, "--listen", f"127.0.0.1:{port}"],
                         stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_port(port)
        start = time.time()
        while json.loads(get(f"{base}/api/info")[2])["devices"] < n:
            if time.time() - start > 300 or p.poll() is not None:
                print(f"{kind:<11}{n:>8}  console: the fleet did not show in 300 s", flush=True)
                return
            time.sleep(0.5)
        up = time.time() - start
        page = get(f"{base}/api/devices?offset=0&limit=250")
        total = page[3].get("x-total-count")
        search = get(f"{base}/api/devices?q=-00042")
        first = get(f"{base}/api/stream", stream=True)
        print(f"{kind:<11}{n:>8}  console: every device in view {up:.1f} s; a page of 250 of {total} "
              f"{page[0] * 1000:.0f} ms ({human(page[1])}), a search {search[0] * 1000:.0f} ms, the "
              f"stream's first event {first[0] * 1000:.0f} ms ({human(first[1])}); peak RSS "
              f"{proc_stat(p.pid)[1]:.0f} MB", flush=True)
    finally:
        p.kill()
        p.wait()


def main():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    work = tempfile.mkdtemp()
    try:
        artifacts(work)
        print(f"{'broker':<11}{'devices':>8}  {'form':<6}{'state':<10}{'active':>7}{'seconds':>9}"
              f"{'per min':>9}{'per dev':>11}{'in all':>10}{'ctl cpu':>9}{'ctl MB':>9}"
              f"{'brk cpu':>9}{'brk MB':>9}", flush=True)
        for kind in BROKERS:
            for n in SIZES:
                if kind == "rumqttd" and n > EMBEDDED_MAX:
                    continue
                fleet(work, kind, n)
        print("(goal: 10,000 devices to all active in <= 10 min, >= 1,000 a minute; trainer status "
              "<= 5 s at 10,000; controller RSS <= 500 MB; Mosquitto RSS <= 2 GB)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
