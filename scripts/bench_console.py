"""The fleet console under load, for scripts/bench.sh (Python standard library only).

  bench_console.py --console URL --broker HOST:PORT --driver URL --devices N --ids FORMAT
                   [--synthetic] [--seconds S] [--prefix P]

1. Time to first render: a fresh headless Chromium (through chromedriver's W3C WebDriver API)
   opens the console three times; the page marks its first render of the device table
   (`performance.mark("kestrel-first-render")`, also `data-first-render-ms` on <html>).
2. Updates: for --seconds, every device gets a new status every 2 s (published here at QoS 0
   over one plain MQTT 3.1.1 connection, in the devices' names: idle simulated agents publish
   nothing new, so their statuses are written for them as busy devices would); the page's
   render times (`window.kestrelRenders`) and the time until a marked status shows up in the
   page are measured.
Prints one JSON object.
"""
import argparse, json, socket, statistics, struct, threading, time, urllib.request


def varint(n):
    out = bytearray()
    while True:
        b, n = n % 128, n // 128
        out.append(b | (128 if n else 0))
        if not n:
            return bytes(out)


def mqtt_string(s):
    b = s.encode()
    return struct.pack(">H", len(b)) + b


class Mqtt:
    """Just enough MQTT 3.1.1 to publish at QoS 0."""

    def __init__(self, host, port):
        self.s = socket.create_connection((host, port))
        body = mqtt_string("MQTT") + bytes([4, 2]) + struct.pack(">H", 60) + mqtt_string(f"bench-console-{time.time_ns()}")
        self.s.sendall(bytes([0x10]) + varint(len(body)) + body)
        assert self.s.recv(4)[:2] == b"\x20\x02", "no CONNACK"

    def publish(self, topic, payload, retain=True):
        body = mqtt_string(topic) + payload
        self.s.sendall(bytes([0x30 | int(retain)]) + varint(len(body)) + body)


def status(device, group, p50):
    return json.dumps({
        "device": device, "groups": [group], "state": "idle", "model": "lfw", "active": 1,
        "previous": None, "target": None, "progress": None, "last_error": None,
        "latency": {"count": 10, "mean_ms": p50, "p50_ms": p50, "p95_ms": p50 * 1.2},
        "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }).encode()


def webdriver(driver, method, path, body=None):
    req = urllib.request.Request(driver + path, method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["value"]


def new_session(driver, profile):
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1280,900"]
    caps = {"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": {
        "binary": "/usr/bin/chromium", "args": args}}}}
    return "/session/" + webdriver(driver, "POST", "/session", caps)["sessionId"]


def js(driver, session, script):
    return webdriver(driver, "POST", session + "/execute/sync", {"script": script, "args": []})


def wait_js(driver, session, script, secs):
    deadline = time.time() + secs
    while time.time() < deadline:
        v = js(driver, session, script)
        if v:
            return v
        time.sleep(0.05)
    raise SystemExit(f"timed out: {script}")


def first_render(a, session):
    webdriver(a.driver, "POST", session + "/url", {"url": a.console})
    # The page shows 250 rows at a time (app.js PAGE).
    rows = f"return document.querySelectorAll('#device-rows tr').length >= {min(a.devices, 250)} && document.documentElement.dataset.firstRenderMs"
    return float(wait_js(a.driver, session, rows, 60))


def updates(a, session, host, port):
    """Statuses of every device every 2 s; the page's render times and the lag of a marked one."""
    js(a.driver, session, "window.kestrelRenders = []; return 1")
    ids = [a.ids.format(i) for i in range(a.devices)]
    mq = Mqtt(host, port)
    lags, stop = [], time.time() + a.seconds
    n = 0
    while time.time() < stop:
        t0 = time.time()
        n += 1
        for i, dev in enumerate(ids):
            mq.publish(f"{a.prefix}/devices/{dev}/status", status(dev, "east" if i % 2 else "west", 20 + (n % 7)))
        # A marked device: how long until the page shows its new p50.
        mark = 100 + n
        mq.publish(f"{a.prefix}/devices/{ids[0]}/status", status(ids[0], "west", mark))
        check = (f"const r = document.querySelector('tr[data-device=\"{ids[0]}\"] td.num'); "
                 f"return r && r.textContent === '{mark:.1f}'")
        wait_js(a.driver, session, check, 20)
        lags.append((time.time() - t0) * 1000)
        time.sleep(max(0, 2 - (time.time() - t0)))
    renders = js(a.driver, session, "return window.kestrelRenders || []")
    return lags, renders


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--console", required=True)
    p.add_argument("--broker", required=True, help="HOST:PORT")
    p.add_argument("--driver", required=True)
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--prefix", default="kestrel")
    p.add_argument("--profile", required=True)
    p.add_argument("--ids", default="bench-{:04d}", help="device id format (Python), e.g. sim-{:03d}")
    p.add_argument("--synthetic", action="store_true", help="publish the devices' retained statuses first")
    a = p.parse_args()
    host, port = a.broker.rsplit(":", 1)
    if a.synthetic:
        mq = Mqtt(host, int(port))
        for i in range(a.devices):
            dev = a.ids.format(i)
            mq.publish(f"{a.prefix}/devices/{dev}/status", status(dev, "east" if i % 2 else "west", 20))
        time.sleep(2)
    firsts = []
    for k in range(3):
        s = new_session(a.driver, f"{a.profile}-{k}")
        firsts.append(first_render(a, s))
        if k < 2:
            webdriver(a.driver, "DELETE", s)
    lags, renders = updates(a, s, host, int(port))
    webdriver(a.driver, "DELETE", s)
    print(json.dumps({
        "devices": a.devices, "first_render_ms": firsts,
        "update_lag_ms_p50": statistics.median(lags), "update_lag_ms_max": max(lags),
        "render_ms_p50": statistics.median(renders) if renders else None,
        "render_ms_max": max(renders) if renders else None, "renders": len(renders),
    }))


if __name__ == "__main__":
    main()
