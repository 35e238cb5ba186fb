"""A standalone Spark cluster on this machine, started from the pyspark wheel's own
`spark-class` on loopback (a master and one-core workers), and a session on it: what the tests
(conftest.py) and the bench (scripts/bench_spark.py) run on.

`isolated=True` gives each worker (and so its executors) its own mount namespace, as a host of
its own would be: a private `/tmp` (its working directory and its own `KESTREL_HOME` there),
and the driver's Kestrel weights, caches, datasets and ONNX Runtime library hidden under empty
mounts. What they share with the driver is the installed software (Java, the venv with the
wheel) and the directories the test hands them, standing for object storage."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HOME = Path(os.environ.get("KESTREL_HOME", Path.home() / ".cache" / "kestrel"))
BIN = Path(os.environ.get("KESTREL_BIN", HOME / "target" / "release"))
LFW = HOME / "datasets" / "lfw" / "imagefolder"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(what: str, check, timeout: float = 90.0):
    """Polls `check` until it returns something true (the cluster's own state, not a fixed
    sleep); fails naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = check()
        if v:
            return v
        time.sleep(0.2)
    raise TimeoutError(f"{what} after {timeout:.0f}s")


def alive_workers(ui: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/", timeout=2) as r:
            state = json.load(r)
    except OSError:
        return 0
    return sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")


#: What an isolated worker must not see of the driver's Kestrel home.
HIDDEN = ("weights", "cache", "datasets", "onnxruntime", "photos", "registry")

#: Runs in the worker's new mount namespace: a private /tmp, the driver's things hidden.
PRIVATE = (
    'set -e; mount -t tmpfs kestrel-private /tmp; '
    'for d in $KESTREL_HIDE; do if [ -d "$d" ]; then mount -t tmpfs kestrel-hidden "$d"; fi; done; '
    'mkdir -p "$KESTREL_HOME"; cd /tmp; exec "$@"'
)


def can_isolate() -> bool:
    """Whether this process may give a child a mount namespace of its own (root with
    CAP_SYS_ADMIN: CI's containers and this machine; not every sandbox). KESTREL_TEST_ISOLATION=0
    says no."""
    if os.environ.get("KESTREL_TEST_ISOLATION") == "0":
        return False
    try:
        r = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", "mount -t tmpfs t /mnt"],
            capture_output=True, timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


@contextlib.contextmanager
def standalone(workers: int = 2, isolated: bool = False):
    """(master URL, workers' log dir) of a running standalone cluster of `workers` one-core
    workers, stopped on exit; `isolated`: each worker in a mount namespace of its own (above)."""
    import pyspark

    spark_home = Path(pyspark.__file__).parent
    logs = Path(tempfile.mkdtemp(prefix="kestrel-spark-"))
    env = dict(
        os.environ,
        SPARK_HOME=str(spark_home),
        SPARK_LOCAL_IP="127.0.0.1",
        PYSPARK_PYTHON=sys.executable,
        SPARK_WORKER_DIR=str(logs / "work"),
    )
    port, ui = free_port(), free_port()
    master = f"spark://127.0.0.1:{port}"
    spark_class = str(spark_home / "bin" / "spark-class")
    procs = []

    def start(name, *args, private=False):
        out = open(logs / f"{name}.log", "wb")
        cmd, penv = [spark_class, *args], env
        if private:
            cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", PRIVATE, "sh", *cmd]
            penv = {k: v for k, v in env.items() if k != "ORT_DYLIB_PATH"}
            penv.update(
                KESTREL_HOME="/tmp/kestrel-home",
                KESTREL_HIDE=" ".join(str(HOME / d) for d in HIDDEN),
                SPARK_WORKER_DIR="/tmp/spark-work",
            )
        procs.append(subprocess.Popen(cmd, env=penv, stdout=out, stderr=out))

    start(
        "master",
        "org.apache.spark.deploy.master.Master",
        "--host", "127.0.0.1", "--port", str(port), "--webui-port", str(ui),
    )
    for i in range(workers):
        start(
            f"worker{i}",
            "org.apache.spark.deploy.worker.Worker",
            "--cores", "1", "--memory", "1g", "--webui-port", str(free_port()), master,
            private=isolated,
        )
    try:
        wait_until(f"{workers} Spark workers registered", lambda: alive_workers(ui) == workers)
        yield master, logs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(logs, ignore_errors=True)


def session(master: str, executors: int = 2, app: str = "kestrel-tests", isolated: bool = False):
    """A SparkSession on `master`, returned once `executors` executors have registered; on an
    `isolated` cluster the executors get nothing of the driver's environment."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    s = (
        SparkSession.builder.master(master)
        .appName(app)
        .config("spark.executor.memory", "768m")
        .config("spark.executor.cores", "1")
        .config("spark.ui.port", str(free_port()))
        .config("spark.sql.shuffle.partitions", "2")
        # A killed task is retried (the fault test), a barrier stage fails fast.
        .config("spark.task.maxFailures", "4")
        .config("spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures", "1")
    )
    if isolated:
        # Executors on one address are taken for one host, whose shuffle files each may read
        # from the other's disk: here each has its own /tmp, as separate hosts have.
        s = s.config("spark.shuffle.readHostLocalDisk", "false")
    else:
        s = s.config("spark.executorEnv.KESTREL_HOME", str(HOME)).config(
            "spark.executorEnv.ORT_DYLIB_PATH", os.environ.get("ORT_DYLIB_PATH", "")
        )
    s = s.getOrCreate()
    # Every executor registered before anyone counts on them (the driver is one more).
    wait_until(
        f"{executors} executors",
        lambda: s.sparkContext._jsc.sc().getExecutorMemoryStatus().size() >= executors + 1,
    )
    return s
